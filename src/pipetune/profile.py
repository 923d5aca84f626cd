"""PIPETUNE_PROFILE_STEP=N (for diagnosis): torch.profiler tables of optimizer step N on every rank, whatever the
strategy. Each rank prints its operators by host time and by device time (the kernels on a GPU); the step runs
as any other, only slower while it is profiled. Choose a step after the warm-up (compilation, graph recording).
With PIPETUNE_PROFILE_TRACE=DIR each rank also writes the step's Chrome trace (the host's calls and the GPU's
kernels on one time axis, where the GPU's idle gaps show) to DIR/trace-rank<R>.json.gz."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

PROFILE_ENV = "PIPETUNE_PROFILE_STEP"
TRACE_ENV = "PIPETUNE_PROFILE_TRACE"
ROWS = 25


def profile_step() -> int:
    """The optimizer step to profile (0: none)."""
    value = os.environ.get(PROFILE_ENV, "")
    return int(value) if value.isdigit() else 0


@contextlib.contextmanager
def profiled(step: int, rank: int, device: torch.device) -> Iterator[None]:
    """Profile what runs inside when `step` is the step PIPETUNE_PROFILE_STEP names; else do nothing."""
    if step != profile_step():
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    averages = profiler.key_averages()
    sorts = ("self_cpu_time_total", "self_device_time_total") if device.type == "cuda" else ("self_cpu_time_total",)
    for sort_by in sorts:
        table = averages.table(sort_by=sort_by, row_limit=ROWS)
        print(f"rank {rank} profile of step {step} by {sort_by}:\n{table}", flush=True)
    if trace_dir := os.environ.get(TRACE_ENV):
        os.makedirs(trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(trace_dir, f"trace-rank{rank}.json.gz"))
