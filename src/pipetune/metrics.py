"""metrics.csv, memory figures and progress (other loggers: loggers.py).

The first eight columns are the seed script's, so its plots keep working; the rest follow.
`peak_vram_gb` is the true peak since the previous row (max_memory_allocated, reset after each
row) on the rank with the highest peak; per-rank peaks follow in `peak_gb_rank<i>`, and on GPUs the
allocator's peak reservation in `reserved_gb_rank<i>` (the figure that counts CUDA-graph pools) and in
`alloc_retries` the allocations so far that needed the allocator to free its cache first (a rank at the
edge of its memory; the most of any rank). On the CPU
the figure is the process's peak resident set size (which cannot be reset).
"""

from __future__ import annotations

import csv
import io
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from pipetune.files import read_metrics_rows, write_atomic
from pipetune.loggers import open_loggers
from pipetune.run_log import log_only, terminal

T = TypeVar("T")

if TYPE_CHECKING:
    from pipetune.config import Config
    from pipetune.parallel.process_group import DistEnv

SEED_COLUMNS = ["strategy", "epoch", "step", "loss", "tokens_per_sec", "step_time_sec", "peak_vram_gb", "lr"]
EXTRA_COLUMNS = ["real_tokens_per_sec", "grad_norm", "supervised_tokens", "val_loss", "val_time_sec", "attention_share"]
"""attention_share: packed rows' attention work against whole rows' (packing.rows_attention_share), the row's steps'
token-weighted mean; empty unpacked."""


def host_peak_gb() -> float:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory since the last reset: device allocations on GPU, peak RSS of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return host_peak_gb()


def alloc_retries(device: torch.device) -> int:
    """Allocations so far that succeeded only after the caching allocator freed its cache (0 on CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    return 0


def peak_reserved_gb(device: torch.device) -> float:
    """Peak memory the caching allocator held from the device since the last reset (0 on CPU). With
    train.cuda_graphs this is the figure to read: a replayed graph's tensors live in its memory pool,
    which max_memory_allocated no longer counts after the recording."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 1e9
    return 0.0


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class MetricsWriter:
    """Appends one row per log step to metrics.csv, flushing each row so a killed run keeps its log.

    `keep_until_step` continues a resumed run's file: its rows up to that step stay, later ones
    (written after the checkpoint, before the run died) go, so the file reads as one run. Rows a full disk or
    a power cut left damaged (cut short, NUL bytes, not UTF-8) go too, with a warning.
    """

    def __init__(self, path: Path, n_ranks: int, keep_until_step: int | None = None) -> None:
        self.columns = SEED_COLUMNS + EXTRA_COLUMNS + [f"peak_gb_rank{i}" for i in range(n_ranks)]
        self.columns += [f"reserved_gb_rank{i}" for i in range(n_ranks)] + ["alloc_retries", "host_wait_frac"]  # GPU
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[dict] = []
        if keep_until_step is not None and path.is_file():
            kept, fieldnames, damaged = read_metrics_rows(path)
            kept = [row for row in kept if int(row["step"]) <= keep_until_step]
            self.columns += [c for c in fieldnames if c not in self.columns]  # e.g. another pp
            if damaged:
                print(
                    f"pipetune: warning: {path}: {damaged} damaged line(s) dropped (a write cut short)",
                    file=sys.stderr,
                    flush=True,
                )
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(kept)
        write_atomic(path, text.getvalue())
        self._file = open(path, "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=self.columns)

    def write(self, row: dict) -> None:
        self._writer.writerow({key: _format(value) for key, value in row.items()})
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _format(value: object) -> object:
    if isinstance(value, float):
        return f"{value:.8g}"
    return value


class PhaseLog:
    """progress.jsonl in the run directory: one line per phase the run enters (rank 0), with the wall-clock time.

    Phases: "setup" (the process imported, checked the config and started its device), "data" (the data read
    and the speed switches resolved), "load" (building this rank's stages), "ready" (with load_s, the seconds
    the load took, and peak_gb, rank 0's peak memory after it), "optimizer" (the runners, the optimizer and a
    resumed state built), "step" (optimizer step `step` begins), "validation", "checkpoint", "adapter",
    "done". `pipetune bench` follows it to say where each run is (so a run's start before its first step reads
    in parts), and reads load time and time to the first step from it."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path = path if enabled else None
        if self.path is not None:
            self.path.write_text("")  # a new run (or a resumed one) starts the log afresh

    def mark(self, phase: str, **fields: object) -> None:
        if self.path is None:
            return
        import json
        import time

        with open(self.path, "a") as f:
            f.write(json.dumps({"phase": phase, "time": time.time(), **fields}) + "\n")


def read_phases(path: Path) -> list[dict]:
    """The lines of a progress.jsonl written so far (a half-written last line is left for the next read)."""
    import json

    if not path.is_file():
        return []
    phases = []
    for line in path.read_text().splitlines():
        try:
            phases.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return phases


class ProgressReporter:
    """A rich progress bar (step/total, loss, tokens/s, ETA) on a terminal; one plain line per row otherwise."""

    def __init__(self, total: int, enabled: bool, description: str = "train") -> None:
        self.enabled = enabled
        self._bar = None
        if not enabled:
            return
        from rich.console import Console

        console = Console(file=terminal(sys.stdout))  # the bar stays out of train.log; its rows go in as lines
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(
                TextColumn(f"[bold]{description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}  {task.fields[speed]} tok/s"),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._bar.add_task(description, total=total, loss="-", speed="-")
            self._bar.start()
        self.total = total

    def update(self, step: int, row: dict) -> None:
        if not self.enabled:
            return
        loss, speed = f"{row['loss']:.4f}", f"{row['tokens_per_sec']:,.0f}"
        line = (
            f"step {step}/{self.total} | loss {loss} | {speed} tok/s | {row['step_time_sec']:.2f} s/step | "
            f"peak {row['peak_vram_gb']:.2f} GB | lr {row['lr']:.2e}"
        )
        if "val_loss" in row:
            line += f" | val_loss {row['val_loss']:.4f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, loss=loss, speed=speed)
            log_only(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class TaskProgress:
    """Progress of counted work (generation, evaluation) on stderr, so stdout keeps the results: rich bars on a
    terminal; elsewhere (a log file, a pipe) plain lines, at a task's start and end and every `interval_s`.

    `task()` returns the callback that advances a task; `note()` prints a line about what happens next.
    """

    def __init__(self, enabled: bool = True, interval_s: float = 10.0) -> None:
        self.enabled, self.interval_s = enabled, interval_s
        self._bar = None
        if not enabled:
            return
        from rich.console import Console

        console = Console(stderr=True)
        if console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            self._bar.start()

    def note(self, text: str) -> None:
        """One line on stderr (above the bars on a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def task(self, description: str, total: int) -> Callable[[int], None]:
        """A new task of `total` items; call the returned function with the number of items just done."""
        if not self.enabled:
            return lambda n=1: None
        if self._bar is not None:
            bar, task_id = self._bar, self._bar.add_task(description, total=total)
            return lambda n=1: bar.advance(task_id, n)
        started = time.monotonic()
        state = {"done": 0, "printed": started}

        def line() -> None:
            elapsed = time.monotonic() - started
            left = elapsed / state["done"] * (total - state["done"]) if 0 < state["done"] < total else 0.0
            eta = f", about {left:.0f} s left" if left else ""
            print(f"{description}: {state['done']}/{total} ({elapsed:.0f} s{eta})", file=sys.stderr, flush=True)

        def advance(n: int = 1) -> None:
            state["done"] += n
            now = time.monotonic()
            if state["done"] >= total or now - state["printed"] >= self.interval_s:
                state["printed"] = now
                line()

        line()
        return advance

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> TaskProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsWindow:
    """The training loop's sums since the last metrics row; device tensors stay on the device until the row is
    written."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.grad_norm = torch.zeros((), device=self.device)
        self.skipped = torch.zeros((), device=self.device)
        self.steps = self.tokens = self.real_tokens = self.supervised = 0
        self.attention_tokens = 0.0
        self.waited = 0.0
        """Seconds the host spent waiting for the GPU (`wait_for`): near none, the host is the limit."""
        self.start = time.perf_counter()

    def wait_for(self, wait: Callable[[], T]) -> T:
        """Call `wait` (something that blocks until the GPU gets somewhere), counting the time in `waited`."""
        started = time.perf_counter()
        try:
            return wait()
        finally:
            self.waited += time.perf_counter() - started

    def add(
        self,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        tokens: int,
        real: int,
        supervised: int,
        skipped: torch.Tensor | bool,
        attention_share: float | None = None,
    ) -> None:
        """One optimizer step's figures; `skipped` (1 or 0, on the device: the step's non-finite flag) keeps a
        skipped step's loss out of the row's mean; `attention_share`: packed rows' (None unpacked)."""
        skipped = torch.as_tensor(skipped, dtype=torch.float32, device=self.device)
        self.loss += torch.where(skipped > 0, 0.0, loss)
        self.skipped += skipped
        self.grad_norm = grad_norm.detach()
        self.steps += 1
        self.tokens += tokens
        self.real_tokens += real
        self.supervised += supervised
        if attention_share is not None:
            self.attention_tokens += attention_share * tokens

    def exclude_since(self, started: float) -> float:
        """Keep the time since `started` (validation, a checkpoint) out of this window; returns it in seconds."""
        seconds = time.perf_counter() - started
        self.start += seconds
        return seconds

    def flush(self, env: DistEnv, holds_loss: bool) -> dict:
        """One row: loss from the last stage, peak memory from every rank, in one all_gather."""
        if self.device.type == "cuda":
            self.wait_for(lambda: torch.cuda.synchronize(self.device))
        elapsed = time.perf_counter() - self.start
        local = torch.stack(
            [
                self._mean_loss() if holds_loss else torch.zeros((), device=self.device),
                self.grad_norm.float(),
                torch.tensor(peak_memory_gb(self.device), device=self.device),
                torch.tensor(peak_reserved_gb(self.device), device=self.device),
                torch.tensor(alloc_retries(self.device), device=self.device),
            ]
        ).float()
        rows = [local]
        if env.distributed:
            rows = [torch.empty_like(local) for _ in range(env.world_size)]
            dist.all_gather(rows, local)
        values = torch.stack(rows).cpu()
        peaks = values[:, 2].tolist()
        row = {
            "loss": float(values[:, 0].sum()),  # only the rank holding the last stage reports one
            "grad_norm": float(values[0, 1]),
            "tokens_per_sec": self.tokens / elapsed,
            "real_tokens_per_sec": self.real_tokens / elapsed,
            "step_time_sec": elapsed / self.steps,
            "peak_vram_gb": max(peaks),
            "supervised_tokens": self.supervised,
            **{f"peak_gb_rank{i}": peak for i, peak in enumerate(peaks)},
        }
        if self.attention_tokens:
            row["attention_share"] = self.attention_tokens / self.tokens
        if self.device.type == "cuda":
            row.update({f"reserved_gb_rank{i}": float(reserved) for i, reserved in enumerate(values[:, 3])})
            # Allocations that failed at first and succeeded after the allocator freed its cache (a slow,
            # synchronizing path): a sign that the rank runs at the edge of its memory.
            row["alloc_retries"] = int(values[:, 4].max())
            # The share of the row's time rank 0's host waited for its GPU, this row's own wait included: near
            # 0 between rows, the host launches no faster than the GPU runs (fewer launches would help).
            row["host_wait_frac"] = self.waited / elapsed
        reset_peak_memory(self.device)
        self._reset()
        return row

    def _mean_loss(self) -> torch.Tensor:
        counted = self.steps - self.skipped
        return torch.where(counted > 0, self.loss / counted.clamp(min=1), float("nan"))


class MetricsLog:
    """Where the loop's metrics rows go: metrics.csv and output.loggers (rank 0), the progress display; with the
    window whose sums make the next row, and the losses logged so far.

    `resumed_at`: the checkpoint step a resumed run continues metrics.csv from (None: a fresh file)."""

    def __init__(self, config: Config, env: DistEnv, total_steps: int, resumed_at: int | None, quiet: bool) -> None:
        run_dir = Path(config.output.dir)
        self.writer = MetricsWriter(run_dir / "metrics.csv", env.world_size, resumed_at) if env.is_main else None
        self.progress = ProgressReporter(total_steps, enabled=env.is_main and not quiet)
        self.loggers = open_loggers(config, run_dir, enabled=env.is_main)
        self.window = MetricsWindow(env.device)
        self.losses: list[float] = []
        """The loss of every training row written (rank 0; empty elsewhere)."""

    def write(self, row: dict) -> None:
        """A row to metrics.csv and every logger (rank 0; elsewhere it goes nowhere)."""
        if self.writer is not None:
            self.writer.write(row)
            self.loggers.write(row)

    def write_step(self, step: int, row: dict) -> None:
        """A training row: written, its loss kept, and shown on the progress display."""
        self.write(row)
        if self.writer is not None:
            self.losses.append(row["loss"])
        self.progress.update(step, row)

    def close(self) -> None:
        self.progress.close()
        self.loggers.close()
        if self.writer is not None:
            self.writer.close()
