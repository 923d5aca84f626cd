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

from pipetune.run_log import write_whole

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
        write_whole(f"rank {rank} profile of step {step} by {sort_by}:\n{table}")  # ranks' tables apart
    if trace_dir := os.environ.get(TRACE_ENV):
        os.makedirs(trace_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(trace_dir, f"trace-rank{rank}.json.gz"))


class CompileLog:
    """What torch.compile spent since the last `line`: its graphs, its time (dynamo's tracing, the compilers
    behind it, the backward's compiled at its first call) and what its caches served. A compiled run's first
    step is mostly this; the line says where it went, and whether a warm cache was found (AOTAutograd's cache,
    inductor's FX graphs)."""

    KEYS = ("bytecode_tracing", "_compile.compile_inner", "OutputGraph.call_user_compiler", "backward._backward_impl")
    COUNTS = (
        ("stats", "unique_graphs"),
        ("aot_autograd", "autograd_cache_hit"),
        ("aot_autograd", "autograd_cache_miss"),
        ("aot_autograd", "autograd_cache_bypass"),
        ("inductor", "fxgraph_cache_hit"),
        ("inductor", "fxgraph_cache_miss"),
    )

    def __init__(self) -> None:
        self.seen = self._read()

    @classmethod
    def _read(cls) -> dict[str, float]:
        try:  # torch's own record of its compilations (torch._dynamo.utils): nothing where it is not there
            from torch._dynamo.utils import compile_times, counters

            names, values = compile_times(repr="csv", aggregate=True)
            times = dict(zip(names, values, strict=True))
            read = {key: float(times.get(key, 0.0)) for key in cls.KEYS}
            read.update({f"{a}.{b}": float(counters[a][b]) for a, b in cls.COUNTS})
            return read
        except Exception:  # noqa: BLE001 - a private record: its absence must not stop a run
            return {}

    def line(self) -> str:
        """The "compile: ..." line for what was compiled since the last call; "" where nothing was."""
        now = self._read()
        new = {key: now[key] - self.seen.get(key, 0.0) for key in now}
        self.seen = now
        total = new.get("_compile.compile_inner", 0.0) + new.get("backward._backward_impl", 0.0)
        if total < 0.5:
            return ""
        tracing = new["bytecode_tracing"]
        compilers = new["OutputGraph.call_user_compiler"] + new["backward._backward_impl"]
        graphs = int(new["stats.unique_graphs"])
        hits, misses = int(new["inductor.fxgraph_cache_hit"]), int(new["inductor.fxgraph_cache_miss"])
        aot = [int(new[f"aot_autograd.autograd_cache_{k}"]) for k in ("hit", "miss", "bypass")]
        return (
            f"compile: {graphs} graph{'s' if graphs != 1 else ''} in {total:.1f} s (dynamo's tracing {tracing:.1f} s, "
            f"the compilers {compilers:.1f} s, guards and the rest {total - tracing - compilers:.1f} s); caches: "
            f"AOTAutograd {aot[0]} hit{'s' if aot[0] != 1 else ''} / {aot[1]} missed / {aot[2]} bypassed, "
            f"inductor's FX graphs {hits} hit{'s' if hits != 1 else ''} / {misses} missed"
        )
