"""`pipetune demo` end to end in a subprocess: loss falls, every output exists and parses."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from pipetune.config import load_config
from pipetune.metrics import SEED_COLUMNS
from pipetune.train import print_rank
from tests.conftest import HEADER_SLACK, LAPTOP_WORKER_GB, header_gb

pytestmark = pytest.mark.slow  # multi-process end-to-end runs: pytest -m "not slow" leaves them out


def test_a_ranks_line_is_written_in_one_piece(monkeypatch) -> None:
    """The demo's workers print their lines to one stdout: under PYTHONUNBUFFERED (as its test runs it), print
    writes a line and its newline apart, and two ranks' lines printed at once came out joined, one rank's plan lost
    to the check below. A rank's line goes out in one write."""
    writes = []
    monkeypatch.setattr(sys, "stdout", SimpleNamespace(write=writes.append, flush=lambda: None))
    print_rank(SimpleNamespace(rank=1), "activation checkpointing (auto): stage 1: 0 of 2 layers")
    assert writes == ["rank 1: activation checkpointing (auto): stage 1: 0 of 2 layers\n"]


def test_demo_runs_end_to_end(demo_run: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, result = demo_run  # tests/conftest.py: `pipetune demo --steps 25`
    config = load_config(out / "config.toml")
    assert config.model.name == "tiny-qwen3" and config.parallel.pp == 2 and config.train.max_steps == 25

    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[: len(SEED_COLUMNS)] == SEED_COLUMNS
    assert [int(r["step"]) for r in rows] == [0, 10, 20, 25]  # step 0: validation before fine-tuning
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"])
    losses = [float(r["loss"]) for r in rows[1:]]
    assert losses[-1] < losses[0]
    assert all(float(r["tokens_per_sec"]) > 0 and float(r["peak_vram_gb"]) > 0 for r in rows[1:])
    # Each worker's peak RSS (the peak columns on a CPU) within what the config's header states it measured, and
    # within the share a 16 GB laptop gives it; the header's cap bounds each worker's plan.
    (stated,) = header_gb("demo", r"([\d.]+) GB a worker \(two")
    (cap,) = header_gb("demo", r"under ([\d.]+) GB a worker")
    peaks = [float(r[f"peak_gb_rank{rank}"]) for r in rows[1:] for rank in (0, 1)]
    assert 0 < max(peaks) <= min(HEADER_SLACK * stated, LAPTOP_WORKER_GB), (peaks, stated)
    # Each worker planned for its share of this machine's memory (it says so), and predicted at least its peak.
    plan = r"rank (\d): activation checkpointing \(auto\): .*; predicted peak ([\d.]+) of [\d.]+ GB \(the host's: "
    predicted = {int(rank): float(gb) for rank, gb in re.findall(plan, result.stdout)}
    for rank in (0, 1):
        measured = max(float(r[f"peak_gb_rank{rank}"]) for r in rows[1:])
        assert measured <= predicted[rank] <= cap, (rank, measured, predicted, cap)

    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["peft_type"] == "LORA"
    assert len(load_file(out / "adapter" / "adapter_model.safetensors")) == 4 * 7 * 2

    # the run ends with its summary, and rank 0's output is in train.log
    assert re.search(r"done: 25 steps in [\d.]+ (s|min)", result.stdout)
    assert f"pipetune export --run {out} --out {out / 'export'}" in result.stdout
    log = (out / "train.log").read_text()
    assert "step 10/25" in log and "done: 25 steps" in log and "run directory" in log
    assert "FutureWarning" not in result.stderr  # library warnings a user cannot act on are silenced
    assert "too few to teach the model" not in result.stderr  # 25 steps are a sixth of the default: enough
    assert json.loads((out / "run.json").read_text())["final_val_loss"] == float(rows[-1]["val_loss"])

    before, after = map(float, re.search(r"([\d.]+) before, ([\d.]+) after", result.stdout).groups())
    assert after < before
    assert "reference summary:" in result.stdout and "fine-tuned model's summary (greedy):" in result.stdout
