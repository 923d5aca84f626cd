"""What a run leaves for its user besides the metrics: rank 0's output in train.log, and the summary it ends with.

`RunLog` copies everything rank 0 prints (stdout and stderr, warnings and tracebacks included) into
<run>/train.log, appending across resumes. `finish_run` prints the wall time, the final train and
validation losses, what the run directory holds and the commands to run next, and writes run.json
(wall time, final losses) for `pipetune report`.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import TextIO

from pipetune.files import read_metrics_rows

ENTRIES = {
    "adapter": "PEFT adapter: adapter_config.json + adapter_model.safetensors",
    "checkpoints": "resumable state (pipetune train --resume)",
    "config.toml": "the resolved config, every key",
    "data.json": "rows read, kept and skipped per split",
    "eval.json": "ROUGE and loss, base vs fine-tuned (pipetune eval)",
    "metrics.csv": "one row per logged step: loss, val_loss, lr, grad_norm, tokens/s, memory",
    "mlruns": "MLflow runs (mlflow ui --backend-store-uri <run>/mlruns)",
    "progress.jsonl": "each phase the run entered, timed",
    "prompt.json": "the prompt settings: system prompt, template tokens, cut rule, caps",
    "report": "pipetune report's charts and index.html",
    "run.json": "wall time and final losses",
    "speed.json": "every speed switch as the run resolved it, and why",
    "tensorboard": "TensorBoard scalars (tensorboard --logdir <run>/tensorboard)",
    "timeline.json": "one schedule step per rank, with the measured bubble",
    "timeline.png": "that step drawn",
    "train.log": "this output",
    "wandb": "Weights & Biases runs (offline: wandb sync <run>/wandb/offline-run-*)",
}
"""What each entry of a run directory is, for the summary."""

STARTED_ENV = "PIPETUNE_STARTED"
"""Set by the local launcher to its start time, so that a run's wall time counts the workers' start-up."""

_active: RunLog | None = None


class _Tee:
    """A text stream that writes to `terminal` and to the run's log file."""

    def __init__(self, terminal: TextIO, log: TextIO) -> None:
        self.terminal, self._log = terminal, log

    def write(self, text: str) -> int:
        self._log.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self._log.flush()
        self.terminal.flush()

    def __getattr__(self, name: str) -> object:  # isatty, fileno, encoding, ...: the terminal's
        return getattr(self.terminal, name)


class RunLog:
    """Within `with RunLog(path):` sys.stdout and sys.stderr also write to `path` (appended); no-op if not enabled."""

    def __init__(self, path: Path, enabled: bool = True) -> None:
        self.path, self.enabled = path, enabled
        self._file: TextIO | None = None
        self._saved: tuple[TextIO, TextIO] | None = None

    def __enter__(self) -> RunLog:
        global _active
        if not self.enabled:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a killed run keeps its lines
        command = shlex.join(["pipetune", *sys.argv[1:]])
        self._file.write(f"\n==> {time.strftime('%Y-%m-%d %H:%M:%S')} rank 0 of: {command}\n")
        self._saved = (sys.stdout, sys.stderr)
        sys.stdout, sys.stderr = _Tee(sys.stdout, self._file), _Tee(sys.stderr, self._file)
        _active = self
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        global _active
        if self._file is None:
            return
        if error is not None and not (isinstance(error, SystemExit) and error.code in (0, None)):
            if not isinstance(error, SystemExit):  # a SystemExit's reason was printed already
                self._file.write("".join(traceback.format_exception(kind, error, tb)))
        sys.stdout, sys.stderr = self._saved
        self._file.close()
        self._file, _active = None, None


def write_whole(text: str) -> None:
    """`text` and its newline on stdout in one write, flushed: under PYTHONUNBUFFERED print writes a text and its
    newline apart, and what two ranks print at once came out joined (a test's demo, once)."""
    sys.stdout.write(f"{text}\n")
    sys.stdout.flush()


def log_only(text: str) -> None:
    """Write to the active run log alone (what a terminal shows as a progress bar goes there as plain lines)."""
    if _active is not None and _active._file is not None:
        _active._file.write(text if text.endswith("\n") else text + "\n")


def terminal(stream: TextIO) -> TextIO:
    """The terminal stream behind a stream that a RunLog copies (for progress bars, kept out of train.log)."""
    return stream.terminal if isinstance(stream, _Tee) else stream


# --------------------------------------------------------------------------- the end of a run


def run_started() -> float:
    """When this run started: the local launcher's start time for its workers, else now."""
    if "WORLD_SIZE" in os.environ and STARTED_ENV in os.environ:
        return float(os.environ[STARTED_ENV])
    return time.time()


def finish_run(run_dir: Path, started: float, resumed_from: int | None = None, full: bool = True) -> str:
    """Write run.json and return the summary to print: wall time and final losses, then (`full`) the run
    directory's entries and the next commands."""
    wall = time.time() - started
    rows = _metrics_rows(run_dir / "metrics.csv")
    final = {column: _last(rows, column) for column in ("loss", "val_loss")}
    steps = int(float(rows[-1]["step"])) if rows else 0
    record = {
        "wall_time_s": round(wall, 1),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "steps": steps,
        "resumed_from_step": resumed_from,
        "final_loss": final["loss"][1] if final["loss"] else None,
        "final_val_loss": final["val_loss"][1] if final["val_loss"] else None,
    }
    (run_dir / "run.json").write_text(json.dumps(record, indent=1) + "\n")

    losses = []
    if final["loss"]:
        losses.append(f"train loss {final['loss'][1]:.4f} (step {final['loss'][0]})")
    if final["val_loss"]:
        losses.append(f"validation loss {final['val_loss'][1]:.4f} (step {final['val_loss'][0]})")
    lines = [f"\ndone: {steps} steps in {format_duration(wall)}" + (f"; {', '.join(losses)}" if losses else "")]
    if not full:
        return lines[0].lstrip()
    lines.append(f"\nrun directory {run_dir}:")
    entries = sorted(run_dir.iterdir(), key=lambda path: path.name)
    width = max((len(path.name) + path.is_dir() for path in entries), default=0)
    for path in entries:
        if path.name.startswith("."):
            continue
        name = path.name + ("/" if path.is_dir() else "")
        lines.append(f"  {name:<{width}}  {ENTRIES.get(path.name, '')}".rstrip())
    run = shlex.quote(str(run_dir))
    commands = [
        (f"pipetune eval --run {run}", "ROUGE and loss, base vs fine-tuned, on the validation split"),
        (f"pipetune report {run}", f"charts and one page: {run_dir / 'report' / 'index.html'}"),
        (
            f"pipetune summarize --adapter {shlex.quote(str(run_dir / 'adapter'))} "
            f"{shlex.quote(str(Path(__file__).parent / 'examples' / 'meeting.txt'))}",
            "summarize a sample meeting (or your own transcript)",
        ),
        (f"pipetune export --run {run} --out {shlex.quote(str(run_dir / 'export'))}", "for transformers + PEFT, vLLM"),
    ]
    width = max(len(command) for command, _ in commands)
    lines.append("\nnext:")
    lines += [f"  {command:<{width}}  # {what}" for command, what in commands]
    return "\n".join(lines)


def format_duration(seconds: float) -> str:
    """42.0 -> '42.0 s', 102 -> '1 min 42 s', 7300 -> '2 h 1 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _metrics_rows(path: Path) -> list[dict[str, str]]:
    return read_metrics_rows(path)[0] if path.is_file() else []


def _last(rows: list[dict[str, str]], column: str) -> tuple[int, float] | None:
    """(step, value) of the last row where `column` holds a finite number."""
    for row in reversed(rows):
        try:
            value = float(row.get(column) or "nan")
        except ValueError:
            continue
        if math.isfinite(value):
            return int(row["step"]), value
    return None
