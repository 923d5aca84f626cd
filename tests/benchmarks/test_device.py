"""benchmarks/device.sh --dry-run: the commands a device call would run, with nothing installed, written or run."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def dry_run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmarks/device.sh", "--dry-run", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")},
        timeout=60,
    )


def test_dry_run_prints_each_step_as_its_command(tmp_path):
    result = dry_run(
        "--tag", "smoke", "--budget", "300",
        "bench", "4b-ddp", "90", "4b", "--strategies", "ddp", "--steps", "6", "::",
        "PIPETUNE_PROFILE_STEP=6", "bench", "72b-nf4", "400", "72b", "--strategies", "single", "--quant", "nf4", "::",
        "tool", "trace_gaps", "{W}/trace/trace-rank0.json.gz", "::",
        "baselines", "20", "100", "90", "1", "::",
        "sh", "echo {OUT}",
        tmp_path=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == (
        "python3 -m pipetune bench --config configs/bench-qwen3-4b.toml --out /tmp/device-smoke/4b-ddp --timeout 75 "
        "--strategies ddp --steps 6"
    )
    # a limit over the budget is cut to it; the step's environment and --quant are spelled out
    assert lines[1] == (
        "PIPETUNE_PROFILE_STEP=6 python3 -m pipetune bench --config configs/bench-qwen2.5-72b.toml "
        '--out /tmp/device-smoke/72b-nf4 --timeout 285 --strategies single --set model.quantize="nf4"'
    )
    assert lines[2] == "python3 benchmarks/tools/trace_gaps.py /tmp/device-smoke/trace/trace-rank0.json.gz"
    assert lines[3].endswith("torchrun --nproc_per_node=2 .baselines/train_seed.py")
    assert lines[4].endswith("torchrun --nproc_per_node=2 .baselines/lora_ddp.py")
    assert lines[5] == f"echo {tmp_path / 'out'}"
    assert not (tmp_path / "out").exists() and not Path("/tmp/device-smoke").exists()


def test_tiny_runs_every_bench_on_the_tiny_model_and_skips_the_baselines(tmp_path):
    result = dry_run("--tiny", "bench", "a", "100", "32b", "--steps", "20", "::", "baselines", "1", "2", "3",
                     tmp_path=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    bench, baselines = result.stdout.splitlines()
    assert 'model.name="qwen3-32b"' in bench and bench.endswith("--steps 1 --warmup 1")
    assert bench.index('model.name="qwen3-32b"') < bench.index('model.name="tiny-qwen3"')
    assert baselines == "== baselines: skipped (--tiny)"


def test_a_bad_step_or_tool_ends_the_call_with_one_line(tmp_path):
    for args, message in (
        (["bogus"], "unknown step 'bogus'"),
        (["tool", "nope"], "no tool benchmarks/tools/nope.py"),
        ([], "no step given"),
    ):
        result = dry_run(*args, tmp_path=tmp_path)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
