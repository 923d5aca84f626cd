"""output.loggers: grouped metric names, TensorBoard and MLflow read back, W&B's calls, the package and server
checks, a logger failing mid-run."""

from __future__ import annotations

import csv
import http.server
import os
import socket
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from pipetune.config import Config, ConfigError
from pipetune.loggers import (
    FAIL_SOONER,
    SERVER_CHECK_SECONDS,
    MetricLoggers,
    check_loggers,
    check_mlflow_server,
    open_loggers,
    row_metrics,
)
from pipetune.metrics import MetricsLog
from pipetune.parallel.process_group import DistEnv

ROWS = [
    {"step": 0, "val_loss": 5.5},  # validation before the first step
    {"strategy": "pp", "epoch": 0, "step": 1, "loss": 5.0, "lr": 1e-3, "grad_norm": 2.0, "tokens_per_sec": 900.0,
     "peak_vram_gb": 0.9, "peak_gb_rank1": 0.7},
    {"strategy": "pp", "epoch": 0, "step": 2, "loss": 4.0, "lr": 5e-4, "grad_norm": 1.5, "tokens_per_sec": 1000.0,
     "peak_vram_gb": 0.9, "peak_gb_rank1": 0.8, "val_loss": 4.5},
]  # fmt: skip


def _config(*loggers: str) -> Config:
    config = Config()
    config.output.loggers = ["csv", *loggers]
    return config


def test_metric_names_are_grouped() -> None:
    assert row_metrics(ROWS[2]) == {
        "train/loss": 4.0,
        "train/lr": 5e-4,
        "train/grad_norm": 1.5,
        "perf/tokens_per_sec": 1000.0,
        "mem/peak_vram_gb": 0.9,
        "mem/peak_gb_rank1": 0.8,
        "val/loss": 4.5,
    }


def test_tensorboard_and_mlflow_get_every_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for variable in FAIL_SOONER:  # unset here, restored (unset) after the test
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    loggers = open_loggers(_config("tensorboard", "mlflow"), tmp_path)
    assert {variable: os.environ[variable] for variable in FAIL_SOONER} == FAIL_SOONER  # a lost server: no stall
    for row in ROWS:
        loggers.write(row)
    mlflow_logger = loggers.loggers[1]
    loggers.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"train/loss", "val/loss", "perf/tokens_per_sec", "mem/peak_gb_rank1"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(0, 5.5), (2, 4.5)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 5.0), (2, 4.0)]

    assert mlflow_logger.tracking_uri == (tmp_path / "mlruns").resolve().as_uri()  # the local file store
    client = MlflowClient(mlflow_logger.tracking_uri)
    run = client.get_run(mlflow_logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert run.data.params["train.lr"] == "0.0002" and run.data.params["parallel.schedule"] == "1f1b"
    history = client.get_metric_history(mlflow_logger.run_id, "val/loss")
    assert [(m.step, m.value) for m in history] == [(0, 5.5), (2, 4.5)]


def test_wandb_runs_offline_in_the_run_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B is an optional extra not installed for the tests: a stand-in module records what pipetune asks of it."""
    calls: list[tuple] = []

    class Run:
        def log(self, metrics: dict, step: int) -> None:
            calls.append(("log", step, metrics))

        def finish(self) -> None:
            calls.append(("finish",))

    stand_in = types.ModuleType("wandb")
    stand_in.Settings = lambda **kwargs: kwargs
    stand_in.init = lambda **kwargs: calls.append(("init", kwargs)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    monkeypatch.setattr("pipetune.loggers.check_loggers", lambda names: None)  # the stand-in is not installed
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = _config("wandb")
    loggers = open_loggers(config, tmp_path)
    for row in ROWS[:2]:
        loggers.write(row)
    loggers.close()
    (_, init), first, second, finish = calls
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path) and init["project"] == "pipetune"
    assert init["config"] == config.to_dict() and init["settings"]["console"] == "off"
    assert first == ("log", 0, {"val/loss": 5.5})
    assert second[:2] == ("log", 1) and second[2]["train/loss"] == 5.0 and finish == ("finish",)


def test_missing_logger_packages_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checked by preflight, before any worker starts (test_bad_input runs the launcher's path)."""
    real_find_spec = __import__("importlib.util").util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name: None if name in ("wandb", "mlflow") else real_find_spec(name)
    )
    with pytest.raises(ConfigError, match=r"need mlflow and wandb, .*pip install 'pipetune\[mlflow,wandb\]'"):
        check_loggers(["csv", "tensorboard", "mlflow", "wandb"])
    with pytest.raises(ConfigError, match=r"\['neptune'\]: unknown logger; choose from csv, tensorboard"):
        check_loggers(["neptune"])
    check_loggers(["csv", "tensorboard"])


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_mlflow_server_is_one_line_before_any_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlflow retries an unreachable server for minutes, then raises chained tracebacks: preflight asks first."""
    uri = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    started = time.monotonic()
    with pytest.raises(ConfigError) as raised:
        check_loggers(["csv", "mlflow"])
    assert time.monotonic() - started < SERVER_CHECK_SECONDS + 2
    message = str(raised.value)
    assert f"MLFLOW_TRACKING_URI = {uri!r} is unreachable" in message and "\n" not in message
    assert "start the tracking server" in message and "unset MLFLOW_TRACKING_URI" in message
    assert "remove mlflow from output.loggers" in message

    with socket.socket() as silent:  # accepts connections, never answers: the check still ends in time
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        started = time.monotonic()
        with pytest.raises(ConfigError, match="is unreachable"):
            check_mlflow_server(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.5)
        assert time.monotonic() - started < 2

    for without_network in ("", "file:///tmp/mlruns", "databricks"):  # a local store: nothing to ask
        check_mlflow_server(without_network)

    # any HTTP answer (here a 404 from a plain HTTP server) means the tracking server is there
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.handle_request, daemon=True).start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.server_address[1]}/")
        check_loggers(["csv", "mlflow"])
    finally:
        server.server_close()


class _Recording:
    name = "recording"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed = False

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True


class _FailsAtStep1(_Recording):
    name = "flaky"

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if step >= 1:
            raise ConnectionError("API request to http://127.0.0.1:9 failed\nwith a long chained traceback")
        super().write(step, metrics)


def test_a_logger_failing_mid_run_costs_one_warning_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    flaky, recording = _FailsAtStep1(), _Recording()
    monkeypatch.setattr("pipetune.metrics.open_loggers", lambda *args, **kwargs: MetricLoggers([flaky, recording]))
    config = _config()
    config.output.dir = str(tmp_path)
    log = MetricsLog(config, DistEnv(0, 2, 0, torch.device("cpu")), total_steps=2, resumed_at=None, quiet=True)
    for row in ROWS:
        log.write(row)
    log.close()

    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "pipetune: warning: output.loggers: flaky failed writing step 1 (ConnectionError: API request to "
        "http://127.0.0.1:9 failed); it is left out for the rest of the run, metrics.csv goes on"
    ]
    assert flaky.steps == [0] and not flaky.closed  # dropped: neither written to again nor closed
    assert recording.steps == [0, 1, 2] and recording.closed  # the other loggers go on
    with open(tmp_path / "metrics.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [0, 1, 2]
