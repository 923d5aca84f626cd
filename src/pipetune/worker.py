"""How a worker ends when something outside the loop ends it: its launcher dies, a signal, a full disk.

A worker started by a launcher asks the kernel to kill it when the launcher dies (Linux's parent-death
signal), so a launcher killed with `kill -9` leaves no workers training on their own. SIGTERM, SIGINT and
SIGHUP become an exception, so that files being written are cleaned up on the way out and the run ends with one
line instead of a traceback per rank. A full disk (or quota) is named as such.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys

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


def disk_full_message(error: OSError, rank: int | None = None) -> str | None:
    """One line for a write that failed because the disk (or the quota) is full, else None."""
    if error.errno not in DISK_FULL:
        return None
    who = f"rank {rank}: " if rank is not None else ""
    where = f" writing {error.filename}" if error.filename else ""
    return (
        f"{who}no space left on the device{where}; committed checkpoints are kept: free space, "
        "then continue with --resume"
    )
