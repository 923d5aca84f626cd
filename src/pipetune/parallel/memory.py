"""Activation memory of this rank's stages, and how many layers `train.activation_checkpointing = "auto"` recomputes.

A stage keeps one set of a layer's activations per microbatch whose backward has not run yet. How many are
in flight depends on the schedule and the stage: under 1F1B stage s of p holds up to p - s, so the first
stages need checkpointing first. A checkpointed layer keeps only its input. The plan checkpoints layers one
at a time, always on the stage that holds the most microbatches at the rank's peak, until the predicted peak
fits the budget:

    peak = fixed + max over the schedule of sum_s inflight_s x (k_s x input + (L_s - k_s) x layer) + layer

(`fixed`: weights, adapters with their gradients and AdamW moments, the loss's workspace and a margin; the
last `layer`: the activations of the one layer being recomputed in backward). The microbatches in flight come
from the schedule's own actions (`schedule_actions`); a layer's activations are measured on a throwaway copy,
on the run's device or, for `pipetune plan`, on the meta device, which needs no memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from pipetune.config import Config, ConfigError, ParallelConfig
from pipetune.model.families import family_of
from pipetune.model.load import DTYPES
from pipetune.model.quantize import linear_shapes, stored_bytes
from pipetune.model.shapes import ResolvedModel, one_layer_model
from pipetune.model.stage import StageModule, local_part
from pipetune.parallel.assemble import Parallelism, StagePart, build_stage_modules
from pipetune.parallel.pipeline import Action, schedule_actions

GB = 1e9
MARGIN = 0.07
"""Share of a rank's memory a plan leaves free: allocator slack, NCCL buffers, the CUDA context."""
COMPILED_ACTIVATIONS = 0.85
"""Share of a layer's eagerly measured activations that the compiled layer keeps: inductor recomputes cheap
elementwise work in backward (the norms' float32 copies among it) rather than saving it. On 2x H200 compiled runs
peaked 5-8% under the eager measurement's prediction, eager runs within 5% of it (benchmarks/journal/plan-check.md)."""
OPTIMIZER_BYTES = 12
"""Per trainable parameter besides the parameter itself: its float32 gradient and two AdamW moments."""


@dataclass
class CheckpointPlan:
    layers: list[int]
    """Layers to checkpoint, per stage of this rank (the first ones of each stage)."""
    peak_bytes: float
    """Predicted peak memory of the rank with that many checkpointed."""
    budget_bytes: float

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.budget_bytes

    def describe(self, stage_ids: Sequence[int], stage_layers: Sequence[int]) -> str:
        parts = [
            f"stage {stage}: {k} of {n} layers"
            for stage, k, n in zip(stage_ids, self.layers, stage_layers, strict=True)
        ]
        if self.budget_bytes == float("inf"):
            budget = "no memory limit to plan for (a CPU: set train.memory_gb)"
        else:
            budget = f"predicted peak {self.peak_bytes / GB:.3g} of {self.budget_bytes / GB:.3g} GB"
        fits = "" if self.fits else " (does not fit even so: lower the microbatch or data.max_length)"
        return f"activation checkpointing (auto): {', '.join(parts)}; {budget}{fits}"


def inflight_timeline(actions: Sequence[Action], stage_ids: Sequence[int]) -> list[list[int]]:
    """For each moment after a forward, the microbatches whose activations each of `stage_ids` holds, from one
    rank's actions in order (`schedule_actions`)."""
    index = {stage: i for i, stage in enumerate(stage_ids)}
    held, timeline = [0] * len(stage_ids), []
    for kind, stage, _ in actions:
        if stage not in index:
            continue
        if kind == "F":
            held[index[stage]] += 1
            timeline.append(list(held))
        elif kind in ("B", "I"):
            held[index[stage]] -= 1
    return timeline or [[0] * len(stage_ids)]


def rank_timeline(p: ParallelConfig, pp_rank: int) -> list[list[int]]:
    """`inflight_timeline` of pipeline rank `pp_rank` under `p`'s schedule; one microbatch at a time for pp = 1
    (the microbatches of a step run one after another, each forward followed by its backward)."""
    if not p.pipelined:
        return [[1]]
    actions = schedule_actions(p.schedule, p.pp, p.stages_per_rank, p.n_microbatches)[pp_rank]
    return inflight_timeline(actions, p.stage_ids(pp_rank))


def activation_bytes(
    stage_layers: Sequence[int],
    checkpointed: Sequence[int],
    moment: Sequence[int],
    layer_bytes: float,
    input_bytes: float,
) -> float:
    """Activations a rank holds at one moment: a checkpointed layer keeps its input, the others everything."""
    return sum(
        held * (k * input_bytes + (n - k) * layer_bytes)
        for held, k, n in zip(moment, checkpointed, stage_layers, strict=True)
    )


def activation_peak(
    stage_layers: Sequence[int],
    checkpointed: Sequence[int],
    timeline: Sequence[Sequence[int]],
    layer_bytes: float,
    input_bytes: float,
) -> tuple[float, Sequence[int]]:
    """The peak of `activation_bytes` over the schedule (plus one layer's activations while a checkpointed layer
    is recomputed in backward), and the moment it happens."""
    moment = max(timeline, key=lambda m: activation_bytes(stage_layers, checkpointed, m, layer_bytes, input_bytes))
    recompute = layer_bytes if any(checkpointed) else 0.0
    return activation_bytes(stage_layers, checkpointed, moment, layer_bytes, input_bytes) + recompute, moment


def plan_checkpointing(
    stage_layers: Sequence[int],
    timeline: Sequence[Sequence[int]],
    layer_bytes: float,
    input_bytes: float,
    fixed_bytes: float,
    budget_bytes: float,
) -> CheckpointPlan:
    """The fewest checkpointed layers per stage whose predicted peak fits `budget_bytes` (all, if none does)."""
    checkpointed = [0] * len(stage_layers)

    def peak() -> tuple[float, Sequence[int]]:
        activations, moment = activation_peak(stage_layers, checkpointed, timeline, layer_bytes, input_bytes)
        return fixed_bytes + activations, moment

    total, moment = peak()
    while total > budget_bytes:
        candidates = [i for i, (k, n) in enumerate(zip(checkpointed, stage_layers, strict=True)) if k < n]
        if not candidates:
            break
        # The stage that holds the most microbatches at the peak saves the most per checkpointed layer.
        checkpointed[max(candidates, key=lambda i: (moment[i], -i))] += 1
        total, moment = peak()
    return CheckpointPlan(checkpointed, total, budget_bytes)


def auto_checkpointing(
    modules: Sequence[StageModule],
    stage_ids: Sequence[int],
    pp_rank: int,
    config: Config,
    resolved: ResolvedModel,
    device: torch.device,
    tp_mesh: DeviceMesh | None = None,
) -> CheckpointPlan:
    """Plan this rank's checkpointed layers for `config`'s microbatch shape and the device's memory (or
    train.memory_gb); measures one layer's activations on a throwaway copy of it (random weights), split over
    `tp_mesh` as the run's layers are (every rank of it measures)."""
    microbatch, seq = config.microbatch_size, config.data.max_length
    layer_bytes, input_bytes = measure_layer_memory(config, resolved, device, microbatch, seq, tp_mesh)
    budget = memory_budget(config, device)
    trainable = sum(
        local_part(param).numel() for module in modules for param in module.parameters() if param.requires_grad
    )
    fixed = _allocated_bytes(modules, device) + OPTIMIZER_BYTES * trainable
    last = next((module for module in modules if module.is_last), None)
    if last is not None:
        fixed += loss_bytes(config, last.lm_head.weight.shape[0])
    fixed += MARGIN * budget if budget != float("inf") else 0.0
    timeline = rank_timeline(config.parallel, pp_rank)
    stage_layers = [len(module.layers) for module in modules]
    return plan_checkpointing(stage_layers, timeline, layer_bytes, input_bytes, fixed, budget)


def memory_budget(config: Config, device: torch.device | None = None) -> float:
    """Memory per rank to plan for: train.memory_gb, else the GPU's (the first one's when no device is named),
    else unlimited (a CPU)."""
    if config.train.memory_gb > 0:
        return config.train.memory_gb * GB
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", 0)
    if device is not None and device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float("inf")


def loss_bytes(config: Config, vocab: int) -> float:
    """The last stage's loss workspace: [rows, vocab] logits in float32 and their gradient, for a whole microbatch,
    or (train.fused_loss) for its supervised rows (at most max_summary_tokens + 1 per sequence) a chunk of
    train.loss_chunk rows at a time."""
    t, d, microbatch = config.train, config.data, config.microbatch_size
    if t.fused_loss:
        rows = min(t.loss_chunk, microbatch * min(d.max_length, d.max_summary_tokens + 1))
        return rows * vocab * 12
    return microbatch * d.max_length * vocab * 10


def measure_layer_memory(
    config: Config,
    resolved: ResolvedModel,
    device: torch.device,
    batch: int,
    seq: int,
    tp_mesh: DeviceMesh | None = None,
) -> tuple[int, int]:
    """(activation bytes one decoder layer keeps for backward, bytes of its input) for a microbatch of
    [batch, seq], with the run's dtype, adapters and LoRA path, on a fresh random copy of one layer (this rank's
    part of it when split over `tp_mesh`; on the meta device: a shape-only copy, no memory, what a CUDA run would
    keep). Measured eagerly; a compiled layer keeps COMPILED_ACTIVATIONS of that."""
    shape_only = dataclasses.replace(resolved, weights_dir=None)  # values do not matter: no checkpoint read
    # PEFT draws its own adapter initialisation from the global generator: the run's streams stay untouched.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        built = build_stage_modules(
            shape_only,
            DTYPES[config.model.dtype],
            config.lora,
            [StagePart([0])],
            device,
            Parallelism(tp_mesh, config.parallel.sequence_parallel),
            # A quantized weight is saved as itself, never as activations: on the meta device the same count.
            quantize=config.model.quantize if device.type != "meta" else "none",
            tp=config.parallel.tp,
        )
        model, (stage,) = built.peft_model, built.modules
        activations, inputs = stage.layer_memory(batch, seq)
    del built, model, stage
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return activations * (COMPILED_ACTIVATIONS if config.train.compile else 1.0), inputs


def _allocated_bytes(modules: Sequence[StageModule], device: torch.device) -> float:
    """What the rank holds now: the allocator's count on a GPU, the stages' tensors on a CPU."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    tensors = {id(t): local_part(t) for module in modules for t in [*module.parameters(), *module.buffers()]}
    return float(sum(t.numel() * t.element_size() for t in tensors.values()))


def check_weights_fit(config: Config, model_config: PretrainedConfig, ranges: Sequence[range]) -> None:
    """Refuse, before any process starts, a layout whose frozen weights alone exceed a rank's memory (the GPU's,
    or train.memory_gb); the message names the settings that would make it fit."""
    budget = memory_budget(config)
    if budget == float("inf"):
        return
    p, quantize = config.parallel, config.model.quantize
    shards = (p.dp if p.sharded else 1) * p.tp  # tensor parallelism splits (nearly) every weight tp ways
    for rank, (layers, root) in enumerate(rank_weight_bytes(config, model_config, ranges)):
        weights = (layers + root) / shards
        if weights > 0.9 * budget:
            sharded = f", sharded over parallel.dp = {p.dp}" if p.sharded else ""
            sharded += f", split over parallel.tp = {p.tp}" if p.tensor_parallel else ""
            stored = config.model.dtype + (f" and {quantize}" if quantize != "none" else "")
            smaller = ', or store the base quantized: model.quantize = "nf4" (~0.52 bytes a weight)'
            raise ConfigError(
                f"{config.model.name!r}: the stage(s) of pipeline rank {rank} hold {weights / GB:.0f} GB of frozen "
                f"{stored} weights (parallel.pp = {p.pp}{sharded}), more than 90% of the "
                f"{budget / GB:.0f} GB of memory per rank, before any activation. Raise parallel.pp (more GPUs, "
                "fewer layers each) or parallel.tp (each layer split over more GPUs), or shard replicas with "
                "parallel.dp_shard = true (strategy 'fsdp' for pp = 1) over more GPUs"
                + (smaller if quantize == "none" else "")
            )


def rank_weight_bytes(
    config: Config, model_config: PretrainedConfig, ranges: Sequence[range]
) -> list[tuple[float, float]]:
    """Frozen weights of each pipeline rank's stages, unsharded: (decoder layers, embedding + norm + lm_head).
    Every stage owns its embedding or lm_head outright (a copy where the checkpoint ties them)."""
    p = config.parallel
    layer, embedding, head = parameter_counts(model_config)
    element = torch.empty((), dtype=getattr(torch, config.model.dtype)).element_size()
    linears = linear_shapes(model_config)  # model.quantize stores these smaller
    quantized = sum(rows * columns for _, rows, columns in linears)
    layer_bytes = (layer - quantized) * element
    layer_bytes += sum(stored_bytes(rows, columns, config.model.quantize, element) for _, rows, columns in linears)
    weights = []
    for rank in range(p.pp):
        stages = p.stage_ids(rank)
        root = (embedding if 0 in stages else 0) + (head if len(ranges) - 1 in stages else 0)
        weights.append((sum(len(ranges[s]) for s in stages) * layer_bytes, root * element))
    return weights


def parameter_counts(model_config: PretrainedConfig) -> tuple[int, int, int]:
    """Parameters of one decoder layer, of the token embedding, and of the final norm + lm_head, counted on a
    meta-device model of one layer, of the modules the family keeps on the first / last stage (exact)."""
    known = _PARAMETER_COUNTS.get(id(model_config))
    if known is not None and known[0] is model_config:  # a plan asks once per layout
        return known[1]
    counts = family_of(model_config).layer_counts(one_layer_model(model_config))
    _PARAMETER_COUNTS[id(model_config)] = (model_config, counts)
    return counts


_PARAMETER_COUNTS: dict[int, tuple[PretrainedConfig, tuple[int, int, int]]] = {}
