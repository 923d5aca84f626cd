"""Memory on a CPU: the plan's budget (train.memory_gb, else the host's share), its prediction an upper bound on the
measured peak RSS, a container's cgroup limit respected, and the shipped CPU configs within what their headers state
under what a 16 GB laptop gives each worker."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from pipetune.config import load_config
from pipetune.files import read_metrics_rows
from pipetune.heap import resident_bytes, trim_heap
from pipetune.host_memory import HostMemory, oom_kills, read_host_memory
from pipetune.model.shapes import resolve_model
from pipetune.parallel import memory
from pipetune.parallel.memory import GB, cpu_budget, memory_budget, predict_cpu_plans
from pipetune.switches import Hardware, resolve
from tests.conftest import HEADER_SLACK, LAPTOP_WORKER_GB, WORKER_HELD, header_gb, run_cli, tiny_config, write_config


def test_without_memory_gb_a_cpu_rank_plans_for_its_share_of_the_hosts_memory(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(memory, "read_host_memory", lambda: HostMemory(16e9, 12e9))
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
    monkeypatch.setattr(memory, "read_host_memory", lambda: HostMemory(16e9, 12e9, 4e9, 3.2e9))  # a container's
    assert cpu_budget() == (
        0.9e9 + 0.9 * 3.2e9,
        "the host's: this process's 0.9 GB and 90% of the 3.2 GB the cgroup leaves; train.memory_gb sets another",
    )


MEMINFO = "MemTotal:       15625000 kB\nMemFree:         2000000 kB\nMemAvailable:   11718750 kB\n"
"""A 16 GB machine with 12 GB available (kB are KiB)."""


def _host(root: Path, cgroup: str, files: dict[str, str]) -> HostMemory:
    """read_host_memory under a fake root: /proc/meminfo, /proc/self/cgroup saying `cgroup`, and `files`."""
    for path, text in {"proc/meminfo": MEMINFO, "proc/self/cgroup": cgroup, **files}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return read_host_memory(root)


V2 = "0::/user.slice/run\n"
V1 = "12:memory:/docker/run\n1:cpu,cpuacct:/docker/run\n0::/\n"


@pytest.mark.parametrize(
    "cgroup, files",
    [
        ("0::/\n", {}),  # no cgroup files: a machine's own processes
        (V2, {"sys/fs/cgroup/user.slice/run/memory.max": "max\n", "sys/fs/cgroup/memory.max": "max\n"}),
        (V1, {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"}),  # v1's "unlimited"
    ],
    ids=["no cgroup", "v2 max", "v1 unlimited"],
)
def test_without_a_cgroup_limit_the_host_memory_is_meminfos(tmp_path: Path, cgroup: str, files: dict) -> None:
    host = _host(tmp_path, cgroup, files)
    assert (host.total, host.available, host.cgroup_limit, host.cgroup_bound) == (16e9, 12e9, None, False)


def test_a_cgroup_limit_bounds_what_is_available_to_what_it_leaves(tmp_path: Path) -> None:
    """v2 and v1: the limit less the cgroup's working set (its usage less inactive file cache), where less than
    MemAvailable; a parent's limit binds its child; a path that the container's mount does not have reads its root."""
    own = "sys/fs/cgroup/user.slice/run"
    host = _host(tmp_path / "v2", V2, {f"{own}/memory.max": "4000000000", f"{own}/memory.current": "1000000000"})
    assert (host.total, host.available, host.cgroup_bound) == (4e9, 3e9, True)
    stat = {f"{own}/memory.stat": "anon 600000000\ninactive_file 200000000\nactive_file 200000000\n"}
    assert _host(tmp_path / "v2", V2, stat).available == 3.2e9  # inactive cache is reclaimed before a kill
    parent = {f"{own}/memory.max": "max", "sys/fs/cgroup/user.slice/memory.max": "3000000000"}
    parent["sys/fs/cgroup/user.slice/memory.current"] = "2500000000"  # the child's and its siblings'
    assert _host(tmp_path / "parent", V2, parent).available == 0.5e9
    # cgroup v1 without a cgroup namespace: /proc/self/cgroup names /docker/run, the mount's root is the container's
    mount = "sys/fs/cgroup/memory"
    v1 = {f"{mount}/memory.limit_in_bytes": "6000000000", f"{mount}/memory.usage_in_bytes": "2000000000"}
    host = _host(tmp_path / "v1", V1, v1)
    assert (host.total, host.available, host.cgroup_limit) == (6e9, 4e9, 6e9)
    roomy = _host(tmp_path / "roomy", V2, {f"{own}/memory.max": "64000000000", f"{own}/memory.current": "1000000000"})
    assert (roomy.total, roomy.available, roomy.cgroup_bound) == (16e9, 12e9, False)  # MemAvailable is less


def test_the_oom_kills_are_counted_in_this_processs_own_cgroup(tmp_path: Path) -> None:
    """A launcher tells a worker the OOM killer ended by this count rising: read in the process's own cgroup (v2's
    memory.events; the root cgroup has none), else a parent's, else v1's memory.oom_control; None where none counts."""
    events = "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n"
    _host(tmp_path / "v2", V2, {"sys/fs/cgroup/user.slice/run/memory.events": events})
    assert oom_kills(tmp_path / "v2") == 2
    _host(tmp_path / "parent", V2, {"sys/fs/cgroup/user.slice/memory.events": events.replace("2", "5")})
    assert oom_kills(tmp_path / "parent") == 5
    _host(tmp_path / "v1", V1, {"sys/fs/cgroup/memory/memory.oom_control": "oom_kill_disable 0\noom_kill 1\n"})
    assert oom_kills(tmp_path / "v1") == 1
    _host(tmp_path / "none", V2, {})
    assert oom_kills(tmp_path / "none") is None


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


def test_the_meetings_config_plans_within_what_its_header_states(smollm2: Path) -> None:
    """A step of whole meetings takes minutes on 2 cores: its peaks were measured by hand (the header); here each
    rank's plan for a 16 GB laptop fits, and predicts no more than the header states. The plan is an upper bound
    on the measured peak (the tests above and below, and the demo's)."""
    name = "demo-smollm2-meetings"
    resolved = resolve_model(load_config(name).model)
    config = resolve(load_config(name), Hardware(False), vocab=resolved.config.vocab_size).config
    plans = predict_cpu_plans(config, resolved, WORKER_HELD, LAPTOP_WORKER_GB * GB)
    (cap,) = header_gb(name, r"the plan predicts at most ([\d.]+) GB a worker")
    assert all(plan.fits for plan in plans) and max(plan.peak_bytes for plan in plans) <= cap * GB, [
        (plan.layers, plan.peak_bytes / GB) for plan in plans
    ]


@pytest.mark.slow
def test_demo_smollm2_trains_a_step_within_a_laptops_share_and_its_header(smollm2: Path, tmp_path: Path) -> None:
    """`pipetune train --config demo-smollm2` for one step, with train.memory_gb what a 16 GB laptop gives each
    worker: each worker's peak RSS within it, within HEADER_SLACK of what the header states, and at most what the
    worker's plan predicted, which is at most what the header states. Without validation (forward-only, in batches
    of the training shape: it holds less than the step; its two passes cost 10 s of the run's 41 on 2 cores, four
    batches 25-29 s); with it the peaks were the same: 3.37 and 2.62 GB with 16 meetings, 3.36 and 2.63 with 4."""
    out = tmp_path / "run"
    settings = ["train.max_steps=1", f"train.memory_gb={LAPTOP_WORKER_GB:.2f}", "data.synthetic_validation=0"]
    sets = [word for setting in (*settings, f"output.dir={out}") for word in ("--set", setting)]
    result = run_cli("train", "--config", "demo-smollm2", *sets)
    rows = [row for row in read_metrics_rows(out / "metrics.csv")[0] if row["peak_gb_rank0"]]
    assert [int(row["step"]) for row in rows] == [1], rows
    peaks = [float(rows[0][f"peak_gb_rank{rank}"]) for rank in (0, 1)]
    stated = header_gb("demo-smollm2", r"([\d.]+) and ([\d.]+) GB the two workers")
    (planned_at_most,) = header_gb("demo-smollm2", r"the plan predicts at most ([\d.]+) GB a worker")
    plan = r"rank (\d): activation checkpointing \(auto\): .*; predicted peak ([\d.]+) of ([\d.]+) GB"
    predicted = {int(rank): (float(gb), float(of)) for rank, gb, of in re.findall(plan, result.stdout)}
    for rank, peak in enumerate(peaks):
        assert predicted[rank][1] == pytest.approx(LAPTOP_WORKER_GB, abs=0.05), predicted  # the laptop's share
        assert peak <= min(HEADER_SLACK * stated[rank], LAPTOP_WORKER_GB), (rank, peaks, stated)
        assert peak <= predicted[rank][0] <= planned_at_most, (rank, peaks, predicted)
