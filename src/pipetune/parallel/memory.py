"""Activation memory of this rank's stages, and how many layers `train.activation_checkpointing = "auto"` recomputes.

A stage keeps one set of a layer's activations per microbatch whose backward has not run yet. How many are
in flight depends on the schedule and the stage: under 1F1B stage s of p holds up to p - s, so the first
stages need checkpointing first. A checkpointed layer keeps only its input. The plan checkpoints layers one
at a time, always on the stage that holds the most microbatches at the rank's peak, until the predicted peak
fits the budget:

    peak = fixed + max over the schedule of sum_s inflight_s x (k_s x input + (L_s - k_s) x layer) + layer

(`fixed`: weights, adapters with their gradients and AdamW moments, the loss's workspace and a margin; the
last `layer`: the activations of the one layer being recomputed in backward).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from pipetune.config import Config, ConfigError
from pipetune.model.quantize import linear_shapes, stored_bytes
from pipetune.model.shapes import ResolvedModel, one_layer_model
from pipetune.model.stage import StageModule
from pipetune.parallel.pipeline import stage_ids

GB = 1e9


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


def inflight_timeline(
    schedule: object, stage_ids: Sequence[int], pp_rank: int, pp: int, n_microbatches: int
) -> list[list[int]]:
    """For each moment after a forward, the microbatches whose activations each of this rank's stages holds.

    Multi-stage schedules publish every rank's actions (`pipeline_order`), which are replayed; the
    single-stage ones are torch's GPipe (all microbatches) and 1F1B (warm-up of pp - stage forwards, then
    a backward before each forward). No schedule (pp = 1): one microbatch at a time."""
    order = getattr(schedule, "pipeline_order", None)
    if order:
        index = {stage: i for i, stage in enumerate(stage_ids)}
        held, timeline = [0] * len(stage_ids), []
        for action in _flatten(order[pp_rank]):
            kind = getattr(action.computation_type, "value", action.computation_type)
            if action.stage_index not in index:
                continue
            if kind == "F":
                held[index[action.stage_index]] += 1
                timeline.append(list(held))
            elif kind in ("B", "I"):
                held[index[action.stage_index]] -= 1
        return timeline or [[0] * len(stage_ids)]
    if schedule is None:
        return [[1]]
    if type(schedule).__name__ == "ScheduleGPipe":
        return [[n_microbatches]]
    return [[min(n_microbatches, pp - stage_ids[0])]]


def _flatten(actions: Sequence[object]) -> list[object]:
    flat = []
    for action in actions:
        if action is None:
            continue
        sub = getattr(action, "sub_actions", None)
        flat.extend(_flatten(sub) if sub else [action])
    return flat


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

    def peak_at(moment: Sequence[int]) -> float:
        return sum(
            held * (k * input_bytes + (n - k) * layer_bytes)
            for held, k, n in zip(moment, checkpointed, stage_layers, strict=True)
        )

    def peak() -> tuple[float, Sequence[int]]:
        moment = max(timeline, key=peak_at)
        recompute = layer_bytes if any(checkpointed) else 0.0
        return fixed_bytes + peak_at(moment) + recompute, moment

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
    schedule: object,
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
    t, p = config.train, config.parallel
    microbatch, seq = config.microbatch_size, config.data.max_length
    layer_bytes, input_bytes = measure_layer_memory(config, resolved, device, microbatch, seq, tp_mesh)
    if t.memory_gb > 0:
        budget = t.memory_gb * GB
    elif device.type == "cuda":
        budget = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        budget = float("inf")  # a CPU has no memory limit to plan for unless train.memory_gb says so
    trainable = sum(_local(param).numel() for module in modules for param in module.parameters() if param.requires_grad)
    fixed = _allocated_bytes(modules, device) + 12 * trainable  # fp32 gradients and two AdamW moments
    last = next((module for module in modules if module.is_last), None)
    if last is not None:
        vocab = last.lm_head.weight.shape[0]
        rows = t.loss_chunk if t.fused_loss else microbatch * seq
        fixed += rows * vocab * (12 if t.fused_loss else 10)  # logits in fp32 (and their gradient)
    fixed += 0.07 * budget if budget != float("inf") else 0.0  # allocator slack, NCCL buffers, CUDA context
    timeline = inflight_timeline(schedule, stage_ids, pp_rank, p.pp, p.n_microbatches)
    stage_layers = [len(module.layers) for module in modules]
    return plan_checkpointing(stage_layers, timeline, layer_bytes, input_bytes, fixed, budget)


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
    part of it when split over `tp_mesh`)."""
    from pipetune.model.load import DTYPES, build_meta, materialize
    from pipetune.model.lora import apply_lora, use_fast_path
    from pipetune.model.quantize import quantize_linears

    shape_only = dataclasses.replace(resolved, weights_dir=None)  # values do not matter: no checkpoint read
    # PEFT draws its own adapter initialisation from the global generator: the run's streams stay untouched.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        model = apply_lora(
            build_meta(shape_only, DTYPES[config.model.dtype], [0], first=False, last=False),
            config.lora,
            resolved.name,
            seed=0,
        )
        if config.lora.fast_path:
            use_fast_path(model)
        quantize_linears(model, config.model.quantize)
        stage = StageModule(model)
        if tp_mesh is not None:
            from pipetune.parallel.tp import apply_tp

            apply_tp([stage], tp_mesh, config.parallel.sequence_parallel)
        materialize(model, shape_only, device)
        model.train()
        measured = stage.layer_memory(batch, seq)
    del model, stage
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return measured


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _allocated_bytes(modules: Sequence[StageModule], device: torch.device) -> float:
    """What the rank holds now: the allocator's count on a GPU, the stages' tensors on a CPU."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    tensors = {id(t): _local(t) for module in modules for t in [*module.parameters(), *module.buffers()]}
    return float(sum(t.numel() * t.element_size() for t in tensors.values()))


def check_weights_fit(config: Config, model_config: PretrainedConfig, ranges: Sequence[range]) -> None:
    """Refuse, before any process starts, a layout whose frozen weights alone exceed a rank's memory (the GPU's,
    or train.memory_gb); the message names the settings that would make it fit."""
    if config.train.memory_gb > 0:
        budget = config.train.memory_gb * GB
    elif torch.cuda.is_available():
        budget = float(torch.cuda.get_device_properties(0).total_memory)
    else:
        return
    p, quantize = config.parallel, config.model.quantize
    layer, embedding, head = parameter_counts(model_config)
    element = torch.empty((), dtype=getattr(torch, config.model.dtype)).element_size()
    linears = linear_shapes(model_config)
    quantized = sum(rows * columns for _, rows, columns in linears)
    layer_bytes = (layer - quantized) * element + sum(stored_bytes(r, c, quantize, element) for _, r, c in linears)
    shards = (p.dp if p.sharded else 1) * p.tp  # tensor parallelism splits (nearly) every weight tp ways
    for rank in range(p.pp):
        stages = stage_ids(p.schedule, rank, p.pp, p.stages_per_rank) if p.pp > 1 else [0]
        weights = sum(len(ranges[s]) for s in stages) * layer_bytes
        weights += embedding * element if 0 in stages else 0
        weights += head * element if len(ranges) - 1 in stages else 0
        weights /= shards
        if weights > 0.9 * budget:
            sharded = f", sharded over parallel.dp = {p.dp}" if p.sharded else ""
            sharded += f", split over parallel.tp = {p.tp}" if p.tp > 1 else ""
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


def parameter_counts(model_config: PretrainedConfig) -> tuple[int, int, int]:
    """Parameters of one decoder layer, of the token embedding, and of the final norm + lm_head, counted on a
    meta-device model of one layer (exact for every family)."""
    model = one_layer_model(model_config)
    layer = sum(param.numel() for param in model.model.layers[0].parameters())
    embedding = model.model.embed_tokens.weight.numel()
    head = model.lm_head.weight.numel() + sum(param.numel() for param in model.model.norm.parameters())
    return layer, embedding, head
