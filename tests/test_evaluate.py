"""ROUGE on hand-checked pairs, and `pipetune eval` showing that a short demo-like fine-tune beats the base."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from pipetune import evaluate as evaluate_module
from pipetune.cli import main
from pipetune.config import Config, ConfigError
from pipetune.data.sources import load_dataset
from pipetune.evaluate import EvalResult, ModelScores, evaluate, rouge_scores, split_sentences

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


class _Model:
    """Stands in for the PEFT model: the fine-tuned one writes the reference summaries, the base one writes nothing."""

    def __init__(self, references: dict[str, str]) -> None:
        self.references, self.adapter = references, True

    @contextlib.contextmanager
    def disable_adapter(self):
        self.adapter = False
        yield
        self.adapter = True


def _evaluate_with_a_stand_in_model(monkeypatch: pytest.MonkeyPatch, config: Config, tmp_path: Path) -> EvalResult:
    """evaluate() on config's real validation split, its model replaced (loss: 1.0 tuned, 2.0 base)."""
    validation = load_dataset(config.data, seed=config.train.seed).splits["validation"]
    references = {e.transcript: e.summary for e in validation}
    model = _Model(references)
    prepared = types.SimpleNamespace(prompts=None, pad_id=0)
    monkeypatch.setattr(evaluate_module, "load_finetuned", lambda config, adapter: (model, prepared))
    monkeypatch.setattr(evaluate_module, "tokenize_split", lambda examples, prompts, pad_id: examples)
    monkeypatch.setattr(evaluate_module, "mean_token_loss", lambda model, split, batch: 1.0 if model.adapter else 2.0)

    def summarize(model, prepared, transcripts, max_new_tokens, batch_size, progress=None, systems=None):
        return [model.references[t] if model.adapter else "The team met." for t in transcripts]

    monkeypatch.setattr(evaluate_module, "summarize", summarize)
    return evaluate(config, tmp_path / "adapter")


def test_bad_eval_settings_are_refused_before_the_model_loads(tmp_path: Path) -> None:
    """Counts below 1 are named; an empty synthetic validation split names the setting that draws one."""
    config = Config()
    config.data.source, config.data.synthetic_train, config.data.synthetic_validation = "synthetic", 2, 0
    with pytest.raises(ConfigError, match=r"--batch-size 0 must be at least 1"):
        evaluate(config, tmp_path, batch_size=0)
    with pytest.raises(ConfigError, match=r"--max-new-tokens 0 must be at least 1 \(or left out"):
        evaluate(config, tmp_path, max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"no such split .* draw validation meetings with data.synthetic_validation"):
        evaluate(config, tmp_path)


def test_cached_base_scores_are_those_of_the_same_meetings() -> None:
    """The base scores' settings hold a digest of the scored meetings: a data file edited under the same name
    scores the base again."""
    import dataclasses

    from pipetune.evaluate import base_settings

    config = Config()
    config.data.source, config.data.synthetic_train, config.data.synthetic_validation = "synthetic", 2, 2
    examples = load_dataset(config.data, seed=config.train.seed).splits["validation"]
    settings = base_settings(config, "validation", None, 8, examples)
    assert settings == base_settings(config, "validation", None, 8, list(examples))
    edited = [dataclasses.replace(examples[0], summary="Another summary."), *examples[1:]]
    assert settings != base_settings(config, "validation", None, 8, edited)


def test_fact_recall_of_whole_meetings_reaches_the_table_and_eval_json(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The validation meetings' facts come from the data: the tuned model writes the references (all facts stated),
    the base model a sentence without any."""
    config = Config()
    config.data.source, config.data.synthetic_lengths = "synthetic", "whole"
    config.data.synthetic_train, config.data.synthetic_validation = 2, 4
    result = _evaluate_with_a_stand_in_model(monkeypatch, config, tmp_path)
    facts = sum(len(e.facts) for e in load_dataset(config.data).splits["validation"])
    assert result.n_facts == facts > 4
    assert result.finetuned.fact_recall == 1.0 and result.base.fact_recall == 0.0
    table = result.table()
    assert f"validation: 4 meetings ({facts} facts)" in table and "facts" in table.splitlines()[1]
    assert "100.0" in table.splitlines()[3] and "0.0" in table.splitlines()[2]
    saved = json.loads(result.save(tmp_path / "eval.json").read_text())
    assert saved["finetuned"]["fact_recall"] == 1.0 and saved["base"]["fact_recall"] == 0.0
    assert saved["examples"][0]["fact_recall"] == 1.0 and saved["examples"][0]["facts_missed"] == []


def test_rows_without_facts_report_no_fact_recall(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rows = [{"dialogue": f"A: meeting {i} about the budget.", "summary": f"They met ({i})."} for i in range(6)]
    (tmp_path / "meetings.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = Config()
    config.data.source, config.data.validation_fraction = str(tmp_path / "meetings.jsonl"), 0.5
    result = _evaluate_with_a_stand_in_model(monkeypatch, config, tmp_path)
    assert result.n_facts == 0 and result.finetuned.fact_recall is None and result.base.fact_recall is None
    assert "facts" not in result.table() and "fact_recall" not in result.examples[0]


def test_table_marks_a_model_without_fact_recall() -> None:
    scores = ModelScores(0.5, 0.25, 0.5, loss=1.0, fact_recall=0.75)
    result = EvalResult("validation", 2, 16, "adapter", ModelScores(0.1, 0.0, 0.1, loss=3.0), scores, n_facts=8)
    base, tuned = result.table().splitlines()[2:]
    assert tuned.split() == ["fine-tuned", "50.0", "25.0", "50.0", "75.0", "1.000"]
    assert base.split() == ["base", "10.0", "0.0", "10.0", "-", "3.000"]
    result.base = None
    assert "(not scored: --no-base)" in result.table()


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
    # The short synthetic meetings know their facts: recall is scored for both models (0.0 and 0.0 measured: a tiny
    # model 25 steps from random weights writes the phrasing, not yet the exact facts).
    assert result["n_facts"] >= 8 and f"validation: 8 meetings ({result['n_facts']} facts)" in stdout
    assert 0 <= base["fact_recall"] <= 1 and 0 <= tuned["fact_recall"] <= 1


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


@pytest.mark.parametrize("lora", [False, True])
def test_mean_token_loss_in_chunks_equals_the_full_logits_loss(lora: bool) -> None:
    """Head and cross-entropy at the supervised positions only, a few rows at a time: the same mean as the whole
    batch's logits (the memory of which ran an H100 out at 32 x 8,192 tokens x 49,152 vocabulary)."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipetune.data.batching import IGNORE, TokenizedSplit
    from pipetune.generate import mean_token_loss

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, num_key_value_heads=2, **shape)).eval()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    ids = torch.randint(0, 97, (5, 24))
    labels = torch.full_like(ids, IGNORE)
    for row, (begin, end) in enumerate([(3, 20), (10, 24), (0, 1), (5, 5), (12, 18)]):
        labels[row, begin:end] = torch.randint(0, 97, (end - begin,))
    split = TokenizedSplit(ids, labels, torch.full((5,), 24))
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    full = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    expected = float(full) / int((labels != IGNORE).sum())
    # batch 2 of 5 rows (a short last batch), 7 positions a chunk: every batch's 6-31 positions split into several
    head_rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, out: head_rows.append(out.shape[0]))
    assert mean_token_loss(model, split, batch_size=2, chunk_rows=7) == pytest.approx(expected, rel=1e-5)
    hook.remove()
    assert max(head_rows) == 7 and sum(head_rows) == int((labels != IGNORE).sum()) and len(head_rows) > 3
    assert mean_token_loss(model, split, batch_size=8) == pytest.approx(expected, rel=1e-5)
