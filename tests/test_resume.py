"""Kill a rank mid-run and resume: metrics.csv and the adapter equal those of a run never interrupted.

Runs have 2 epochs of 4 optimizer steps, a checkpoint every 3 steps and at epoch ends (3, 4, 6, 8),
and LoRA dropout, so an exact match needs the dropout RNG of every rank restored (tests/conftest.py: TWO_EPOCHS,
the uninterrupted run `two_epoch_run`).
PIPETUNE_TEST_KILL_AT_STEP makes the highest rank SIGKILL itself (the tests' entry, tests/faults.py).
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipetune.checkpoint import MARKER, committed_checkpoints
from pipetune.config import Config, load_config
from pipetune.parallel.torch_compat import keep_rng_out_of_no_grad_forwards
from tests.conftest import TWO_EPOCHS, TWO_EPOCHS_NO_DROPOUT, run_cli, tiny_config, write_config
from tests.parity import assert_adapter_matches, learning_rates


def _metrics(run_dir: Path) -> list[tuple[str, str, str]]:
    """(epoch, step, loss) of every row, as written."""
    with open(run_dir / "metrics.csv") as f:
        return [(row["epoch"], row["step"], row["loss"]) for row in csv.DictReader(f)]


def _adapter_bytes(run_dir: Path) -> bytes:
    return (run_dir / "adapter" / "adapter_model.safetensors").read_bytes()


def _config_file(tmp: Path, name: str, *overrides: str) -> str:
    config = tiny_config(tmp / name, *TWO_EPOCHS, *overrides)
    return str(write_config(config, tmp / f"{name}.toml"))


def _train(config_file: str, *args: str, check: bool = True, faults: bool = False):
    return run_cli("train", "--config", config_file, "--quiet", *args, check=check, faults=faults)


@pytest.fixture(scope="module")
def reference(two_epoch_run: Path) -> Path:
    return two_epoch_run


@pytest.mark.slow
def test_reference_run_checkpoints_and_keeps_the_last_two(reference: Path) -> None:
    assert [step for _, step, _ in _metrics(reference)] == [str(s) for s in range(0, 9)]  # 0: validation only
    assert [c.step for c in committed_checkpoints(reference)] == [6, 8]
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == ["step-6", "step-8"]


@pytest.mark.slow
def test_killed_and_resumed_run_equals_the_uninterrupted_one(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Killed before step 6's checkpoint is committed, then resumed by hand with --max-restarts 1 and killed again,
    right after step 6's checkpoint is committed: the restarted group resumes from it and finishes the run."""
    config_file = _config_file(tmp_path, "run")
    run_dir = tmp_path / "run"
    monkeypatch.setenv("PIPETUNE_TEST_KILL_AT_STEP", "6")  # before step 6's checkpoint is committed
    killed = _train(config_file, check=False, faults=True)
    assert killed.returncode != 0
    # What happened, not a hang: the survivor's line when its collective fails first, else (the launcher's monitor
    # stops it first: a race, seen once) the launcher's line naming the killed worker.
    assert "lost a peer" in killed.stderr or "rank 1 was killed by SIGKILL" in killed.stderr, killed.stderr[-2000:]
    assert [c.step for c in committed_checkpoints(run_dir)] == [3, 4]  # a part-written step-6 does not count
    assert not (run_dir / "adapter").exists()

    monkeypatch.setenv("PIPETUNE_TEST_KILL_AT_STEP", "6:saved")  # fires in the resumed group's first attempt only
    agent = logging.getLogger("torch.distributed.elastic")  # the launcher's (this process's) torch agent
    agent.addHandler(caplog.handler)
    try:
        resumed = run_cli("train", "--config", config_file, "--resume", "--max-restarts", "1", faults=True)
    finally:
        agent.removeHandler(caplog.handler)
    assert f"resumed from {run_dir / 'checkpoints' / 'step-4'} at step 4" in resumed.stdout
    # A rank really died (SIGKILL): the agent logs it. (Its peer's own line, "lost a peer", is there only when the
    # peer sees the closed connection before the launcher's monitor stops it: a race, which failed a full run.)
    assert "(exitcode: -9) local_rank: 1" in caplog.text, caplog.text
    assert f"resumed from {run_dir / 'checkpoints' / 'step-6'} at step 6" in resumed.stdout

    assert _metrics(run_dir) == _metrics(reference)  # every row once, losses identical
    assert _adapter_bytes(run_dir) == _adapter_bytes(reference)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-6", "step-8"]


INTERLEAVED = ['parallel.schedule="interleaved_1f1b"', "parallel.stages_per_rank=2"]


def two_process_configs(tmp: Path) -> dict[str, tuple[Config, dict[Path, Path]]]:
    """The run that tests/conftest.py trains after the shared ones (tmp holds both): the pp=2 run without dropout
    as it stood at step 6 (its checkpoint there, metrics.csv, trimmed on resume), resumed under 4 stages."""
    reference, resumed = tmp / "two-epochs-no-dropout", tmp / "four-stages"
    copies = {
        reference / "metrics.csv": resumed / "metrics.csv",
        reference / "checkpoints" / "step-6": resumed / "checkpoints" / "step-6",
    }
    config = tiny_config(resumed, *TWO_EPOCHS_NO_DROPOUT, *INTERLEAVED, 'train.resume="auto"')
    return {"four-stages": (config, copies)}


@pytest.mark.slow
def test_checkpoint_of_two_stages_resumes_under_four(shared_runs: Path, two_process_runs: Path) -> None:
    """Adapter and optimizer state are keyed by full-model names: the layout may change on resume. Here from
    layers 0-1 and 2-3 on ranks 0 and 1 to one layer a stage, two stages a rank (interleaved: layers 0 and 2 on
    rank 0), on the same two processes.

    Without dropout (its random stream belongs to a rank, not a layer), the continued run matches: the reference
    is tests/conftest.py's two-epochs-no-dropout (TWO_EPOCHS_NO_DROPOUT: lora.dropout = 0, train.seed = 7).
    """
    reference = shared_runs / "two-epochs-no-dropout"
    assert load_config(reference / "config.toml").lora.dropout == 0.0
    assert [c.step for c in committed_checkpoints(reference)] == [6, 8]

    # The pp=2 run as it stood at step 6 (its checkpoint there, metrics.csv), resumed: two_process_configs.
    resumed = two_process_runs / "four-stages"
    assert json.loads((resumed / "run.json").read_text())["resumed_from_step"] == 6
    assert load_config(resumed / "config.toml").parallel.n_stages == 4

    expected = [float(loss) for _, step, loss in _metrics(reference) if int(step) > 6]
    got = [float(loss) for _, step, loss in _metrics(resumed) if int(step) > 6]
    assert len(got) == len(expected) == 2
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    ref_adapter, adapter = (
        load_file(reference / "adapter" / "adapter_model.safetensors"),
        load_file(resumed / "adapter" / "adapter_model.safetensors"),
    )
    # four stages sum in another order than two: rounding apart, as every parallel run (tests/parity.py)
    assert_adapter_matches(adapter, ref_adapter, learning_rates(reference))
    assert (resumed / "checkpoints" / "step-8" / MARKER).is_file()


def test_no_grad_forwards_leave_the_dropout_stream_alone() -> None:
    """What keeps torch < 2.12's shape-inference forward (no_grad, first step) from shifting dropout masks."""
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    keep_rng_out_of_no_grad_forwards(module, torch.device("cpu"))
    x = torch.ones(4, 8)
    torch.manual_seed(0)
    expected = module(x)
    torch.manual_seed(0)
    with torch.no_grad():
        module(x)  # draws a mask, then puts the stream back
    assert torch.equal(module(x), expected)
    assert not torch.equal(module(x), expected)  # training forwards do advance it
