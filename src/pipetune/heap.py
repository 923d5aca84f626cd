"""A CPU rank's resident memory kept near what its tensors hold: glibc's free heap given back as it grows.

glibc's malloc returns to the system only the free memory at the top of its heap. What a step frees in the middle
stays resident until an allocation of a size that fits reuses it, and a step whose allocations do not fit the holes
grows the heap instead: on a CPU rank most of the peak can be free heap. SmolLM2-135M recomputing its 30 layers over
a 4,096-token row peaked at 7.6 GB of resident memory holding 1.1 GB of tensors, 6.0 GB of it free heap (each layer
recomputed left ~0.2 GB); without recomputation, over 2 x 512 tokens, ~1 GB of free heap beside 2.9 GB of tensors
(measured with mallinfo2 on a 2-core CPU). That memory is neither planned for nor needed.

`HeapTrimmer` watches the process's resident memory and, each time it passes a ceiling (what the last trim left
plus TRIM_SLACK), has glibc give its free pages back (malloc_trim, which releases free pages in the middle of the
heap too); the ceiling then rises to what that trim left. Steps that stay under the peak already reached trim
nothing, so a steady run pays nothing: the tiny demo ran 20 steps within 3% of its speed without it, where giving
back every freed page at once (a fixed mmap threshold, or a trim every few milliseconds) made it 45-60% slower: its
layers' tensors are small, and every page given back is faulted in again when reused. Where there is no glibc
(macOS, musl), nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

TRIM_SLACK = 64e6
"""Bytes of resident memory past what the last trim left before the next: the free heap a CPU rank's plan allows."""
POLL_S = 0.005
"""Seconds between two looks at the resident memory."""


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def resident_bytes() -> float:
    """This process's resident memory now, in bytes (/proc/self/statm; where there is none, its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)  # macOS says bytes, Linux KiB


def trim_heap() -> bool:
    """Give the heap's free pages back to the system now; False where there is no glibc to ask."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True


class HeapTrimmer:
    """While open, a daemon thread that trims the heap (`trim_heap`) whenever the resident memory passes the
    ceiling: what the last trim left plus `slack` bytes. A no-op where the heap cannot be trimmed."""

    def __init__(self, slack: float = TRIM_SLACK, poll_s: float = POLL_S) -> None:
        self.slack, self.poll_s, self.trims = slack, poll_s, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if _TRIM is not None:
            trim_heap()
            self.ceiling = resident_bytes() + slack
            self._thread = threading.Thread(target=self._run, name="pipetune-heap-trim", daemon=True)
            self._thread.start()

    @property
    def active(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if resident_bytes() > self.ceiling:
                trim_heap()
                self.trims += 1
                self.ceiling = max(self.ceiling, resident_bytes() + self.slack)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
