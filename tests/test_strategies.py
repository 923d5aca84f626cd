"""One definition of each strategy's layout and of the stage -> rank map, read by config checks, bench and plan."""

from __future__ import annotations

import dataclasses

import pytest

from pipetune.bench import strategy_config
from pipetune.config import RUN_STRATEGIES, ConfigError, ParallelConfig, validate
from pipetune.parallel.memory import rank_timeline
from pipetune.parallel.pipeline import schedule_actions
from pipetune.planner.layouts import Layout
from pipetune.schedules import SCHEDULES
from pipetune.strategies import STRATEGY_SPECS, strategies_of_grid
from tests.conftest import tiny_config


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_rank_holds_the_stages_its_schedule_runs(schedule: str) -> None:
    """`ParallelConfig.stage_ids` is where torch's schedule runs each stage, every stage on one rank, and the memory
    plan's timeline has one column per stage the rank holds."""
    spec = SCHEDULES[schedule]
    v = spec.max_stages_per_rank or 3
    p = ParallelConfig(pp=2, schedule=schedule, stages_per_rank=v, n_microbatches=4)
    actions = schedule_actions(schedule, p.pp, v, p.n_microbatches)
    for rank in range(p.pp):
        assert {stage for _, stage, _ in actions[rank]} == set(p.stage_ids(rank))
        assert all(len(moment) == len(p.stage_ids(rank)) for moment in rank_timeline(p, rank))
    assert sorted(p.stage_ranks()) == list(range(p.n_stages))
    assert all(stage in p.stage_ids(rank) for stage, rank in p.stage_ranks().items())
    assert ParallelConfig(pp=1, schedule=schedule).stage_ids(0) == [0]


@pytest.mark.parametrize("strategy", RUN_STRATEGIES)
def test_bench_runs_each_strategy_on_the_grid_the_planner_and_the_checks_give_it(tmp_path, strategy: str) -> None:
    """A bench variant is `Layout.for_strategy` applied, on the strategy's own grid, which the planner lays out
    under that strategy and config validation accepts; a whole-model strategy with a pipeline is refused."""
    config = tiny_config(tmp_path, "parallel.dp=2")  # pp = 2 x dp = 2: four ranks
    variant = strategy_config(config, strategy, steps=2, warmup=1, out_dir=tmp_path)
    p = variant.parallel
    assert Layout.of(variant) == Layout.for_strategy(config, strategy)
    spec = STRATEGY_SPECS[strategy]
    if not spec.pipeline:
        assert (p.pp, p.dp, p.tp) == spec.grid(config.parallel.world_size, 2)
    assert strategy in strategies_of_grid(p.pp, p.dp, p.tp)
    validate(variant, p.world_size)
    assert p.sharded == (spec.sharded is True or (spec.sharded is None and p.dp_shard))
    if not spec.pipeline:
        piped = dataclasses.replace(Layout.of(variant), pp=2, schedule="gpipe").apply(variant)
        with pytest.raises(ConfigError, match=f"parallel.strategy = '{strategy}'"):
            validate(piped, piped.parallel.world_size)
