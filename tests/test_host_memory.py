"""Memory on a CPU: the plan's budget (train.memory_gb, else the host's share), its prediction an upper bound on the
measured peak RSS, and the shipped CPU configs within what their headers state."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from pipetune.config import config_path, load_config
from pipetune.heap import resident_bytes, trim_heap
from pipetune.model.shapes import resolve_model
from pipetune.parallel import memory
from pipetune.parallel.memory import GB, cpu_budget, memory_budget, predict_cpu_plans
from pipetune.switches import Hardware, resolve
from tests.conftest import tiny_config, write_config

LAPTOP_AVAILABLE = 12e9
"""What a 16 GB laptop has available (MemAvailable) with a desktop session running: the shipped CPU configs'
headers state their plans for it."""
WORKER_HELD = 0.9e9
"""A SmolLM2 demo worker's resident memory before its first step (0.79-0.85 GB measured on a 2-core CPU)."""


def test_without_memory_gb_a_cpu_rank_plans_for_its_share_of_the_hosts_memory(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(memory, "available_host_memory", lambda: 12e9)
    monkeypatch.setattr(memory, "resident_bytes", lambda: 0.9e9)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    budget, note = cpu_budget()
    assert budget == pytest.approx(0.9e9 + 0.9 * 12e9 / 2)  # what it holds, and 90% of half of what is available
    assert note == "the host's: this process's 0.9 GB and 90% of the 12 GB available over 2 processes; " + (
        "train.memory_gb sets another"
    )
    cpu = torch.device("cpu")
    assert memory_budget(tiny_config(tmp_path), cpu) == budget
    assert memory_budget(tiny_config(tmp_path, "train.memory_gb=3"), cpu) == 3e9  # the override
    assert memory_budget(tiny_config(tmp_path)) == float("inf")  # checks before any process: no rank's share yet
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert "available;" in cpu_budget()[1]  # one process: nothing to split


def _run(tmp_path: Path, name: str, *overrides: str) -> tuple[str, float]:
    """Train tiny_config in this process for one step: its plan's line and the process's peak RSS meanwhile."""
    from pipetune.cli import main

    config = tiny_config(tmp_path / name, "parallel.pp=1", "parallel.n_microbatches=1", "train.max_steps=1", *overrides)
    trim_heap()  # what earlier tests freed is not this run's
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS (VmHWM) starts again from what is held now
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            code = main(["train", "--config", str(write_config(config, tmp_path / f"{name}.toml")), "--quiet"])
        except SystemExit as e:
            code = e.code
    assert code == 0, said.getvalue()[-2000:]
    peak = float(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    line = json.loads((tmp_path / name / "speed.json").read_text())["line"]
    return line, peak


def test_the_cpu_plan_bounds_the_measured_peak_rss_at_two_lengths(tmp_path: Path) -> None:
    """With train.memory_gb, the plan's predicted peak is at least the peak resident memory the run reaches, and not
    far above it: at 128 tokens keeping every layer, at 1,024 recomputing some to fit 0.6 GB above what this
    process holds."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc to measure the peak RSS of one run")
    for name, length, above in (("short", 128, None), ("long", 1024, 0.6e9)):
        trim_heap()
        memory_gb = 64 if above is None else (resident_bytes() + above) / GB
        line, peak = _run(tmp_path, name, f"data.max_length={length}", f"train.memory_gb={memory_gb:.3f}")
        planned = re.search(r"checkpointing: stage 0: (\d) of 4 layers; predicted peak ([\d.]+) of", line)
        assert planned, line
        predicted = float(planned.group(2)) * GB
        assert peak <= predicted <= 1.5 * peak, (name, peak / GB, line)
        assert (int(planned.group(1)) > 0) == (name == "long"), line  # the long row recomputes layers to fit


def _header_gb(name: str, pattern: str) -> float:
    header = config_path(name).read_text().split("[model]")[0]
    found = re.search(pattern, header.replace("\n# ", " "))
    assert found, (name, pattern)
    return float(found.group(1))


@pytest.mark.parametrize("name", ["demo-smollm2", "demo-smollm2-meetings"])
def test_the_smollm2_cpu_configs_plan_within_what_their_headers_state(name: str, smollm2: Path) -> None:
    """A SmolLM2 step costs 15 s (512-token rows) to several minutes (whole meetings) on 2 cores: their peaks were
    measured by hand (the headers); here each rank's plan for a 16 GB laptop fits, and predicts no more than the
    header states. The plan is an upper bound on the measured peak (the test above, and the demo's test)."""
    resolved = resolve_model(load_config(name).model)
    config = resolve(load_config(name), Hardware(False), vocab=resolved.config.vocab_size).config
    budget = WORKER_HELD + 0.9 * LAPTOP_AVAILABLE / 2  # cpu_budget on that laptop, for each of the two workers
    plans = predict_cpu_plans(config, resolved, WORKER_HELD, budget)
    cap = _header_gb(name, r"the plan predicts at most ([\d.]+) GB a worker")
    assert all(plan.fits for plan in plans) and max(plan.peak_bytes for plan in plans) <= cap * GB, [
        (plan.layers, plan.peak_bytes / GB) for plan in plans
    ]
