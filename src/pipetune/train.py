"""The training loop: this rank's pipeline stage(s) of one replica, LoRA adapters only, one explicit loop.

    pipetune train --config configs/qwen3-4b-ami.toml --nproc 2
    torchrun --nproc-per-node 2 -m pipetune train --config configs/qwen3-4b-ami.toml

Every rank cuts the same batches from the memory-mapped token cache and takes its dp replica's
share; stage 0 feeds the token ids, the last stage the labels, and all ranks know each
step's global supervised-token count, which normalizes the loss (see parallel/pipeline.py).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipetune.checkpoint import (
    Position,
    TrainState,
    find_resume_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from pipetune.config import Config, save_config
from pipetune.data.batching import bucket_lengths, bucketed_epoch_batches, epoch_batches, pad_fraction
from pipetune.data.cache import tokenized_data
from pipetune.export import PROMPT_FILE, write_prompt_settings
from pipetune.loggers import open_loggers
from pipetune.metrics import (
    MetricsWindow,
    MetricsWriter,
    PhaseLog,
    ProgressReporter,
    host_peak_gb,
    peak_memory_gb,
    reset_peak_memory,
)
from pipetune.model.graphs import choose_cuda_graphs, give_gradients_own_memory
from pipetune.model.load import DTYPES, build_meta, materialize
from pipetune.model.lora import adapter_state, apply_lora, save_adapter, use_fast_path
from pipetune.model.quantize import quantize_linears
from pipetune.model.split import run_split, stage_costs
from pipetune.model.stage import StageModule
from pipetune.parallel.fsdp import shard_stages
from pipetune.parallel.memory import auto_checkpointing
from pipetune.parallel.mesh import all_reduce_gradients, build_mesh, clip_global_grad_norm
from pipetune.parallel.pipeline import PipelineRunner, SingleRunner, TokenLoss, evaluate_validation
from pipetune.parallel.process_group import (
    DistEnv,
    restart_count,
)
from pipetune.parallel.timeline import StageTimeline, plot_saved_timeline, save_timeline
from pipetune.parallel.torch_compat import (
    keep_rng_out_of_no_grad_forwards,
    restore_gradients,
    stash_gradients,
)
from pipetune.parallel.tp import apply_tp, sum_partial_gradients
from pipetune.preflight import check_optimizer_steps, preflight
from pipetune.schedules import SCHEDULES, stage_ids


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
    """Where this rank is, for the message when a peer stops responding."""

    step: int = 0
    phase: str = "setup"


def train(config: Config, env: DistEnv, quiet: bool = False, status: LoopStatus | None = None) -> RunResult:
    def print0(*args: object) -> None:
        if env.is_main and not quiet:
            print(*args, flush=True)

    def warn0(message: str) -> None:  # printed even when quiet
        if env.is_main:
            print(f"pipetune: warning: {message}", file=sys.stderr, flush=True)

    status = status or LoopStatus()
    prepared = preflight(config, env.world_size)
    restarted = restart_count() > 0  # the launcher restarted the group
    resume_from = find_resume_checkpoint(config, restarted)
    t, p = config.train, config.parallel
    device = env.device
    if t.cuda_graphs and device.type != "cuda":
        warn0("train.cuda_graphs = true is ignored on the CPU (CUDA graphs need GPUs): the layers run compiled only")
    run_dir = Path(config.output.dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir / "config.toml")
        write_prompt_settings(run_dir / PROMPT_FILE, prepared.prompts, config)  # for export and plain-HF use
    phases = PhaseLog(run_dir / "progress.jsonl", enabled=env.is_main)
    mesh = build_mesh(env, p.pp, p.dp, p.tp)
    # LoRA dropout: a different stream per stage and replica, one per tp group (parallel/tp.py: equal masks).
    torch.manual_seed(t.seed + mesh.replica_rank)
    global_batch = t.batch_size * p.dp  # samples per schedule step over all replicas; rank takes its columns

    # ------------------------------------------------------------------ data
    # Tokenized once into a memory-mapped cache (local rank 0 builds it, the node's other ranks wait);
    # each step's batch is cut from it on the host, so no rank holds the whole training set on its device.
    data = tokenized_data(config.data, prepared.prompts, t.seed, wait=env.local_rank != 0)
    if env.is_main:
        data.write_summary(run_dir / "data.json")
    train_split = data.splits["train"]
    real_tokens = train_split.lengths  # per sample, on the CPU
    max_length = config.data.max_length
    sample_lengths = bucket_lengths(real_tokens, config.data.buckets or [max_length])

    def epoch_plan(epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This epoch's batches (sample indices) and the padded length of each: the same on every (re)start."""
        if config.data.buckets:
            return bucketed_epoch_batches(sample_lengths, global_batch, t.seed, epoch)
        batches = epoch_batches(len(train_split), global_batch, t.seed, epoch)
        return batches, torch.full((len(batches),), max_length, dtype=torch.long)

    steps_per_epoch = check_optimizer_steps(config, len(train_split), data.skipped_line(), len(epoch_plan(0)[0]))
    total_steps = steps_per_epoch * t.epochs if t.max_steps < 0 else min(t.max_steps, steps_per_epoch * t.epochs)
    supervised = train_split.supervised  # per sample, on the CPU: no device sync per step
    validation = None
    if len(data.splits.get("validation", ())) and not SCHEDULES[p.schedule].has_eval:
        print0(f"note: no val_loss during training: torch's {p.schedule} schedule has no forward-only mode")
    elif len(data.splits.get("validation", ())):
        val_split = data.splits["validation"].dense(max_length, prepared.pad_id)
        validation = (val_split.input_ids.to(device), val_split.labels.to(device))
    print0(
        f"data: {'tokenized into' if data.built else 'token cache'} {data.path}; "
        f"{len(train_split)} training samples, {train_split.truncated} cut to fit data.max_length {max_length} "
        "(the transcript's middle elided, the summary capped at data.max_summary_tokens); "
        f"{data.skipped_line()}; "
        f"{steps_per_epoch} optimizer steps/epoch, {total_steps} in all; effective batch "
        f"{t.batch_size} x grad_accum {t.grad_accum} x dp {p.dp} = {global_batch * t.grad_accum} sequences"
    )
    if config.data.buckets:
        print0(
            f"length buckets {config.data.buckets}: pad fraction {pad_fraction(real_tokens, config.data.buckets):.1%} "
            f"(one length {max_length}: {pad_fraction(real_tokens, [max_length]):.1%})"
        )

    # ------------------------------------------------------------------ model: this rank's stage
    n_stages = p.n_stages
    costs, ranges = run_split(config, prepared.model.config)
    # This rank's stages (several for interleaved schedules) live in one pruned model, one PEFT wrapper.
    my_stages = stage_ids(p.schedule, mesh.pp_rank, p.pp, p.stages_per_rank) if p.pp > 1 else [0]
    # Built on the meta device and sharded there (FSDP), then each rank allocates and fills only its part.
    phases.mark("load")
    load_started = time.perf_counter()
    model = build_meta(
        prepared.model,
        DTYPES[config.model.dtype],
        layers=sorted(i for s in my_stages for i in ranges[s]),
        first=0 in my_stages,
        last=n_stages - 1 in my_stages,
    )
    peft_model = apply_lora(model, config.lora, config.model.name, t.seed)
    quantize_linears(peft_model, config.model.quantize)  # placeholders, quantized as materialize fills them
    if config.lora.fast_path:
        use_fast_path(peft_model)
    peft_model.train()
    modules = [StageModule(peft_model, list(ranges[s]), first=s == 0, last=s == n_stages - 1) for s in my_stages]
    # Split (tp) and sharded (FSDP) on the meta device: parameters become DTensor shards, before the optimizer
    # and pipeline stages, and each rank then allocates only its shards.
    if mesh.tp_mesh is not None:
        apply_tp(modules, mesh.tp_mesh, p.sequence_parallel)
    if p.sharded:
        shard_stages(modules, mesh.dp_mesh, pipelined=n_stages > 1)
    load_stats = materialize(peft_model, prepared.model, device, t.seed, roots=modules)
    for module in modules:
        module.checkpoint_layers = len(module.layers) if t.activation_checkpointing is True else 0
        keep_rng_out_of_no_grad_forwards(module, device)
    phases.mark("ready", load_s=round(time.perf_counter() - load_started, 2), peak_gb=round(peak_memory_gb(device), 2))
    params = [param for param in peft_model.parameters() if param.requires_grad]
    estimated = stage_costs(ranges, costs)
    print0(
        "stages: "
        + ", ".join(
            f"{i}: layers {r.start}-{r.stop - 1} (est. {cost / 1e9:.2f} layer-GFLOP/token)"
            for i, (r, cost) in enumerate(zip(ranges, estimated, strict=True))
        )
    )
    if not quiet:
        print(
            f"rank {env.rank}: stage{'s' if len(my_stages) > 1 else ''} {', '.join(map(str, my_stages))} "
            + (
                "random weights (model.init = 'random'); "
                if config.model.init == "random"
                else f"read {load_stats.tensors} tensors, {load_stats.bytes / 1e9:.2f} GB; "
            )
            + f"after load: peak host RSS {host_peak_gb():.2f} GB"
            + (f", peak GPU {peak_memory_gb(device):.2f} GB" if device.type == "cuda" else ""),
            flush=True,
        )

    # One runner per padded length: a pipeline stage fixes its shapes at its first step.
    loss_fn = TokenLoss()
    last_stage = next((module for module in modules if module.is_last), None)
    if t.fused_loss and last_stage is not None:
        last_stage.head_in_loss = True
        loss_fn = TokenLoss(head=last_stage.lm_head, chunk=t.loss_chunk)
    runners: dict[int, PipelineRunner | SingleRunner] = {}
    timelines: dict[int, StageTimeline] = {}
    for length in config.data.buckets or [max_length]:
        if n_stages == 1:
            runners[length] = SingleRunner(modules[0], p.n_microbatches, loss_fn)
            continue
        runners[length] = PipelineRunner(
            modules, my_stages, n_stages, device, mesh.pp_group, p.schedule, p.n_microbatches, loss_fn
        )
        if t.timeline_step:
            timelines[length] = StageTimeline(runners[length].stages, runners[length].schedule, env.rank, device)
    runner = runners[max_length]  # validation runs at full length
    if t.activation_checkpointing == "auto":  # planned for the longest shape, with the schedule's microbatches
        plan = auto_checkpointing(modules, my_stages, mesh.pp_rank, config, prepared.model, device, mesh.tp_mesh)
        for module, count in zip(modules, plan.layers, strict=True):
            module.checkpoint_layers = count
        print(f"rank {env.rank}: {plan.describe(my_stages, [len(m.layers) for m in modules])}", flush=True)
    cuda_graphs = t.compile and t.cuda_graphs and device.type == "cuda"
    if cuda_graphs:
        checkpointed = any(module.checkpoint_layers for module in modules)
        layers_here = sum(len(module.layers) for module in modules)
        cuda_graphs, note = choose_cuda_graphs(
            costs, layers_here, checkpointed, p.n_microbatches, config.microbatch_size, max_length, p.tp
        )
        if note:
            print(f"rank {env.rank}: note: {note}", flush=True)
    if cuda_graphs:
        give_gradients_own_memory(params)
    if t.compile:  # compilation itself happens at the first forward
        for module in modules:
            module.compile_layers(cuda_graphs=cuda_graphs)
    optimizer = torch.optim.AdamW(
        params, lr=t.lr, betas=(0.9, 0.999), weight_decay=t.weight_decay, fused=device.type == "cuda"
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, total_steps, t.min_lr_ratio)
    )

    # ------------------------------------------------------------------ resume: adapters, optimizer, RNG, data position
    train_state = TrainState.of(peft_model, optimizer, scheduler)
    position = Position()
    if resume_from is not None:
        position = load_checkpoint(resume_from, train_state, env.rank)
        print0(f"resumed from {resume_from.path} at step {position.step}")

    # ------------------------------------------------------------------ loop
    writer = None
    if env.is_main:  # a resumed run continues metrics.csv from its checkpoint's step
        writer = MetricsWriter(run_dir / "metrics.csv", env.world_size, position.step if resume_from else None)
    progress = ProgressReporter(total_steps, enabled=env.is_main and not quiet)
    loggers = open_loggers(config, run_dir, enabled=env.is_main)
    hooks = HOOKS
    hooks.start(env.rank, env.world_size)
    losses: list[float] = []
    step, skipped_in_row = position.step, position.skipped_in_row
    if validation is not None and resume_from is None:  # where the validation curve starts: the base model
        status.phase = "validation"
        phases.mark("validation", step=0)
        row: dict = {"strategy": p.strategy, "epoch": 0, "step": 0}
        started = time.perf_counter()
        row["val_loss"] = evaluate_validation(runner, peft_model, validation, t.batch_size, loss_fn, device, p.dp)
        row["val_time_sec"] = time.perf_counter() - started
        if writer is not None:
            writer.write(row)
            loggers.write(row)
        print0(f"step 0/{total_steps} | val_loss {row['val_loss']:.4f} (before fine-tuning)")
    window = MetricsWindow(device)
    reset_peak_memory(device)
    for epoch in range(position.epoch, t.epochs):
        if step >= total_steps:
            break
        batches, lengths = epoch_plan(epoch)
        # This replica's share of every schedule step: its batch_size columns of the global batch.
        replica_batches = batches[:, mesh.dp_rank * t.batch_size : (mesh.dp_rank + 1) * t.batch_size]
        for i in range(position.batch if epoch == position.epoch else 0, steps_per_epoch):
            if step >= total_steps:
                break
            status.step, status.phase = step + 1, "pipeline send/recv"
            phases.mark("step", step=step + 1)
            group = slice(i * t.grad_accum, (i + 1) * t.grad_accum)
            n_supervised = int(supervised[batches[group].flatten()].sum())
            loss_fn.normalizer = max(n_supervised, 1)  # all-masked step: loss 0, never 0/0
            step_loss = torch.zeros((), device=device)
            for j, (index, length) in enumerate(zip(replica_batches[group], lengths[group].tolist(), strict=True)):
                timeline = timelines.get(length) if step + 1 == t.timeline_step and j == 0 else None
                if timeline is not None:
                    timeline.start()
                # A sharded pipeline stage may drop earlier gradients on its first step (see restore_gradients).
                stashed = stash_gradients(params) if p.sharded and n_stages > 1 and j > 0 else None
                input_ids, labels = train_split.batch(index, length, prepared.pad_id)
                out = runners[length].step(input_ids.to(device), labels.to(device))
                if stashed is not None:
                    restore_gradients(params, stashed)
                if out is not None:
                    step_loss += out
                if timeline is not None:
                    save_timeline(timeline, env, run_dir, config)
            if mesh.tp_mesh is not None:
                sum_partial_gradients(params)
            if not p.sharded:  # FSDP reduce-scattered them during backward
                status.phase = "gradient all-reduce over dp"
                all_reduce_gradients(params, mesh)
            hooks.before_grad_norm(step + 1, params)
            status.phase = "gradient-norm all-reduce"
            grad_norm, bad_stages = clip_global_grad_norm(params, t.max_grad_norm, device, step_loss, p.dp * p.tp)
            lr = optimizer.param_groups[0]["lr"]
            if bad_stages:  # every rank got the same flags from the all-reduce: all skip together
                optimizer.zero_grad(set_to_none=not cuda_graphs)
                skipped_in_row += 1
                warn0(
                    f"step {step + 1}: non-finite loss or gradient norm on stage {', '.join(map(str, bad_stages))}; "
                    f"optimizer step skipped ({skipped_in_row} in a row, the run stops at {t.max_skipped_steps})"
                )
                if skipped_in_row >= t.max_skipped_steps:
                    last = latest_checkpoint(run_dir)
                    kept = (
                        f"The newest committed checkpoint, {last.path}, holds weights from before them (those of "
                        f"step {last.weights_step}: a skipped step changes no weight)"
                        if last
                        else "No checkpoint was committed"
                    )
                    raise TrainingError(
                        f"{skipped_in_row} optimizer steps in a row (up to step {step + 1}) had a non-finite loss or "
                        f"gradient norm; stopping. {kept}. Lower train.lr (applied on resume, like the schedule), "
                        "check the data, or raise train.max_skipped_steps, then continue with --resume"
                    )
            else:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=not cuda_graphs)
                skipped_in_row = 0
            step += 1
            window.add(
                step_loss,
                grad_norm,
                global_batch * int(lengths[group].sum()),
                int(real_tokens[batches[group].flatten()].sum()),
                n_supervised,
                skipped=bool(bad_stages),
            )
            hooks.after_step(step, saved=False)

            epoch_end = i == steps_per_epoch - 1
            save = (t.save_every > 0 and step % t.save_every == 0) or epoch_end or step == total_steps
            evaluate = validation is not None and (
                (t.eval_every > 0 and step % t.eval_every == 0) or epoch_end or step == total_steps
            )
            if step % t.log_every == 0 or save or evaluate:  # a row at every checkpoint: resumed runs log the same
                status.phase = "metrics all-gather"
                row = window.flush(env, runner.is_last and mesh.tp_rank == 0)  # one loss per replica
                row.update(strategy=p.strategy, epoch=epoch, step=step, lr=lr)
                if evaluate:  # timed in its own column, and kept out of the next row's step time and tokens/s
                    status.phase = "validation"
                    phases.mark("validation", step=step)
                    started = time.perf_counter()
                    row["val_loss"] = evaluate_validation(
                        runner, peft_model, validation, t.batch_size, loss_fn, device, p.dp * p.tp
                    )
                    row["val_time_sec"] = window.exclude_since(started)
                if writer is not None:
                    writer.write(row)
                    loggers.write(row)
                    losses.append(row["loss"])
                progress.update(step, row)
            if save:
                status.phase = "checkpoint barrier"
                phases.mark("checkpoint", step=step)
                next_epoch, next_batch = (epoch + 1, 0) if epoch_end else (epoch, i + 1)
                after = Position(step, next_epoch, next_batch, skipped_in_row)
                started = time.perf_counter()
                saved = save_checkpoint(config, train_state, after, env.rank, env.world_size)
                print0(f"checkpoint {saved} ({window.exclude_since(started):.1f} s)")  # not training time either
                hooks.after_step(step, saved=True)
    progress.close()
    if env.rank == 0 and t.timeline_step:
        plot_saved_timeline(run_dir, config)
    loggers.close()
    if writer is not None:
        writer.close()

    # ------------------------------------------------------------------ adapter: one PEFT directory from all stages
    status.phase = "adapter gather"
    phases.mark("adapter", step=step)
    state = adapter_state(peft_model)
    if env.distributed:
        gathered: list[dict] | None = [None] * env.world_size if env.is_main else None
        dist.gather_object(state, gathered, dst=0)
        if env.is_main:
            state = {name: tensor for part in gathered for name, tensor in part.items()}
    if env.is_main:
        save_adapter(state, config.lora, config.model.name, run_dir / "adapter")
        print0(f"adapter ({len(state)} tensors) -> {run_dir / 'adapter'}")
    phases.mark("done", step=step)
    return RunResult(run_dir, losses, position.step if resume_from is not None else None)


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
