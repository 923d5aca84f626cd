"""benchmarks/tools/fact_recall.py end to end on CPU: a tiny model, one step per run, two held-out meetings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.benchmarks.test_tools import run_tool


@pytest.mark.slow
def test_fact_recall_benchmark_trains_both_runs_and_compares_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As its command line runs it, in this process (its runs train in the process that calls it either way), in
    two calls as on a GPU machine: the whole run alone, then the cut run and the scores, reusing the whole run."""
    out = tmp_path / "fact-recall"
    args = ["--model", "tiny-qwen3", "--out", str(out), "--steps", "1", "--train-meetings", "4", "--meetings", "2"]
    args += ["--max-length", "256", "--cut-length", "128", "--max-new-tokens", "4", "--target", "0"]
    with pytest.raises(SystemExit) as ended:
        run_tool("fact_recall", *args, "--only", "whole", monkeypatch=monkeypatch)
    assert ended.value.code == 0 and (out / "whole" / "adapter").is_dir() and not (out / "cut").exists()
    trained = (out / "whole" / "metrics.csv").stat().st_mtime_ns
    with pytest.raises(SystemExit) as ended:
        run_tool("fact_recall", *args, "--reuse", monkeypatch=monkeypatch)
    printed = capsys.readouterr()
    assert "whole: reusing" in printed.out and (out / "whole" / "metrics.csv").stat().st_mtime_ns == trained
    assert ended.value.code == 0, printed.out + printed.err
    assert "2 held-out whole meetings" in printed.out and "trained on cut meetings" in printed.out
    result = json.loads((out / "result.json").read_text())
    assert result["tokens_per_step"] == {"whole": 2 * 256, "cut": 4 * 128}  # the same tokens a step
    runs = result["results"]
    assert set(runs) == {"whole", "cut", "cut_reading_whole"}
    assert runs["whole"]["n_facts"] == runs["cut"]["n_facts"] > 0  # the same held-out meetings
    for name in ("whole", "cut"):
        assert 0 <= runs[name]["finetuned"]["fact_recall"] <= 1 and runs[name]["base"]["fact_recall"] is not None
        assert (out / name / "adapter").is_dir() and (out / name / f"eval-{name}.json").is_file()
    assert runs["cut_reading_whole"]["base"] is None
    # What each prompt shows: a longer window keeps a longer head and tail of the same transcript.
    assert 0 <= result["facts_in_view"]["cut"] <= result["facts_in_view"]["whole"] <= 1
    assert "facts the prompt itself mentions" in printed.out
    # Scored again with this version's matching (the same here), from the meetings drawn again.
    with pytest.raises(SystemExit) as ended:
        run_tool("fact_recall", *args, "--rescore", str(out / "result.json"), monkeypatch=monkeypatch)
    rescored = json.loads((out / "result-rescored.json").read_text())
    assert ended.value.code == 0 and set(rescored) == set(runs)
    assert all(r["now"] == r["stored"] for run in rescored.values() for r in run.values())


@pytest.mark.slow
def test_fact_recall_vary_trains_the_whole_run_once_per_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--vary lora.dropout=0.15,0: two whole-meeting runs, the same held-out meetings scored for each."""
    out = tmp_path / "vary"
    args = ["--model", "tiny-qwen3", "--out", str(out), "--steps", "1", "--train-meetings", "4", "--meetings", "2"]
    args += ["--max-length", "256", "--max-new-tokens", "4", "--vary", "lora.dropout=0.15,0"]
    with pytest.raises(SystemExit) as ended:
        run_tool("fact_recall", *args, monkeypatch=monkeypatch)
    printed = capsys.readouterr()
    assert ended.value.code == 0, printed.out + printed.err
    result = json.loads((out / "result.json").read_text())
    assert result["vary"] == "lora.dropout" and list(result["results"]) == ["0.15", "0"]
    for value, row in result["results"].items():
        assert row["steps"] == 1 and row["n_facts"] > 0 and row["validation_loss"] > 0
        saved = (out / f"lora.dropout={value}" / "config.toml").read_text()
        assert f"dropout = {float(value)}" in saved
    assert not (out / "cut").exists() and "lora.dropout=0.15" in printed.out
