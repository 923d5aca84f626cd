"""ROUGE on hand-checked pairs, and `pipetune eval` showing that a short demo-like fine-tune beats the base."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipetune.cli import main
from pipetune.config import ConfigError
from pipetune.evaluate import rouge_scores, split_sentences

# Hand counts (rouge-score lowercases, drops punctuation, stems; F = 2PR / (P + R)):
#   "the cat sat on the mat" vs "the cat lay on the mat": unigrams 5 of 6 shared (the x2, cat, on, mat) -> 5/6;
#     bigrams the-cat, on-the, the-mat: 3 of 5 on each side -> 3/5.
#   "team chose rubber" vs "the team chose a rubber case": unigrams P 3/3, R 3/6 -> 2/3;
#     bigrams team-chose only: P 1/2, R 1/5 -> 2/7.
CAT = ("the cat sat on the mat", "the cat lay on the mat")
TEAM = ("team chose rubber", "the team chose a rubber case")


def test_rouge_matches_hand_counts() -> None:
    cat = rouge_scores([CAT[0]], [CAT[1]])
    assert cat["rouge1"] == pytest.approx(5 / 6) and cat["rouge2"] == pytest.approx(3 / 5)
    team = rouge_scores([TEAM[0]], [TEAM[1]])
    assert team["rouge1"] == pytest.approx(2 / 3) and team["rouge2"] == pytest.approx(2 / 7)
    both = rouge_scores([CAT[0], TEAM[0]], [CAT[1], TEAM[1]])
    assert both["rouge1"] == pytest.approx((5 / 6 + 2 / 3) / 2)
    assert both["rouge2"] == pytest.approx((3 / 5 + 2 / 7) / 2)
    assert rouge_scores([""], ["the team met"]) == {"rouge1": 0.0, "rouge2": 0.0, "rougeLsum": 0.0}


def test_rouge_lsum_reads_sentences() -> None:
    """Two sentences in swapped order: one LCS over the whole text finds 3 of 6 tokens, per sentence all 6."""
    prediction, reference = "they chose rubber. the team met.", "the team met. they chose rubber."
    assert split_sentences(reference) == "the team met.\nthey chose rubber."
    scores = rouge_scores([prediction], [reference])
    assert scores["rougeLsum"] == pytest.approx(1.0)
    # bigrams: 4 of 5 shared (rubber-the and met-they cross the sentence boundary) -> 4/5
    assert scores["rouge1"] == pytest.approx(1.0) and scores["rouge2"] == pytest.approx(4 / 5)


def test_missing_rouge_score_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rouge_score", None)  # import fails as when not installed
    with pytest.raises(ConfigError, match=r"pip install 'pipetune\[eval\]'"):
        rouge_scores(["a"], ["a"])


@pytest.fixture(scope="module")
def demo_run(demo_run: tuple[Path, subprocess.CompletedProcess]) -> Path:
    """The run directory of `pipetune demo --steps 25` (tests/conftest.py)."""
    return demo_run[0]


@pytest.mark.slow
def test_finetuned_beats_base(demo_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Measured on 8 validation meetings (48 new tokens): ROUGE-1 2.2 -> 30.9, ROUGE-2 0.0 -> 10.5,
    ROUGE-Lsum 1.9 -> 28.8, token loss 8.87 -> 3.61. The margins below are 40% of those gaps or less."""
    code = main(["eval", "--run", str(demo_run), "--limit", "8", "--max-new-tokens", "48", "--quiet"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "validation: 8 meetings" in stdout and "fine-tuned" in stdout

    result = json.loads((demo_run / "eval.json").read_text())
    base, tuned = result["base"], result["finetuned"]
    assert result["n_examples"] == 8 and len(result["examples"]) == 3
    assert tuned["rouge1"] > base["rouge1"] + 0.10
    assert tuned["rougeLsum"] > base["rougeLsum"] + 0.10
    assert tuned["rouge2"] > base["rouge2"] + 0.04
    assert tuned["loss"] < base["loss"] - 2.0


@pytest.mark.slow
def test_eval_talks_and_reuses_the_base_scores(demo_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Not on a terminal: plain progress lines on stderr. The base scores of the previous test's eval.json (same
    model, data and generation settings) are reused, not computed again; the fine-tuned ones come out the same."""
    first = json.loads((demo_run / "eval.json").read_text())
    assert main(["eval", "--run", str(demo_run), "--limit", "8", "--max-new-tokens", "48", "--no-base"]) == 0
    err = capsys.readouterr().err
    assert "base model scores reused from" in err and "fine-tuned: 0/8" in err and "fine-tuned: 8/8" in err
    assert "base: 0/8" not in err
    again = json.loads((demo_run / "eval.json").read_text())
    assert again["base"] == first["base"] and again["finetuned"] == first["finetuned"]
    assert again["examples"] == first["examples"]

    out = demo_run / "no-base.json"  # no earlier scores there: --no-base scores the fine-tuned model only
    assert (
        main(["eval", "--run", str(demo_run), "--limit", "2", "--max-new-tokens", "4", "--no-base", "--out", str(out)])
        == 0
    )
    assert "(not scored: --no-base)" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["base"] is None and "base" not in result["examples"][0] and result["finetuned"]["loss"] > 0


@pytest.mark.slow
def test_eval_rejects_unknown_split(demo_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--run", str(demo_run), "--split", "test", "--quiet"]) == 2
    error = capsys.readouterr().err
    assert "--split 'test'" in error and "train, validation" in error


def test_eval_needs_a_run_with_an_adapter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--run", str(tmp_path), "--quiet"]) == 2
    assert "has no adapter/" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_evaluation_shows_its_progress(
    demo_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real-model demo's evaluation (show_evaluation) runs for minutes on a CPU: it says what it does and how
    far it is, on stderr, while stdout keeps the table. Run on a copy of the demo's adapter, 2 meetings."""
    from pipetune.config import load_config
    from pipetune.demo import show_evaluation

    shutil.copytree(demo_run / "adapter", tmp_path / "adapter")
    config = load_config(demo_run / "config.toml", [f'output.dir="{tmp_path}"', "data.max_summary_tokens=16"])
    show_evaluation(config, limit=2)
    captured = capsys.readouterr()
    for progress in ("eval: loading", "base: 0/2 (", "base: 2/2 (", "fine-tuned: 0/2 (", "fine-tuned: 2/2 ("):
        assert progress in captured.err, captured.err
    assert "validation: 2 meetings" in captured.out and "fine-tuned: 2/2" not in captured.out
