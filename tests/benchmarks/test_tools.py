"""Smoke tests of benchmarks/tools/: each tool starts, finds what it reads, and does its cheapest job."""

from __future__ import annotations

import csv
import gzip
import json
import runpy
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "benchmarks" / "tools"
JOURNAL = TOOLS.parent / "journal"


def run_tool(name: str, *args: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs benchmarks/tools/NAME.py as its command line would, in this process (torch is imported once)."""
    monkeypatch.setattr(sys, "argv", [str(TOOLS / f"{name}.py"), *args])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tools put src/ and tools/ first; undone after the test
    runpy.run_path(str(TOOLS / f"{name}.py"), run_name="__main__")


ARGPARSE_TOOLS = [
    "data_scale",
    "dropout_rng",
    "layer_levers",
    "load_memory",
    "matmul_shapes",
    "packed_attention",
    "pad_waste",
    "plan_calibrate",
    "plan_check",
    "quant_quality",
    "smollm2_rouge",
    "summarize_speed",
    "switch_interval",
    "trace_gaps",
]


def test_every_tool_has_a_smoke_test():
    # fact_recall runs end to end in tests/benchmarks/test_fact_recall.py
    others = {"loss_gap_bubble", "plot_loss_curves", "fact_recall"}
    assert {p.stem for p in TOOLS.glob("*.py")} == set(ARGPARSE_TOOLS) | others


@pytest.mark.parametrize("name", ARGPARSE_TOOLS)
def test_tool_imports_and_prints_its_usage(name, monkeypatch, capsys):
    with pytest.raises(SystemExit) as ended:
        run_tool(name, "--help", monkeypatch=monkeypatch)
    assert ended.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_plan_check_reads_every_run_it_lists():
    """plan_check.py's runs name result files in benchmarks/journal/results: each is there and holds its run."""
    plan_check = runpy.run_path(str(TOOLS / "plan_check.py"), run_name="plan_check")
    assert plan_check["RESULTS"] == JOURNAL / "results"
    for run in plan_check["RUNS"]:
        measured = plan_check["measured"](run)
        assert measured["tokens_per_sec"] > 0, run.source


def test_loss_gap_bubble_reads_a_recorded_timeline(monkeypatch, capsys):
    timeline = sorted((JOURNAL / "results" / "timelines").glob("*.json"))[0]
    run_tool("loss_gap_bubble", str(timeline), monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert f"{timeline}: step" in out and "rank 0 (stages" in out


def test_plot_loss_curves_draws_two_runs_and_their_gap(tmp_path, monkeypatch, capsys):
    for name, losses in (("a", [2.0, 1.5, 1.0]), ("b", [2.0, 1.2, 1.0])):
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "loss"])
            writer.writerows((step, loss) for step, loss in enumerate(losses, start=1))
    out_png = tmp_path / "curves.png"
    run_tool("plot_loss_curves", str(out_png), f"a={tmp_path}/a.csv", f"b={tmp_path}/b.csv", monkeypatch=monkeypatch)
    assert out_png.stat().st_size > 0
    assert "b vs a: largest relative gap 20.00% at step 2" in capsys.readouterr().out


def test_trace_gaps_finds_the_gpu_idle_gap(tmp_path, monkeypatch, capsys):
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 700, "dur": 300},
    ]
    trace = tmp_path / "trace-rank0.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    run_tool("trace_gaps", str(trace), "--min-us", "100", monkeypatch=monkeypatch)
    out = capsys.readouterr().out
    assert "GPU busy 0.60 ms (60.0%)" in out and "0.40 ms idle at +0.30 ms" in out
    # --launchers: each GPU event's time under the host operators around the runtime call that launched it
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "pipetune::document_sdpa", "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "tid": 1, "ts": 10, "dur": 20},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaMemcpyAsync",
            "tid": 1,
            "ts": 12,
            "dur": 5,
            "args": {"correlation": 7},
        },
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 200, "dur": 20},
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cuLaunchKernel",
            "tid": 1,
            "ts": 205,
            "dur": 5,
            "args": {"correlation": 8},
        },
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 20, "dur": 300, "args": {"correlation": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 400, "dur": 100, "args": {"correlation": 8}},
    ]
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    run_tool("trace_gaps", str(trace), "--launchers", monkeypatch=monkeypatch)
    out = capsys.readouterr().out.splitlines()
    assert "0.30 ms  75.0%  gpu_memcpy" in out[1] and out[1].endswith("pipetune::document_sdpa > aten::copy_")
    assert "0.10 ms  25.0%  gemm" in out[2] and out[2].endswith("aten::mm")
    # --between: the gap (20-320 µs after the copy, before the gemm) by its width and the events around it
    run_tool("trace_gaps", str(trace), "--between", monkeypatch=monkeypatch)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "idle time by gap width: < 200 us 0.08 ms (1)"
    assert out[2].split() == ["0.08", "ms", "Memcpy", "DtoD", "|", "gemm"]


def test_matmul_shapes_times_each_member_and_the_stacked_groups(tmp_path, monkeypatch, capsys):
    """The layer's matmuls at the extended inputs' widths (tiny-qwen3: hidden 256, r 16: q/k/v take 256 + 48 + 16
    padding = 320 columns), each forward and backward, and q/k/v and gate/up stacked, summed per group."""
    out = tmp_path / "shapes.json"
    args = ["--config", "configs/qwen3-4b-meetings.toml", "--set", "model.name=tiny-qwen3", "--tokens", "32"]
    run_tool("matmul_shapes", *args, "--repeats", "1", "--out", str(out), monkeypatch=monkeypatch)
    rows = {row["matmul"]: row for row in json.loads(out.read_text())["rows"]}
    assert "k backward [32, 128] @ [128, 320]" in rows and "qkv stacked backward [32, 512] @ [512, 320]" in rows
    assert "down forward [32, 752] @ [256, 752]^T" in rows  # intermediate 688 + 16 + 48 padding
    assert all(row["ms"] > 0 for row in rows.values())
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("qkv: forward") and lines[-1].startswith("gate_up: forward")


def test_packed_attention_packs_and_checks_the_cpu_kernel(tmp_path, monkeypatch, capsys):
    """On a CPU the tool packs the demo's samples as a run does and runs the CPU's document attention (the
    documents kernel: the CPU's flash attention on each sample, over a static span table; no flex backward there)
    forward and backward against the float32 reference, each document's operators alone, the one-document
    sweep and layouts run, and the unseen-lengths calls run (the demo's short samples are not moved: `moved` is
    timed on the GPU); the GPU's variants are named and checked before anything runs."""
    out = tmp_path / "packed.json"
    args = ["--config", "configs/demo.toml", "--set", "data.packing=true", "--rows", "2", "--warmup", "0"]
    timing = [
        "--repeats",
        "1",
        "--new-lengths",
        "2",
        "--sweep",
        "64,128,192",
        "--layouts",
        "64,128",
        "--head-rows",
        "9",
    ]
    run_tool("packed_attention", *args, *timing, "--out", str(out), monkeypatch=monkeypatch)
    results = json.loads(out.read_text())
    assert results["rows"] == 2 and results["seq"] == 384
    assert all(n >= 2 for n in results["documents_a_row"])  # packed: several samples a row (and the pads)
    assert 0 <= results["pad_share"] < 0.5
    assert set(results["kernels"]) == {"as run"}
    assert len(results["new_lengths_ms_a_row"]) == 2
    assert results["kernels_alone_ms_a_row"] > 0  # each document's operators alone
    assert set(results["sweep"]["ms"]) == {"64", "128", "192"} and len(results["sweep"]["fit_a_b_c"]) == 3
    for length in ("64", "128"):  # each layout of one document: the same math as the documents kernel's call
        found = results["layouts"][length]
        assert set(found) == {"as run", "contiguous", "expanded", "flash"}
        assert all(r["difference"] < 1e-5 and r["forward_ms"] > 0 and r["backward_ms"] > 0 for r in found.values())
    for kernel in [*results["kernels"].values(), results["head_rows"]]:
        assert max(kernel["relative_errors"].values()) < 1e-5
    assert 9 <= results["head_rows"]["chosen_a_row"] <= 9 * max(results["documents_a_row"])
    assert "as run" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run_tool("packed_attention", *args, "--variants", "fwd 1x1", monkeypatch=monkeypatch)
    assert "unknown variants ['fwd 1x1']" in capsys.readouterr().err


def test_switch_interval_times_each_interval_alone_and_beside_a_busy_thread(tmp_path, monkeypatch, capsys):
    out = tmp_path / "probe.json"
    args = ["--lengths", "2", "--long", "1", "--long-ms", "1", "--small", "2", "--repeats", "1", "--out", str(out)]
    before = sys.getswitchinterval()
    run_tool("switch_interval", *args, monkeypatch=monkeypatch)
    rows = json.loads(out.read_text())["rows"]
    assert [row["interval_ms"] for row in rows] == [5.0, 0.5] and all(row["alone_ms"] > 0 for row in rows)
    assert sys.getswitchinterval() == before and capsys.readouterr().out.count("beside a busy thread") == 2
