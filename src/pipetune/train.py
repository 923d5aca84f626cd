"""The training loop: this rank's pipeline stage(s) of one replica, LoRA adapters only, one explicit loop.

    pipetune train --config configs/qwen3-4b-ami.toml --nproc 2
    torchrun --nproc-per-node 2 -m pipetune train --config configs/qwen3-4b-ami.toml

Every rank cuts the same batches from the memory-mapped token cache and takes its dp replica's
share; stage 0 feeds the token ids, the last stage the labels, and all ranks know each
step's global supervised-token count, which normalizes the loss (see parallel/pipeline.py).
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from peft import PeftModel
from torch.distributed.tensor import DTensor

from pipetune.checkpoint import (
    Checkpoint,
    CheckpointSettings,
    Position,
    TrainState,
    diverged_advice,
    find_resume_checkpoint,
    latest_checkpoint,
    layout_change,
    load_checkpoint,
    resumed_seed,
    sane_checkpoint,
    save_checkpoint,
)
from pipetune.config import Config, save_config
from pipetune.data.batching import SampleStore, bucket_lengths, bucketed_epoch_batches, epoch_batches, pad_fraction
from pipetune.data.cache import tokenized_data
from pipetune.data.packing import batches_of_rows, epoch_rows, members, packed_batch, packing_line, rows_attention_share
from pipetune.data.prompt import PROMPT_FILE, write_prompt_settings
from pipetune.data.sources import chat_lines
from pipetune.metrics import MetricsLog, PhaseLog, host_peak_gb, peak_memory_gb, reset_peak_memory
from pipetune.model.attention import (
    PLAN_BUILDS,
    documents_advice,
    expect_document_lengths,
    prebuild_plans,
    use_document_attention,
)
from pipetune.model.graphs import choose_cuda_graphs, give_gradients_own_memory, graphs_untried
from pipetune.model.host_tensors import to_device
from pipetune.model.load import DTYPES
from pipetune.model.lora import adapter_state, save_adapter
from pipetune.model.shapes import head_dim
from pipetune.model.split import StageCosts, run_split, stage_costs
from pipetune.model.stage import StageModule
from pipetune.parallel.assemble import StagePart, build_stage_modules, compile_stages, run_parallelism
from pipetune.parallel.gradients import GradientSync, bad_ranks, clip_global_grad_norm
from pipetune.parallel.memory import auto_checkpointing, check_plans_fit
from pipetune.parallel.mesh import Mesh, build_mesh
from pipetune.parallel.pipeline import PipelineRunner, SingleRunner, TokenLoss, evaluate_validation
from pipetune.parallel.process_group import DistEnv, under_launcher
from pipetune.parallel.timeline import StageTimeline, plot_saved_timeline, save_timeline
from pipetune.parallel.torch_compat import (
    keep_rng_out_of_no_grad_forwards,
    restore_gradients,
    stash_gradients,
)
from pipetune.parallel.tp import sum_partial_gradients
from pipetune.preflight import Prepared, epoch_steps, preflight
from pipetune.profile import CompileLog, profiled
from pipetune.run_lock import record_launch, restarted_launch
from pipetune.run_log import write_whole
from pipetune.schedules import SCHEDULES
from pipetune.switches import Hardware, resolve
from pipetune.worker import has_launcher, named_cache_error


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float]
    """Logged loss of every metrics row (rank 0; empty elsewhere)."""
    resumed_from: int | None = None
    """The checkpoint step this run continued from; None for a fresh start."""


class TrainingError(Exception):
    """The run cannot go on (non-finite steps in a row, a peer that stopped); the message says why and what to do."""


@dataclass
class LoopStatus:
    """Where this rank is, for the message when a peer stops responding or the rank fails."""

    step: int = 0
    phase: str = "setup"

    def where(self) -> str:
        return f"the {self.phase} of step {self.step}" if self.step else f"the {self.phase}"


def train(config: Config, env: DistEnv, quiet: bool = False, status: LoopStatus | None = None) -> RunResult:
    """Fine-tune this rank's part of the model; every rank of the group calls it. `status` says where the rank is
    (for the launcher's message when a peer stops responding)."""
    say = functools.partial(print0, env, quiet)
    status = status or LoopStatus()
    # The launcher said the checks' warnings before the workers started; under torchrun alone rank 0 says them.
    hardware = Hardware.of(env.device)
    speak = env.is_main and under_launcher() and not has_launcher()
    prepared = preflight(config, env.world_size, speak=speak, hardware=hardware)
    checkpoints = CheckpointSettings.of(config)
    run_dir = Path(config.output.dir)
    restarted = restarted_launch(run_dir)  # a restart of the launch that started what is there: it continues
    resume_from = find_resume_checkpoint(checkpoints, restarted)
    if env.distributed:  # every rank read the run directory before rank 0 writes into it: a slow rank would
        dist.barrier()  # otherwise take rank 0's new metrics.csv for an earlier run's and refuse to start
    if env.is_main and not restarted:
        record_launch(run_dir)  # before anything is written: what a restart finds then is this launch's
    t, p, device = config.train, config.parallel, env.device
    if t.cuda_graphs is True and device.type != "cuda":
        ignored = "train.cuda_graphs = true is ignored on the CPU (CUDA graphs need GPUs)"
        warn0(env, f"{ignored}: the layers run compiled only")
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir / "config.toml")  # as asked, "auto" kept: a resume resolves it again
        write_prompt_settings(run_dir / PROMPT_FILE, prepared.prompts, config)  # for export and plain-HF use
    phases = PhaseLog(run_dir / "progress.jsonl", enabled=env.is_main)
    phases.mark("setup")  # the imports, the checks, the GPU's context: what a run pays before its data
    mesh = build_mesh(env, p.pp, p.dp, p.tp)
    # LoRA dropout: a different stream per stage and replica, one per tp group (parallel/tp.py: equal masks).
    torch.manual_seed(t.seed + mesh.replica_rank)

    data = build_data(prepared.speed.config, env, prepared, run_dir, say)
    # the attention kernel by the samples' lengths, a CPU's loss by the vocabulary
    speed = resolve(config, hardware, data.real_tokens, prepared.model.config.vocab_size)
    config, t = speed.config, speed.config.train
    phases.mark("data")
    if data.packing and t.packed_attention == "documents":  # cuDNN's plans for them, built ahead (below, step 1)
        expect_document_lengths(data.real_tokens)  # the samples' (pad tails take no attention there)
        if advice := documents_advice(data.real_tokens, device.type == "cuda"):
            say(advice)
        if p.tp == 1:  # forward and backward, each in the thread that will use them, as the model loads and compiles
            hf, size = prepared.model.config, head_dim(prepared.model.config)
            heads = (hf.num_attention_heads, hf.num_key_value_heads, size)
            prebuild_plans(device, DTYPES[config.model.dtype], *heads, config.data.max_length, size**-0.5)
    stages = build_stages(config, env, mesh, prepared, phases, say, quiet)
    runners = build_runners(config, env, mesh, prepared, stages)
    say(speed.line(*runners.decisions))
    if env.is_main:
        speed.save(run_dir / "speed.json", *runners.decisions)
    optimizer, scheduler = build_optimizer(config, stages.params, data.total_steps)
    state = TrainState.of(stages.peft_model, optimizer, scheduler)
    position = resume_position(config, env.rank, mesh, checkpoints, resume_from, state, say)
    phases.mark("optimizer")

    # ------------------------------------------------------------------ loop
    # A resumed run continues metrics.csv from its checkpoint's step.
    metrics = MetricsLog(config, env, data.total_steps, position.step if resume_from else None, quiet)
    loop = Loop(config, env, mesh, data, stages, runners, state, metrics, status, phases, HOOKS, say)
    loop.step, loop.skipped_in_row = position.step, position.skipped_in_row
    loop.hooks.start(env.rank, env.world_size)
    if data.validation is not None and resume_from is None:  # where the validation curve starts: the base model
        row = {"strategy": p.strategy, "epoch": 0, "step": 0, **validation_columns(loop)}
        metrics.write(row)
        say(f"step 0/{data.total_steps} | val_loss {row['val_loss']:.4f} (before fine-tuning)")
    reset_peak_memory(device)
    run_steps(loop, position, checkpoints)
    metrics.close()
    if env.rank == 0 and t.timeline_step:
        plot_saved_timeline(run_dir, config)

    status.phase = "adapter gather"
    phases.mark("adapter", step=loop.step)
    save_gathered_adapter(config, env, stages.peft_model, run_dir, say)
    phases.mark("done", step=loop.step)
    return RunResult(run_dir, metrics.losses, position.step if resume_from is not None else None)


def resume_position(
    config: Config,
    rank: int,
    mesh: Mesh,
    checkpoints: CheckpointSettings,
    resume_from: Checkpoint | None,
    state: TrainState,
    say: Callable[[str], None],
) -> Position:
    """Where the run starts: step 0, or a committed checkpoint's adapters, optimizer, RNG and data position."""
    if resume_from is None:
        return Position()
    # RNG states belong to ranks: under another layout, each rank is seeded as a fresh run's (tp groups alike).
    changed = layout_change(resume_from, checkpoints)
    rng_seed = None if changed is None else resumed_seed(config.train.seed, mesh.replica_rank, resume_from.step)
    position = load_checkpoint(resume_from, state, rank, rng_seed)
    note = ""
    if changed and config.lora.dropout > 0:
        note = f" ({changed}: LoRA dropout draws continue from a new stream)"
    say(f"resumed from {resume_from.path} at step {position.step}{note}")
    return position


def run_steps(loop: Loop, position: Position, checkpoints: CheckpointSettings) -> None:
    """Every optimizer step from `position` to the run's last, each followed by what the cadence asks: a metrics
    row (with validation), a checkpoint holding the position after it."""
    data, config = loop.data, loop.config
    compiled = CompileLog()
    for epoch, index, batches, lengths in data.steps_from(position):
        with profiled(loop.step + 1, loop.env.rank, loop.env.device):  # PIPETUNE_PROFILE_STEP, for diagnosis
            lr = run_step(loop, batches, lengths)
        # Where a first step's time went, said even when quiet (a bench's log keeps it), by the main rank.
        while PLAN_BUILDS:
            count, seconds, passes = PLAN_BUILDS.pop(0)
            _first_steps(loop, f"packed attention: cuDNN's {passes} plans, {count} document lengths, {seconds:.1f} s")
        _first_steps(loop, compiled.line())
        loop.hooks.after_step(loop.step, saved=False)
        epoch_end = index == data.epoch_steps[epoch] - 1
        log, evaluate, save = cadence(config, loop.step, data.total_steps, epoch_end, data.validation is not None)
        if log or save:  # both wait for the GPU anyway; a checkpoint holds the settled schedule and skip count
            settle(loop)
        if log:
            log_row(loop, epoch, lr, evaluate)
        if save:  # with the position after this step, where a resumed run continues
            next_epoch, next_batch = (epoch + 1, 0) if epoch_end else (epoch, index + 1)
            save_step(loop, checkpoints, Position(loop.step, next_epoch, next_batch, loop.skipped_in_row))
    settle(loop)


# --------------------------------------------------------------------------- what the loop is built from


@dataclass
class TrainData:
    """The training split and its epoch plans, the step counts, and the validation split on the device (None
    without one, or under a schedule with no forward-only mode)."""

    split: SampleStore
    real_tokens: torch.Tensor
    """Per sample, on the CPU: its tokens, and (next) its supervised tokens; read once, no device sync per step."""
    supervised: torch.Tensor
    padded_lengths: torch.Tensor
    """Per sample: the length it is padded to (its bucket, or data.max_length)."""
    buckets: list[int]
    max_length: int
    global_batch: int
    """Samples per schedule step over all replicas; each rank takes its replica's columns."""
    grad_accum: int
    """Schedule steps per optimizer step."""
    pad_id: int
    seed: int
    epoch_steps: list[int]
    """Optimizer steps in each epoch (preflight.epoch_steps): the first grad_accum x that many batches of its plan.
    A packed epoch's own count, which no other epoch and not train.epochs changes: a resumed run's Position
    counts the same steps whatever train.epochs it has."""
    total_steps: int
    validation: tuple[torch.Tensor, torch.Tensor] | None
    max_samples_per_row: int = 0
    """data.packing: samples per row at most (0: unpacked, one sample a row). Packed batches hold rows of sample
    indices, [n_batches, global_batch, width] with -1 where a row has fewer (width: at most max_samples_per_row)."""
    _rows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def packing(self) -> bool:
        return self.max_samples_per_row > 0

    def attention_share(self, batches: torch.Tensor) -> float:
        """Packed batches' attention work against whole rows' (packing.rows_attention_share)."""
        return rows_attention_share(batches.reshape(-1, batches.shape[-1]), self.real_tokens, self.max_length)

    def samples_in(self, batches: torch.Tensor) -> torch.Tensor:
        """The sample indices in some of a plan's batches, flat."""
        return members(batches) if self.packing else batches.flatten()

    def packed_rows(self, epoch: int) -> torch.Tensor:
        """This epoch's packed rows, every one (packing takes a while on large splits: packed once an epoch)."""
        if epoch not in self._rows:
            rows = epoch_rows(self.real_tokens, self.max_length, self.max_samples_per_row, self.seed, epoch)
            self._rows[epoch] = rows
        return self._rows[epoch]

    def epoch_plan(self, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This epoch's batches (sample indices) and the padded length of each: the same on every (re)start."""
        if self.packing:
            batches = batches_of_rows(self.packed_rows(epoch), self.global_batch)
            return batches, torch.full((len(batches),), self.max_length, dtype=torch.long)
        if self.buckets:
            return bucketed_epoch_batches(self.padded_lengths, self.global_batch, self.seed, epoch)
        batches = epoch_batches(len(self.split), self.global_batch, self.seed, epoch)
        return batches, torch.full((len(batches),), self.max_length, dtype=torch.long)

    def steps_from(self, position: Position) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(epoch, index within it, batches, padded lengths) of each optimizer step from `position` up to
        total_steps: grad_accum schedule steps of the epoch plan."""
        step = position.step
        for epoch in range(position.epoch, len(self.epoch_steps)):
            if step >= self.total_steps:
                return
            batches, lengths = self.epoch_plan(epoch)
            for index in range(position.batch if epoch == position.epoch else 0, self.epoch_steps[epoch]):
                if step >= self.total_steps:
                    return
                group = slice(index * self.grad_accum, (index + 1) * self.grad_accum)
                yield epoch, index, batches[group], lengths[group]
                step += 1


def build_data(
    config: Config, env: DistEnv, prepared: Prepared, run_dir: Path, say: Callable[[str], None]
) -> TrainData:
    """The token cache's splits (local rank 0 builds it, the node's other ranks wait), counted and planned.

    Each step's batch is cut from the memory-mapped cache on the host, so no rank holds the whole training set
    on its device."""
    t, p = config.train, config.parallel
    try:
        data = tokenized_data(config.data, prepared.prompts, t.seed, wait=env.local_rank != 0)
    except OSError as e:  # a full disk: the line names the cache (worker.no_space_message)
        raise named_cache_error(e) from None
    if env.is_main:
        data.write_summary(run_dir / "data.json")
    train_split = data.splits["train"]
    real_tokens = train_split.lengths  # per sample, on the CPU
    max_length = config.data.max_length
    planned = TrainData(
        split=train_split,
        real_tokens=real_tokens,
        supervised=train_split.supervised,
        padded_lengths=bucket_lengths(real_tokens, config.data.buckets or [max_length]),
        buckets=config.data.buckets,
        max_length=max_length,
        global_batch=t.batch_size * p.dp,
        grad_accum=t.grad_accum,
        pad_id=prepared.pad_id,
        seed=t.seed,
        epoch_steps=[],
        total_steps=0,
        validation=None,
        max_samples_per_row=config.data.max_samples_per_row if config.data.packing else 0,
    )
    rows_of = planned.packed_rows if planned.packing else None  # packed once: the same rows the loop trains
    planned.epoch_steps = epoch_steps(config, real_tokens, data.skipped_line(), rows_of)
    in_all = sum(planned.epoch_steps)
    planned.total_steps = in_all if t.max_steps < 0 else min(t.max_steps, in_all)
    if len(data.splits.get("validation", ())) and not SCHEDULES[p.schedule].has_eval:
        say(f"note: no val_loss during training: torch's {p.schedule} schedule has no forward-only mode")
    elif len(data.splits.get("validation", ())):
        val_split = data.splits["validation"].dense(max_length, prepared.pad_id)
        planned.validation = (val_split.input_ids.to(env.device), val_split.labels.to(env.device))
    say(
        f"data: {'tokenized into' if data.built else 'token cache'} {data.path}; "
        f"{len(train_split)} training samples, {train_split.truncated} cut to fit data.max_length {max_length} "
        "(the transcript's middle elided, the summary capped at data.max_summary_tokens); "
        f"{data.skipped_line()}; "
        f"{_count_range(planned.epoch_steps)} optimizer steps/epoch, {planned.total_steps} in all; effective batch "
        f"{t.batch_size} x grad_accum {t.grad_accum} x dp {p.dp} = {planned.global_batch * t.grad_accum} "
        + ("packed rows" if planned.packing else "sequences")
    )
    if train_split.summaries_capped:
        say(train_split.capped_summaries_note(config.data.max_summary_tokens))
    for line in chat_lines(data.summary.get("columns", {})):  # chat rows: their system messages kept or replaced
        say(f"data {line}")
    if planned.packing:  # the rows epoch 1 trains: those of its steps (as steps_from cuts them)
        rows = planned.epoch_plan(0)[0][: min(planned.epoch_steps[0], planned.total_steps) * t.grad_accum]
        line = packing_line(rows, real_tokens, max_length, planned.max_samples_per_row)
        say(f"packing: epoch 1 trains {line}; train.batch_size counts rows")
    if config.data.buckets:
        say(
            f"length buckets {config.data.buckets}: pad fraction {pad_fraction(real_tokens, config.data.buckets):.1%} "
            f"(one length {max_length}: {pad_fraction(real_tokens, [max_length]):.1%})"
        )
    return planned


def _count_range(counts: list[int]) -> str:
    """The epochs' optimizer steps for the startup line: "12", or "11-12" where packed epochs differ."""
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


@dataclass
class Stages:
    """This rank's pipeline stages (several for interleaved schedules), in one pruned model with one PEFT wrapper."""

    peft_model: PeftModel
    modules: list[StageModule]
    ids: list[int]
    params: list[torch.Tensor]
    """The trained (LoRA) parameters."""
    costs: StageCosts


def build_stages(
    config: Config,
    env: DistEnv,
    mesh: Mesh,
    prepared: Prepared,
    phases: PhaseLog,
    say: Callable[[str], None],
    quiet: bool,
) -> Stages:
    """Build this rank's stages on the meta device, split (tp) and shard (FSDP) them there, then allocate and fill
    only this rank's part (parallel/assemble.py: the order of it all)."""
    t, p = config.train, config.parallel
    device = env.device
    n_stages = p.n_stages
    costs, ranges = run_split(config, prepared.model.config)
    my_stages = p.stage_ids(mesh.pp_rank)
    phases.mark("load")
    load_started = time.perf_counter()
    parts = [StagePart(list(ranges[s]), first=s == 0, last=s == n_stages - 1) for s in my_stages]
    built = build_stage_modules(
        prepared.model,
        DTYPES[config.model.dtype],
        config.lora,
        parts,
        device,
        run_parallelism(config, mesh),
        seed=t.seed,
        quantize=config.model.quantize,
        tp=p.tp,
        name=config.model.name,
        packing=config.data.packing,
    )
    peft_model, modules, load_stats = built.peft_model, built.modules, built.loaded
    for module in modules:
        keep_rng_out_of_no_grad_forwards(module, device)
    phases.mark("ready", load_s=round(time.perf_counter() - load_started, 2), peak_gb=round(peak_memory_gb(device), 2))
    params = [param for param in peft_model.parameters() if param.requires_grad]
    estimated = stage_costs(ranges, costs)
    say(
        "stages: "
        + ", ".join(
            f"{i}: layers {r.start}-{r.stop - 1} (est. {cost / 1e9:.2f} layer-GFLOP/token)"
            for i, (r, cost) in enumerate(zip(ranges, estimated, strict=True))
        )
    )
    if not quiet:
        print_rank(
            env,
            f"stage{'s' if len(my_stages) > 1 else ''} {', '.join(map(str, my_stages))} "
            + (
                "random weights (model.init = 'random'); "
                if config.model.init == "random"
                else f"read {load_stats.tensors} tensors, {load_stats.bytes / 1e9:.2f} GB; "
            )
            + f"after load: peak host RSS {host_peak_gb():.2f} GB"
            + (f", peak GPU {peak_memory_gb(device):.2f} GB" if device.type == "cuda" else ""),
        )
    return Stages(peft_model, modules, my_stages, params, costs)


@dataclass
class Runners:
    """What runs a schedule step: one runner per padded length (a pipeline stage fixes its shapes at its first
    step), the loss they share, the timelines that record a step, and the gradients' sum over the replicas."""

    by_length: dict[int, PipelineRunner | SingleRunner]
    timelines: dict[int, StageTimeline]
    loss_fn: TokenLoss
    validation: PipelineRunner | SingleRunner
    """What validation runs: the full-length shape; in a pipeline, stages of its own (see build_runners)."""
    cuda_graphs: bool
    gradients: GradientSync
    decisions: list[str] = field(default_factory=list)
    """This rank's own decisions for the startup line: its checkpointed layers, its CUDA graphs."""


def build_loss(config: Config, stages: Stages) -> tuple[TokenLoss, StageModule | None]:
    """The loss, and this rank's last stage if it holds it. With train.fused_loss the loss applies lm_head (the
    last stage returns normed hidden states); with train.head_rows the last layer runs on the loss's rows alone
    (model/head_rows.py)."""
    last_stage = next((module for module in stages.modules if module.is_last), None)
    if config.train.fused_loss is not True or last_stage is None:
        return TokenLoss(), last_stage
    last_stage.head_in_loss = True
    if config.train.head_rows is True:
        last_stage.head_rows = True
        use_document_attention(stages.peft_model)
    return TokenLoss(head=last_stage.lm_head, chunk=config.train.loss_chunk), last_stage


def build_runners(config: Config, env: DistEnv, mesh: Mesh, prepared: Prepared, stages: Stages) -> Runners:
    """The loss and the runners of every padded length; then checkpointing ("auto": planned for the longest shape,
    with the schedule's microbatches), CUDA graphs and compilation (which happens at the first forward)."""
    t, p = config.train, config.parallel
    device, modules, max_length = env.device, stages.modules, config.data.max_length
    loss_fn, last_stage = build_loss(config, stages)

    def runner() -> PipelineRunner | SingleRunner:
        if not p.pipelined:
            return SingleRunner(modules[0], p.n_microbatches, loss_fn)
        return PipelineRunner(
            modules, stages.ids, p.n_stages, device, mesh.pp_group, p.schedule, p.n_microbatches, loss_fn
        )

    runners: dict[int, PipelineRunner | SingleRunner] = {}
    timelines: dict[int, StageTimeline] = {}
    for length in config.data.buckets or [max_length]:
        runners[length] = runner()
        if t.timeline_step and p.pipelined:
            timelines[length] = StageTimeline(runners[length].stages, runners[length].schedule, env.rank, device)
    # Validation's forward-only steps run on pipeline stages of their own: on torch 2.11 a training step on
    # stages whose first step was forward-only (the validation before step 1) sent no input gradient ("[5] for
    # chunk 0 has gradients None", 2x H200), and torch re-infers a stage's shapes after every forward-only step.
    validation = runner() if p.pipelined else runners[max_length]
    decisions = []
    if t.activation_checkpointing == "auto":
        plan = auto_checkpointing(modules, stages.ids, mesh.pp_rank, config, prepared.model, device, mesh.tp_mesh)
        for module, count, offloaded in zip(modules, plan.layers, plan.offloaded_layers(), strict=True):
            module.set_layer_modes(count, offloaded)
        layers = [len(m.layers) for m in modules]
        print_rank(env, plan.describe(stages.ids, layers))
        decisions.append(
            plan.describe(stages.ids, layers, why=False).replace("activation checkpointing (auto)", "checkpointing")
        )
        check_plans_fit(plan, config, device)
    cuda_graphs = t.compile and t.cuda_graphs and device.type == "cuda"
    if cuda_graphs:
        checkpointed = any(module.checkpoint_layers for module in modules)
        layers_here = sum(len(module.layers) for module in modules)
        cuda_graphs, note = choose_cuda_graphs(
            stages.costs,
            layers_here,
            checkpointed,
            p.n_microbatches,
            config.microbatch_size,
            max_length,
            p.tp,
            graphs_untried(config.model.quantize),
        )
        if note:
            print_rank(env, f"note: {note}")
        decisions.append("CUDA graphs recorded" if cuda_graphs else "CUDA graphs off on this rank (note above)")
    if cuda_graphs:
        give_gradients_own_memory(stages.params)
    if t.compile:
        per_graph = t.layers_per_graph
        if per_graph != 1 and (p.sharded or p.tensor_parallel):
            untried = f"parallel.tp = {p.tp}" if p.tensor_parallel else "FSDP"
            print0(
                env,
                False,
                f"note: train.layers_per_graph = {per_graph} not applied: one layer per graph with "
                f"{untried} (grouped layers have not run there yet)",
            )
            per_graph = 1
        compile_stages(modules, cuda_graphs=cuda_graphs, per_graph=per_graph)
    # Whole-model replicas overlap their all-reduce with the backward; FSDP reduce-scatters during it.
    gradients = GradientSync(
        stages.params,
        None if p.sharded else mesh.dp_group,
        t.grad_accum * p.n_microbatches,
        overlap=p.overlapped_gradient_sum,
    )
    return Runners(runners, timelines, loss_fn, validation, cuda_graphs, gradients, decisions)


def build_optimizer(
    config: Config, params: list[torch.Tensor], total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the LoRA parameters, and its learning-rate schedule (lr_factor) over the run's steps.

    Fused (one kernel for all parameters, on GPUs and CPUs alike): its step takes a `found_inf` flag on the
    device and then changes nothing, which is how a non-finite step is skipped without the host waiting for the
    GPU (run_step). Under tensor parallelism some adapters are DTensors and some plain tensors (parallel/tp.py),
    and a fused step refuses a group that mixes them: each kind gets a group of its own, with the same settings."""
    t = config.train
    kinds = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    optimizer = torch.optim.AdamW(
        [{"params": group} for group in kinds if group],
        lr=t.lr,
        betas=(0.9, 0.999),
        weight_decay=t.weight_decay,
        fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, total_steps, t.min_lr_ratio)
    )
    return optimizer, scheduler


# --------------------------------------------------------------------------- the loop's steps


@dataclass
class Loop:
    """What the loop's steps act on, and where the loop stands."""

    config: Config
    env: DistEnv
    mesh: Mesh
    data: TrainData
    stages: Stages
    runners: Runners
    state: TrainState
    metrics: MetricsLog
    status: LoopStatus
    phases: PhaseLog
    hooks: TrainHooks
    say: Callable[[str], None]
    step: int = 0
    """Optimizer steps done (skipped ones included)."""
    skipped_in_row: int = 0
    """Consecutive steps skipped for a non-finite loss or gradient norm, up to this one (once settled)."""
    unsettled: tuple[int, HostCopy] | None = None
    """The last step and its per-rank non-finite flags on their way to the host, until `settle` reads them."""


class HostCopy:
    """A device tensor's copy to the host, started now and waited for only when read: an event marks where the
    copy sits on the stream, so reading it waits for the work queued before it, not for all that came after
    (a plain `.cpu()` later would queue behind the next step's forward and backward and drain the GPU)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.done: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = tensor.detach().clone()

    def get(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


def run_step(loop: Loop, batches: torch.Tensor, lengths: torch.Tensor) -> float:
    """One optimizer step over `batches` (grad_accum schedule steps of the global batch, padded to `lengths`):
    forward and backward, the gradients reduced and clipped, then the optimizer's step, which changes nothing
    where a loss or norm is non-finite (every rank gets the same flags from the all-reduce, so all skip
    together). The host does not wait for the flags: the step is settled (counted, warned about, the schedule
    advanced) after the next step's forward and backward are queued, or before a metrics row or checkpoint.
    Returns the step's lr."""
    data, optimizer = loop.data, loop.state.optimizer
    loop.status.step, loop.status.phase = loop.step + 1, "pipeline send/recv"
    loop.phases.mark("step", step=loop.step + 1)
    n_supervised = int(data.supervised[data.samples_in(batches)].sum())
    loop.runners.loss_fn.normalizer = max(n_supervised, 1)  # all-masked step: loss 0, never 0/0
    step_loss = forward_backward(loop, batches, lengths)
    settle(loop)  # the previous step: its flags are long computed while this step's work waits in the queue
    grad_norm, flags = reduce_gradients(loop, step_loss)
    lr = optimizer.param_groups[0]["lr"]
    skipped = flags.amax().clamp(max=1)  # 0-dim: under tp a DTensor step takes it as replicated
    optimizer.found_inf = skipped  # fused AdamW: no change to weights, moments or step count when set
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    optimizer.zero_grad(set_to_none=not loop.runners.cuda_graphs)
    loop.step += 1
    loop.unsettled = (loop.step, HostCopy(flags))
    tokens, real = data.global_batch * int(lengths.sum()), int(data.real_tokens[data.samples_in(batches)].sum())
    share = data.attention_share(batches) if data.packing else None
    loop.metrics.window.add(step_loss, grad_norm, tokens, real, n_supervised, skipped, share)
    return lr


def settle(loop: Loop) -> None:
    """Read the last step's non-finite flags (waiting for their copy, not for the work queued after it): a skipped
    step is counted and warned about, and the run stops after train.max_skipped_steps in a row; a step taken
    advances the learning-rate schedule."""
    if loop.unsettled is None:
        return
    (step, flags), loop.unsettled = loop.unsettled, None
    t = loop.config.train
    bad_stages = bad_ranks(loop.metrics.window.wait_for(flags.get))
    if not bad_stages:
        loop.state.scheduler.step()
        loop.skipped_in_row = 0
        return
    loop.skipped_in_row += 1
    warn0(
        loop.env,
        f"step {step}: non-finite loss or gradient norm on stage {', '.join(map(str, bad_stages))}; "
        f"optimizer step skipped ({loop.skipped_in_row} in a row, the run stops at {t.max_skipped_steps})",
    )
    if loop.skipped_in_row >= t.max_skipped_steps:
        if not loop.env.is_main:  # rank 0 says why, after reading the checkpoints' adapters
            raise TrainingError(f"{loop.skipped_in_row} non-finite optimizer steps in a row")
        raise too_many_skipped(Path(loop.config.output.dir), loop.skipped_in_row, step)


def forward_backward(loop: Loop, batches: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The optimizer step's schedule steps, each on this replica's share (its batch_size columns of the global
    batch); returns their summed loss (0 on ranks without the last stage)."""
    config, env, runners, params = loop.config, loop.env, loop.runners, loop.stages.params
    t, p = config.train, config.parallel
    columns = slice(loop.mesh.dp_rank * t.batch_size, (loop.mesh.dp_rank + 1) * t.batch_size)
    step_loss = torch.zeros((), device=env.device)
    for j, (index, length) in enumerate(zip(batches[:, columns], lengths.tolist(), strict=True)):
        timeline = runners.timelines.get(length) if loop.step + 1 == t.timeline_step and j == 0 else None
        if timeline is not None:
            timeline.start()
        # A sharded pipeline stage may drop earlier gradients on its first step (see restore_gradients).
        stashed = stash_gradients(params) if p.sharded and p.pipelined and j > 0 else None
        position_ids = None
        if loop.data.packing:  # rows of several samples: their position ids go to every stage
            input_ids, labels, position_ids = packed_batch(loop.data.split, index, length, loop.data.pad_id)
        else:
            input_ids, labels = loop.data.split.batch(index, length, loop.data.pad_id)
        # The ids go through pinned memory without waiting for the device (model/host_tensors.py); the labels stay
        # on the host, where the loss finds its supervised positions (model/loss.py) and copies them likewise.
        if position_ids is not None and t.packed_attention != "documents":
            position_ids = to_device(position_ids, env.device)
        elif position_ids is not None and env.device.type == "cuda":  # the documents kernel reads them on the host;
            position_ids = position_ids.pin_memory()  # the stage copies them (to_device), from this pinned block
        out = runners.by_length[length].step(to_device(input_ids, env.device), labels, position_ids)
        if stashed is not None:
            restore_gradients(params, stashed)
        if out is not None:
            step_loss += out
        if timeline is not None:
            save_timeline(timeline, env, Path(config.output.dir), config)
    return step_loss


def reduce_gradients(loop: Loop, step_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the step's gradients over tp shards and dp replicas, then clip them by their global norm; returns the
    norm and the per-rank flags of a non-finite loss or norm, on the device."""
    p, params, mesh = loop.config.parallel, loop.stages.params, loop.mesh
    if mesh.tp_mesh is not None:
        sum_partial_gradients(params)
    if not p.sharded:  # FSDP reduce-scattered them during backward
        loop.status.phase = "gradient all-reduce over dp"
        loop.runners.gradients.finish()
    loop.hooks.before_grad_norm(loop.step + 1, params)
    loop.status.phase = "gradient-norm all-reduce"
    return clip_global_grad_norm(params, loop.config.train.max_grad_norm, loop.env.device, step_loss, p.dp * p.tp)


def validation_columns(loop: Loop) -> dict[str, float]:
    """val_loss after step `loop.step` (forward only, through the pipeline; a collective over the dp x tp ranks
    holding the last stage, each computing it whole) and the seconds it took, which the metrics window keeps out
    of the next row's step time and tokens/s."""
    p = loop.config.parallel
    loop.status.phase = "validation"
    loop.phases.mark("validation", step=loop.step)
    started = time.perf_counter()
    val_loss = evaluate_validation(
        loop.runners.validation,
        loop.stages.peft_model,
        loop.data.validation,
        loop.config.train.batch_size,
        loop.runners.loss_fn,
        loop.env.device,
        p.dp * p.tp,
    )
    return {"val_loss": val_loss, "val_time_sec": loop.metrics.window.exclude_since(started)}


def log_row(loop: Loop, epoch: int, lr: float, evaluate: bool) -> None:
    """The metrics row of the steps since the last one (a collective: every rank's peak memory), with val_loss
    when `evaluate`."""
    p = loop.config.parallel
    loop.status.phase = "metrics all-gather"
    holds_loss = loop.runners.validation.is_last and loop.mesh.tp_rank == 0  # one loss per replica
    row = loop.metrics.window.flush(loop.env, holds_loss)
    row.update(strategy=p.strategy, epoch=epoch, step=loop.step, lr=lr)
    if evaluate:
        row.update(validation_columns(loop))
    loop.metrics.write_step(loop.step, row)


def save_step(loop: Loop, checkpoints: CheckpointSettings, after: Position) -> None:
    """Checkpoint the state at `after` (a collective); its time is kept out of the metrics too."""
    loop.status.phase = "checkpoint barrier"
    loop.phases.mark("checkpoint", step=loop.step)
    started = time.perf_counter()
    saved = save_checkpoint(checkpoints, loop.state, after, loop.env.rank, loop.env.world_size)
    loop.say(f"checkpoint {saved} ({loop.metrics.window.exclude_since(started):.1f} s)")
    loop.hooks.after_step(loop.step, saved=True)


def _first_steps(loop: Loop, line: str) -> None:
    """A line on where a first step's time went (cuDNN's plans, compilation), on the main rank, even when quiet."""
    if line and loop.env.is_main:
        print(line, flush=True)


def print_rank(env: DistEnv, message: str) -> None:
    """A line of this rank's on stdout, "rank N: message", written in one piece (`run_log.write_whole`)."""
    write_whole(f"rank {env.rank}: {message}")


def print0(env: DistEnv, quiet: bool, message: str) -> None:
    """Print on rank 0, unless quiet."""
    if env.is_main and not quiet:
        print(message, flush=True)


def warn0(env: DistEnv, message: str) -> None:
    """A warning on rank 0's stderr, printed even when quiet."""
    if env.is_main:
        print(f"pipetune: warning: {message}", file=sys.stderr, flush=True)


def cadence(config: Config, step: int, total_steps: int, epoch_end: bool, has_validation: bool) -> tuple[bool, ...]:
    """(log, evaluate, save) after optimizer step `step`: a checkpoint every train.save_every steps, at each
    epoch's end and at the last step; validation every train.eval_every steps and at the same ends; a metrics row
    every train.log_every steps and with every checkpoint and validation (so a resumed run logs the same rows)."""
    t = config.train
    save = (t.save_every > 0 and step % t.save_every == 0) or epoch_end or step == total_steps
    evaluate = has_validation and ((t.eval_every > 0 and step % t.eval_every == 0) or epoch_end or step == total_steps)
    log = step % t.log_every == 0 or save or evaluate
    return log, evaluate, save


def too_many_skipped(run_dir: Path, skipped_in_row: int, step: int) -> TrainingError:
    """The error that stops a run after train.max_skipped_steps non-finite steps in a row, up to `step`: it names
    a checkpoint to continue from whose weights predate those steps and are finite and sane, never one whose
    weights would stop the resumed run again (a run that diverged before its steps turned non-finite)."""
    first = step - skipped_in_row + 1
    newest = latest_checkpoint(run_dir)
    good, rejected = sane_checkpoint(run_dir, before_step=first)
    stop = (
        f"{skipped_in_row} optimizer steps in a row (up to step {step}) had a non-finite loss or gradient norm; "
        "stopping."
    )
    if newest is None:
        return TrainingError(
            f"{stop} No checkpoint was committed. Lower train.lr, check the data, or raise train.max_skipped_steps, "
            "then run again with --resume (it starts over: there is no checkpoint to continue from)"
        )
    if good is not None and good.step == newest.step:
        return TrainingError(
            f"{stop} The newest committed checkpoint, {good.path}, holds finite weights from before them (those of "
            f"step {good.weights_step}: a skipped step changes no weight). Lower train.lr (applied on resume, like "
            "the schedule), check the data, or raise train.max_skipped_steps, then continue with --resume"
        )
    return TrainingError(
        f"{stop} The newest committed checkpoint is no place to continue from ({'; '.join(rejected)}); "
        f"{diverged_advice(run_dir, first)}"
    )


def save_gathered_adapter(
    config: Config, env: DistEnv, peft_model: PeftModel, run_dir: Path, say: Callable[[str], None]
) -> None:
    """One PEFT adapter directory from every stage's tensors (gathered to rank 0)."""
    state = adapter_state(peft_model)
    if env.distributed:
        gathered: list[dict] | None = [None] * env.world_size if env.is_main else None
        dist.gather_object(state, gathered, dst=0)
        if env.is_main:
            state = {name: tensor for part in gathered for name, tensor in part.items()}
    if env.is_main:
        save_adapter(state, config.lora, config.model.name, run_dir / "adapter")
        say(f"adapter ({len(state)} tensors) -> {run_dir / 'adapter'}")


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class TrainHooks:
    """Points of the loop where a caller may step in; these do nothing. Only the tests' entry (tests/faults.py)
    installs others (`HOOKS`), to inject faults into real runs."""

    def start(self, rank: int, world_size: int) -> None:
        """The loop is about to start on `rank` of `world_size`."""

    def before_grad_norm(self, step: int, params: list[torch.Tensor]) -> None:
        """Step `step`'s gradients are reduced; the global norm comes next."""

    def after_step(self, step: int, saved: bool) -> None:
        """Optimizer step `step` is done; `saved`: its checkpoint is committed too."""


HOOKS = TrainHooks()
"""The hooks `train` calls."""
