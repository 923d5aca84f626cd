"""`pipetune bench` compares strategies in one invocation and measures the pipeline bubble."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli, tiny_config, write_config

pytestmark = pytest.mark.slow  # multi-process end-to-end runs: pytest -m "not slow" leaves them out


def test_bench_runs_strategies_and_reports_bubble(tmp_path: Path) -> None:
    """A pipeline (2 processes) and one process; ddp's config is checked in tests/parallel/test_fsdp.py and
    test_tensor_parallel.py (strategy_config), and its run measured as the pipeline's is."""
    config = write_config(tiny_config(tmp_path / "unused"), tmp_path / "c.toml")
    out = tmp_path / "bench"
    result = run_cli(
        "bench",
        "--config",
        str(config),
        "--strategies",
        "pp,single",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    )
    rows = json.loads((out / "bench.json").read_text())
    assert [r["strategy"] for r in rows] == ["pp", "single"]
    pp, single = rows
    assert (pp["gpus"], single["gpus"]) == (2, 1)
    assert pp["timed_steps"] == single["timed_steps"] == 2
    assert all(r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    assert len(pp["peak_gb_per_rank"]) == 2 and len(single["peak_gb_per_rank"]) == 1
    assert pp["expected_bubble"] == 1 / 5  # (p - 1) / (m + p - 1) with p = 2, m = 4
    assert len(pp["bubble_per_rank"]) == 2 and all(0 <= b < 1 for b in pp["bubble_per_rank"])
    assert "bubble_per_rank" not in single
    timeline = json.loads((out / "pp" / "timeline.json").read_text())
    kinds = sorted({(a["rank"], a["kind"]) for a in timeline["actions"]})
    assert kinds == [(0, "B"), (0, "F"), (1, "B"), (1, "F"), (1, "L")]  # the loss: work on the last stage
    last = {(a["kind"], a["microbatch"]): a for a in timeline["actions"] if a["rank"] == 1}
    assert sorted(mb for kind, mb in last if kind == "L") == [0, 1, 2, 3]  # one per microbatch, F then L then B
    assert all(last["F", mb]["end_ms"] <= last["L", mb]["start_ms"] <= last["L", mb]["end_ms"] for mb in range(4))
    assert all(last["L", mb]["end_ms"] <= last["B", mb]["start_ms"] for mb in range(4))
    for png in (out / "bench.png", out / "pp" / "timeline.png"):
        assert png.read_bytes().startswith(b"\x89PNG")
    assert "pipetune bench" in result.stdout
    # Each row names what it measured, and the table says it too, leading with real (non-pad) tokens/s.
    import torch

    for row in rows:
        setup = row["setup"]
        assert (setup["model"], setup["dtype"], setup["row_tokens"], setup["rows_per_step"]) == (
            "tiny-qwen3",
            "float32",
            128,
            8,
        )
        assert setup["versions"]["torch"] == torch.__version__ and setup["gpu"].startswith("none (CPU")
        assert setup["switches"]["train.compile"] == "auto"  # as the config asks; the run's own resolution beside
        resolved = row["resolved_switches"]
        assert resolved["switches"]["train.compile"] is False and resolved["reasons"]["train.compile"] == "CPU"
        assert resolved["line"].startswith("speed: fast LoRA path off (CPU")
        assert setup["attention_share"] == 1.0  # unpacked rows attend whole
    assert (pp["setup"]["layout"]["pp"], single["setup"]["layout"]["pp"]) == (2, 1)
    assert all(0 < r["real_tokens_per_sec"] <= r["tokens_per_sec"] for r in rows)
    assert "real tokens/s" in result.stdout and "tiny-qwen3 (float32, LoRA r16), 8 rows x 128 tokens" in result.stdout
    # It talks while it runs: each strategy's phases with the seconds since its launch, in order.
    said = [line for line in result.stdout.splitlines() if line.startswith("bench: pp: ")]
    starting = [line.split(": ")[2].split(" (")[0] for line in said[:6]]
    assert starting == ["launch", "setup", "data", "load", "ready", "optimizer"], said
    assert any("warm-up step 1/1 (compiles, records graphs)" in line for line in said), said
    assert any("timed step 2" in line for line in said) and "done" in said[-1], said
    assert all(0 < r["load_s"] < r["first_step_s"] and r["load_peak_gb"] > 0 for r in rows)


def test_bench_reports_a_strategy_past_its_timeout_and_runs_the_next(tmp_path: Path) -> None:
    config = write_config(tiny_config(tmp_path / "unused"), tmp_path / "c.toml")
    out = tmp_path / "bench"
    # 1 s: no strategy gets past its start; each is ended and reported, and the next one still runs.
    args = ["bench", "--config", str(config), "--strategies", "pp,single", "--steps", "1", "--warmup", "1"]
    result = run_cli(*args, "--out", str(out), "--timeout", "1", check=False)
    assert result.returncode == 1
    rows = json.loads((out / "bench.json").read_text())
    assert [r["strategy"] for r in rows] == ["pp", "single"]
    assert all(r["error"].startswith("timed out after 1 s in ") and r["last_phase"] for r in rows), rows
    assert "bench: single: timed out after 1 s in " in result.stdout


def test_a_strategy_timed_out_after_timed_steps_keeps_their_figures(tmp_path: Path) -> None:
    """The 72B shape's NF4 run ended all its steps, then the timeout came while it saved: its steps count."""
    from pipetune.bench import FlopCount, strategy_result

    (tmp_path / "metrics.csv").write_text(
        "step,loss,tokens_per_sec,real_tokens_per_sec,step_time_sec,peak_gb_rank0\n"
        "1,9.0,100,90,8.0,5.0\n2,8.0,1000,900,0.8,6.0\n3,7.0,2000,1800,0.4,6.5\n"
    )
    ended = {"error": "timed out after 155 s in done", "last_phase": "done", "load_s": 38.0}
    result = strategy_result(ended, tmp_path, "ddp", 1, 2, FlopCount(1e9, 790.0))
    assert result["timed_out"] == ended["error"] and "error" not in result
    assert (result["timed_steps"], result["peak_gb_per_rank"]) == (2, [6.5])
    # The timed steps' tokens over their time (not a median of the rows' rates: 1,500).
    assert result["tokens_per_sec"] == pytest.approx((1000 * 0.8 + 2000 * 0.4) / 1.2)
    assert result["step_time_sec"] == pytest.approx(0.6)
    warming = {"error": "timed out after 155 s in warm-up step 1/1", "last_phase": "warm-up step 1/1"}
    assert strategy_result(warming, tmp_path, "ddp", 3, 2, FlopCount(1e9, 790.0)) == {"strategy": "ddp", **warming}
    failed = {"error": "exit code 1 in timed step 2", "last_phase": "timed step 2"}
    assert strategy_result(failed, tmp_path, "ddp", 1, 2, FlopCount(1e9, 790.0)) == {"strategy": "ddp", **failed}
    # A run that ended well without a timed step is an error entry, not a crash of the whole bench.
    assert strategy_result({"load_s": 38.0}, tmp_path, "ddp", 3, 2, FlopCount(1e9, 790.0)) == {
        "strategy": "ddp",
        "load_s": 38.0,
        "error": "no timed step in metrics.csv",
    }


def test_the_padding_share_is_over_the_timed_tokens_and_ranks_are_in_order(tmp_path: Path) -> None:
    """The pad share is 1 - real tokens / tokens of the timed steps (not a ratio of two medians of other rows);
    rows that cover several steps weigh as many; rank 10's peak comes after rank 9's; a loss that is not a number
    (every step of the row skipped) is null in bench.json."""
    from pipetune.bench import FlopCount, strategy_result

    peaks = ",".join(f"peak_gb_rank{r}" for r in range(11))
    values = ",".join(str(r) for r in range(11))
    (tmp_path / "metrics.csv").write_text(
        f"step,loss,tokens_per_sec,real_tokens_per_sec,step_time_sec,{peaks}\n"
        f"2,9.0,1000,950,1.0,{values}\n4,8.0,2000,1000,1.0,{values}\n5,nan,3000,2950,1.0,{values}\n"
    )
    result = strategy_result({}, tmp_path, "ddp", 0, 11, FlopCount(1e9, 790.0))
    tokens, real = 1000 * 2 + 2000 * 2 + 3000, 950 * 2 + 1000 * 2 + 2950
    assert result["pad_share"] == pytest.approx(1 - real / tokens)
    assert result["peak_gb_per_rank"] == [float(r) for r in range(11)] and result["final_loss"] is None


def test_packed_rows_mfu_counts_the_attention_each_step_drew(tmp_path: Path) -> None:
    """Packed rows record their own attention share (metrics' attention_share): MFU counts each row's tokens at its
    own FLOPs a token (the epoch's share moved to the row's) over the timed seconds, and the timed rows' mean share
    is reported. A run without the column keeps the plain count."""
    from pipetune.bench import FlopCount, strategy_result

    (tmp_path / "metrics.csv").write_text(
        "step,loss,tokens_per_sec,real_tokens_per_sec,step_time_sec,peak_gb_rank0,attention_share\n"
        "1,9.0,1000,990,1.0,5.0,0.2\n2,8.0,900,890,1.0,5.0,0.6\n3,7.0,1100,1090,1.0,5.0,0.1\n"
    )
    flops, per_share, share = 1e9, 5e8, 0.3
    result = strategy_result({}, tmp_path, "single", 0, 1, FlopCount(flops, 790.0, per_share, share))
    achieved = sum(t * (flops + per_share * (s - share)) for t, s in ((1000, 0.2), (900, 0.6), (1100, 0.1))) / 3
    assert result["mfu"] == pytest.approx(achieved / 790e12)
    assert result["mfu"] != pytest.approx(1000 * flops / 790e12)  # the epoch's share: the heavy step undercounted
    assert result["timed_attention_share"] == pytest.approx(0.3)
    plain = strategy_result({}, tmp_path, "single", 0, 1, FlopCount(flops, 790.0))  # no FLOPs per share: plain
    assert plain["mfu"] == pytest.approx(1000 * flops / 790e12)  # 3,000 tokens in 3 s
    # The table says when the timed rows' share is 5% or more off the epoch's (not when it is within).
    from pipetune.bench import drawn_rows_notes

    (note,) = drawn_rows_notes([{**result, "setup": {"attention_share": 0.25}}])
    assert note.startswith("note: single's timed steps drew packed rows of 30% attention share against the epoch's 25%")
    assert drawn_rows_notes([{**result, "setup": {"attention_share": 0.29}}]) == []


def test_bench_removes_only_its_own_earlier_runs(tmp_path: Path) -> None:
    from pipetune.bench import clear_previous_run
    from pipetune.config import ConfigError

    mine, theirs = tmp_path / "pp", tmp_path / "single"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "config.toml").write_text("")
    (mine / "progress.jsonl").write_text("")
    clear_previous_run(mine)
    assert not mine.exists()
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="is not an earlier bench run of this strategy"):
        clear_previous_run(theirs)
    assert (theirs / "notes.txt").read_text() == "keep me"
