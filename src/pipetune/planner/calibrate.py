"""`pipetune plan --calibrate`: the step-time model's layer and link rates measured on this machine's GPUs.

One decoder layer (random weights; the run's dtype, adapters, LoRA path, compilation and CUDA graphs) is timed
forward and backward at each microbatch shape of the plan's leading layouts, and one stage-to-stage transfer (a
microbatch's hidden states from GPU 0 to GPU 1). Measured shapes replace the model's layer time; the others are
scaled by how far the model was off on the shapes timed alone. A tensor-parallel shape is timed on as many GPUs
as its tp, each process holding its share of the layer, so that the all-reduces and the DTensor dispatch are in
the figure (`time_tp_layers`); on fewer GPUs it is left to the model (one process cannot time it as a run pays
it). A layer is timed with CUDA events between calls issued back to back, so a host slower than the GPU shows in
the figure, as it does in a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipetune.config import Config, ConfigError
from pipetune.parallel.memory import element_bytes
from pipetune.parallel.process_group import exit_finished
from pipetune.planner.speed import GpuRates, LayerWork, layer_seconds

REPEATS = 10
"""Timed calls per direction and shape (after WARMUP untimed ones)."""
WARMUP = 3


def calibrate(
    config: Config, gpus: int, budget: float | None = None, shapes: int = 4, device: torch.device | None = None
) -> GpuRates:
    """Rates with this machine's layer times at up to `shapes` microbatch shapes of the plan's fastest layouts
    (timed on `device`, GPU 0 by default)."""
    from pipetune.planner.plan import make_plan

    if device is None:
        if not torch.cuda.is_available():
            raise ConfigError("--calibrate times a layer on this machine's GPU, and there is none; plan without it")
        device = torch.device("cuda", 0)
    rates = GpuRates()
    plan = make_plan(config, gpus, budget, rates)
    leading = [p for p in plan.predictions if p.fits] or plan.predictions
    works = list(dict.fromkeys((p.work, p.mode) for p in leading if can_time(p.work, device)))[:shapes]
    measured, ratios = {}, []
    for work, mode in works:
        mode = timed_mode(mode, device)
        forward, backward = time_shape(config, work, mode, device)
        measured[work.key(mode)] = (forward, backward)
        modelled = sum(layer_seconds(work, rates, mode))
        ratios.append((work, (forward + backward) / modelled))
        print(
            f"calibrate: {work.key(mode)}: forward {forward * 1e3:.2f} ms, backward {backward * 1e3:.2f} ms "
            f"(model: {modelled * 1e3:.2f} ms for both)",
            flush=True,
        )
    link = rates.link_bytes_per_s
    if device.type == "cuda" and torch.cuda.device_count() >= 2 and works:
        work = works[0][0]
        nbytes = work.tokens * work.hidden * element_bytes(config)
        link = nbytes / time_transfer(nbytes)
        print(f"calibrate: {nbytes / 1e6:.1f} MB from GPU 0 to GPU 1 at {link / 1e9:.0f} GB/s", flush=True)
    name = f"calibrated on {torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type}"
    return with_timings(rates, name, measured, ratios, link)


def with_timings(
    rates: GpuRates,
    name: str,
    measured: dict[str, tuple[float, float]],
    ratios: list[tuple[LayerWork, float]],
    link: float | None = None,
) -> GpuRates:
    """`rates` with the timed layers (tensor-parallel ones timed split: time_tp_layers), the untimed ones scaled
    by the measured over modelled times of the shapes timed alone (`ratios`, by shape; their geometric mean: the
    model's compute rates, not tp's host and links), and a measured link (no separate latency: it is in the
    timing)."""
    alone = [ratio for work, ratio in ratios if timed_alone(work)]
    return dataclasses.replace(
        rates,
        name=name,
        layer_seconds=dict(measured),
        layer_scale=math.exp(statistics.mean(map(math.log, alone))) if alone else 1.0,
        split_tp_timings=True,
        **({"link_bytes_per_s": link, "link_latency_s": 0.0} if link is not None else {}),
    )


def time_tp_layers(config: Config, works: list[tuple[LayerWork, str]], tp: int) -> dict[str, tuple[float, float]]:
    """Tensor-parallel shapes timed as a run pays them: `tp` processes (one per GPU; gloo processes on a CPU),
    each with its share of one whole layer, the all-reduces and DTensor dispatch included (`time_layer` with a
    mesh). Returns rank 0's (forward, backward) seconds by `LayerWork.key`, for the shapes of `works` split tp
    ways."""
    works = [(work, mode) for work, mode in works if work.tp == tp]
    if not works:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        counts = (WARMUP, REPEATS)  # this process's, for each rank to time as many calls
        torch.multiprocessing.spawn(_time_tp_rank, args=(tp, config, works, tmp, counts), nprocs=tp, join=True)
        timed = json.loads((Path(tmp) / "times.json").read_text())
    return {key: (forward, backward) for key, (forward, backward) in timed.items()}


def _time_tp_rank(
    rank: int, tp: int, config: Config, works: list[tuple[LayerWork, str]], tmp: str, counts: tuple[int, int]
) -> None:
    """One rank of time_tp_layers."""
    global WARMUP, REPEATS
    WARMUP, REPEATS = counts
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= tp
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (one-host, two-GPU timings)
    init = f"file://{os.path.join(tmp, 'init')}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=tp)
    mesh = init_device_mesh(device.type, (tp,))
    times = {}
    for work, mode in works:
        mode = timed_mode(mode, device)
        times[work.key(mode)] = time_layer(config, work, mode, device, tp_mesh=mesh)
    if rank == 0:
        (Path(tmp) / "times.json").write_text(json.dumps(times))
    dist.barrier()  # every rank's collectives done before any leaves
    dist.destroy_process_group()
    # Without the interpreter's shutdown: gloo's worker threads can still be releasing a collective's tensors
    # then, and abort the process ("terminate called without an active exception": seen once in CI on CPU;
    # exit_skipping_teardown says more). A failure above leaves through spawn's own error path instead.
    exit_finished()


def timed_alone(work: LayerWork) -> bool:
    """Whether one process timing a layer measures what a run pays for it. Not under tensor parallelism: a
    share of a layer timed alone has none of the all-reduces and none of the DTensor dispatch that make its cost
    in a run (the 72B shape at tp=2: the all-reduces took 36% of the GPU's time, and the plan calibrated with
    such timings was 26% fast); those shapes are timed on tp GPUs (time_tp_layers) where there are as many."""
    return work.tp == 1


def timed_mode(mode: str, device: torch.device) -> str:
    """How a layer of `mode` is timed on `device`: CUDA graphs need a GPU, so off one it runs compiled only."""
    return "compiled" if mode == "graphs" and device.type != "cuda" else mode


def can_time(work: LayerWork, device: torch.device) -> bool:
    """Whether this machine can time `work` as a run pays it: alone, or on as many GPUs as its tp; an FP8 base's
    layer only where `device` has FP8 matmuls (elsewhere the model's time stands)."""
    from pipetune.model.quantize import FP8_MIN_CAPABILITY

    if work.fp8_elements and not (
        device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY
    ):
        return False
    return timed_alone(work) or (device.type == "cuda" and torch.cuda.device_count() >= work.tp)


def time_shape(config: Config, work: LayerWork, mode: str, device: torch.device) -> tuple[float, float]:
    """(forward, backward) seconds of `work` as a run pays them: one layer timed alone on `device`, or split over
    tp processes (time_tp_layers)."""
    if timed_alone(work):
        return time_layer(config, work, mode, device)
    return time_tp_layers(config, [(work, mode)], work.tp)[work.key(mode)]


def time_layer(
    config: Config,
    work: LayerWork,
    mode: str,
    device: torch.device,
    grouped: bool = True,
    tp_mesh: DeviceMesh | None = None,
) -> tuple[float, float]:
    """Median seconds of one forward and one backward of a fresh layer: alone, this rank's share of it under tp
    (without the run's all-reduces); with `tp_mesh` (every rank of it calls this), the whole layer split over the
    mesh as a run splits it (parallel/tp.py), all-reduces and DTensor dispatch included.
    `grouped`: on the fast LoRA path, the down-projections of one input as one matmul where a run would."""
    from pipetune.model.graphs import give_gradients_own_memory, mark_graph_step
    from pipetune.model.load import DTYPES
    from pipetune.model.shapes import resolve_model
    from pipetune.model.stage import hidden_states, layer_call_kwargs
    from pipetune.parallel.assemble import Parallelism, StagePart, build_stage_modules, compile_stages
    from pipetune.planner.plan import tensor_parallel_share

    resolved = resolve_model(dataclasses.replace(config.model, init="random"))
    share = tensor_parallel_share(resolved.config, work.tp if tp_mesh is None else 1)
    shape_only = dataclasses.replace(resolved, config=share, weights_dir=None)
    dtype = DTYPES[config.model.dtype]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        built = build_stage_modules(
            shape_only,
            dtype,
            config.lora,
            [StagePart([0])],
            device,
            Parallelism(tp_mesh),
            # the quantized base the run's layers use: NF4 dequantized in every call, FP8 matmuls
            quantize="nf4" if work.nf4_weights else "fp8" if work.fp8_elements else "none",
            tp=work.tp,
            grouped=grouped,
        )
        model, (stage,) = built.peft_model, built.modules
        layer = stage.layers[0]
        if mode in ("compiled", "graphs"):
            compile_stages([stage], cuda_graphs=mode == "graphs")  # its one layer, in place, as a run compiles it
        # Backward adds into the gradients, as a run's microbatches do; made by a replayed graph they would live
        # in its pool, which the next call overwrites (torch refuses to read them then).
        give_gradients_own_memory([p for p in layer.parameters() if p.requires_grad])
        hidden = torch.randn(work.microbatch, work.seq, share.hidden_size, dtype=dtype, device=device)
        hidden.requires_grad_(True)
        position_ids = torch.arange(work.seq, device=device).unsqueeze(0).expand(work.microbatch, -1)
        kwargs = layer_call_kwargs(stage.family, stage.rotary, hidden, position_ids)[stage.family.layer_kind(layer)]
        forwards, backwards = [], []
        for call in range(WARMUP + REPEATS):
            mark_graph_step(device)  # graphs: each call a step of its own, as in a run
            marks = [Mark(device)]
            out = hidden_states(layer(hidden, **kwargs))
            marks.append(Mark(device))
            out.backward(torch.ones_like(out))
            marks.append(Mark(device))
            if call >= WARMUP:
                forwards.append(marks[0].seconds_to(marks[1]))
                backwards.append(marks[1].seconds_to(marks[2]))
            hidden.grad = None
    del built, model, layer, stage
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(forwards), statistics.median(backwards)


class Mark:
    """A point in time on `device`'s stream (a CUDA event), or on the host's clock for a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.time = time.perf_counter()

    def seconds_to(self, later: Mark) -> float:
        if self.device.type == "cuda":
            later.event.synchronize()
            return self.event.elapsed_time(later.event) / 1e3
        return later.time - self.time


def time_transfer(nbytes: int) -> float:
    """Seconds to copy `nbytes` from GPU 0 to GPU 1: REPEATS copies back to back, timed on the host."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    for _ in range(WARMUP):
        target.copy_(source)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    started = time.perf_counter()
    for _ in range(REPEATS):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize("cuda:0")
    torch.cuda.synchronize("cuda:1")
    return (time.perf_counter() - started) / REPEATS
