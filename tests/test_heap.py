"""pipetune/heap.py: a CPU rank's free heap given back to the system as its resident memory grows."""

from __future__ import annotations

import time

from pipetune import heap
from pipetune.heap import TRIM_SLACK


def test_the_heap_trimmer_trims_when_the_resident_memory_passes_its_ceiling(monkeypatch) -> None:
    rss, trims = [1.0e9], []

    def trim() -> bool:
        trims.append(rss[0])
        rss[0] = min(rss[0], 1.1e9)  # what the free pages' return leaves
        return True

    monkeypatch.setattr(heap, "_TRIM", lambda pad: 0)
    monkeypatch.setattr(heap, "resident_bytes", lambda: rss[0])
    monkeypatch.setattr(heap, "trim_heap", trim)
    trimmer = heap.HeapTrimmer(poll_s=0.001)
    try:
        assert trimmer.active and trimmer.ceiling == 1.0e9 + TRIM_SLACK
        rss[0] = 1.05e9  # under the ceiling: nothing given back
        time.sleep(0.05)
        assert trims == [1.0e9]  # the trim when it started
        rss[0] = 1.3e9  # past it: trimmed, and the ceiling is what that left plus the slack
        deadline = time.monotonic() + 5
        while len(trims) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert trims[1:] == [1.3e9] and trimmer.ceiling == 1.1e9 + TRIM_SLACK
    finally:
        trimmer.close()
    assert not trimmer.active
