"""Charts and one HTML page for one or more run directories, overlaid so runs can be compared.

    pipetune report runs/demo
    pipetune report runs/pp2-1f1b runs/pp2-gpipe --out reports/schedules

Reads what runs write: metrics.csv (loss and validation loss from step 0, learning rate, gradient norm,
tokens/s, peak memory per rank), config.toml (the highlights in the table), run.json (wall time), data.json
(rows read, kept, skipped), eval.json (ROUGE and loss of base and fine-tuned model, example summaries) and
bench.json (a list of benchmark rows). The charts sit in a grid; each run's evaluation, examples and data
counts follow.

Look at the page as a browser renders it (Debian: apt-get install chromium):

    chromium --headless --no-sandbox --window-size=1400,2400 --screenshot=report.png runs/demo/report/index.html
"""

from __future__ import annotations

import html
import json
import math
import statistics
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetune.config import ConfigError
from pipetune.files import rank_columns, read_metrics_rows
from pipetune.run_log import format_duration

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


@dataclass
class RunData:
    """What one run directory holds, as far as the report needs it."""

    path: Path
    label: str
    """Legend and table name: the directory name, with parents added when two runs share it."""
    rows: list[dict[str, Any]] = field(default_factory=list)
    """metrics.csv rows; numbers parsed, empty cells dropped."""
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    """config.toml as read (raw TOML: a newer run's keys do not break the report)."""
    bench: list[dict[str, Any]] = field(default_factory=list)
    evaluation: dict[str, Any] = field(default_factory=dict)
    """eval.json: base and fine-tuned scores, example summaries."""
    info: dict[str, Any] = field(default_factory=dict)
    """run.json: wall time, final losses."""
    data: dict[str, Any] = field(default_factory=dict)
    """data.json: rows read, kept and skipped per split."""

    def series(self, column: str) -> tuple[list[float], list[float]]:
        """(steps, values) of the rows where `column` holds a number."""
        points = [(row["step"], row[column]) for row in self.rows if _is_number(row.get(column))]
        return [p[0] for p in points], [p[1] for p in points]

    def rank_peaks(self) -> list[float]:
        """Highest peak memory (GB) of each rank over the run; [overall peak] for runs without per-rank columns."""
        columns = rank_columns({key for row in self.rows for key in row}, "peak_gb_rank")
        if not columns:
            _, values = self.series("peak_vram_gb")
            return [max(values)] if values else []
        return [max(self.series(column)[1], default=0.0) for column in columns]


def load_runs(run_dirs: list[str | Path]) -> list[RunData]:
    paths = [Path(p) for p in run_dirs]
    for path in paths:
        if not path.is_dir():
            raise ConfigError(f"run directory {str(path)!r} does not exist; give directories written by pipetune train")
        if not (path / "metrics.csv").is_file() and not (path / "bench.json").is_file():
            raise ConfigError(
                f"{str(path)!r} holds neither metrics.csv nor bench.json; give a run directory "
                "(pipetune train writes <output.dir>/metrics.csv)"
            )
    return [_load_run(path, label) for path, label in zip(paths, _labels(paths), strict=True)]


def _load_run(path: Path, label: str) -> RunData:
    run = RunData(path, label)
    if (path / "metrics.csv").is_file():
        rows, _, _ = read_metrics_rows(path / "metrics.csv")  # a damaged tail (a live or killed run) is left out
        run.rows = [{key: _parse(value) for key, value in raw.items() if key and value != ""} for raw in rows]
    if (path / "config.toml").is_file():
        run.config = tomllib.loads((path / "config.toml").read_text())
    if (path / "bench.json").is_file():
        bench = json.loads((path / "bench.json").read_text())
        run.bench = [entry for entry in bench if isinstance(entry, dict)] if isinstance(bench, list) else []
    for name, attribute in (("eval.json", "evaluation"), ("run.json", "info"), ("data.json", "data")):
        if (path / name).is_file():
            setattr(run, attribute, json.loads((path / name).read_text()))
    return run


def _labels(paths: list[Path]) -> list[str]:
    """The shortest path suffixes that tell the runs apart (runs/a/demo and runs/b/demo: a/demo, b/demo)."""
    parts = [path.resolve().parts for path in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(path) for path in paths]


def _parse(value: str) -> Any:
    try:
        return float(value)
    except ValueError:
        return value


def _is_number(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


# --------------------------------------------------------------------------- charts


def _figure(width: float = 7.0, height: float = 4.0) -> Any:
    """A matplotlib Figure drawn by the Agg canvas: no display, no pyplot global state."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "pipetune's charts need matplotlib, which is not installed: pip install 'pipetune[plots]'"
        ) from None
    figure = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def plot_loss(runs: list[RunData], path: Path) -> Path | None:
    """Train loss against step, validation loss dashed in the same color where metrics.csv has val_loss."""
    figure = _figure()
    axes = figure.subplots()
    drawn = False
    for color, run in zip(COLORS * 10, runs, strict=False):
        steps, values = run.series("loss")
        if steps:
            axes.plot(steps, values, color=color, label=f"{run.label} (train)" if _has(run, "val_loss") else run.label)
            drawn = True
        steps, values = run.series("val_loss")
        if steps:
            axes.plot(steps, values, color=color, linestyle="--", marker="o", markersize=3, label=f"{run.label} (val)")
    if not drawn:
        return None
    axes.set(xlabel="optimizer step", ylabel="loss (nats per summary token)", title="Loss")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path)
    return path


def plot_series(
    runs: list[RunData], column: str, path: Path, title: str, ylabel: str, from_zero: bool = False
) -> Path | None:
    """One metrics.csv column against step, a line per run; None when no run has it."""
    figure = _figure()
    axes = figure.subplots()
    drawn = False
    for color, run in zip(COLORS * 10, runs, strict=False):
        steps, values = run.series(column)
        if steps:
            axes.plot(steps, values, color=color, marker="o", markersize=3, label=run.label)
            drawn = True
    if not drawn:
        return None
    axes.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    if from_zero:
        axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(path)
    return path


def plot_rouge(runs: list[RunData], path: Path) -> Path | None:
    """ROUGE-1/2/Lsum of the base and the fine-tuned model (eval.json), a pair of bars per run and measure."""
    keys = next((_rouge_keys(run.evaluation["finetuned"]) for run in runs if run.evaluation.get("finetuned")), [])
    bars = []
    for run in runs:
        for model in ("base", "finetuned"):
            scores = run.evaluation.get(model)
            if keys and isinstance(scores, dict) and all(_is_number(_float(scores.get(key))) for key in keys):
                name = "base" if model == "base" else "fine-tuned"
                bars.append((f"{run.label} {name}" if len(runs) > 1 else name, [100 * scores[k] for k in keys]))
    if not bars:
        return None
    figure = _figure()
    axes = figure.subplots()
    width = 0.8 / len(bars)
    for index, (color, (label, values)) in enumerate(zip(COLORS * 10, bars, strict=False)):
        positions = [k - 0.4 + width * (index + 0.5) for k in range(len(keys))]
        drawn = axes.bar(positions, values, width=width, color=color, label=label)
        axes.bar_label(drawn, fmt="{:.1f}", fontsize=8)
    axes.set_xticks(range(len(keys)), [_rouge_name(key) for key in keys])
    axes.set_ylim(0, 1.25 * max(max(values) for _, values in bars) + 1)
    split = next((run.evaluation.get("split") for run in runs if run.evaluation), "")
    axes.set(ylabel="F-measure (%)", title=f"ROUGE on {split}: base vs fine-tuned")
    axes.grid(alpha=0.3, axis="y")
    axes.legend()
    figure.savefig(path)
    return path


def plot_memory(runs: list[RunData], path: Path) -> Path | None:
    """Peak memory of each rank over the whole run, one group of bars per rank, one bar per run."""
    peaks = [(run, run.rank_peaks()) for run in runs]
    peaks = [(run, values) for run, values in peaks if values]
    if not peaks:
        return None
    figure = _figure()
    axes = figure.subplots()
    n_ranks = max(len(values) for _, values in peaks)
    width = 0.8 / len(peaks)
    for index, (color, (run, values)) in enumerate(zip(COLORS * 10, peaks, strict=False)):
        positions = [rank - 0.4 + width * (index + 0.5) for rank in range(len(values))]
        axes.bar(positions, values, width=width, color=color, label=run.label)
    axes.set_xticks(range(n_ranks), [f"rank {rank}" for rank in range(n_ranks)])
    axes.set_ylim(0, 1.3 * max(max(values) for _, values in peaks))  # room for the legend above the bars
    axes.set(ylabel="peak memory (GB)", title="Peak memory per rank (GPU allocations; peak RSS on CPU)")
    axes.grid(alpha=0.3, axis="y")
    axes.legend()
    figure.savefig(path)
    return path


def plot_bench(bench: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """bench.json as bars: tokens/s of each benchmarked setting (with its MFU when recorded), and its peak memory
    when recorded. Entries without a throughput (a failed strategy) are left out; None when none remains."""
    entries = [entry for entry in bench if _is_number(_float(entry.get("tokens_per_sec")))]
    if not entries:
        return None
    names = [bench_label(entry, index) for index, entry in enumerate(entries)]
    peaks = [bench_peak_gb(entry) for entry in entries]
    with_memory = any(_is_number(peak) for peak in peaks)
    figure = _figure(width=4.0 + 0.6 * len(entries), height=4.0 * (2 if with_memory else 1))
    panels = figure.subplots(2 if with_memory else 1, 1, squeeze=False)[:, 0]
    bars = panels[0].bar(names, [float(entry["tokens_per_sec"]) for entry in entries], color=COLORS[0])
    panels[0].bar_label(bars, labels=[_throughput_label(entry) for entry in entries], fontsize=8)
    panels[0].set(ylabel="tokens/s (all GPUs)", title=title)
    if with_memory:
        bars = panels[1].bar(names, [peak if _is_number(peak) else 0.0 for peak in peaks], color=COLORS[1])
        panels[1].bar_label(bars, fmt="{:.1f}")
        panels[1].set(ylabel="peak memory (GB, highest rank)")
    for axes in panels:
        axes.tick_params(axis="x", rotation=20)
        axes.grid(alpha=0.3, axis="y")
    figure.savefig(path)
    return path


def _throughput_label(entry: dict[str, Any]) -> str:
    mfu = _float(entry.get("mfu"))
    return f"{float(entry['tokens_per_sec']):,.0f}" + (f"\nMFU {mfu:.0%}" if _is_number(mfu) else "")


def bench_peak_gb(entry: dict[str, Any]) -> float | None:
    """A benchmark row's peak memory: `peak_gb`, else the highest of `peak_gb_per_rank` (pipetune bench)."""
    peak = _float(entry.get("peak_gb"))
    per_rank = entry.get("peak_gb_per_rank")
    if peak is None and isinstance(per_rank, list) and per_rank:
        peak = max((value for value in map(_float, per_rank) if value is not None), default=None)
    return peak


def bench_label(entry: dict[str, Any], index: int) -> str:
    """A bar's name: the entry's text fields (strategy, schedule, ...) joined, else its position."""
    words = [str(value) for value in entry.values() if isinstance(value, str) and value]
    return " ".join(words) or f"#{index + 1}"


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _rouge_keys(scores: dict[str, Any]) -> list[str]:
    """The ROUGE measures of an eval.json score dict, in its order (rouge1, rouge2, rougeLsum)."""
    return [key for key in scores if key.startswith("rouge")]


def _rouge_name(key: str) -> str:
    return key.replace("rouge", "ROUGE-")


def _has(run: RunData, column: str) -> bool:
    return any(_is_number(row.get(column)) for row in run.rows)


# --------------------------------------------------------------------------- index.html


def summary_row(run: RunData) -> dict[str, str]:
    """The table row of one run: config highlights, final losses, speed, memory, eval scores."""
    model, train, parallel = (run.config.get(key, {}) for key in ("model", "train", "parallel"))
    _, losses = run.series("loss")
    _, val_losses = run.series("val_loss")
    _, speeds = run.series("tokens_per_sec")
    steps, _ = run.series("loss")
    peaks = run.rank_peaks()
    batch = train.get("batch_size")
    if batch is not None and train.get("grad_accum", 1) != 1:
        batch = f"{batch} x {train['grad_accum']}"
    tuned = run.evaluation.get("finetuned") or {}
    wall = _float(run.info.get("wall_time_s"))
    train_rows = run.data.get("splits", {}).get("train", {})
    return {
        "run": run.label,
        "model": str(model.get("name", "")),
        "pp": str(parallel.get("pp", "")),
        "schedule": str(parallel.get("schedule", "")),
        "n_microbatches": str(parallel.get("n_microbatches", "")),
        "batch": "" if batch is None else str(batch),
        "steps": f"{steps[-1]:.0f}" if steps else "",
        "final loss": f"{losses[-1]:.4f}" if losses else "",
        "final val loss": f"{val_losses[-1]:.4f}" if val_losses else "",
        "median tokens/s": f"{statistics.median(speeds):,.0f}" if speeds else "",
        "peak GB (max rank)": f"{max(peaks):.2f}" if peaks else "",
        "eval ROUGE-1": f"{100 * tuned['rouge1']:.1f}" if _is_number(_float(tuned.get("rouge1"))) else "",
        "train samples": str(train_rows.get("kept", "")),
        "wall time": format_duration(wall) if wall is not None else "",
    }


def _table(rows: list[dict[str, Any]]) -> str:
    columns = [
        column
        for column in dict.fromkeys(key for row in rows for key in row)
        if any(row.get(column, "") != "" for row in rows)
    ]
    head = "".join(f"<th>{html.escape(column)}</th>" for column in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(row.get(column, '')))}</td>" for column in columns) + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, list):
        return " ".join(_cell(item) for item in value)
    return str(value)


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1600px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 4px 10px; text-align: right; vertical-align: top; }
th:first-child, td:first-child { text-align: left; }
th { background: #f3f3f3; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 12px; }
.charts img { width: 100%; border: 1px solid #eee; }
table.examples td, table.examples th { text-align: left; width: 33%; font-size: 0.9em; }
img.bench { max-width: 100%; }
"""


def write_index(runs: list[RunData], charts: list[Path], bench_charts: dict[str, Path], out: Path) -> Path:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>pipetune report</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>pipetune report: {html.escape(', '.join(run.label for run in runs))}</h1>",
        _table([summary_row(run) for run in runs]),
        "<div class='charts'>",
        *(f"<img src='{html.escape(chart.name)}' alt='{html.escape(chart.stem)}'>" for chart in charts),
        "</div>",
    ]
    for run in runs:
        parts += _evaluation_section(run, len(runs) > 1) + _data_section(run, len(runs) > 1)
        if run.bench:
            parts.append(f"<h2>Benchmark: {html.escape(run.label)}</h2>")
            parts.append(_table(run.bench))
            if run.label in bench_charts:
                parts.append(f"<img class='bench' src='{html.escape(bench_charts[run.label].name)}' alt='benchmark'>")
    parts.append("<p>Directories: " + ", ".join(html.escape(str(run.path)) for run in runs) + "</p></body></html>")
    path = out / "index.html"
    path.write_text("\n".join(parts) + "\n")
    return path


def _evaluation_section(run: RunData, named: bool) -> list[str]:
    """eval.json: the scores of both models, and the example summaries beside their references."""
    evaluation = run.evaluation
    if not evaluation.get("finetuned"):
        return []
    title = f"Evaluation{': ' + run.label if named else ''}"
    rows = []
    for name, key in (("base", "base"), ("fine-tuned", "finetuned")):
        scores = evaluation.get(key)
        if isinstance(scores, dict):
            rows.append(
                {"model": name}
                | {_rouge_name(k): f"{100 * scores[k]:.1f}" for k in _rouge_keys(scores)}
                | ({"loss": f"{scores['loss']:.3f}"} if "loss" in scores else {})
            )
    meetings = f"{evaluation.get('n_examples', '?')} {evaluation.get('split', '')} meetings"
    parts = [f"<h2>{html.escape(title)}</h2>", f"<p>{html.escape(meetings)}, greedy decoding.</p>", _table(rows)]
    examples = evaluation.get("examples") or []
    if examples:
        columns = [("reference", "reference"), ("base", "base model"), ("finetuned", "fine-tuned model")]
        columns = [(key, name) for key, name in columns if any(key in example for example in examples)]
        head = "".join(f"<th>{name}</th>" for _, name in columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(example.get(key, '')))}</td>" for key, _ in columns) + "</tr>"
            for example in examples
        )
        parts += ["<h3>Example summaries</h3>", f"<table class='examples'><tr>{head}</tr>{body}</table>"]
    return parts


def _data_section(run: RunData, named: bool) -> list[str]:
    """data.json: rows read, kept and skipped (by reason) per split."""
    splits = run.data.get("splits") or {}
    if not splits:
        return []
    rows = []
    for name, counts in splits.items():
        skipped = counts.get("skipped") or {}
        rows.append(
            {
                "split": name,
                "read": counts.get("read", ""),
                "kept": counts.get("kept", ""),
                "skipped": ", ".join(f"{n} {why}" for why, n in skipped.items()) or "0",
                "held out for validation": counts.get("held_out") or "",
            }
        )
    source = run.data.get("source", "")
    title = f"Data{': ' + run.label if named else ''}"
    return [f"<h2>{html.escape(title)}</h2>", f"<p>source: {html.escape(str(source))}</p>", _table(rows)]


def build_report(run_dirs: list[str | Path], out: str | Path | None = None) -> Path:
    """Render the charts and index.html into `out` (default: <first run>/report/); return index.html's path."""
    runs = load_runs(run_dirs)
    out = Path(out) if out is not None else runs[0].path / "report"
    out.mkdir(parents=True, exist_ok=True)
    charts = [
        chart
        for chart in (
            plot_loss(runs, out / "loss.png"),
            plot_series(runs, "lr", out / "lr.png", "Learning rate", "learning rate"),
            plot_series(runs, "grad_norm", out / "grad_norm.png", "Gradient norm (before clipping)", "global L2 norm"),
            plot_series(
                runs, "tokens_per_sec", out / "throughput.png", "Throughput", "tokens/s (all ranks)", from_zero=True
            ),
            plot_memory(runs, out / "memory.png"),
            plot_rouge(runs, out / "rouge.png"),
        )
        if chart is not None
    ]
    bench_charts = {}
    for index, run in enumerate(runs):
        chart = plot_bench(
            run.bench, out / (f"bench_{index}.png" if len(runs) > 1 else "bench.png"), f"Benchmark: {run.label}"
        )
        if chart is not None:
            bench_charts[run.label] = chart
    return write_index(runs, charts, bench_charts, out)
