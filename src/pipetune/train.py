"""The training loop: one stage per rank, LoRA adapters only, one explicit loop.

    pipetune train --config configs/qwen3-4b-ami.toml --nproc 2
    torchrun --nproc-per-node 2 -m pipetune train --config configs/qwen3-4b-ami.toml

Every rank builds the same batches (the data is small next to the model); stage 0 feeds the
token ids, the last stage the labels, and all ranks know each step's supervised-token count,
which normalizes the loss (see parallel/pipeline.py).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipetune.config import Config, save_config
from pipetune.data.batching import IGNORE, epoch_batches, tokenize_split
from pipetune.data.sources import load_dataset
from pipetune.metrics import MetricsWriter, ProgressReporter, host_peak_gb, peak_memory_gb, reset_peak_memory
from pipetune.model.load import DTYPES, build_model
from pipetune.model.lora import adapter_state, apply_lora, save_adapter, use_fast_path
from pipetune.model.split import estimate_costs, split_layers, stage_costs
from pipetune.model.stage import StageModule
from pipetune.parallel.pipeline import PipelineRunner, SingleRunner, TokenLoss
from pipetune.parallel.process_group import DistEnv, close_distributed, init_distributed
from pipetune.parallel.timeline import StageTimeline, gather_timeline, plot_timeline
from pipetune.preflight import preflight


@dataclass
class RunResult:
    run_dir: Path
    losses: list[float]
    """Logged loss of every metrics row (rank 0; empty elsewhere)."""


def run_training(config: Config, quiet: bool = False) -> RunResult:
    env = init_distributed()
    try:
        return train(config, env, quiet)
    finally:
        close_distributed()


def train(config: Config, env: DistEnv, quiet: bool = False) -> RunResult:
    def print0(*args: object) -> None:
        if env.is_main and not quiet:
            print(*args, flush=True)

    prepared = preflight(config, env.world_size)
    t, p = config.train, config.parallel
    device = env.device
    run_dir = Path(config.output.dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir / "config.toml")
    torch.manual_seed(t.seed + env.rank)  # LoRA dropout: a different stream per stage

    # ------------------------------------------------------------------ data
    dataset = load_dataset(config.data, seed=t.seed)
    if env.is_main:
        dataset.write_summary(run_dir / "data.json")
    train_split = tokenize_split(dataset.splits["train"], prepared.prompts, prepared.pad_id)
    n_batches = len(train_split) // t.batch_size
    steps_per_epoch = n_batches // t.grad_accum
    if steps_per_epoch == 0:
        raise ValueError(
            f"{len(train_split)} training samples make no optimizer step of batch_size {t.batch_size} x "
            f"grad_accum {t.grad_accum}; lower them or add data"
        )
    total_steps = steps_per_epoch * t.epochs if t.max_steps < 0 else min(t.max_steps, steps_per_epoch * t.epochs)
    supervised = (train_split.labels != IGNORE).sum(dim=1)  # per sample, on the CPU: no device sync per step
    input_ids = train_split.input_ids.to(device)
    labels = train_split.labels.to(device)
    print0(
        f"data: {len(train_split)} training samples, {train_split.truncated} truncated; {dataset.skipped_line()}; "
        f"{steps_per_epoch} optimizer steps/epoch, {total_steps} in all"
    )

    # ------------------------------------------------------------------ model: this rank's stage
    stage_index, n_stages = env.rank, p.pp
    costs = estimate_costs(prepared.model.config, config.data.max_length)
    ranges = split_layers(prepared.n_layers, n_stages, p.layers_per_stage, costs)
    layers = ranges[stage_index]
    model, load_stats = build_model(
        prepared.model,
        DTYPES[config.model.dtype],
        device,
        layers=layers,
        first=stage_index == 0,
        last=stage_index == n_stages - 1,
        seed=t.seed,
    )
    peft_model = apply_lora(model, config.lora, config.model.name, t.seed)
    if config.lora.fast_path:
        use_fast_path(peft_model)
    module = StageModule(peft_model).train()
    if t.compile:
        module.compile_layers()
    params = [param for param in module.parameters() if param.requires_grad]
    estimated = stage_costs(ranges, costs)
    print0(
        "stages: "
        + ", ".join(
            f"{i}: layers {r.start}-{r.stop - 1} (~{cost / 1e9:.2f} GFLOP/token)"
            for i, (r, cost) in enumerate(zip(ranges, estimated, strict=True))
        )
    )
    if not quiet:
        print(
            f"rank {env.rank}: stage {stage_index} read {load_stats.tensors} tensors, {load_stats.bytes / 1e9:.2f} GB; "
            f"after load: peak host RSS {host_peak_gb():.2f} GB"
            + (f", peak GPU {peak_memory_gb(device):.2f} GB" if device.type == "cuda" else ""),
            flush=True,
        )

    loss_fn = TokenLoss()
    if n_stages == 1:
        runner = SingleRunner(module, p.n_microbatches, loss_fn)
    else:
        runner = PipelineRunner(module, stage_index, n_stages, device, None, p.schedule, p.n_microbatches, loss_fn)
    timeline = None
    if t.timeline_step and isinstance(runner, PipelineRunner):
        timeline = StageTimeline(runner.stage, env.rank, device)
    optimizer = torch.optim.AdamW(
        params, lr=t.lr, betas=(0.9, 0.999), weight_decay=t.weight_decay, fused=device.type == "cuda"
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, total_steps, t.min_lr_ratio)
    )

    # ------------------------------------------------------------------ loop
    writer = MetricsWriter(run_dir / "metrics.csv", env.world_size) if env.is_main else None
    progress = ProgressReporter(total_steps, enabled=env.is_main and not quiet)
    losses: list[float] = []
    step = 0
    window = _Window(device)
    reset_peak_memory(device)
    for epoch in range(t.epochs):
        if step >= total_steps:
            break
        batches = epoch_batches(len(train_split), t.batch_size, t.seed, epoch)
        device_batches = batches.to(device)
        for i in range(steps_per_epoch):
            if step >= total_steps:
                break
            group = slice(i * t.grad_accum, (i + 1) * t.grad_accum)
            n_supervised = int(supervised[batches[group].flatten()].sum())
            loss_fn.normalizer = max(n_supervised, 1)  # all-masked step: loss 0, never 0/0
            step_loss = torch.zeros((), device=device)
            for j, index in enumerate(device_batches[group]):
                recording = timeline is not None and step + 1 == t.timeline_step and j == 0
                if recording:
                    timeline.start()
                out = runner.step(input_ids[index], labels[index])
                if out is not None:
                    step_loss += out
                if recording:
                    save_timeline(timeline, env, run_dir, config)
            grad_norm = clip_global_grad_norm(params, t.max_grad_norm, device)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window.add(
                step_loss,
                grad_norm,
                t.batch_size * t.grad_accum * input_ids.shape[1],
                int(train_split.real_tokens[batches[group].flatten()].sum()),
                n_supervised,
            )

            if step % t.log_every == 0 or step == total_steps:
                row = window.flush(env, runner.is_last)
                row.update(strategy=p.strategy, epoch=epoch, step=step, lr=lr)
                if writer is not None:
                    writer.write(row)
                    losses.append(row["loss"])
                progress.update(step, row)
    progress.close()
    if writer is not None:
        writer.close()

    # ------------------------------------------------------------------ adapter: one PEFT directory from all stages
    state = adapter_state(peft_model)
    if env.distributed:
        gathered: list[dict] | None = [None] * env.world_size if env.is_main else None
        dist.gather_object(state, gathered, dst=0)
        if env.is_main:
            state = {name: tensor for part in gathered for name, tensor in part.items()}
    if env.is_main:
        save_adapter(state, config.lora, config.model.name, run_dir / "adapter")
        print0(f"adapter ({len(state)} tensors) -> {run_dir / 'adapter'}")
    return RunResult(run_dir, losses)


def save_timeline(timeline: StageTimeline, env: DistEnv, run_dir: Path, config: Config) -> None:
    """Gather one schedule step's actions to rank 0; write timeline.json and timeline.png."""
    summary = gather_timeline(*timeline.stop(), env.world_size)
    if summary is None:
        return
    p = config.parallel
    m = p.n_microbatches
    summary["expected_bubble"] = (p.pp - 1) / (m + p.pp - 1)
    (run_dir / "timeline.json").write_text(json.dumps(summary, indent=1))
    title = (
        f"{p.schedule}, pp={p.pp}, {m} microbatches: step {summary['step_ms']:.1f} ms, bubble "
        + ", ".join(f"{b:.0%}" for b in summary["bubble"])
        + f" (ideal {summary['expected_bubble']:.0%})"
    )
    plot_timeline(summary, run_dir / "timeline.png", title)


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def clip_global_grad_norm(params: list[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
    """The L2 norm of all stages' gradients together (one all-reduce of squared norms), then clip by it."""
    grads = [param.grad for param in params if param.grad is not None]
    local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=device)
    squared = local.float().pow(2)
    if dist.is_initialized():
        dist.all_reduce(squared)
    total = squared.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class _Window:
    """Sums since the last metrics row; device tensors stay on the device until the row is written."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.steps = self.tokens = self.real_tokens = self.supervised = 0
        self.start = time.perf_counter()

    def add(self, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: int, real: int, supervised: int) -> None:
        self.loss += loss
        self.grad_norm = grad_norm.detach()
        self.steps += 1
        self.tokens += tokens
        self.real_tokens += real
        self.supervised += supervised

    def flush(self, env: DistEnv, holds_loss: bool) -> dict:
        """One row: loss from the last stage, peak memory from every rank, in one all_gather."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.start
        local = torch.stack(
            [
                self.loss / self.steps if holds_loss else torch.zeros((), device=self.device),
                self.grad_norm.float(),
                torch.tensor(peak_memory_gb(self.device), device=self.device),
            ]
        ).float()
        rows = [local]
        if env.distributed:
            rows = [torch.empty_like(local) for _ in range(env.world_size)]
            dist.all_gather(rows, local)
        values = torch.stack(rows).cpu()
        peaks = values[:, 2].tolist()
        row = {
            "loss": float(values[-1, 0]),
            "grad_norm": float(values[0, 1]),
            "tokens_per_sec": self.tokens / elapsed,
            "real_tokens_per_sec": self.real_tokens / elapsed,
            "step_time_sec": elapsed / self.steps,
            "peak_vram_gb": max(peaks),
            "supervised_tokens": self.supervised,
            **{f"peak_gb_rank{i}": peak for i, peak in enumerate(peaks)},
        }
        reset_peak_memory(self.device)
        self._reset()
        return row
