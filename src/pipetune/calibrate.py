"""`pipetune plan --calibrate`: the step-time model's layer and link rates measured on this machine's GPUs.

One decoder layer (random weights; the run's dtype, adapters, LoRA path, compilation and CUDA graphs) is timed
forward and backward at each microbatch shape of the plan's leading layouts, and one stage-to-stage transfer (a
microbatch's hidden states from GPU 0 to GPU 1). Measured shapes replace the model's layer time; the others
(tensor-parallel ones among them, which one process cannot time as a run pays them: `timed_alone`) are scaled by
how far the model was off on the measured ones. A layer is timed with CUDA events between calls issued
back to back, so a host slower than the GPU shows in the figure, as it does in a run.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from pipetune.config import Config, ConfigError
from pipetune.parallel.speed import GpuRates, LayerWork, layer_seconds

REPEATS = 10
"""Timed calls per direction and shape (after WARMUP untimed ones)."""
WARMUP = 3


def calibrate(
    config: Config, gpus: int, budget: float | None = None, shapes: int = 4, device: torch.device | None = None
) -> GpuRates:
    """Rates with this machine's layer times at up to `shapes` microbatch shapes of the plan's fastest layouts
    (timed on `device`, GPU 0 by default)."""
    from pipetune.plan import make_plan

    if device is None:
        if not torch.cuda.is_available():
            raise ConfigError("--calibrate times a layer on this machine's GPU, and there is none; plan without it")
        device = torch.device("cuda", 0)
    rates = GpuRates()
    plan = make_plan(config, gpus, budget, rates)
    leading = [p for p in plan.predictions if p.fits] or plan.predictions
    works = list(dict.fromkeys((p.work, p.mode) for p in leading if timed_alone(p.work)))[:shapes]
    measured, ratios = {}, []
    for work, mode in works:
        if mode == "graphs" and device.type != "cuda":
            mode = "compiled"
        forward, backward = time_layer(config, work, mode, device)
        measured[work.key(mode)] = (forward, backward)
        modelled = sum(layer_seconds(work, rates, mode))
        ratios.append((forward + backward) / modelled)
        print(
            f"calibrate: {work.key(mode)}: forward {forward * 1e3:.2f} ms, backward {backward * 1e3:.2f} ms "
            f"(model: {modelled * 1e3:.2f} ms for both)",
            flush=True,
        )
    link = rates.link_bytes_per_s
    if device.type == "cuda" and torch.cuda.device_count() >= 2 and works:
        work = works[0][0]
        nbytes = work.tokens * work.hidden * torch.empty((), dtype=getattr(torch, config.model.dtype)).element_size()
        link = nbytes / time_transfer(nbytes)
        print(f"calibrate: {nbytes / 1e6:.1f} MB from GPU 0 to GPU 1 at {link / 1e9:.0f} GB/s", flush=True)
    name = f"calibrated on {torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type}"
    return with_timings(rates, name, measured, ratios, link)


def with_timings(
    rates: GpuRates,
    name: str,
    measured: dict[str, tuple[float, float]],
    ratios: list[float],
    link: float | None = None,
) -> GpuRates:
    """`rates` with the timed layers, the untimed ones scaled by the timed ones' measured over modelled times
    (`ratios`, their geometric mean), and a measured link (no separate latency: it is in the timing)."""
    return dataclasses.replace(
        rates,
        name=name,
        layer_seconds=dict(measured),
        layer_scale=math.exp(statistics.mean(map(math.log, ratios))) if ratios else 1.0,
        **({"link_bytes_per_s": link, "link_latency_s": 0.0} if link is not None else {}),
    )


def timed_alone(work: LayerWork) -> bool:
    """Whether one process timing a layer measures what a run pays for it. Not under tensor parallelism: a
    share of a layer timed alone has none of the all-reduces and none of the DTensor dispatch that make its cost
    in a run (the 72B shape at tp=2: the all-reduces took 36% of the GPU's time, and the plan calibrated with
    such timings was 26% fast); the model predicts those, scaled like every untimed shape."""
    return work.tp == 1


def time_layer(
    config: Config, work: LayerWork, mode: str, device: torch.device, grouped: bool = True
) -> tuple[float, float]:
    """Median seconds of one forward and one backward of a fresh layer (this rank's share of it under tp).
    `grouped`: on the fast LoRA path, the down-projections of one input as one matmul where a run would."""
    from pipetune.model.graphs import give_gradients_own_memory
    from pipetune.model.load import DTYPES, build_meta, materialize
    from pipetune.model.lora import apply_lora, use_fast_path
    from pipetune.model.quantize import quantize_linears
    from pipetune.model.shapes import resolve_model
    from pipetune.model.stage import StageModule
    from pipetune.plan import tensor_parallel_share

    resolved = resolve_model(dataclasses.replace(config.model, init="random"))
    share = tensor_parallel_share(resolved.config, work.tp)
    shape_only = dataclasses.replace(resolved, config=share, weights_dir=None)
    dtype = DTYPES[config.model.dtype]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = apply_lora(build_meta(shape_only, dtype, [0], first=False, last=False), config.lora, resolved.name, 0)
        if work.nf4_weights:  # the NF4 base the run's layers dequantize in every call
            quantize_linears(model, "nf4")
        if config.lora.fast_path:
            use_fast_path(model, config.lora.shared_dropout, work.tp, grouped)
        materialize(model, shape_only, device)
        model.train()
        stage = StageModule(model)
        layer = stage.layers[0]
        if mode in ("compiled", "graphs"):
            layer.compile(mode="reduce-overhead" if mode == "graphs" else None)
        # Backward adds into the gradients, as a run's microbatches do; made by a replayed graph they would live
        # in its pool, which the next call overwrites (torch refuses to read them then).
        give_gradients_own_memory([p for p in layer.parameters() if p.requires_grad])
        hidden = torch.randn(work.microbatch, work.seq, share.hidden_size, dtype=dtype, device=device)
        hidden.requires_grad_(True)
        position_ids = torch.arange(work.seq, device=device).unsqueeze(0).expand(work.microbatch, -1)
        kwargs = dict(
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=stage.rotary(hidden, position_ids),
            use_cache=False,
        )
        forwards, backwards = [], []
        for call in range(WARMUP + REPEATS):
            torch.compiler.cudagraph_mark_step_begin()  # graphs: each call a step of its own, as in a run
            marks = [_Mark(device)]
            out = layer(hidden, **kwargs)
            out = out[0] if isinstance(out, tuple) else out
            marks.append(_Mark(device))
            out.backward(torch.ones_like(out))
            marks.append(_Mark(device))
            if call >= WARMUP:
                forwards.append(marks[0].seconds_to(marks[1]))
                backwards.append(marks[1].seconds_to(marks[2]))
            hidden.grad = None
    del model, layer, stage
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(forwards), statistics.median(backwards)


class _Mark:
    """A point in time on `device`'s stream (a CUDA event), or on the host's clock for a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.time = time.perf_counter()

    def seconds_to(self, later: _Mark) -> float:
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
