"""Running out of memory, said in one line: which rank, where in the run, what it was allocating, what to set.

Three ways a rank runs out: the GPU's allocator raises torch.OutOfMemoryError; the host's raises MemoryError or
a RuntimeError of torch's DefaultCPUAllocator; or the kernel's OOM killer ends the process with SIGKILL, which no
Python code sees. For the last, each worker of pipetune's launcher records where it is and its peak RSS in a small
file (`ProgressFile`, about once a second), and the launcher reads it, with the cgroup's OOM-kill count, when the
worker's exit code is -9. Committed checkpoints are never touched: the line says to continue with --resume.
"""

from __future__ import annotations

import json
import os
import re
import resource
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from pipetune.host_memory import total_host_memory

PROGRESS_ENV = "PIPETUNE_PROGRESS_DIR"
"""Set by pipetune's launcher for its workers: where each writes rank<R>.json (ProgressFile)."""
GPU_ADVICE = (
    'set train.activation_checkpointing = true (or "offload"), lower train.batch_size (or raise '
    "parallel.n_microbatches) or data.max_length, or set train.memory_gb below the GPU's memory so that the plan "
    "leaves room"
)
HOST_ADVICE = (
    "lower train.batch_size or data.max_length, run fewer processes on this machine, or set train.memory_gb to the "
    "memory this machine can give each process (the plan then recomputes layers to fit)"
)
_ASKED_GPU = re.compile(r"Tried to allocate ([\d.]+ [KMGT]i?B)")
_ASKED_HOST = re.compile(r"you tried to allocate (\d+) bytes")


COMMAND_ADVICE = {
    "eval": "lower --batch-size (meetings generated together) or --max-new-tokens",
    "summarize": "lower --batch-size or --max-batch-tokens (the KV cache's tokens a batch)",
    "export": "export on a machine with more memory: the merged model (and a GGUF file's tensors) are held at once",
}
"""What to set when a one-process command (not training: its workers have their own line) runs out of memory."""


def memory_failure(error: BaseException, rank: int, where: str, who: str = "", advice: str = "") -> str | None:
    """The line for an allocation that failed on the GPU or the host (`error`, or one it was raised from: a
    pipeline stage wraps its own), without the checkpoints' part; None for any other error. `who` (default "rank
    R") ran out; `advice` replaces training's."""
    seen: BaseException | None = error
    while seen is not None:
        line = _memory_line(seen, who or f"rank {rank}", where, advice)
        if line is not None:
            return line
        seen = seen.__cause__ or seen.__context__
    return None


def command_memory_failure(error: BaseException, command: str) -> str | None:
    """The line for `pipetune COMMAND` (eval, summarize, export: one process) running out of memory, or None."""
    advice = COMMAND_ADVICE.get(command)
    return memory_failure(error, 0, f"`pipetune {command}`", who="pipetune", advice=advice) if advice else None


def _memory_line(error: BaseException, who: str, where: str, advice: str) -> str | None:
    text = str(error)
    if isinstance(error, torch.OutOfMemoryError):
        asked = _ASKED_GPU.search(text)
        what = f"allocating {asked.group(1)}" if asked else "allocating"
        return f"{who} ran out of GPU memory in {where}, {what} ({_first_line(text)}); {advice or GPU_ADVICE}"
    if isinstance(error, MemoryError) or (isinstance(error, RuntimeError) and "DefaultCPUAllocator" in text):
        asked = _ASKED_HOST.search(text)
        what = f"allocating {int(asked.group(1)) / 1e9:.1f} GB" if asked else "allocating"
        detail = _host_detail(error)
        return f"{who} ran out of host memory in {where}, {what} ({detail}); {advice or HOST_ADVICE}"
    return None


def killed_line(rank: int, exitcode: int, progress: dict | None, oom_kills: int | None) -> str:
    """The line for a worker that died of SIGKILL (exit code -9): where it was and its peak RSS when its ProgressFile
    last wrote (up to a second before),
    and whether the cgroup's OOM killer ended it (`oom_kills`: how many it ended during the run; None: unknown)."""
    where = f", last seen in {progress['where']}" if progress and progress.get("where") else ""
    peak = (
        f"; its peak RSS was {progress['peak_rss_gb']:.1f} GB or more" if progress and "peak_rss_gb" in progress else ""
    )
    limit = total_host_memory() / 1e9
    of = f" of the {limit:.1f} GB this machine gives the run" if limit and peak else ""
    if oom_kills:
        cause = "killed by the kernel's OOM killer: host memory ran out"
    else:
        cause = "killed by SIGKILL, most likely by the kernel's OOM killer (host memory ran out)"
    return f"rank {rank} was {cause} (exit code {exitcode}){where}{peak}{of}; {HOST_ADVICE}"


class ProgressFile:
    """A worker's `where` (a callable: LoopStatus.where) and peak RSS, written to <PROGRESS_ENV>/rank<R>.json about
    once a second by a daemon thread, for the launcher's line should the kernel kill the worker."""

    def __init__(self, rank: int, where: Callable[[], str], every_s: float = 1.0) -> None:
        directory = os.environ.get(PROGRESS_ENV)
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        self.where, self.every_s = where, every_s
        self._stop = threading.Event()
        if self.path is not None:
            self.write()
            threading.Thread(target=self._run, name="pipetune-progress", daemon=True).start()

    def write(self) -> None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux: KiB
        try:
            self.path.write_text(json.dumps({"where": self.where(), "peak_rss_gb": peak}))
        except OSError:
            pass  # a report's detail, never a reason to stop training

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.write()

    def close(self) -> None:
        self._stop.set()


def read_progress(directory: str | None, rank: int) -> dict | None:
    """What ProgressFile last wrote for `rank`, or None."""
    try:
        data = json.loads((Path(directory) / f"rank{rank}.json").read_text()) if directory else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:240] if text.strip() else "out of memory"


def _host_detail(error: BaseException) -> str:
    text = str(error)
    if "DefaultCPUAllocator" in text:  # after torch's "[enforce fail at alloc_cpu.cpp:127] err == 0."
        text = text[text.index("DefaultCPUAllocator") :]
    return _first_line(text) if text else type(error).__name__
