"""What each parallel.strategy fixes of a run's layout, in one torch-free table.

Config validation reads what each strategy requires of pp, dp, tp and sharding from it, `pipetune bench` the
process grid it runs a strategy on (`Strategy.grid`), and the planner (planner/layouts.py) which strategies
run a process grid (`strategies_of_grid`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Strategy:
    name: str
    pipeline: bool
    """Runs pipeline stages over parallel.pp ranks; the others run whole-model replicas (pp = 1)."""
    tensor_parallel: bool | None
    """True: each replica split over parallel.tp >= 2 ranks; False: whole layers (tp = 1); None: either."""
    sharded: bool | None
    """True: FSDP over the replicas (parallel.dp_shard implied); False: never (dp_shard refused); None: as
    parallel.dp_shard says."""
    min_replicas: int = 1
    max_replicas: int | None = None
    """parallel.dp at least, at most (None: any)."""

    def grid(self, ranks: int, tp: int) -> tuple[int, int, int]:
        """(pp, dp, tp) this strategy runs on `ranks` processes; `tp`: the tensor-parallel degree it splits
        replicas over, where it does (a pipeline's grid is its config's: not decided here)."""
        if self.max_replicas == 1:
            return 1, 1, 1
        tp = tp if self.tensor_parallel else 1
        return 1, ranks // tp, tp


STRATEGY_SPECS: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("pp", pipeline=True, tensor_parallel=None, sharded=None),
        Strategy("ddp", pipeline=False, tensor_parallel=False, sharded=False),
        Strategy("fsdp", pipeline=False, tensor_parallel=None, sharded=True, min_replicas=2),
        Strategy("tp", pipeline=False, tensor_parallel=True, sharded=None),
        Strategy("single", pipeline=False, tensor_parallel=False, sharded=None, max_replicas=1),
    )
}
"""What a run (and `pipetune bench --strategies`) can be, in the order the docs and messages list them."""


def strategies_of_grid(pp: int, dp: int, tp: int) -> list[str]:
    """The strategies the planner lays out on a (pp, dp, tp) grid: a pipeline for pp >= 2; otherwise those whose
    own grid (`Strategy.grid`) it is, one process being "single" alone."""
    if pp > 1:
        return [s.name for s in STRATEGY_SPECS.values() if s.pipeline]
    ranks = dp * tp
    return [
        s.name
        for s in STRATEGY_SPECS.values()
        if not s.pipeline
        and s.grid(ranks, tp) == (1, dp, tp)
        and dp >= s.min_replicas
        and (ranks > 1 or s.max_replicas == 1)
        and bool(s.tensor_parallel) == (tp > 1)
    ]
