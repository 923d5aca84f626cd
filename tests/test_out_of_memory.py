"""Running out of memory ends a run with one line (docs/errors.md): which rank, where, what it was allocating,
what to set; committed checkpoints are kept and --resume continues from them."""

from __future__ import annotations

import csv
import dataclasses
import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipetune.cli import main
from pipetune.data.batching import SampleStore
from pipetune.launch import failure_report
from pipetune.out_of_memory import GPU_ADVICE, HOST_ADVICE, PROGRESS_ENV, ProgressFile, memory_failure, read_progress
from pipetune.worker import Ending
from tests.conftest import tiny_config, write_config

WHERE = "the pipeline send/recv of step 3"


def _host_allocation_failure() -> RuntimeError:
    """torch's own error for an allocation the host cannot make (1 PB)."""
    try:
        torch.empty(10**15, dtype=torch.uint8)
    except RuntimeError as e:
        return e
    raise AssertionError("a petabyte was allocated")


def test_each_allocation_failure_is_one_line_naming_rank_step_size_and_what_to_set() -> None:
    gpu = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.10 GiB "
        "is free.\nOf the allocated memory 74.2 GiB is allocated by PyTorch"
    )
    assert memory_failure(gpu, 1, WHERE) == (
        f"rank 1 ran out of GPU memory in {WHERE}, allocating 2.00 GiB (CUDA out of memory. Tried to allocate 2.00 "
        f"GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.10 GiB is free.); {GPU_ADVICE}"
    )
    host = memory_failure(_host_allocation_failure(), 0, WHERE)
    assert host == (
        f"rank 0 ran out of host memory in {WHERE}, allocating 1000000.0 GB (DefaultCPUAllocator: can't allocate "
        f"memory: you tried to allocate 1000000000000000 bytes. Error code 12 (Cannot allocate memory)); {HOST_ADVICE}"
    )
    assert memory_failure(MemoryError(), 0, WHERE) == (
        f"rank 0 ran out of host memory in {WHERE}, allocating (MemoryError); {HOST_ADVICE}"
    )
    assert memory_failure(RuntimeError("shape mismatch"), 0, WHERE) is None
    try:  # a pipeline stage raises its own error from the allocator's
        raise RuntimeError("stage 0 failed in its forward") from gpu
    except RuntimeError as wrapped:
        assert memory_failure(wrapped, 1, WHERE).startswith(f"rank 1 ran out of GPU memory in {WHERE}, allocating 2.00")


def _failed(exitcode: int, ending: Ending | None, timestamp: int = 0) -> SimpleNamespace:
    data = {"pipetune": dataclasses.asdict(ending)} if ending else {}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, timestamp=timestamp)


@pytest.mark.parametrize("command", ["summarize", "eval", "export"])
def test_a_one_process_command_out_of_memory_is_one_line_with_its_own_advice(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """eval, summarize and export run in the user's process: an allocation that fails there is one line naming the
    command, the size and the flag to lower, not a traceback. Any other error still leaves with its traceback."""
    from pipetune.cli import COMMANDS

    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 48.00 GiB. GPU 0 has 79 GiB in all")
    failures = {"summarize": gpu, "eval": gpu, "export": _host_allocation_failure()}

    def fail(args):
        raise failures[command]

    monkeypatch.setattr(COMMANDS[command], "run", fail)
    args = {"summarize": ["--adapter", "a", "x.txt"], "eval": ["--run", "r"], "export": ["--run", "r", "--out", "o"]}
    assert main([command, *args[command]]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"`pipetune {command}`" in err and ("48.00 GiB" in err or "1000000.0 GB" in err)
    assert {"summarize": "--max-batch-tokens", "eval": "--batch-size", "export": "more memory"}[command] in err

    def other(args):
        raise RuntimeError("not memory")

    monkeypatch.setattr(COMMANDS[command], "run", other)
    with pytest.raises(RuntimeError, match="not memory"):
        main([command, *args[command]])


def test_the_launcher_names_a_worker_the_kernel_killed_and_an_allocation_that_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once `pipetune: worker 0 failed (exit code -9); its output is above`, and nothing above it."""
    monkeypatch.setenv(PROGRESS_ENV, str(tmp_path))
    progress = ProgressFile(0, lambda: WHERE, every_s=60)
    progress.close()
    assert read_progress(str(tmp_path), 0)["where"] == WHERE
    lost = Ending("peer lost", 1, "rank 1 lost a peer in the pipeline send/recv of step 3")
    failures = {0: _failed(-signal.SIGKILL, None), 1: _failed(1, lost, timestamp=1)}
    lines, code = failure_report(failures, tmp_path / "run", str(tmp_path), oom_kills=1)
    assert code == 1 and len(lines) == 1
    line = lines[0]
    assert line.startswith(
        f"pipetune: error: rank 0 was killed by the kernel's OOM killer: host memory ran out (exit code -9), last "
        f"seen in {WHERE}; its peak RSS was "
    ), line
    assert line.endswith(f"; {HOST_ADVICE}; no checkpoint was committed yet: run the same command again to start over")
    unknown = failure_report(failures, tmp_path / "run", None, oom_kills=None)[0][0]
    assert "rank 0 was killed by SIGKILL, most likely by the kernel's OOM killer (host memory ran out) (exit code" in (
        unknown
    )
    assert "last seen" not in unknown and "peak RSS" not in unknown  # no progress recorded: nothing said of it
    oom = Ending("out of memory", 1, f"rank 1 ran out of GPU memory in {WHERE}, allocating 2.00 GiB (...); ...")
    assert failure_report({0: _failed(1, lost), 1: _failed(1, oom)}, tmp_path) == ([f"pipetune: error: {oom.line}"], 1)


def test_a_host_allocation_failure_in_a_step_is_one_line_and_the_run_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """One process, a checkpoint every step: step 2's batch cannot be allocated; step-1 stays, --resume finishes."""
    run_dir = tmp_path / "run"
    config = tiny_config(
        run_dir, "parallel.pp=1", 'parallel.strategy="single"', "train.max_steps=2", "data.synthetic_validation=0"
    )
    config_file = str(write_config(config, tmp_path / "c.toml"))
    batch = SampleStore.batch

    def batch_then_fail(self: SampleStore, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        if (run_dir / "checkpoints" / "step-1" / "COMMITTED").exists():  # step 2's first batch
            raise _host_allocation_failure()
        return batch(self, *args)

    monkeypatch.setattr(SampleStore, "batch", batch_then_fail)
    with pytest.raises(SystemExit) as ended:  # as a process ends: `python -m pipetune` exits with it
        main(["train", "--config", config_file, "--quiet", "--set", "train.save_every=1"])
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("pipetune: error:") == 1, err
    assert (
        "pipetune: error: rank 0 ran out of host memory in the pipeline send/recv of step 2, allocating 1000000.0 GB "
        "(DefaultCPUAllocator: can't allocate memory"
    ) in err
    assert err.rstrip().endswith(
        f"the newest committed checkpoint, {run_dir / 'checkpoints' / 'step-1'}, is kept: continue with --resume"
    )
    monkeypatch.setattr(SampleStore, "batch", batch)
    assert main(["train", "--config", config_file, "--quiet", "--set", "train.save_every=1", "--resume"]) == 0
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [row["step"] for row in rows] == ["1", "2"], rows  # steps 1 and 2 once each
    assert json.loads((run_dir / "checkpoints" / "step-2" / "COMMITTED").read_text())["step"] == 2


def test_a_cuda_out_of_memory_on_one_rank_of_several_is_one_line_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Once the raw torch.OutOfMemoryError traceback (Qwen3-4B on one H100, step 2): rank 1's line, exit code 1."""
    from pipetune import launch, train
    from pipetune.parallel.process_group import DistEnv

    def out_of_memory(config, env, quiet, status):
        status.step, status.phase = 2, "pipeline send/recv"
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.25 GiB. GPU 0 has a total capacity")

    monkeypatch.setattr(launch, "init_distributed", lambda *_: DistEnv(1, 2, 1, torch.device("cpu")))
    monkeypatch.setattr(train, "train", out_of_memory)
    monkeypatch.setattr(launch, "close_distributed", lambda: None)

    def exit_now(code: int) -> None:  # a crash's way out (os._exit), here an exception that ends only the test
        raise SystemExit(code)

    monkeypatch.setattr(launch, "exit_skipping_teardown", exit_now)
    with pytest.raises(SystemExit) as ended:
        launch.run_training(tiny_config(tmp_path / "run"))
    assert ended.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("pipetune: error:") == 1, err
    assert err.startswith(
        "pipetune: error: rank 1 ran out of GPU memory in the pipeline send/recv of step 2, allocating 3.25 GiB "
    ), err
    assert f"{GPU_ADVICE}; no checkpoint was committed yet" in err
