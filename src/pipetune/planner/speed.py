"""Predicted step time of a layout, from the model config alone: each rank's schedule actions replayed in order.

A decoder layer's forward or backward on a microbatch of T tokens takes the longer of its GPU time and the
host's time to launch it (a host that launches faster than the GPU runs stays ahead and costs nothing):

    GPU time = T x (matmul FLOPs / (matmul rate [x FP8 speed-up]) + attention FLOPs / attention rate
                    + hidden x other + masked x dropout [+ FP8-quantized elements x their time, uncompiled])
               + NF4 weights x dequantization time (model.quantize = "nf4": once per call, in each direction)

with FLOPs per token from the stage cost model (model/split.py: forward + input-gradient backward, half each;
attention's backward twice its forward) and `other` the time per token and hidden unit of everything that is not
a matmul (norms, residuals, the adapters' small products), which is what compilation changes, and `dropout`
the time per element of the LoRA dropout masks (`masked` elements a token). A
checkpointed layer runs its forward again in backward. The last stage adds the head and loss (the split's
measured weight of them against a layer). Pipeline transfers, tensor-parallel all-reduces and FSDP's gathers
are bytes over the link between the GPUs; the schedule's actions (`schedule_actions`) are replayed rank by rank,
each starting when its rank is free and its input has arrived, so bubble and imbalance come out of the replay.

The rates are an H200's as the benchmarks measured them (`GpuRates`' fields say where each comes from);
`pipetune plan --calibrate` replaces the layer times and the link's rate with timings on the GPUs at hand.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipetune.model.split import StageCosts

MODES = ("plain", "eager", "compiled", "graphs")
"""How layers run: PEFT's own path eagerly; lora.fast_path eagerly; compiled (train.compile); replayed as CUDA
graphs (train.cuda_graphs, where it pays off)."""


@dataclass(frozen=True)
class GpuRates:
    """What one GPU and its link to the others do per second, for the step-time model.

    The defaults are an H200's. The matmul rate was measured (profile), the attention rate too (one layer's
    attention at a long row); the link is NVLink's. The per-mode constants (other, host, kernel, FSDP) were
    fitted, by least squares on log tokens/s, to the 32 timed pipetune runs on 2x H200 in
    benchmarks/journal/results (benchmarks/journal/plan-check.md has each run beside its prediction): they describe
    those runs, and a GPU of another kind needs `pipetune plan --calibrate`."""

    name: str = "H200, fitted to the benchmarks' runs (uncalibrated here)"
    matmul_flops: float = 775e12
    """Base-weight matmuls: the profile of a Qwen3-4B stage measured ~775 TFLOP/s (2026-11-29-speed-h200.md)."""
    attention_flops: float = 470e12
    """Causal attention, forward and backward, as SDPA runs it (cuDNN's kernel on an H200 with torch 2.11): at
    131,072 tokens of Qwen3-8B a layer's forward took 246 ms and forward with backward 913 ms, 462-486 TFLOP/s as
    this model counts them (2026-12-01-keep-attention-and-2048-one-h200.md). Short rows cannot tell it from
    `other_seconds`; the long rows can: with it the three on one H200 land within 5% (400e12, flash attention's
    published order of magnitude used before, put them 9-17% slow; plan-check.md)."""
    other_seconds: dict[str, float] = field(
        default_factory=lambda: {"plain": 2.11e-10, "eager": 0.81e-10, "compiled": 0.71e-10, "graphs": 0.71e-10}
    )
    """Forward time per token and hidden unit of a layer's non-matmul work but LoRA dropout (norms, residuals,
    the adapters' small products); backward takes `backward_other` times it. Fitted with dropout in it (0.9e-10
    compiled, 1.0e-10 eager, 2.3e-10 plain: every fitted run drew 7 masks over ~10.5 x hidden elements a token),
    less that share of `dropout_seconds` since. A first estimate from single figures (compiled: Qwen3-4B's
    forward at 4 x 512 tokens ~1.1 ms of which matmuls ~0.53, NOTES.md) gave 1.05."""
    dropout_seconds: float = 1.8e-12
    """Forward time per element a LoRA dropout mask covers (`LayerWork.masked`); backward `backward_other` times
    it. Measured: Qwen3-4B's packed 4,096-token step with dropout 0.15 against 0 (0.337 s against 0.306,
    2026-12-02-4k-one-h200.md), compiled with CUDA graphs; eager runs are assumed alike."""
    fp8_matmul_speedup: float = 1.5
    """The matmuls' speed-up with an FP8 base (model.quantize = "fp8") over bf16, each FP8 linear's quantization
    and transposed weight copy included. Fitted to three compiled runs against bf16 in the same call: this model
    gives them 1.21x, 1.30x and 1.18x bf16 where they measured 1.25x (Qwen3-8B, 4,096-token rows), 1.26x (the 72B
    shape's pipeline) and 1.18x (Qwen3-4B, one microbatch of 16)."""
    fp8_element_seconds: dict[str, float] = field(
        default_factory=lambda: {"plain": 1.15e-11, "eager": 1.15e-11, "compiled": 0.0, "graphs": 0.0}
    )
    """Time per element an FP8 linear quantizes outside a compiled layer (its input forward, its output's
    gradient backward: `LayerWork.fp8_elements`, spread over forward and backward as the other non-matmul work
    is); a compiled layer fuses the quantization into its neighbours (in `fp8_matmul_speedup`). Fitted to the
    eager Qwen3-8B run at 4,096-token rows (3.31 s a step against eager bf16's 2.77 in another call:
    2026-12-02-4k-one-h200.md)."""
    backward_other: float = 1.2
    """Backward's non-matmul work over forward's: the 72B timeline's chunks took ~80 ms backward, ~70 forward."""
    kernel_seconds: dict[str, float] = field(
        default_factory=lambda: {"plain": 1.7e-3, "eager": 1.7e-3, "compiled": 1.3e-4, "graphs": 1.3e-4}
    )
    """GPU time per layer call that does not grow with the tokens: the gaps between a call's kernels. Fitted."""
    host_seconds: dict[str, float] = field(
        default_factory=lambda: {"plain": 2.8e-3, "eager": 2.8e-3, "compiled": 1.5e-3, "graphs": 5e-5}
    )
    """Host time to launch one layer call (a forward or a backward). Fitted; the profile of compiled 8 x 2 runs
    measured ~1.85 ms with the profiler's own cost in it (model/graphs.py's HOST_SECONDS_PER_LAYER_CALL, which
    decides where graphs pay off); a CUDA graph's replay takes tens of microseconds."""
    tp_host_seconds: float = 3.7e-3
    """Host time to launch one layer call under tensor parallelism without CUDA graphs: torch's DTensor dispatch
    of the split layer and its adapters on top of the launches. Fitted to the one such run that is host-bound
    (the 72B shape, tp=2, 8 x 2: 5.0 s a step for 1,280 layer calls, where GPU work and all-reduces model 2.98 s;
    not yet profiled). Qwen3-4B's tp run (1 x 16) is GPU-bound and does not see it."""
    nf4_weight_seconds: float = 1.96e-12
    """GPU time to dequantize one NF4 weight, once in an NF4 linear's forward and once in its input gradient: the
    72B shape's 8,936 dequantizations a step took 2.2 s (~1.3 TB/s; 2026-11-30-wave6-h200.md)."""
    nf4_call_seconds: float = 0.3e-3
    """Host time per NF4 linear call on top of its layer call's: the operator and its compiled dequantization
    (0.34 ms in the profile of the 72B shape, the profiler's own cost in it)."""
    link_bytes_per_s: float = 300e9
    """Between two GPUs of a node (NVLink): pipeline transfers, all-reduces, FSDP's gathers."""
    link_latency_s: float = 3e-5
    """Per transfer or collective."""
    fsdp_call_seconds: dict[str, float] = field(
        default_factory=lambda: {"plain": 2.7e-3, "eager": 2.7e-3, "compiled": 4.4e-4, "graphs": 4.4e-4}
    )
    """FSDP2's own work per gathered layer call, beside the gather's bytes. Fitted (two runs: 4B eager, 72B
    compiled)."""
    step_seconds: float = 5e-3
    """Per optimizer step: clipping's all-reduce, the optimizer, the metrics row."""
    layer_seconds: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Measured (forward, backward) seconds of one layer by `LayerWork.key`, from `--calibrate`; they replace
    the model where present."""
    layer_scale: float = 1.0
    """Measured over modelled layer time where `--calibrate` timed some shapes: applied to the shapes it did not."""
    split_tp_timings: bool = False
    """Whether the tensor-parallel shapes in `layer_seconds` were timed split over as many GPUs, all-reduces
    included (calibrate.time_tp_layers). Files from before timed them alone, in one process: such timings miss
    what a run pays for them and are not used."""

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> GpuRates:
        values = json.loads(Path(path).read_text())
        values["layer_seconds"] = {key: tuple(value) for key, value in values.get("layer_seconds", {}).items()}
        values.setdefault("dropout_seconds", 0.0)  # a file from before the term: its other_seconds hold dropout
        return cls(**values)


@dataclass(frozen=True)
class LayerWork:
    """What one rank's share of one decoder layer does per microbatch."""

    costs: StageCosts
    """Per-token FLOPs of this rank's share of a layer (a tensor-parallel rank: 1/tp of the heads and columns)."""
    hidden: int
    tokens: int
    """Tokens per microbatch (microbatch x sequence)."""
    microbatch: int
    seq: int
    tp: int = 1
    model: str = ""
    """The model's name: measured layer times are kept by model and shape."""
    nf4_weights: int = 0
    """Weights of this share of a layer stored in NF4 (model.quantize = "nf4"): dequantized in every call."""
    nf4_linears: int = 0
    """Its NF4 linears: one operator call each, forward and backward."""
    masked: int = 0
    """Elements per token that this share of a layer's LoRA dropout masks cover in a forward: the adapted linears'
    input widths, one per shared input where one mask serves it (lora.shared_dropout); 0 without dropout."""
    fp8_elements: int = 0
    """With an FP8 base: elements per token its linears quantize, their input widths forward and output widths
    backward (0: no FP8 base)."""

    def key(self, mode: str) -> str:
        """What a measured time is filed under: model, microbatch shape, tp, how the layer runs and a quantized
        base (NF4 or FP8: `--calibrate` times each as the run builds it)."""
        base = " nf4" if self.nf4_weights else " fp8" if self.fp8_elements else ""
        return f"{self.model} {self.microbatch}x{self.seq} tp={self.tp} {mode}{base}"


def layer_seconds(work: LayerWork, rates: GpuRates, mode: str) -> tuple[float, float]:
    """(forward, backward) seconds of one layer call on a microbatch, launch cost included."""
    measured = rates.layer_seconds.get(work.key(mode)) if work.tp == 1 or rates.split_tp_timings else None
    if measured is not None:
        return measured
    c, t = work.costs, work.tokens
    matmul = t * (c.layer - c.attention) / 2 / rates.matmul_flops
    if work.fp8_elements:
        matmul /= rates.fp8_matmul_speedup
    attention = _attention_forward(work, rates)
    other = t * (work.hidden * rates.other_seconds[mode] + work.masked * rates.dropout_seconds)
    # An FP8 base's quantization outside compiled layers: fp8_elements a token over forward and backward together.
    other += t * work.fp8_elements * rates.fp8_element_seconds[mode] / (1 + rates.backward_other)
    dequantize = work.nf4_weights * rates.nf4_weight_seconds
    host, kernels = rates.host_seconds[mode], rates.kernel_seconds[mode]
    if work.tp > 1 and mode != "graphs":
        host = max(host, rates.tp_host_seconds)
    if mode != "graphs":
        host += work.nf4_linears * rates.nf4_call_seconds
    forward = max(rates.layer_scale * (kernels + matmul + attention + other + dequantize), host)
    backward = max(
        rates.layer_scale * (kernels + matmul + 2 * attention + rates.backward_other * other + dequantize), host
    )
    return forward, backward


def _attention_forward(work: LayerWork, rates: GpuRates) -> float:
    return work.tokens * work.costs.attention / 3 / rates.attention_flops


def recompute_seconds(work: LayerWork, rates: GpuRates, forward: float, keep_attention: bool) -> float:
    """A checkpointed layer's recomputation in backward: its `forward` again, less attention's forward where the
    layer keeps attention's output (train.keep_attention)."""
    return max(0.0, forward - rates.layer_scale * _attention_forward(work, rates)) if keep_attention else forward


def head_seconds(costs: StageCosts, forward: float, backward: float) -> float:
    """The last stage's head and loss per microbatch: the split's weight of them against a layer's time."""
    return costs.head_time / costs.layer * (forward + backward)


def link_seconds(nbytes: float, rates: GpuRates) -> float:
    return rates.link_latency_s + nbytes / rates.link_bytes_per_s


def all_reduce_seconds(nbytes: float, ranks: int, rates: GpuRates) -> float:
    """A ring all-reduce of `nbytes` over `ranks` GPUs."""
    if ranks < 2:
        return 0.0
    return link_seconds(2 * (ranks - 1) / ranks * nbytes, rates)


@dataclass
class Replay:
    step_seconds: float
    """One schedule step, first action to last."""
    busy_seconds: list[float]
    """Per rank: time spent computing."""

    @property
    def bubble(self) -> list[float]:
        return [1 - busy / self.step_seconds for busy in self.busy_seconds]


def replay_schedule(
    order: dict[int, Sequence[tuple[str, int, int]]],
    stage_rank: dict[int, int],
    forward: Sequence[float],
    backward: Sequence[float],
    transfer: float,
) -> Replay:
    """Run every rank's actions in order: an action starts when its rank is free and its input is there (the
    previous stage's forward, the next stage's backward, plus `transfer` when they sit on another rank).
    `forward[s]` / `backward[s]`: stage s's time per microbatch; a split backward's input part ("I") takes the
    whole backward, its weight part ("W": the adapters' gradients) nothing."""
    last = len(forward) - 1
    finished: dict[tuple[str, int, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    busy = dict.fromkeys(order, 0.0)
    position = dict.fromkeys(order, 0)

    def ready(kind: str, stage: int, microbatch: int) -> float | None:
        if kind == "F":
            source = None if stage == 0 else ("F", stage - 1, microbatch)
        elif kind in ("B", "I"):
            source = ("F", stage, microbatch) if stage == last else ("B", stage + 1, microbatch)
        else:
            source = ("I", stage, microbatch)
        if source is None:
            return 0.0
        if source[0] == "B" and source not in finished:
            source = ("I", *source[1:])  # zero-bubble schedules hand back the input part
        if source not in finished:
            return None
        moved = stage_rank[source[1]] != stage_rank[stage]
        return finished[source] + (transfer if moved else 0.0)

    remaining = sum(len(actions) for actions in order.values())
    while remaining:
        progressed = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                kind, stage, microbatch = actions[position[rank]]
                start = ready(kind, stage, microbatch)
                if start is None:
                    break
                seconds = forward[stage] if kind == "F" else backward[stage] if kind in ("B", "I") else 0.0
                clock[rank] = max(clock[rank], start) + seconds
                busy[rank] += seconds
                finished[(kind, stage, microbatch)] = clock[rank]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule replay stalled with {remaining} actions left")
    return Replay(max(clock.values()), [busy[rank] for rank in sorted(order)])
