"""Metrics loggers besides metrics.csv: TensorBoard, MLflow and Weights & Biases, each through its own library.

`output.loggers` names them; `check_loggers` runs before any worker starts, so a missing package, or an
MLflow tracking server that does not answer within a few seconds, is one line with the fix, not a worker's
minutes of retries and tracebacks. Rank 0 writes every metrics row to each logger under grouped names: train/
(loss, lr, grad_norm, ...), val/ (val_loss -> val/loss), perf/ (tokens/s, step time) and mem/ (peak memory
per rank). A logger that fails mid-run costs one warning and is left out from then on; metrics.csv and the
run go on.
"""

from __future__ import annotations

import importlib.util
import os
import ssl
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from pipetune.config import Config, ConfigError

PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""Logger name -> the module it needs; the pip extra of the same name installs it."""
LOGGERS = ("csv", *PACKAGES)
PERF_COLUMNS = ("tokens_per_sec", "real_tokens_per_sec", "step_time_sec")
FAIL_SOONER = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
"""mlflow's defaults (7 retries with doubling waits, 120 s a request) hold rank 0, and so every rank at its next
collective, for minutes when the server goes away mid-run; these bound it to under a minute."""
SERVER_CHECK_SECONDS = 3.0
"""How long the MLflow tracking server has to answer before the run starts (mlflow itself retries for minutes)."""


def check_loggers(names: list[str]) -> None:
    """Unknown logger names and missing packages, as one ConfigError naming the pip extra to install."""
    unknown = [name for name in names if name not in LOGGERS]
    if unknown:
        raise ConfigError(f"output.loggers {unknown}: unknown logger; choose from {', '.join(LOGGERS)}")
    missing = [name for name in names if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:
        raise ConfigError(
            f"output.loggers {missing} need{'s' if len(missing) == 1 else ''} "
            f"{' and '.join(PACKAGES[name] for name in missing)}, which is not installed: "
            f"pip install 'pipetune[{','.join(missing)}]', or remove {' and '.join(missing)} from output.loggers"
        )
    if "mlflow" in names:
        check_mlflow_server(os.environ.get("MLFLOW_TRACKING_URI", ""))


def check_mlflow_server(uri: str, timeout: float = SERVER_CHECK_SECONDS) -> None:
    """An http(s) tracking URI must answer within `timeout` seconds (any HTTP answer will do: a 404 or 401 is a
    server); other URIs (unset: a local file store, file:, databricks) are left to mlflow."""
    if not uri.lower().startswith(("http://", "https://")):
        return
    outcome: list[str] = []

    def ask() -> None:
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
                outcome.append("")
        except urllib.error.HTTPError:  # the server answered
            outcome.append("")
        except urllib.error.URLError as e:
            answered = isinstance(e.reason, ssl.SSLError)  # TLS trouble is mlflow's to report: the host is there
            outcome.append("" if answered else str(e.reason))
        except Exception as e:  # a malformed URI (no host, a bad port), a reset connection, ...
            outcome.append(f"{type(e).__name__}: {e}")

    asking = threading.Thread(target=ask, daemon=True)  # bounds name resolution too, which ignores `timeout`
    asking.start()
    asking.join(timeout)
    problem = outcome[0] if outcome else f"no answer within {timeout:g} s"
    if problem:
        raise ConfigError(
            f"output.loggers has mlflow, but MLFLOW_TRACKING_URI = {uri!r} is unreachable ({problem}); start the "
            "tracking server there, unset MLFLOW_TRACKING_URI to log to a local file store (<run>/mlruns), or "
            "remove mlflow from output.loggers"
        )


def metric_name(column: str) -> str:
    """A metrics.csv column's grouped name: val_loss -> val/loss, peak_gb_rank0 -> mem/peak_gb_rank0, ..."""
    if column.startswith("val_"):
        return "val/" + column.removeprefix("val_")
    if column in PERF_COLUMNS:
        return "perf/" + column
    if "_gb" in column:
        return "mem/" + column
    return "train/" + column


def row_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row under their grouped names (step and epoch are the x axis, not metrics)."""
    return {
        metric_name(key): float(value)
        for key, value in row.items()
        if key not in ("step", "epoch") and isinstance(value, int | float) and not isinstance(value, bool)
    }


class Logger(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """Scalars under <run>/tensorboard; each row is flushed, so a killed run keeps its curves."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MLflowLogger:
    """An MLflow run: in $MLFLOW_TRACKING_URI when set, else in a local file store at <run>/mlruns.

    The experiment is $MLFLOW_EXPERIMENT_NAME or "pipetune", the run is named after the run directory,
    and every config key is a parameter (section.key)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, config: Config) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.7 refuses file stores without it
        for variable, value in FAIL_SOONER.items():  # unless set: the run waits on a lost server under a minute
            os.environ.setdefault(variable, value)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        self._client = MlflowClient(self.tracking_uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "pipetune")
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        self.run_id = self._client.create_run(experiment_id, run_name=run_dir.resolve().name).info.run_id
        params = [
            Param(f"{section}.{key}", str(value))
            for section, values in config.to_dict().items()
            for key, value in values.items()
        ]
        self._client.log_batch(self.run_id, params=params)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id, "FINISHED")


class WandbLogger:
    """A Weights & Biases run under <run>/wandb: offline unless $WANDB_MODE says otherwise (upload later with
    `wandb sync <run>/wandb/offline-run-*`); project $WANDB_PROJECT or "pipetune", the config as its config."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: Config) -> None:
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "pipetune"),
            name=run_dir.resolve().name,
            dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=config.to_dict(),
            settings=wandb.Settings(silent=True, console="off"),  # stdout stays ours (and train.log's)
        )

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class MetricLoggers:
    """The loggers of output.loggers other than csv (metrics.csv has its own writer); rank 0 only.

    A logger that raises is warned about once and dropped: a lost dashboard is no reason to lose the run."""

    def __init__(self, loggers: list[Logger]) -> None:
        self.loggers = loggers

    def write(self, row: dict[str, Any]) -> None:
        metrics = row_metrics(row)
        for logger in list(self.loggers):
            try:
                logger.write(int(row["step"]), metrics)
            except Exception as e:
                self._drop(logger, f"writing step {row['step']}", e)

    def close(self) -> None:
        for logger in list(self.loggers):
            try:
                logger.close()
            except Exception as e:
                self._drop(logger, "closing", e)
        self.loggers = []

    def _drop(self, logger: Logger, doing: str, error: Exception) -> None:
        self.loggers.remove(logger)
        name = getattr(logger, "name", type(logger).__name__)
        detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        print(
            f"pipetune: warning: output.loggers: {name} failed {doing} ({type(error).__name__}"
            f"{': ' + detail if detail else ''}); it is left out for the rest of the run, metrics.csv goes on",
            file=sys.stderr,
            flush=True,
        )


def open_loggers(config: Config, run_dir: Path, enabled: bool = True) -> MetricLoggers:
    """Start every logger of output.loggers (none when not enabled: ranks other than 0)."""
    if not enabled:
        return MetricLoggers([])
    check_loggers(config.output.loggers)
    names = config.output.loggers
    loggers: list[Logger] = []
    if "tensorboard" in names:
        loggers.append(TensorBoardLogger(run_dir))
    if "mlflow" in names:
        loggers.append(MLflowLogger(run_dir, config))
    if "wandb" in names:
        loggers.append(WandbLogger(run_dir, config))
    return MetricLoggers(loggers)
