"""How a worker ends when something outside the loop ends it: its launcher dies, a signal, a full disk.

A worker started by a launcher asks the kernel to kill it when the launcher dies (Linux's parent-death
signal), so a launcher killed with `kill -9` leaves no workers training on their own. SIGTERM, SIGINT and
SIGHUP become an exception, so that files being written are cleaned up on the way out and the run ends with one
line instead of a traceback per rank. A full disk (or quota) is named as such.

A worker of pipetune's launcher does not print how it ended: it hands an `Ending` to the launcher (in the error
file torch's elastic agent gives each worker), which says it once for all the ranks that ended alike.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LAUNCHER_ENV = "PIPETUNE_LAUNCHER_PID"
"""Set by pipetune's local launcher for its workers: the pid whose death ends them, and who reports for them."""
PR_SET_PDEATHSIG = 1
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class Stopped(BaseException):
    """A stop signal arrived (a BaseException, like KeyboardInterrupt, so that no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def end_with_launcher() -> None:
    """Be killed when the process that started this one dies (Linux; elsewhere nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    expected = os.environ.get(LAUNCHER_ENV)
    parent = os.getppid()
    # The launcher may have died before the prctl: then this process was already handed to another parent.
    if parent == 1 or (expected is not None and expected.isdigit() and parent != int(expected)):
        os._exit(1)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def raise_on_stop_signals() -> dict[int, object]:
    """SIGTERM, SIGINT and SIGHUP raise Stopped in the main thread (at its next Python instruction); returns the
    handlers they replace, for `restore_signals`."""

    def handler(signum: int, _frame: object) -> None:
        raise Stopped(signum)

    return {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}


def restore_signals(previous: dict[int, object]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def has_launcher() -> bool:
    """A pipetune launcher started this worker and reports stops for it."""
    return LAUNCHER_ENV in os.environ


def ranks_label(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


def disk_full_message(error: OSError, rank: int | None = None) -> str | None:
    """One line for a write that failed because the disk (or the quota) is full, else None."""
    if error.errno not in DISK_FULL:
        return None
    return no_space_message([] if rank is None else [rank], [error.filename] if error.filename else [])


def no_space_message(ranks: list[int], files: list[str]) -> str:
    """The disk-full line for `ranks` (none: the launcher itself) that were writing `files`: the file, or the
    directory that holds them all. Writing the token cache, the run had not started: nothing to continue."""
    who = f"{ranks_label(ranks)}: " if ranks else ""
    where = ""
    if len(set(files)) == 1:
        where = f" writing {files[0]}"
    elif files:
        where = f" writing into {os.path.commonpath(files)}"
    caches = {_cache_part(f) for f in files}
    if files and None not in caches:
        return (
            f"{who}no space left on the device{where} ({' and '.join(sorted(caches))}); the run had not started: "
            "free space there, or set PIPETUNE_CACHE to a directory on a disk with room"
        )
    return (
        f"{who}no space left on the device{where}; committed checkpoints are kept: free space, "
        "then continue with --resume"
    )


def named_cache_error(error: OSError) -> OSError:
    """`error` from building the token cache; a full disk's with the cache's data directory as its file when it
    names none (a write to an open file fails without a name)."""
    if error.filename is not None or error.errno not in DISK_FULL:
        return error
    from pipetune.files import default_cache_dir

    return OSError(error.errno, error.strerror, str(default_cache_dir() / "data"))


CACHE_PARTS = {"data": "the token cache", "tokenizers": "the demo tokenizer", "models": "a converted model"}
"""What pipetune's cache (files.default_cache_dir()) keeps in each folder, as a full disk's line names it."""


def _cache_part(file: str) -> str | None:
    """What of pipetune's cache `file` is part of (CACHE_PARTS), or None when it is outside the cache."""
    from pipetune.files import default_cache_dir

    for folder, part in CACHE_PARTS.items():
        if Path(os.path.abspath(file)).is_relative_to(os.path.abspath(default_cache_dir() / folder)):
            return part
    return None


@dataclass
class Ending:
    """How one rank's run ended (`line`: what it prints when it reports itself), for its launcher to say once for
    all ranks: `kind` is "disk full" (`file`: what it was writing), "stopped" (`signum`), "timeout" (a peer stopped
    responding), "peer lost" (a peer exited: a consequence of another rank's ending), "out of memory" (an allocation
    failed: out_of_memory.py) or "config" (a ConfigError on a rank other than 0, which rank 0 says itself when it
    reaches it too)."""

    kind: str
    rank: int
    line: str
    file: str | None = None
    signum: int | None = None

    @classmethod
    def read(cls, error_file_data: dict) -> Ending | None:
        """The ending a worker wrote into its elastic error file (what torch parsed of it), else None."""
        data = error_file_data.get("pipetune") if isinstance(error_file_data, dict) else None
        return cls(**data) if isinstance(data, dict) else None


def end_worker(ending: Ending) -> None:
    """Say how this rank ended: to the pipetune launcher that started it, which says it once for the run (through
    the error file torch's elastic agent reads when the worker exits), else on stderr (a stop: by rank 0 only).
    A group that the launcher will restart says it itself: the launcher reports only the last attempt's end."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") if has_launcher() else None
    attempt, restarts = (int(os.environ.get(f"TORCHELASTIC_{key}", "0")) for key in ("RESTART_COUNT", "MAX_RESTARTS"))
    if error_file and attempt >= restarts:
        with open(error_file, "w") as f:
            json.dump({"message": ending.line, "timestamp": int(time.time()), "pipetune": asdict(ending)}, f)
        return
    if ending.kind != "stopped" or (ending.rank == 0 and not has_launcher()):
        print(f"pipetune: error: {ending.line}", file=sys.stderr, flush=True)
