"""The pieces under `pipetune plan`: every rank's schedule actions, their replay, a layer's activations on meta."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import Counter

import pytest
import torch

from pipetune.config import Config, ModelConfig, apply_override
from pipetune.model.shapes import resolve_model
from pipetune.parallel.memory import inflight_timeline, measure_layer_memory
from pipetune.parallel.pipeline import schedule_actions
from pipetune.planner.speed import GpuRates, replay_schedule
from pipetune.schedules import SCHEDULES, stage_ids


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_runs_each_microbatch_once_forward_and_backward(schedule: str) -> None:
    pp, m = 2, 4
    v = SCHEDULES[schedule].min_stages_per_rank
    order = schedule_actions(schedule, pp, v, m)
    assert sorted(order) == list(range(pp))
    for rank, actions in order.items():
        mine = set(stage_ids(schedule, rank, pp, v))
        assert {stage for _, stage, _ in actions} == mine
        counts = Counter((kind if kind != "I" else "B", stage, mb) for kind, stage, mb in actions if kind != "W")
        assert counts == Counter({(kind, s, mb): 1 for kind in "FB" for s in mine for mb in range(m)})


def test_microbatches_in_flight_follow_the_schedule() -> None:
    # 1F1B over 4 ranks holds pp - rank microbatches at its peak; GPipe all of them.
    for rank in range(4):
        timeline = inflight_timeline(schedule_actions("1f1b", 4, 1, 8)[rank], [rank])
        assert max(held for (held,) in timeline) == 4 - rank
    assert max(held for (held,) in inflight_timeline(schedule_actions("gpipe", 4, 1, 8)[1], [1])) == 8


@pytest.mark.parametrize(
    ("schedule", "v"), [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)]
)
def test_replay_of_equal_stages_has_the_textbook_bubble(schedule: str, v: int) -> None:
    """Stages of equal time, backward twice the forward, free transfers: bubble (p - 1) / (v m + p - 1)."""
    pp, m = 4, 8
    order = schedule_actions(schedule, pp, v, m)
    stage_rank = {s: r for r in range(pp) for s in stage_ids(schedule, r, pp, v)}
    replay = replay_schedule(order, stage_rank, [1.0 / v] * (pp * v), [2.0 / v] * (pp * v), transfer=0.0)
    assert replay.busy_seconds == pytest.approx([3.0 * m] * pp)
    expected = (pp - 1) / (v * m + pp - 1)
    assert replay.bubble == pytest.approx([expected] * pp, abs=1e-9)


def test_replay_waits_for_the_slowest_stage_and_transfers() -> None:
    order = schedule_actions("1f1b", 2, 1, 4)
    balanced = replay_schedule(order, {0: 0, 1: 1}, [1.0, 1.0], [2.0, 2.0], 0.0).step_seconds
    slow_last = replay_schedule(order, {0: 0, 1: 1}, [1.0, 1.5], [2.0, 3.0], 0.0).step_seconds
    moved = replay_schedule(order, {0: 0, 1: 1}, [1.0, 1.0], [2.0, 2.0], 0.1).step_seconds
    assert slow_last == pytest.approx(1.0 + 4 * 4.5 + 2.0)  # the slow stage sets the pace of every microbatch
    assert moved > balanced


def test_layer_activations_on_meta_are_the_cpu_measurement() -> None:
    """The meta device runs no kernel and allocates nothing, yet keeps the tensors a real forward keeps (no dropout:
    the one place where CUDA's kernels, which meta imitates, and the CPU's differ); an NF4 base changes nothing."""
    config = Config()
    for item in ('model.name="tiny-qwen3"', 'model.init="random"', 'model.dtype="float32"', "lora.dropout=0.0"):
        apply_override(config, item)
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    meta = measure_layer_memory(config, resolved, torch.device("meta"), 2, 128)
    cpu = measure_layer_memory(config, resolved, torch.device("cpu"), 2, 128)
    assert meta[1] == cpu[1] == 2 * 128 * 256 * 4
    assert meta[0] == pytest.approx(cpu[0], rel=0.05), (meta, cpu)
    assert measure_layer_memory(config, resolved, torch.device("meta"), 4, 128)[0] == pytest.approx(
        2 * meta[0], rel=0.01
    )
    # The adapters inside the base matmuls (lora.adapter_in_matmul): measured on their own path, meta as the CPU.
    in_matmul = copy.deepcopy(config)
    for item in ("lora.fast_path=true", "lora.adapter_in_matmul=true"):
        apply_override(in_matmul, item)
    extended = [measure_layer_memory(in_matmul, resolved, torch.device(d), 2, 128) for d in ("meta", "cpu")]
    assert extended[0][0] == pytest.approx(extended[1][0], rel=0.05), extended
    # An NF4 layer keeps the same activations: the 4-bit weight's tensors that its operator saves are weights
    # (counted as activations, they had made a 72B NF4 run checkpoint 10 of 80 layers it did not need to).
    apply_override(config, 'model.quantize="nf4"')
    assert measure_layer_memory(config, resolved, torch.device("cpu"), 2, 128) == cpu


def test_calibration_times_a_layer_and_the_model_uses_the_times(tmp_path, monkeypatch) -> None:
    """--calibrate's path on a CPU (the figures are the CPU's): the timed shape's layer time replaces the model's."""
    from pipetune.planner import calibrate
    from pipetune.planner.plan import make_plan
    from pipetune.planner.speed import layer_seconds
    from tests.conftest import tiny_config

    monkeypatch.setattr(calibrate, "WARMUP", 1)
    monkeypatch.setattr(calibrate, "REPEATS", 2)
    config = tiny_config(tmp_path)
    rates = calibrate.calibrate(config, 2, shapes=1, device=torch.device("cpu"))
    ((key, (forward, backward)),) = rates.layer_seconds.items()
    assert forward > 0 and backward > 0 and rates.layer_scale > 0
    plan = make_plan(config, 2, rates=rates)
    timed = next(p for p in plan.predictions if p.work.key(p.mode) == key)
    assert layer_seconds(timed.work, rates, timed.mode) == (forward, backward)
    saved = tmp_path / "rates.json"
    rates.save(saved)
    assert type(rates).load(saved) == rates
    older = {k: v for k, v in json.loads(saved.read_text()).items() if k != "dropout_seconds"}
    saved.write_text(json.dumps(older))  # a file from before dropout had a term: its other_seconds hold it
    assert type(rates).load(saved).dropout_seconds == 0.0

    # A tensor-parallel shape is timed split over as many processes as its tp (here 2 gloo processes), each with
    # its share of the layer and the run's all-reduces; a CPU cannot time it for a plan (no GPUs to split over).
    tp_config = tiny_config(tmp_path, "parallel.pp=1", "parallel.tp=2", "parallel.n_microbatches=1")
    split = next(p for p in make_plan(tp_config, 2).predictions if p.work.tp == 2)
    assert not calibrate.can_time(split.work, torch.device("cpu"))
    ((key, (forward, backward)),) = calibrate.time_tp_layers(tp_config, [(split.work, split.mode)], 2).items()
    # (a plan's layers run as "auto" resolves them on its GPUs; a CPU times graphed layers compiled)
    cpu_mode = calibrate.timed_mode(split.mode, torch.device("cpu"))
    assert key == split.work.key(cpu_mode) and forward > 0 and backward > 0
    # Rates from before timed tp shapes alone (split_tp_timings false): the model predicts those shapes instead.
    timed_alone = dataclasses.replace(rates, layer_seconds={key: (1.0, 1.0)}, split_tp_timings=False)
    assert layer_seconds(split.work, timed_alone, cpu_mode) != (1.0, 1.0)
    split_rates = calibrate.with_timings(GpuRates(), "split", {key: (1.0, 1.0)}, [])
    assert layer_seconds(split.work, split_rates, cpu_mode) == (1.0, 1.0)
