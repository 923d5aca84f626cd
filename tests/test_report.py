"""`pipetune report` renders charts and index.html from run directories."""

from __future__ import annotations

import csv
import html
import json
from pathlib import Path

import pytest

from pipetune.cli import main
from pipetune.config import ConfigError, save_config
from pipetune.metrics import MetricsWriter
from pipetune.report import bench_peak_gb, build_report, load_runs, summary_row
from tests.conftest import tiny_config

PNG = b"\x89PNG\r\n\x1a\n"
EVAL = {  # as pipetune eval writes it
    "split": "validation",
    "n_examples": 8,
    "base": {"rouge1": 0.125, "rouge2": 0.0, "rougeLsum": 0.1, "loss": 8.9},
    "finetuned": {"rouge1": 0.401, "rouge2": 0.2, "rougeLsum": 0.35, "loss": 2.514},
    "examples": [
        {"reference": f"The team chose option {i}.", "base": f"noise {i} <&>", "finetuned": f"They chose {i}."}
        for i in range(3)
    ],
}


def _row(step: int, loss: float) -> dict:
    return {
        "strategy": "pp",
        "epoch": 0,
        "step": step,
        "loss": loss,
        "tokens_per_sec": 1000.0 + step,
        "step_time_sec": 0.5,
        "peak_vram_gb": 0.9,
        "lr": 1e-3,
        "real_tokens_per_sec": 800.0,
        "grad_norm": 1.0,
        "supervised_tokens": 100,
        "peak_gb_rank0": 0.9,
        "peak_gb_rank1": 0.7,
    }


def _run(directory: Path, schedule: str, losses: list[float]) -> Path:
    """A run directory as training writes it: config.toml and metrics.csv (through MetricsWriter)."""
    save_config(tiny_config(directory, f'parallel.schedule="{schedule}"'), _mkdir(directory) / "config.toml")
    writer = MetricsWriter(directory / "metrics.csv", n_ranks=2)
    for step, loss in enumerate(losses, start=1):
        writer.write(_row(step, loss))
    writer.close()
    return directory


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _add_val_loss(run: Path, values: dict[int, float]) -> None:
    """Rewrite metrics.csv with a val_loss column filled on some steps (as a run with validation writes it)."""
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*rows[0], "val_loss"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "val_loss": values.get(int(row["step"]), "")})


def test_report_of_two_runs(tmp_path: Path) -> None:
    first = _run(tmp_path / "runs" / "one" / "sched", "1f1b", [5.0, 4.0, 3.0])
    second = _run(tmp_path / "runs" / "two" / "sched", "gpipe", [5.5, 4.5, 3.25])
    _add_val_loss(first, {2: 4.4, 3: 3.3})
    bench = [  # pipetune bench's rows (per-rank peaks, a failed strategy) and a plain peak_gb row
        {"strategy": "pp", "gpus": 2, "tokens_per_sec": 3170.0, "peak_gb_per_rank": [9.7, 8.1], "mfu": 0.03},
        {"strategy": "ddp", "tokens_per_sec": 19780.0, "peak_gb": 12.1},
        {"strategy": "single", "error": "exit code 1"},
    ]
    (second / "bench.json").write_text(json.dumps(bench))
    (second / "eval.json").write_text(json.dumps(EVAL))
    (second / "run.json").write_text(json.dumps({"wall_time_s": 102.4, "steps": 3}))
    data = {"train": {"read": 40, "kept": 37, "skipped": {"empty dialogue": 3}}, "validation": {"read": 8, "kept": 8}}
    (second / "data.json").write_text(json.dumps({"source": "meetings.jsonl", "splits": data}))

    index = build_report([first, second])
    out = first / "report"  # the default: <first run>/report
    assert index == out / "index.html"
    charts = ("loss.png", "lr.png", "grad_norm.png", "throughput.png", "memory.png", "rouge.png", "bench_1.png")
    for chart in charts:
        assert (out / chart).read_bytes()[:8] == PNG, chart

    page = index.read_text()
    assert "one/sched" in page and "two/sched" in page  # same directory name: parents tell them apart
    assert "1f1b" in page and "gpipe" in page and "tiny-qwen3" in page
    assert "3.0000" in page and "3.2500" in page and "3.3000" in page  # final loss of each, final val loss
    assert "40.1" in page and "12.5" in page and "2.514" in page  # eval: fine-tuned and base scores, loss
    assert "1 min 42 s" in page and "<td>37</td>" in page and "3 empty dialogue" in page  # wall time, data counts
    for example in EVAL["examples"]:  # the example summaries beside their references
        assert all(html.escape(text) in page for text in example.values())
    assert "19,780" in page and "9.7 8.1" in page and "exit code 1" in page  # the benchmark table
    for chart in charts:
        assert f"src='{chart}'" in page
    assert "<div class='charts'>" in page  # in a grid

    one, two = load_runs([first, second])
    assert one.series("val_loss") == ([2.0, 3.0], [4.4, 3.3])
    assert one.rank_peaks() == [0.9, 0.7]
    assert [bench_peak_gb(entry) for entry in two.bench] == [9.7, 12.1, None]
    row = summary_row(two)
    assert (row["pp"], row["n_microbatches"], row["batch"], row["steps"]) == ("2", "4", "4 x 2", "3")


def test_report_cli_and_bad_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path / "run", "1f1b", [2.0, 1.0])
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "index.html").is_file() and (tmp_path / "out" / "loss.png").is_file()
    assert not (tmp_path / "out" / "bench.png").exists()

    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="neither metrics.csv nor bench.json"):
        load_runs([_mkdir(tmp_path / "empty")])


def test_report_reads_a_metrics_file_with_a_damaged_tail(tmp_path: Path) -> None:
    from pipetune.report import _load_run

    (tmp_path / "metrics.csv").write_bytes(b"step,loss,tokens_per_sec\n1,2.5,100\n2,2.4,1\x00\x00\xff\n3,2.")
    run = _load_run(tmp_path, "run")
    assert run.rows == [{"step": 1, "loss": 2.5, "tokens_per_sec": 100}]
