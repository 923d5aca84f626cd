"""train.log copies rank 0's output (tracebacks included); the summary a run ends with, and run.json."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from pipetune.metrics import MetricsWriter
from pipetune.run_log import RunLog, finish_run, format_duration, log_only, terminal


def test_run_log_copies_stdout_stderr_and_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run" / "train.log"
    with pytest.raises(ValueError), RunLog(path):
        print("to stdout")
        print("to stderr", file=sys.stderr)
        assert terminal(sys.stdout) is not sys.stdout  # what progress bars draw on: not the log
        log_only("step 1/3 | loss 2.0")
        raise ValueError("the run failed")
    assert sys.stdout is terminal(sys.stdout)  # restored
    seen = capsys.readouterr()
    assert seen.out == "to stdout\n" and seen.err == "to stderr\n"  # the terminal gets what it got before
    log = path.read_text()
    assert log.index("to stdout") < log.index("to stderr") < log.index("step 1/3") < log.index("Traceback")
    assert "ValueError: the run failed" in log

    with RunLog(path):  # a resumed run appends
        print("second attempt")
    assert path.read_text().startswith(log) and path.read_text().count("==> ") == 2
    with RunLog(tmp_path / "other.log", enabled=False):  # ranks other than 0
        print("not logged")
    assert not (tmp_path / "other.log").exists()


def test_finish_run_summarizes_and_writes_run_json(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.csv", n_ranks=2)
    writer.write({"strategy": "pp", "epoch": 0, "step": 0, "val_loss": 6.0})
    writer.write({"strategy": "pp", "epoch": 0, "step": 10, "loss": 3.5, "val_loss": 3.25})
    writer.write({"strategy": "pp", "epoch": 1, "step": 20, "loss": 2.5})
    writer.close()
    (tmp_path / "adapter").mkdir()
    summary = finish_run(tmp_path, time.time() - 102)
    record = json.loads((tmp_path / "run.json").read_text())
    assert "done: 20 steps in 1 min 42 s; train loss 2.5000 (step 20), validation loss 3.2500 (step 10)" in summary
    assert "  adapter/  " in summary and "PEFT adapter" in summary and "metrics.csv" in summary
    assert f"pipetune eval --run {tmp_path}" in summary and f"pipetune report {tmp_path}" in summary
    assert finish_run(tmp_path, time.time(), full=False).startswith("done: 20 steps in ")  # --quiet: one line
    assert (record["steps"], record["final_loss"], record["final_val_loss"]) == (20, 2.5, 3.25)
    assert 101 < record["wall_time_s"] < 110
    assert [format_duration(s) for s in (42.04, 102, 7300)] == ["42.0 s", "1 min 42 s", "2 h 1 min"]
