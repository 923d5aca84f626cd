"""Bubble of timelines recorded before the loss was an action of its own (kind "L").

Those timelines held forward (F) and backward (B) only, so the last stage's loss (with the fused loss:
lm_head + cross-entropy, ~2 ms per microbatch at seq 512) counted as idle time. On the last stage a
microbatch's backward starts right after its loss, so the gap between its F end and its B start is the
loss. This adds those gaps back as work and prints each rank's bubble both ways, and the median
forward and backward time per stage.

    python3 benchmarks/tools/loss_gap_bubble.py benchmarks/journal/results/timelines/*.json
"""

from __future__ import annotations

import json
import statistics
import sys

for path in sys.argv[1:]:
    timeline = json.loads(open(path).read())
    actions, step = timeline["actions"], timeline["step_ms"]
    last = max(a["stage"] for a in actions)
    ends = {a["microbatch"]: a["end_ms"] for a in actions if a["stage"] == last and a["kind"] == "F"}
    starts = {a["microbatch"]: a["start_ms"] for a in actions if a["stage"] == last and a["kind"] == "B"}
    loss = [starts[mb] - ends[mb] for mb in sorted(ends)]
    last_rank = next(a["rank"] for a in actions if a["stage"] == last)
    print(f"{path}: step {step:.1f} ms, loss gaps {', '.join(f'{g:.1f}' for g in loss)} ms (rank {last_rank})")
    for rank, recorded in enumerate(timeline["bubble"]):
        busy = sum(a["end_ms"] - a["start_ms"] for a in actions if a["rank"] == rank)
        busy += sum(loss) if rank == last_rank else 0.0
        stages = sorted({a["stage"] for a in actions if a["rank"] == rank})
        times = {
            kind: statistics.median(
                a["end_ms"] - a["start_ms"] for a in actions if a["rank"] == rank and a["kind"] == kind
            )
            for kind in "FB"
        }
        print(
            f"  rank {rank} (stages {stages}): bubble {recorded:.1%} recorded, {1 - busy / step:.1%} with the loss "
            f"as work; median F {times['F']:.1f} ms, B {times['B']:.1f} ms"
        )
    print(f"  ideal {timeline['expected_bubble']:.1%}" if "expected_bubble" in timeline else "")
