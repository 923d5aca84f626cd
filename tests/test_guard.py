"""Guards: a non-finite step is skipped by every stage together; a peer that stops responding ends the run.

Faults come from the tests' entry (tests/faults.py): PIPETUNE_TEST_NAN_AT poisons one stage's
gradients, PIPETUNE_TEST_HANG_AT makes one rank stop responding.
"""

from __future__ import annotations

import csv
import math
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipetune.checkpoint import (
    CheckpointError,
    CheckpointSettings,
    Position,
    TrainState,
    committed_checkpoints,
    find_resume_checkpoint,
    save_checkpoint,
    verify_files,
)
from pipetune.metrics import MetricsWindow
from pipetune.parallel.gradients import bad_ranks, clip_global_grad_norm
from pipetune.parallel.process_group import DistEnv
from pipetune.train import lr_factor, too_many_skipped
from tests.conftest import run_cli, tiny_config, write_config


def test_grad_norm_flags_non_finite_values_and_leaves_such_gradients_alone() -> None:
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad, params[1].grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([4.0, 0.0, 0.0, 0.0])

    norm, flags = clip_global_grad_norm(params, 1.0, torch.device("cpu"), loss=torch.tensor(2.0))
    assert bad_ranks(flags) == [] and float(norm) == pytest.approx(5.0)
    assert float(torch.cat([p.grad for p in params]).norm()) == pytest.approx(1.0)  # clipped

    params[1].grad = torch.tensor([float("inf"), 0.0, 0.0, 0.0])
    _, flags = clip_global_grad_norm(params, 1.0, torch.device("cpu"))
    assert bad_ranks(flags) == [0]
    params[1].grad = torch.tensor([1.0, 0.0, 0.0, 0.0])
    _, flags = clip_global_grad_norm(params, 1.0, torch.device("cpu"), loss=torch.tensor(float("nan")))
    assert bad_ranks(flags) == [0]
    assert params[1].grad[0] == 1.0  # nothing was clipped by a non-finite norm


def _rows(run_dir: Path) -> dict[int, dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return {int(row["step"]): row for row in csv.DictReader(f)}


@pytest.mark.slow
def test_nan_on_a_middle_stage_is_skipped_by_all_then_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Skips are decided on the device and settled one step late, or before a row or checkpoint: steps 5 and 7
    are settled inside the next step, 2 and 6 before their row."""
    run_dir = tmp_path / "run"
    config = tiny_config(
        run_dir,
        "parallel.pp=3",
        "train.epochs=2",
        "train.max_steps=8",
        "train.log_every=2",
        "train.save_every=2",
        "train.max_skipped_steps=3",
        "train.warmup_steps=0",
    )
    # Stage 1 of 3 (a stage before it, one after) gets NaN gradients at step 2 (once), then at steps 5, 6, 7 (three
    # in a row: stop).
    monkeypatch.setenv("PIPETUNE_TEST_NAN_AT", "1:2,5,6,7")
    result = run_cli(
        "train", "--config", str(write_config(config, tmp_path / "c.toml")), "--quiet", check=False, faults=True
    )

    assert result.returncode != 0
    assert "step 2: non-finite loss or gradient norm on stage 1; optimizer step skipped (1 in a row" in result.stderr
    assert "step 5: non-finite loss or gradient norm on stage 1; optimizer step skipped (1 in a row" in result.stderr
    assert "step 7: non-finite loss or gradient norm on stage 1; optimizer step skipped (3 in a row" in result.stderr
    assert "3 optimizer steps in a row (up to step 7) had a non-finite loss or gradient norm; stopping" in result.stderr
    assert result.stderr.count("; stopping.") == 1  # said once, by rank 0
    assert (  # steps 5 and 6 were skipped: step-6 holds the weights of step 4
        f"The newest committed checkpoint, {run_dir / 'checkpoints' / 'step-6'}, holds finite weights from before them "
        "(those of step 4: a skipped step changes no weight). Lower train.lr (applied on resume" in result.stderr
    )

    rows = _rows(run_dir)
    assert sorted(rows) == [0, 2, 4, 6]  # step 0: validation; stopped in step 8, before its row or checkpoint
    assert math.isfinite(float(rows[2]["loss"])) and math.isfinite(float(rows[4]["loss"]))  # step 2's left out
    assert math.isnan(float(rows[6]["loss"]))  # both of its steps skipped
    # The schedule advanced after steps 1 and 3 only: step 4 ran at the schedule's third lr.
    assert float(rows[4]["lr"]) == pytest.approx(config.train.lr * lr_factor(2, 0, 8, config.train.min_lr_ratio))

    # The last committed checkpoint is intact, and a skipped step changed no adapter weight.
    checkpoints = committed_checkpoints(run_dir)
    assert [c.step for c in checkpoints] == [4, 6]
    verify_files(checkpoints[-1])
    for rank in range(3):
        before = load_file(checkpoints[0].path / f"adapter.rank{rank}.safetensors")
        after = load_file(checkpoints[1].path / f"adapter.rank{rank}.safetensors")
        assert all(torch.equal(before[name], after[name]) for name in before)
        assert all(torch.isfinite(t).all() for t in after.values())


@pytest.mark.slow
def test_a_peer_that_stops_responding_ends_the_run_with_rank_and_collective(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tiny_config(tmp_path / "run", "parallel.timeout_s=10")
    monkeypatch.setenv("PIPETUNE_TEST_HANG_AT", "1:2")  # rank 1 sleeps before step 2's gradient-norm all-reduce
    result = run_cli(
        "train", "--config", str(write_config(config, tmp_path / "c.toml")), "--quiet", check=False, faults=True
    )

    assert result.returncode != 0
    assert "rank 0 waited 10 s for a peer in the gradient-norm all-reduce of step 2 and gave up" in result.stderr
    assert "raise parallel.timeout_s" in result.stderr


def test_validation_and_checkpoint_time_stay_out_of_the_step_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The row after a validation (or a checkpoint) reports training alone in step_time_sec and tokens/s."""
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    env, window = DistEnv(0, 1, 0, torch.device("cpu")), MetricsWindow(torch.device("cpu"))

    def step() -> None:
        now[0] += 2.0
        window.add(torch.tensor(1.0), torch.tensor(1.0), 100, 80, 10, skipped=False)

    step()
    row = window.flush(env, holds_loss=True)
    assert (row["step_time_sec"], row["tokens_per_sec"]) == (2.0, 50.0)
    started, now[0] = now[0], now[0] + 30.0  # a validation
    assert window.exclude_since(started) == 30.0
    started, now[0] = now[0], now[0] + 5.0  # a checkpoint
    window.exclude_since(started)
    step()
    step()
    row = window.flush(env, holds_loss=True)
    assert (row["step_time_sec"], row["tokens_per_sec"]) == (2.0, 50.0)


def test_a_rank_that_fails_says_why_at_once_and_leaves_without_teardown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """An unexpected error on one rank of several: its traceback right away, then out without destroying the
    process group, whose NCCL teardown can wait forever on a peer blocked in a transfer with it (a pipeline
    stage's send on 2x H200 hung so until the bench's limit, and said nothing)."""
    from pipetune import launch, train

    def fail(config, env, quiet, status):
        status.step, status.phase = 1, "pipeline send/recv"
        raise RuntimeError("stage 5 has no gradient to send")

    events = []

    def exit_now(code: int):  # os._exit: what follows never runs; here it does, after the exit is recorded
        events.append(("exit", code))
        raise SystemExit(code)

    monkeypatch.setattr(launch, "init_distributed", lambda *_: DistEnv(1, 2, 1, torch.device("cpu")))
    monkeypatch.setattr(train, "train", fail)
    monkeypatch.setattr(launch, "exit_skipping_teardown", exit_now)
    monkeypatch.setattr(launch, "close_distributed", lambda: events.append("teardown"))
    with pytest.raises(SystemExit):
        launch.run_training(tiny_config(tmp_path / "run"))
    assert events[0] == ("exit", 1)
    err = capsys.readouterr().err
    assert "pipetune: rank 1 failed in the pipeline send/recv of step 1:" in err
    assert "RuntimeError: stage 5 has no gradient to send" in err  # the traceback


def _checkpoint(run_dir: Path, step: int, value: float, skipped_in_row: int = 0) -> None:
    """A committed one-process checkpoint at `step` whose adapter tensor holds `value` (1e12: a diverged run)."""
    param = torch.nn.Parameter(torch.full((2, 3), 0.01))
    with torch.no_grad():
        param[0, 0] = value
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = TrainState({"base_model.model.layers.0.q_proj.lora_A.weight": param}, optimizer, scheduler, {param: "p"})
    settings = CheckpointSettings.of(tiny_config(run_dir, "parallel.pp=1", "train.keep_checkpoints=5"))
    save_checkpoint(settings, state, Position(step, 0, step, skipped_in_row), 0, 1)


def test_the_non_finite_stop_names_a_checkpoint_whose_weights_are_finite_and_sane(tmp_path: Path) -> None:
    """A run that diverged before its steps turned non-finite: the newest checkpoint's adapter holds 1e12. Resuming
    it with a lower lr stops again at once, so the advice names the newest sane one, and a resume of the diverged
    one is refused with the same advice."""
    run_dir = tmp_path / "run"
    _checkpoint(run_dir, 2, 0.3)
    _checkpoint(run_dir, 4, 1e12)
    _checkpoint(run_dir, 6, 1e12, skipped_in_row=1)  # step 6 skipped: the weights of step 5
    message = str(too_many_skipped(run_dir, 3, 8))
    step2 = run_dir / "checkpoints" / "step-2"
    assert "3 optimizer steps in a row (up to step 8) had a non-finite loss or gradient norm; stopping." in message
    assert "step-6: its adapter holds values up to 1.0e+12 (base_model.model.layers.0.q_proj.lora_A.weight)" in message
    assert f"{step2} holds finite weights (those of step 2): move step-4, step-6 out of {run_dir / 'checkpoints'}" in (
        message
    )
    with pytest.raises(CheckpointError) as refused:
        find_resume_checkpoint(CheckpointSettings.of(tiny_config(run_dir, 'train.resume="auto"')))
    assert f"checkpoint {run_dir / 'checkpoints' / 'step-6'} cannot be resumed: its adapter holds values up to" in (
        str(refused.value)
    )
    assert f"{step2} holds finite weights (those of step 2): move step-4, step-6 out of" in str(refused.value)

    shutil.rmtree(step2)  # none sane left: start over
    _checkpoint(run_dir, 7, float("nan"))
    message = str(too_many_skipped(run_dir, 3, 10))
    assert "step-7: its adapter holds non-finite values" in message
    assert "no committed checkpoint holds finite, sane weights: start over with a lower train.lr in another" in message
