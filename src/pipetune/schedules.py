"""What pipetune knows of each pipeline schedule, in one torch-free table.

Config validation reads each schedule's stages-per-rank and microbatch rules from it, parallel/pipeline.py its
torch class and stage placement, the trainer whether it has a forward-only mode (validation loss) and the ideal
bubble, and the planner (planner/layouts.py) which stages per rank to try.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    name: str
    torch_class: str
    """Its class in torch.distributed.pipelining.schedules (all exist from torch 2.8 on)."""
    placement: str
    """"looped": rank r holds stages r, r + pp, r + 2 pp, ...; "v": rank r holds stages r and 2 pp - 1 - r."""
    min_stages_per_rank: int
    max_stages_per_rank: int | None
    """None: any number from the minimum on."""
    one_microbatch_per_stage: bool = False
    """It needs at least as many microbatches as pipeline stages."""
    microbatch_rounds: bool = False
    """It runs microbatches in rounds of pp: n_microbatches below pp, or a multiple of the rounds."""
    splits_backward: bool = False
    """Backward splits into input- and weight-gradient parts (zero bubble), which recomputed (checkpointed) and
    torch.compile'd layers do not support."""
    has_eval: bool = True
    """torch gives it a forward-only mode, which validation loss during training runs."""

    @property
    def multi_stage(self) -> bool:
        return self.min_stages_per_rank > 1

    def stage_ids(self, rank: int, pp: int, stages_per_rank: int) -> list[int]:
        """The pipeline stages `rank` runs, in order."""
        if self.placement == "v":
            return [rank, 2 * pp - 1 - rank]
        return [rank + k * pp for k in range(stages_per_rank)]


SCHEDULES: dict[str, Schedule] = {
    s.name: s
    for s in (
        Schedule("gpipe", "ScheduleGPipe", "looped", 1, 1),
        Schedule("1f1b", "Schedule1F1B", "looped", 1, 1, one_microbatch_per_stage=True),
        Schedule("interleaved_1f1b", "ScheduleInterleaved1F1B", "looped", 2, None, microbatch_rounds=True),
        Schedule("looped_bfs", "ScheduleLoopedBFS", "looped", 2, None),
        Schedule(
            "interleaved_zero_bubble",
            "ScheduleInterleavedZeroBubble",
            "looped",
            2,
            None,
            microbatch_rounds=True,
            splits_backward=True,
        ),
        Schedule("zbv", "ScheduleZBVZeroBubble", "v", 2, 2, splits_backward=True, has_eval=False),
        Schedule(
            "dualpipev",
            "ScheduleDualPipeV",
            "v",
            2,
            2,
            one_microbatch_per_stage=True,
            splits_backward=True,
            has_eval=False,
        ),
    )
}
"""parallel.schedule's values, in the order the docs and error messages list them."""


def stage_ids(schedule: str, rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The pipeline stages a rank runs, in order: looped (r, r + pp, ...) or V-shaped (r, 2 pp - 1 - r)."""
    return SCHEDULES[schedule].stage_ids(rank, pp, stages_per_rank)


def ideal_bubble(pp: int, stages_per_rank: int, n_microbatches: int) -> float:
    """The idle share of a schedule step with stages of equal cost and free transfers: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)
