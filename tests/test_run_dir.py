"""A run directory belongs to one run at a time, and nothing deletes or replaces what it did not create.

In-process: the lock, a stale lock, a finished run without checkpoints, the demo's directory, a full disk.
One multi-process run (marked slow) stops a launcher with SIGTERM, kills one with SIGKILL, and resumes with a
changed learning rate.
"""

from __future__ import annotations

import csv
import dataclasses
import errno
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipetune.checkpoint import CheckpointSettings, committed_checkpoints, find_resume_checkpoint, verify_files
from pipetune.cli import demo_dir, main
from pipetune.config import ConfigError, load_config
from pipetune.run_lock import (
    LAUNCH_FILE,
    LOCK_FILE,
    launch_id,
    lock_for_worker,
    lock_run_dir,
    record_launch,
    restarted_launch,
)
from pipetune.train import lr_factor
from tests.conftest import REPO, run_cli, tiny_config, write_config


def _train(config_file: Path, *args: str) -> int:
    return main(["train", "--config", str(config_file), "--quiet", *args])


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_locked_run_directory_refuses_a_second_run(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    config_file = write_config(tiny_config(run_dir, "train.lr=0.5"), tmp_path / "c.toml")
    with lock_run_dir(run_dir):  # as a running launcher holds it
        before = _files(run_dir)
        assert _train(config_file) == 2
        assert _files(run_dir) == before  # no config.toml written over the running run's
        err = capsys.readouterr().err
        assert f"output.dir = '{run_dir}' is in use by another run (process {os.getpid()} on " in err
        assert "wait for it to end, or choose another output.dir" in err
        assert lock_for_worker(run_dir, rank=0) is None  # this process's workers run inside its lock
        with monkeypatch.context() as patched:
            patched.setenv("PIPETUNE_RUN_LOCK", "another launcher's token")
            with pytest.raises(ConfigError, match="is no longer locked by this worker's launcher"):
                lock_for_worker(run_dir, rank=0)
    assert not (run_dir / LOCK_FILE).exists() and "PIPETUNE_RUN_LOCK" not in os.environ


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 4194305, "host": "gone", "started": 1.5e9}))  # no flock
    with lock_run_dir(tmp_path):
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
    assert "note: taking over the lock of" in capsys.readouterr().err
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_fresh_start_never_replaces_a_finished_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "adapter").mkdir(parents=True)
    (run_dir / "adapter" / "adapter_model.safetensors").write_bytes(b"trained")
    (run_dir / "metrics.csv").write_text("strategy,epoch,step,loss\npp,0,1,2.0\n")
    config_file = write_config(tiny_config(run_dir, "parallel.pp=1"), tmp_path / "c.toml")
    before = _files(run_dir)

    assert _train(config_file) == 2
    assert "holds an earlier run (adapter and metrics.csv) without checkpoints to continue from" in (
        capsys.readouterr().err
    )
    assert _train(config_file, "--resume") == 2
    assert "holds a finished run's adapter/ but no checkpoint to continue from" in capsys.readouterr().err
    assert _files(run_dir) == before


def test_a_restart_continues_only_what_its_own_launch_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun restarts a group after any failure, a refused start (exit 2) included. The restarted attempt skips
    the fresh-start refusal only where its own launch's first attempt passed it (rank 0 recorded the launch)."""
    finished = tmp_path / "finished"
    (finished / "adapter").mkdir(parents=True)
    (finished / "metrics.csv").write_text("strategy,epoch,step,loss\npp,0,500,0.1\n")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-b")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # launch B's attempt 0 was refused there
    settings = CheckpointSettings.of(tiny_config(finished, "parallel.pp=1"))  # train.resume = "never"
    for recorded in (None, "run launch-a"):  # no record, then an earlier launch's
        if recorded:
            (finished / LAUNCH_FILE).write_text(json.dumps({"launch": recorded}))
        assert not restarted_launch(finished)
        with pytest.raises(ConfigError, match=r"holds an earlier run \(adapter and metrics.csv\) without checkpoints"):
            find_resume_checkpoint(settings, restarted_launch(finished))
    (finished / "checkpoints" / "step-2").mkdir(parents=True)
    (finished / "checkpoints" / "step-2" / "COMMITTED").write_text(json.dumps({"step": 2, "world_size": 1}))
    with pytest.raises(ConfigError, match=r"already holds checkpoints of an earlier run \(newest: step-2\)"):
        find_resume_checkpoint(settings, restarted_launch(finished))

    # Launch B's attempt 0 passed in a new directory and wrote there: its restart continues that.
    mine = tmp_path / "mine"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert not restarted_launch(mine)
    record_launch(mine)
    (mine / "metrics.csv").write_text("strategy,epoch,step,loss\npp,0,1,2.0\n")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restarted_launch(mine)
    assert find_resume_checkpoint(CheckpointSettings.of(tiny_config(mine)), restarted_launch(mine)) is None

    # torchrun's default rendezvous id names no launch: its agent does. Nothing is recorded without restarts.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launch_id() == launch_id() and launch_id().startswith(f"agent {os.getppid()} on ")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    record_launch(tmp_path / "no-restarts")
    assert not (tmp_path / "no-restarts" / LAUNCH_FILE).exists()


def test_the_demo_writes_only_into_a_new_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    mine = tmp_path / "mine"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "checkpoints" / "keep").write_text("not the demo's")
    assert main(["demo", "--out", str(mine)]) == 2
    assert "exists and is not empty; the demo writes only into a new directory" in capsys.readouterr().err
    assert (mine / "checkpoints" / "keep").read_text() == "not the demo's"

    monkeypatch.chdir(tmp_path)
    assert demo_dir(None) == Path("runs/demo")
    Path("runs/demo").mkdir(parents=True)
    assert demo_dir(None) == Path("runs/demo")  # empty: still new
    Path("runs/demo/metrics.csv").write_text("an earlier demo")
    assert demo_dir(None) == Path("runs/demo-2")


def test_a_full_disk_ends_the_run_with_one_line_and_keeps_what_was_committed(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second checkpoint's first file is written to /dev/full (through its temporary name: one process, so
    its pid is this one's): the write fails with ENOSPC as on a full disk. The same run profiles its first step
    (PIPETUNE_PROFILE_STEP, for diagnosis) and writes its trace (PIPETUNE_PROFILE_TRACE)."""
    monkeypatch.setenv("PIPETUNE_PROFILE_STEP", "1")
    monkeypatch.setenv("PIPETUNE_PROFILE_TRACE", str(tmp_path / "traces"))
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "parallel.pp=1", "train.max_steps=2", "train.save_every=1")
    step2 = run_dir / "checkpoints" / "step-2"
    step2.mkdir(parents=True)
    (step2 / f".adapter.rank0.safetensors.{os.getpid()}.tmp").symlink_to("/dev/full")

    with pytest.raises(SystemExit) as stopped:
        _train(write_config(config, tmp_path / "c.toml"))
    assert stopped.value.code == 1
    out, err = capsys.readouterr()
    assert out.count("rank 0 profile of step 1 by self_cpu_time_total") == 1, out  # step 1 only
    with gzip.open(tmp_path / "traces" / "trace-rank0.json.gz") as trace:
        assert json.load(trace)["traceEvents"]
    assert err.count("pipetune: error:") == 1 and "Traceback" not in err
    assert f"rank 0: no space left on the device writing {step2 / 'adapter.rank0.safetensors'}; " in err
    assert "committed checkpoints are kept: free space, then continue with --resume" in err
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]  # the temporary file is gone
    assert [c.step for c in committed_checkpoints(run_dir)] == [1]
    verify_files(committed_checkpoints(run_dir)[0])


def test_a_lock_path_that_is_a_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(ConfigError) as refused:
        lock_run_dir(tmp_path)
    assert str(refused.value) == (
        f"{tmp_path / LOCK_FILE} is a directory, not pipetune's lock file; remove it (pipetune keeps nothing there), "
        "or choose another output.dir"
    )


def test_a_stop_signal_that_torch_turns_into_another_error_is_still_a_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """SIGTERM on the first line of torch's metrics wrapper surfaces as an UnboundLocalError raised while handling
    the agent's SignalException: still one line and exit 128 + 15. Any other error is not taken for a stop."""
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from pipetune.launch import launch_local

    def agent(stopped: bool):
        def run(*argv: str) -> None:
            try:
                if stopped:
                    raise SignalException("stopped", signal.SIGTERM)
                raise KeyError("a worker's own failure")
            finally:
                raise UnboundLocalError("cannot access local variable 'start'")

        return lambda *config: run

    config = tiny_config(tmp_path / "run")
    monkeypatch.setattr(launcher_api, "elastic_launch", agent(stopped=True))
    assert launch_local(config, 2) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == (
        "pipetune: error: stopped by SIGTERM; no checkpoint was committed: continue with --resume\n"
    )
    monkeypatch.setattr(launcher_api, "elastic_launch", agent(stopped=False))
    with pytest.raises(UnboundLocalError):
        launch_local(config, 2)


def test_a_config_error_on_a_rank_other_than_0_is_said_by_the_launcher(tmp_path: Path) -> None:
    """Rank 0 says its own ConfigError; one that only another rank reached (rank 0 then lost its peer) is said by
    the launcher from that rank's ending, with exit code 2, not as "worker 1 failed; its output is above"."""
    from types import SimpleNamespace

    from pipetune.launch import failure_report
    from pipetune.worker import Ending

    def failed(exitcode: int, ending: Ending | None) -> SimpleNamespace:
        data = {"pipetune": dataclasses.asdict(ending)} if ending else {}
        return SimpleNamespace(exitcode=exitcode, error_file_data=data, timestamp=0)

    config = Ending("config", 1, "rank 1: data.max_length = 8 cannot hold the chat template")
    lost = Ending("peer lost", 0, "rank 0 lost a peer in the validation")
    assert failure_report({0: failed(1, lost), 1: failed(2, config)}, tmp_path) == (
        ["pipetune: error: rank 1: data.max_length = 8 cannot hold the chat template"],
        2,
    )
    lines, code = failure_report({0: failed(2, None), 1: failed(2, config)}, tmp_path)  # rank 0 said it: once
    assert lines == ["pipetune: worker 0 failed (exit code 2); its output is above"] and code == 1


@pytest.mark.parametrize("fault", ["SIGTERM", "disk full"])
def test_a_launcher_ended_while_it_tokenizes_says_the_run_had_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, fault: str
) -> None:
    """Before any worker starts, the launcher builds the token cache: SIGTERM to it, or a full disk under it, ends
    the run with one line saying nothing trained, and leaves no half-written cache (staging directory) behind."""
    from pipetune.data import cache

    monkeypatch.setenv("PIPETUNE_CACHE", str(tmp_path / "cache"))
    write_split = cache._write_split

    def fail_while_writing(directory: Path, *args: object) -> dict:
        if fault == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
            return write_split(directory, *args)
        raise OSError(errno.ENOSPC, "No space left on device")  # as a write to an open file: no file name

    def unhandled(signum: int, frame: object) -> None:  # SIGTERM's default would end pytest, not fail the test
        raise AssertionError("the launcher left SIGTERM unhandled while it tokenized")

    monkeypatch.setattr(cache, "_write_split", fail_while_writing)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        code = _train(write_config(tiny_config(tmp_path / "run"), tmp_path / "c.toml"))  # pp = 2: a launcher
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert err.count("pipetune: error:") == 1 and "Traceback" not in err, err
    if fault == "SIGTERM":
        assert code == 128 + signal.SIGTERM
        assert "pipetune: error: stopped by SIGTERM before training started; there is nothing to resume: run the " in (
            err
        )
    else:
        assert code == 1
        assert (
            f"pipetune: error: no space left on the device writing {tmp_path / 'cache' / 'data'} (the token cache); "
            "the run had not started: free space there, or set PIPETUNE_CACHE to a directory on a disk with room"
        ) in err
        assert "--resume" not in err
    assert list((tmp_path / "cache" / "data").iterdir()) == []  # no staging directory, no cache
    assert not (tmp_path / "run" / LOCK_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["disk full", "SIGTERM"])
def test_an_ending_of_every_rank_is_said_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str) -> None:
    """Both ranks write step 2's checkpoint to a full disk, or both get SIGTERM after step 2 (tests/faults.py): the
    launcher says it once, for both ranks."""
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "train.max_steps=3", "train.save_every=1")
    monkeypatch.setenv("PIPETUNE_TEST_DISK_FULL_AT" if fault == "disk full" else "PIPETUNE_TEST_TERM_AT", "2")
    config_file = str(write_config(config, tmp_path / "c.toml"))
    result = run_cli("train", "--config", config_file, "--quiet", check=False, faults=True)

    assert result.stderr.count("pipetune: error:") == 1 and "Traceback" not in result.stderr, result.stderr
    if fault == "disk full":
        assert result.returncode == 1, result.stderr
        said = (
            f"ranks 0, 1: no space left on the device writing into {run_dir / 'checkpoints' / 'step-2'}; "
            "committed checkpoints are kept: free space, then continue with --resume"
        )
        kept = [1]
    else:
        assert result.returncode == 128 + signal.SIGTERM, result.stderr
        said = (
            f"ranks 0, 1: stopped by SIGTERM; the newest committed checkpoint, {run_dir / 'checkpoints' / 'step-1'}, "
            "is kept: continue with --resume"
        )
        kept = [1]
    assert f"pipetune: error: {said}" in result.stderr, result.stderr
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    assert [c.step for c in committed_checkpoints(run_dir)] == kept
    verify_files(committed_checkpoints(run_dir)[0])


def _start(config_file: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "pipetune", "train", "--config", str(config_file), "--quiet", *args]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoint_after(run_dir: Path, step: int, launcher: subprocess.Popen) -> int:
    while not any(c.step > step for c in committed_checkpoints(run_dir)):
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.2)
    return committed_checkpoints(run_dir)[-1].step


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"  # a zombie is dead
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux's")
def test_killed_and_stopped_launchers_and_a_resume_with_a_new_lr(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, "train.epochs=100", "train.max_steps=200", "train.save_every=1")
    config_file = write_config(config, tmp_path / "c.toml")

    # SIGKILL to the launcher: its workers die with it instead of training on alone.
    launcher = _start(config_file)
    killed_at = _wait_for_checkpoint_after(run_dir, 0, launcher)
    workers = _children(launcher.pid)
    assert len(workers) == 2
    launcher.kill()
    launcher.communicate(timeout=600)
    deadline = time.monotonic() + 600  # a hang guard: the kernel kills them at once
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(pid) for pid in workers)
    assert (run_dir / LOCK_FILE).exists()  # left behind by the killed launcher

    # Resume with a new lr: the stale lock is taken over, the lr is applied and config.toml records it.
    resumed_at = committed_checkpoints(run_dir)[-1].step
    assert resumed_at >= killed_at
    launcher = _start(config_file, "--resume", "--set", "train.lr=1e-5")
    _wait_for_checkpoint_after(run_dir, resumed_at, launcher)
    with open(run_dir / "metrics.csv") as f:
        lrs = {int(row["step"]): float(row["lr"]) for row in csv.DictReader(f) if row["lr"]}  # not step 0's
    assert lrs[resumed_at + 1] == pytest.approx(1e-5 * lr_factor(resumed_at, 0, 200, 0.1), rel=1e-6)
    assert lrs[resumed_at] == pytest.approx(1e-3 * lr_factor(resumed_at - 1, 0, 200, 0.1), rel=1e-6)
    assert load_config(run_dir / "config.toml").train.lr == 1e-5

    # SIGTERM to the launcher: one line, exit 128 + 15, no temporary file, the committed checkpoints intact.
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=600)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "note: taking over the lock of" in err and "which ended without releasing it" in err
    assert err.count("pipetune: error:") == 1 and "Traceback" not in err, err
    assert "pipetune: error: stopped by SIGTERM; the newest committed checkpoint, " in err
    assert not [p for p in run_dir.rglob("*") if p.name.endswith(".tmp") or p.name == LOCK_FILE]
    verify_files(committed_checkpoints(run_dir)[-1])
