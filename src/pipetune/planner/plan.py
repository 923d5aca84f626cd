"""`pipetune plan`: the predicted peak memory per rank and tokens/s of every layout a config allows on N GPUs; the
fastest layout that fits is the pick, which `parallel.strategy = "auto"` runs.

    pipetune plan --config configs/bench-qwen3-4b.toml --gpus 2 [--gpu-memory 141] [--calibrate]

Memory is parallel/memory.py's model, the one `activation_checkpointing = "auto"` plans with: each rank's frozen
weights, its adapters with their gradients and AdamW moments, the loss workspace, and one layer's activations
(measured on the meta device, as CUDA keeps them) times the microbatches the schedule holds in flight; a layout
fits when it leaves that model's margin free. Speed is planner/speed.py's replay of the schedule. Both need the
model config only, so a plan takes seconds on a CPU; `--calibrate` times a layer and a transfer on the GPUs.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig

from pipetune.config import Config, ConfigError, ParallelConfig
from pipetune.data.inspect import training_attention_share
from pipetune.host_memory import total_host_memory
from pipetune.model.families import family_of
from pipetune.model.graphs import choose_cuda_graphs, graphs_untried
from pipetune.model.shapes import ResolvedModel, head_dim, one_layer_model, resolve_model
from pipetune.model.split import StageCosts, run_split
from pipetune.parallel.memory import (
    GB,
    HOST_SHARE,
    LAYER_MODES,
    MARGIN,
    OPTIMIZER_BYTES,
    ROW_PROBE,
    WEIGHTS_SHARE,
    activation_peak,
    element_bytes,
    host_budget,
    longest_rows,
    loss_bytes,
    measure_layer_memory,
    memory_budget,
    offload_hides,
    plan_checkpointing,
    rank_timeline,
    rank_weight_bytes,
    row_costs,
)
from pipetune.parallel.pipeline import schedule_actions
from pipetune.planner.layouts import Layout, candidate_layouts
from pipetune.planner.speed import (
    GpuRates,
    LayerWork,
    Replay,
    all_reduce_seconds,
    head_seconds,
    layer_seconds,
    link_seconds,
    recompute_seconds,
    replay_schedule,
)
from pipetune.preflight import check_data_source, linear_layer_names
from pipetune.switches import mlp_chunk_tokens

H200_MEMORY = 143_771 * 2**20
"""Bytes of an H200 as torch reports them: the budget when there is no GPU here and no --gpu-memory."""


@dataclass
class Prediction:
    layout: Layout
    peaks: list[float]
    """Predicted peak bytes of each pipeline rank (its dp and tp ranks alike), the margin not included."""
    checkpointed: list[list[int]]
    """Checkpointed layers per stage of each pipeline rank."""
    stage_layers: list[list[int]]
    """Layers per stage of each pipeline rank."""
    tokens_per_sec: float
    step_seconds: float
    """One optimizer step."""
    bubble: list[float]
    budget: float
    longest: dict[str, int] = field(default_factory=dict)
    """The longest row (tokens a sequence, at this microbatch) with every layer kept, recomputed or offloaded
    (parallel/memory.py's LAYER_MODES): the fewest over the pipeline ranks."""
    mode: str = "compiled"
    """How the layers run (planner/speed.py's MODES): "graphs" where CUDA graphs pay off."""
    offloaded: list[list[int]] = field(default_factory=list)
    """Of the checkpointed layers, those whose input waits in host memory, per stage of each pipeline rank."""
    work: LayerWork | None = None
    """One layer's work per microbatch (what --calibrate times)."""

    weights: float = 0.0
    """The most frozen weights a rank holds (as preflight's check_weights_fit counts them)."""

    @property
    def fits(self) -> bool:
        peak_fits = max(self.peaks) + MARGIN * self.budget <= self.budget
        return peak_fits and self.weights <= WEIGHTS_SHARE * self.budget

    def checkpointing(self) -> str:
        if not any(map(any, self.checkpointed)):
            return "off"
        offloaded = sum(map(sum, self.offloaded))
        host = f", {offloaded} offloaded" if offloaded else ""  # as the run's own plan says it
        if self.checkpointed == self.stage_layers:
            return "all" + host
        return (
            "auto "
            + " ".join(f"{sum(k)}/{sum(n)}" for k, n in zip(self.checkpointed, self.stage_layers, strict=True))
            + host
        )


@dataclass
class Plan:
    model: str
    gpus: int
    budget: float
    rates: GpuRates
    sequences: int
    seq: int
    predictions: list[Prediction]
    """Fitting layouts first, fastest first; then the others, smallest peak first."""
    changes: list[str] = field(default_factory=list)
    """When nothing fits: the smallest changes that would make a layout fit."""
    attention_share: float = 1.0
    """A row's attention work against causal attention over the whole row (below 1: packed rows)."""
    host_memory: float = 0.0
    """Bytes of host memory of the machine that trains (HOST_SHARE of it holds offloaded inputs)."""
    refused: list[str] = field(default_factory=list)
    """When no layout runs: why each process grid runs none."""

    @property
    def pick(self) -> Prediction | None:
        return self.predictions[0] if self.predictions and self.predictions[0].fits else None


@dataclass(frozen=True)
class _Shape:
    """One tensor-parallel rank's share of the model, and what the plan needs of it."""

    config: PretrainedConfig
    resolved: ResolvedModel
    trainable_per_layer: int
    linear_sizes: list[int]
    """Weights of each linear layer of one decoder layer's share (what model.quantize stores quantized)."""
    masked: int
    """Elements per token under the layer's LoRA dropout masks (`LayerWork.masked`)."""
    widths: int
    """The layer's linears' input and output widths together (what an FP8 base quantizes a token)."""


def make_plan(
    config: Config,
    gpus: int,
    budget: float | None = None,
    rates: GpuRates | None = None,
    layouts: Sequence[Layout] | None = None,
    search: bool = True,
    attention_share: float = 1.0,
    host_memory: float | None = None,
) -> Plan:
    """Predict every candidate layout (or `layouts`) of `config` on `gpus` GPUs with `budget` bytes each (None:
    train.memory_gb, the GPU's, else an H200's). `search`: when nothing fits, look for the changes that would.
    `attention_share`: a row's attention work against whole-row causal attention (packed rows: less; memory does
    not change, flex attention's is linear in the row like SDPA's). `host_memory`: bytes of host memory of the
    machine that trains, which offloaded inputs fill (None: this machine's, or its cgroup's limit where less)."""
    rates = rates or GpuRates()
    budget = default_budget(config) if budget is None else budget
    resolved = resolve_model(dataclasses.replace(config.model, init="random"))  # its config only, no weights
    enumerated, refused = layouts is None, []
    if layouts is None:
        layouts = candidate_layouts(config, resolved.config, linear_layer_names(resolved), gpus, refused)
    shapes: dict[int, _Shape] = {}
    predictions = []
    for layout in layouts:
        if layout.tp not in shapes:
            shapes[layout.tp] = _shape(config, resolved, layout.tp)
        shape = shapes[layout.tp]
        predictions.append(predict(layout, config, resolved, shape, budget, rates, attention_share, host_memory))
    if enumerated:
        predictions = _distinct(predictions)
    predictions.sort(key=lambda p: (not p.fits, -p.tokens_per_sec if p.fits else max(p.peaks), _order(p.layout)))
    sequences = config.train.batch_size * config.parallel.dp * config.train.grad_accum
    seq = config.data.max_length
    host = total_host_memory() if host_memory is None else host_memory
    plan = Plan(
        config.model.name,
        gpus,
        budget,
        rates,
        sequences,
        seq,
        predictions,
        attention_share=attention_share,
        host_memory=host,
        refused=refused if not predictions else [],
    )
    if plan.pick is None and search and enumerated and predictions:
        plan.changes = changes_that_fit(config, gpus, budget, rates, host_memory)
    return plan


def default_budget(config: Config) -> float:
    """Bytes per GPU to plan for without --gpu-memory: train.memory_gb, else this machine's GPU, else an H200's."""
    budget = memory_budget(config)
    return H200_MEMORY if budget == float("inf") else budget


def changes_that_fit(
    config: Config, gpus: int, budget: float, rates: GpuRates, host_memory: float | None = None
) -> list[str]:
    """The fewest GPUs (up to 8 times as many), and the longest data.max_length (down to a quarter), with which
    some layout fits. Checkpointing and the smallest microbatches are layouts of their own, already tried."""
    changes = []
    for more in (2 * gpus, 4 * gpus, 8 * gpus):
        if more > 64:
            break
        plan = make_plan(config, more, budget, rates, search=False, host_memory=host_memory)
        if plan.pick is not None:
            changes.append(f"{more} GPUs ({pick_summary(plan.pick)})")
            break
    length = config.data.max_length // 2
    while length >= max(128, config.data.max_length // 4):
        shorter = copy.deepcopy(config)
        shorter.data.max_length = length  # the one change named: the summary's cap stays (the prompt caps it)
        plan = make_plan(shorter, gpus, budget, rates, search=False, host_memory=host_memory)
        if plan.pick is not None:
            changes.append(f"data.max_length = {length} ({pick_summary(plan.pick)})")
            break
        length //= 2
    return changes


def pick_summary(pick: Prediction) -> str:
    return f"{pick.layout.describe()}, {pick.layout.batching()}, checkpointing {pick.checkpointing()}"


def predict(
    layout: Layout,
    config: Config,
    resolved: ResolvedModel,
    shape: _Shape,
    budget: float,
    rates: GpuRates,
    attention_share: float = 1.0,
    host_memory: float | None = None,
) -> Prediction:
    """Peak memory of every pipeline rank and tokens/s of `config` run as `layout` (`host_memory`: make_plan's)."""
    variant = layout.planned(config)
    p, t = variant.parallel, variant.train
    costs, ranges = _split(variant, resolved.config, attention_share)
    share_costs = _split(variant, shape.config, attention_share)[0]
    microbatch, seq = variant.microbatch_size, variant.data.max_length
    layer_bytes, input_bytes = (microbatch * n for n in _layer_memory(variant, shape.resolved, seq))
    weights = rank_weight_bytes(variant, shape.config, ranges)
    layer_weights = weights[0][0] / sum(len(ranges[s]) for s in p.stage_ids(0))
    fsdp = p.sharded and not p.pipelined  # layers gathered one at a time; in a pipeline they stay gathered all step
    # Under tp the fused loss works on this rank's vocabulary columns; the plain one on gathered, whole logits.
    vocab = (shape.config if t.fused_loss is True else resolved.config).vocab_size
    host = host_budget(p.world_size, host_memory)  # what a rank's offloaded inputs may fill

    held = max((stored + root) / (p.dp if p.sharded else 1) for stored, root in weights)  # check_weights_fit's count
    memory = _rank_memory(variant, shape, ranges, weights, (layer_bytes, input_bytes), budget, host, vocab, costs)
    peaks, checkpointed, offloaded_layers = memory.peaks, memory.checkpointed, memory.offloaded
    stage_layers, longest = memory.stage_layers, memory.longest

    mode, rank_modes = _mode(variant), []  # time: each stage's work per microbatch
    hidden = resolved.config.hidden_size
    work = _layer_work(config, shape, share_costs, hidden, microbatch, seq, layout.tp)
    element = element_bytes(config)
    hidden_bytes = microbatch * seq * hidden * element
    forward, backward, gather_seconds = {}, {}, 0.0
    for rank, (layers, k) in enumerate(zip(stage_layers, checkpointed, strict=True)):
        rank_mode = _rank_mode(mode, variant, costs, sum(layers), any(k), layout.tp)
        rank_modes.append(rank_mode)
        f, b = layer_seconds(work, rates, rank_mode)
        tensor_parallel = 2 * all_reduce_seconds(hidden_bytes, layout.tp, rates)  # attention's and the MLP's outputs
        f, b = f + tensor_parallel, b + tensor_parallel
        if p.sharded:
            gather = link_seconds(layer_weights * (p.dp - 1) / p.dp, rates) + rates.fsdp_call_seconds[rank_mode]
            if fsdp:
                f, b = f + gather, b + gather
            else:  # kept gathered through the schedule step: once per layer and step
                gather_seconds = max(gather_seconds, sum(layers) * gather)
        head = head_seconds(
            share_costs,
            *layer_seconds(
                dataclasses.replace(work, nf4_weights=0, nf4_linears=0, masked=0, fp8_elements=0), rates, rank_mode
            ),
        )
        for stage, n, recomputed in zip(p.stage_ids(rank), layers, k, strict=True):
            forward[stage] = n * f + (head if stage == len(ranges) - 1 else 0.0)
            backward[stage] = n * b + recomputed * recompute_seconds(work, rates, f, t.keep_attention)
    if mode == "graphs" and "graphs" not in rank_modes:
        mode = "compiled"
    replay = _replay_step(p, forward, backward, link_seconds(hidden_bytes, rates))
    trainable = sum(map(sum, stage_layers)) / p.pp * shape.trainable_per_layer
    step = t.grad_accum * (replay.step_seconds + gather_seconds)
    step += all_reduce_seconds(4 * trainable, p.dp, rates) + rates.step_seconds  # the adapters' gradients
    tokens_per_sec = t.batch_size * p.dp * t.grad_accum * seq / step
    bubble = replay.bubble if p.pipelined else []
    rows = {mode: min(ranks[mode] for ranks in longest) for mode in LAYER_MODES}
    return Prediction(
        layout,
        peaks,
        checkpointed,
        stage_layers,
        tokens_per_sec,
        step,
        bubble,
        budget,
        rows,
        mode,
        work=work,
        offloaded=offloaded_layers,
        weights=held,
    )


@dataclass
class _RankMemory:
    """`_rank_memory`'s answer, a list entry per pipeline rank."""

    peaks: list[float]
    checkpointed: list[list[int]]
    offloaded: list[list[int]]
    stage_layers: list[list[int]]
    longest: list[dict[str, int]]
    """The longest row each of memory.LAYER_MODES fits."""


def _rank_memory(
    variant: Config,
    shape: _Shape,
    ranges: Sequence[range],
    weights: list[tuple[float, float]],
    layer: tuple[float, float],
    budget: float,
    host: float,
    vocab: int,
    costs: StageCosts,
) -> _RankMemory:
    """Each pipeline rank's predicted peak, its recomputed and offloaded layers as the run's "auto" would choose
    them, and its longest rows; `layer`: one layer's activation and input bytes for the microbatch."""
    p = variant.parallel
    fsdp = p.sharded and not p.pipelined  # layers gathered one at a time; in a pipeline they stay gathered all step
    layer_weights = weights[0][0] / sum(len(ranges[s]) for s in p.stage_ids(0))
    memory = _RankMemory([], [], [], [], [])
    for rank in range(p.pp):
        layers = [len(ranges[s]) for s in p.stage_ids(rank)]
        trainable = sum(layers) * shape.trainable_per_layer / (p.dp if fsdp else 1)
        stored, root = weights[rank]
        fixed = (stored / p.dp + 2 * layer_weights if fsdp else stored) + root  # FSDP: this layer and the next
        fixed += (4 + OPTIMIZER_BYTES) * trainable  # float32 adapters, their gradients and AdamW moments
        timeline = rank_timeline(p, rank)
        last = len(ranges) - 1 in p.stage_ids(rank)
        row = row_costs(variant, shape.config, _layer_memory(variant, shape.resolved, ROW_PROBE), fixed, last, vocab)
        memory.longest.append(longest_rows(layers, timeline, row, (1 - MARGIN) * budget, host))
        fixed += loss_bytes(variant, vocab) if last else 0.0
        k, offloaded = _layer_modes(variant, layers, timeline, layer, fixed, budget, host, costs)
        memory.peaks.append(fixed + activation_peak(layers, k, timeline, *layer, offloaded)[0])
        memory.checkpointed.append(k)
        memory.offloaded.append(list(offloaded or [0] * len(layers)))
        memory.stage_layers.append(layers)
    return memory


def _layer_work(
    config: Config, shape: _Shape, costs: StageCosts, hidden: int, microbatch: int, seq: int, tp: int
) -> LayerWork:
    """What one decoder layer of width `hidden` computes for a microbatch of `microbatch` x `seq` tokens, split
    over `tp` ranks."""
    nf4 = shape.linear_sizes if config.model.quantize == "nf4" else []
    return LayerWork(
        costs,
        hidden,
        microbatch * seq,
        microbatch,
        seq,
        tp,
        config.model.name,
        sum(nf4),
        len(nf4),
        shape.masked,
        shape.widths if config.model.quantize == "fp8" else 0,
    )


def _rank_mode(mode: str, config: Config, costs: StageCosts, layers: int, checkpointed: bool, tp: int) -> str:
    """How a rank's layers run: with "graphs", the run's own rule rank by rank (checkpointing, recording time)."""
    if mode != "graphs":
        return mode
    untried = graphs_untried(config.model.quantize)
    microbatch, seq, m = config.microbatch_size, config.data.max_length, config.parallel.n_microbatches
    graphs = choose_cuda_graphs(costs, layers, checkpointed, m, microbatch, seq, tp, untried)
    return "graphs" if graphs[0] else "compiled"


def _layer_modes(
    config: Config,
    layers: list[int],
    timeline: list[list[int]],
    memory: tuple[float, float],
    fixed: float,
    budget: float,
    host: float,
    costs: StageCosts,
) -> tuple[list[int], list[int] | None]:
    """Recomputed and offloaded layers per stage of one rank, as the run would choose them (`auto_checkpointing`);
    `memory`: one layer's activation and input bytes for the microbatch; `host`: what its offloaded inputs may
    fill."""
    t, (layer_bytes, input_bytes) = config.train, memory
    if t.activation_checkpointing == "auto":
        tokens = config.microbatch_size * config.data.max_length
        hides = offload_hides(input_bytes, costs.layer / 2 * tokens)  # a LoRA layer's forward: half its count
        margin = fixed + MARGIN * budget
        plan = plan_checkpointing(layers, timeline, layer_bytes, input_bytes, margin, budget, host, hides)
        return plan.layers, plan.offloaded
    k = list(layers) if t.activation_checkpointing else [0] * len(layers)
    return k, list(layers) if t.activation_checkpointing == "offload" else None


def _replay_step(p: ParallelConfig, forward: dict[int, float], backward: dict[int, float], transfer: float) -> Replay:
    """One schedule step of stages taking `forward` / `backward` seconds (by stage) per microbatch: replayed in
    the schedule's order on their ranks, `transfer` seconds between ranks; without a pipeline, microbatches in turn."""
    if not p.pipelined:
        busy = p.n_microbatches * (forward[0] + backward[0])
        return Replay(busy, [busy])
    order = schedule_actions(p.schedule, p.pp, p.stages_per_rank, p.n_microbatches)
    stages = sorted(forward)
    return replay_schedule(
        order, p.stage_ranks(), [forward[s] for s in stages], [backward[s] for s in stages], transfer
    )


def _mode(config: Config) -> str:
    """How this run's layers execute (speed.MODES)."""
    t = config.train
    if not t.compile:
        return "eager" if config.lora.fast_path else "plain"
    if t.cuda_graphs:  # where the rule of model/graphs.py keeps them: decided rank by rank in predict
        return "graphs"
    return "compiled"


def _shape(config: Config, resolved: ResolvedModel, tp: int) -> _Shape:
    share = tensor_parallel_share(resolved.config, tp)
    layer = one_layer_model(share).model.layers[0]
    targets = set(config.lora.target_modules)
    linears = [(name, module) for name, module in layer.named_modules() if isinstance(module, nn.Linear)]
    trainable = sum(
        config.lora.r * (module.in_features + module.out_features)
        for name, module in linears
        if name.rsplit(".", 1)[-1] in targets
    )
    sizes = [module.in_features * module.out_features for _, module in linears]
    widths = {name.rsplit(".", 1)[-1]: m.in_features for name, m in linears if name.rsplit(".", 1)[-1] in targets}
    masked = sum(widths.values()) if config.lora.dropout > 0 else 0
    if masked and config.lora.shared_dropout and config.lora.fast_path and tp == 1:  # lora.use_fast_path's groups
        for names in family_of(resolved.config).shared_inputs:
            masked -= sum(sorted(widths[name] for name in names if name in widths)[1:])  # one mask a group
    both = sum(module.in_features + module.out_features for _, module in linears)
    return _Shape(share, dataclasses.replace(resolved, config=share, weights_dir=None), trainable, sizes, masked, both)


def tensor_parallel_share(model_config: PretrainedConfig, tp: int) -> PretrainedConfig:
    """One tensor-parallel rank's share of the model as a model of its own: heads, key-value heads, MLP columns
    and vocabulary divided by tp (as parallel.tp splits them), hidden and head sizes as they are. Its layer's
    parameters, FLOPs and activations are the rank's (the hidden states between blocks stay whole)."""
    if tp == 1:
        return model_config
    share = copy.deepcopy(model_config)
    share.head_dim = head_dim(model_config)
    share.num_attention_heads = model_config.num_attention_heads // tp
    share.num_key_value_heads = (
        getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    ) // tp
    share.intermediate_size = model_config.intermediate_size // tp
    share.vocab_size = -(-model_config.vocab_size // tp)
    share.bos_token_id = share.eos_token_id = share.pad_token_id = None  # ids past the share's vocabulary
    return share


_LAYER_MEMORY: dict[tuple, tuple[PretrainedConfig, tuple[int, int]]] = {}
_SPLITS: dict[tuple, tuple[PretrainedConfig, tuple[StageCosts, list[range]]]] = {}


def _split(
    config: Config, model_config: PretrainedConfig, attention_share: float = 1.0
) -> tuple[StageCosts, list[range]]:
    """`run_split`, remembered: the costs depend on the sequence, the loss and the attention share, the ranges on
    the stage count (they are the run's own, which training balances with whole rows' costs)."""
    d, p = config.data, config.parallel
    key = (id(model_config), d.max_length, d.max_summary_tokens, config.train.fused_loss, p.n_stages, attention_share)
    key += tuple(p.layers_per_stage)
    if key not in _SPLITS or _SPLITS[key][0] is not model_config:
        costs, ranges = run_split(config, model_config)  # the run's own stages: training balances whole rows
        if attention_share != 1.0:
            costs = run_split(config, model_config, attention_share)[0]
        _SPLITS[key] = (model_config, (costs, ranges))
    return _SPLITS[key][1]


def _layer_memory(config: Config, resolved: ResolvedModel, seq: int) -> tuple[int, int]:
    """(activation bytes, input bytes) of one layer for one sequence: they grow with the microbatch in proportion."""
    key = (
        id(resolved.config),
        mlp_chunk_tokens(config.train, seq, config.parallel.tp),
        config.model.dtype,
        config.lora.r,
        tuple(config.lora.target_modules),
        config.lora.dropout > 0,
        config.lora.fast_path,
        config.lora.shared_dropout,
        seq,
    )
    if key not in _LAYER_MEMORY or _LAYER_MEMORY[key][0] is not resolved.config:
        long = dataclasses.replace(config, data=dataclasses.replace(config.data, max_length=seq))
        measured = measure_layer_memory(long, resolved, torch.device("meta"), 1, seq)  # chunked MLPs as at seq
        _LAYER_MEMORY[key] = (resolved.config, measured)
    return _LAYER_MEMORY[key][1]


def _distinct(predictions: list[Prediction]) -> list[Prediction]:
    """Drop "auto" checkpointing where it plans what a listed "off" or "on" layout already is (none, or every
    layer)."""
    listed = {(p.layout.checkpointing, dataclasses.replace(p.layout, checkpointing=False)) for p in predictions}
    kept = []
    for prediction in predictions:
        plain = dataclasses.replace(prediction.layout, checkpointing=False)
        same = {"off": False, "all": True}.get(prediction.checkpointing())
        if prediction.layout.checkpointing == "auto" and same is not None and (same, plain) in listed:
            continue
        kept.append(prediction)
    return kept


def _order(layout: Layout) -> tuple:
    return (
        layout.gpus,
        layout.strategy,
        layout.pp,
        layout.tp,
        layout.schedule,
        layout.stages_per_rank,
        layout.n_microbatches,
        layout.microbatch,
        str(layout.checkpointing),
        layout.dp_shard,
    )


# --------------------------------------------------------------------------- output


def format_plan(plan: Plan, top: int | None = 15) -> str:
    """The ranked table: the `top` fitting layouts, the best of each strategy not among them, and the layouts that
    do not fit closest to fitting (None: every layout)."""
    rows = plan.predictions
    if top is not None:
        fitting = [p for p in rows if p.fits]
        shown = fitting[:top]
        for strategy in dict.fromkeys(p.layout.strategy for p in rows):
            best = next((p for p in rows if p.layout.strategy == strategy), None)
            if best is not None and best not in shown:
                shown.append(best)
        shown += [p for p in rows if not p.fits][:3]
        rows = [p for p in plan.predictions if p in shown]
    width = max([len(p.layout.describe()) for p in rows] + [6])
    budget = plan.budget / GB
    lines = [
        f"pipetune plan: {plan.model}, {plan.sequences} sequences of {plan.seq} tokens per optimizer step, "
        f"{plan.gpus} GPU{'s' if plan.gpus > 1 else ''} of {budget:.0f} GB; rates: {plan.rates.name}"
        + (
            f"; packed rows: attention {plan.attention_share:.0%} of a whole row's (the training split)"
            if plan.attention_share < 1
            else ""
        ),
        f"{'#':>4}  {'layout':<{width}}  {'microbatches':<18} {'checkpointing':<16} {'peak GB per rank':<18} "
        f"{'tokens/s':>9}  {'bubble':<9} fits",
    ]
    for prediction in rows:
        rank = plan.predictions.index(prediction) + 1
        peaks = " ".join(f"{peak / GB:.1f}" for peak in prediction.peaks)
        bubble = " ".join(f"{b:.0%}" for b in prediction.bubble)
        fits = (
            "yes" if prediction.fits else f"no: {max(prediction.peaks) / GB:.0f} + {MARGIN:.0%} margin > {budget:.0f}"
        )
        lines.append(
            f"{rank:>4}  {prediction.layout.describe():<{width}}  {prediction.layout.batching():<18} "
            f"{prediction.checkpointing():<16} {peaks:<18} {prediction.tokens_per_sec:>9,.0f}  {bubble:<9} {fits}"
        )
    lines += longest_row_lines(plan, rows, width)
    n_fit = sum(p.fits for p in plan.predictions)
    lines.append(
        f"{len(plan.predictions)} layouts, {n_fit} fit"
        + ("" if top is None or len(rows) == len(plan.predictions) else f"; {len(rows)} shown (--all: every one)")
    )
    lines.append(pick_line(plan) if plan.pick else no_fit_message(plan))
    return "\n".join(lines)


def longest_row_lines(plan: Plan, rows: Sequence[Prediction], width: int) -> list[str]:
    """The longest row each shown layout trains, from the memory model: every layer kept, recomputed, or recomputed
    with its input in host memory (train.activation_checkpointing = true / "offload")."""
    lines = [
        f"longest row per layout (tokens a sequence at its microbatch; {MARGIN:.0%} margin; offload: within "
        f"{HOST_SHARE:.0%} of {plan.host_memory / GB:,.0f} GB of host memory, --host-memory): "
        + " / ".join(LAYER_MODES)
    ]
    for prediction in rows:
        rank = plan.predictions.index(prediction) + 1
        tokens = " / ".join(f"{prediction.longest.get(mode, 0):,}" for mode in LAYER_MODES)
        lines.append(f"{rank:>4}  {prediction.layout.describe():<{width}}  {tokens}")
    return lines


def pick_line(plan: Plan) -> str:
    """What the plan picks and why, in one line."""
    pick = plan.pick
    assert pick is not None
    others = [p for p in plan.predictions if p.fits and p.layout.strategy != pick.layout.strategy]
    runner_up = (
        f"; next other strategy: {others[0].layout.describe()} at {others[0].tokens_per_sec:,.0f}" if others else ""
    )
    peaks = " / ".join(_gb(peak) for peak in pick.peaks)
    return (
        f"pick: {pick.layout.describe()}, {pick.layout.batching()} microbatches, checkpointing {pick.checkpointing()}: "
        f"predicted {pick.tokens_per_sec:,.0f} tokens/s, peak {peaks} GB of {plan.budget / GB:.0f} per rank, the "
        f"fastest of {sum(p.fits for p in plan.predictions)} layouts that fit{runner_up}"
    )


def _gb(nbytes: float) -> str:
    """GB with two significant digits below 10 (a tiny model's figures), whole ones above."""
    return f"{nbytes / GB:.0f}" if nbytes >= 10 * GB else f"{nbytes / GB:.2g}"


def no_fit_message(plan: Plan) -> str:
    """Nothing fits: the closest layout, and the smallest changes that would make one fit."""
    if not plan.predictions:
        why = f" ({'; '.join(plan.refused)})" if plan.refused else ""
        return (
            f"no layout of {plan.model} runs on {plan.gpus} GPUs{why}; use another number of processes (--nproc), "
            "or a train.batch_size x train.grad_accum that splits over them"
        )
    closest = min(plan.predictions, key=lambda p: max(p.peaks))
    need = max(closest.peaks) / (1 - MARGIN) / GB
    return (
        f"nothing fits {plan.gpus} GPU{'s' if plan.gpus > 1 else ''} of {plan.budget / GB:.0f} GB: the smallest "
        f"predicted peak is {_gb(max(closest.peaks))} GB ({closest.layout.describe()}, {closest.layout.batching()}"
        f" microbatches, checkpointing {closest.checkpointing()}), which needs {need:.0f} GB per GPU with the margin"
        + (
            f"; it would fit with {', or with '.join(plan.changes)}"
            if plan.changes
            else "; nor would it fit with up to 8 times the GPUs or a quarter of data.max_length"
        )
    )


# --------------------------------------------------------------------------- parallel.strategy = "auto"


def available_gpus(config: Config, nproc: int | None = None) -> int:
    """GPUs a run may spread over: --nproc, else torchrun's world size, else this machine's GPUs, else the
    config's own process count."""
    if nproc:
        return nproc
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return config.parallel.world_size


def resolve_auto(config: Config, gpus: int, announce: bool = True) -> Config:
    """`parallel.strategy = "auto"`: the config as its plan's pick on `gpus` GPUs, and one line saying what and why
    (printed by the first process only)."""
    check_data_source(config.data)  # a missing data file fails before the plan resolves the model
    plan = auto_plan(config, gpus)
    if plan.pick is None:
        raise ConfigError(f"parallel.strategy = 'auto': {no_fit_message(plan)}")
    if announce and os.environ.get("RANK", "0") == "0":
        elsewhere = ""
        if not torch.cuda.is_available():
            elsewhere = (
                f"no GPU found here, so this is the plan for {_planned_gpus(plan)}, "
                f"and the pick runs as {_processes(gpus)}: "
            )
        print(f"pipetune: parallel.strategy = auto: {elsewhere}{pick_line(plan)}", flush=True)
    return plan.pick.layout.apply(config)


LAYOUT_KEYS = ("parallel.strategy", "parallel.pp", "parallel.dp", "parallel.tp")
"""The --set keys that ask for a layout explicitly: `fit_to_gpus` keeps such a layout as asked."""


def layout_asked(overrides: Sequence[str]) -> bool:
    """Whether `--set` overrides (section.key=value) set the layout (LAYOUT_KEYS): `fit_to_gpus`'s `explicit`."""
    return any(item.partition("=")[0].strip() in LAYOUT_KEYS for item in overrides)


def fit_to_gpus(config: Config, gpus: int, explicit: bool) -> Config:
    """A config's layout on a machine with fewer GPUs than its processes (`gpus`): as it is where it fits; else,
    where the layout came from the config file (not `explicit`), the layout that fits, said in one line: one
    process on one GPU, the plan's pick on several; where it was asked for on the command line, one line naming
    the fix. Two ranks never share a GPU unless asked to (--nproc)."""
    p = config.parallel
    wanted = p.world_size
    if gpus >= wanted or gpus < 1:
        return config
    layout = f"parallel.pp x dp x tp = {p.pp} x {p.dp} x {p.tp} is {wanted} processes, one a GPU, but this machine has"
    layout += f" {gpus}"
    if explicit:
        raise ConfigError(
            f"{layout}: use --nproc {wanted} to run them sharing {'it' if gpus == 1 else 'them'}, or "
            f"--set parallel.strategy=auto for the layout that fits {gpus} GPU{'s' if gpus > 1 else ''}"
        )
    if gpus == 1:
        fitted = single_process(config)
        what = "one process ('single')"
    else:
        auto = dataclasses.replace(config, parallel=dataclasses.replace(p, strategy="auto"))
        fitted = resolve_auto(auto, gpus, announce=False)
        q = fitted.parallel
        what = f"the plan's pick, {q.strategy} pp x dp x tp = {q.pp} x {q.dp} x {q.tp}"
    rows = config.train.batch_size * p.dp
    if os.environ.get("RANK", "0") == "0":
        print(
            f"pipetune: {layout}: running {what}, {rows} rows a schedule step as the config's layout runs them "
            f"(--nproc {wanted} runs the config's own layout on {'this GPU' if gpus == 1 else 'these GPUs'})",
            flush=True,
        )
    return fitted


def single_process(config: Config) -> Config:
    """`config` run as one process with the same rows a step: the replicas' batch on one, its microbatches
    chosen for one GPU ("auto"), the pipeline's own settings gone."""
    variant = copy.deepcopy(config)
    p = variant.parallel
    variant.train.batch_size *= p.dp
    p.strategy, p.pp, p.dp, p.tp, p.dp_shard, p.sequence_parallel = "single", 1, 1, 1, False, False
    p.schedule, p.stages_per_rank, p.layers_per_stage, p.n_microbatches = "1f1b", 1, [], "auto"
    return variant


def auto_plan(config: Config, gpus: int) -> Plan:
    """The plan `parallel.strategy = "auto"` runs: this machine's GPU memory (or train.memory_gb) and host memory,
    the H200's rates, the training split's attention share."""
    return make_plan(config, gpus, attention_share=attention_share(config))


def attention_share(config: Config) -> float:
    """The training split's attention share (`data.inspect.training_attention_share`) with the run's prompts; 1.0
    without packing or buckets, where it reads no data."""
    if not config.data.packing and not config.data.buckets:
        return 1.0
    from pipetune.preflight import prepare

    return training_attention_share(config, prepare(config).prompts)


def no_gpu_line(config: Config, plan: Plan) -> str | None:
    """Without a GPU here, a plan's figures are an H200's (or a GPU of --gpu-memory at an H200's speed): one line
    saying so, and what parallel.strategy = "auto" runs on this machine (resolve_auto's plan). None with a GPU."""
    if torch.cuda.is_available():
        return None
    here = available_gpus(config)
    same = (here, default_budget(config), total_host_memory(), GpuRates()) == (
        plan.gpus,
        plan.budget,
        plan.host_memory,
        plan.rates,
    )
    auto = plan if same else auto_plan(config, here)  # the plan's own attention share: the same data
    runs = (
        f"runs {auto.pick.layout.describe()} ({auto.pick.layout.batching()} microbatches, checkpointing "
        f"{auto.pick.checkpointing()}) as {_processes(here)} (gloo), at a CPU's speed"
        if auto.pick is not None
        else f"refuses to run: {no_fit_message(auto)}"
    )
    return (
        f"no GPU found here: these predictions are for {_planned_gpus(plan)}, "
        f'not for this machine; on it, parallel.strategy = "auto" {runs} (--calibrate on a GPU machine times its '
        "own GPUs)"
    )


def _processes(n: int) -> str:
    return f"{n} CPU process" + ("es" if n > 1 else "")


def _planned_gpus(plan: Plan) -> str:
    """What a plan made without a GPU here is for: H200s, or GPUs of --gpu-memory (or train.memory_gb) at an
    H200's speed."""
    n, memory = plan.gpus, f"{plan.budget / GB:.0f} GB"
    if plan.budget == H200_MEMORY:
        return f"{n} H200 GPU{'s' if n > 1 else ''} ({memory} each)"
    return f"{n} GPU{'s' if n > 1 else ''} of {memory} at an H200's speed"
