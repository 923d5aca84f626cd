"""ROUGE, fact recall and token loss of the base model and the fine-tuned one on a held-out split.

    pipetune eval --run runs/demo
    pipetune eval --adapter runs/x/adapter --config my.toml --split test --limit 50

Both models are the same PEFT model: the base is scored with the adapter disabled, so the
comparison isolates what fine-tuning learned. ROUGE is rouge-score's F-measure (Porter stemmer),
averaged over the split; for ROUGE-Lsum each text is split into one sentence per line first.
Fact recall, for meetings that know their facts (synthetic ones: decisions, action items, figures), is the share of
a meeting's facts the generated summary states, averaged over those meetings; a fact is stated when each of its
key strings appears in the summary, in one of its written forms, after data/facts.normalize (case, punctuation,
whitespace, thousands separators). Real data has no facts and reports no recall (None), not 0.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipetune.config import Config, ConfigError
from pipetune.data.batching import tokenize_split
from pipetune.data.example import Example
from pipetune.data.facts import MAX_GAP, fact_recall, mean_fact_recall, states
from pipetune.data.sources import load_dataset
from pipetune.files import write_atomic
from pipetune.generate import load_finetuned, mean_token_loss, summarize
from pipetune.metrics import TaskProgress

ROUGE_KEYS = ("rouge1", "rouge2", "rougeLsum")
ROUGE_NAMES = {"rouge1": "ROUGE-1", "rouge2": "ROUGE-2", "rougeLsum": "ROUGE-Lsum"}
N_EXAMPLES_SAVED = 3
"""Generated summaries kept in eval.json beside the scores, for a look at what the numbers mean."""

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> str:
    """One sentence per line (a break after '. ', '! ' and '? '): the form ROUGE-Lsum reads sentences from."""
    return "\n".join(part.strip() for part in _SENTENCE_END.split(text.strip()) if part.strip())


def rouge_scorer() -> object:
    """rouge-score's scorer for ROUGE-1/2/Lsum with the Porter stemmer; a clear error when it is missing."""
    try:
        from rouge_score import rouge_scorer as scorers
    except ImportError:
        raise ConfigError(
            "ROUGE needs the rouge-score package, which is not installed: pip install 'pipetune[eval]'"
        ) from None
    return scorers.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def rouge_scores(predictions: list[str], references: list[str], scorer: object | None = None) -> dict[str, float]:
    """ROUGE-1, ROUGE-2 and ROUGE-Lsum F-measures (0..1), each averaged over the pairs."""
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")
    scorer = scorer or rouge_scorer()
    sums = dict.fromkeys(ROUGE_KEYS, 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        scores = scorer.score(split_sentences(reference), split_sentences(prediction))  # (target, prediction)
        for key in ROUGE_KEYS:
            sums[key] += scores[key].fmeasure
    return {key: total / max(len(predictions), 1) for key, total in sums.items()}


@dataclass
class ModelScores:
    rouge1: float
    rouge2: float
    rougeLsum: float  # noqa: N815 (rouge-score's name)
    loss: float
    """Mean cross-entropy per summary token (teacher forcing), as in training."""
    fact_recall: float | None = None
    """Share of each meeting's facts its generated summary states (0..1), averaged over the meetings that have facts;
    None when none has (real data)."""


@dataclass
class EvalResult:
    split: str
    n_examples: int
    max_new_tokens: int
    adapter: str
    base: ModelScores | None
    """None with --no-base."""
    finetuned: ModelScores
    examples: list[dict[str, Any]] = field(default_factory=list)
    """The first few meetings: reference, base (when scored) and fine-tuned summaries."""
    base_settings: dict[str, Any] = field(default_factory=dict)
    """What the base scores depend on; a later eval with the same settings reuses them."""
    n_facts: int = 0
    """Facts of the scored meetings, all together (0: meetings without facts, no fact recall)."""

    def table(self) -> str:
        """Scores in percent (ROUGE, fact recall) and nats per token (loss), one row per model; the fact recall
        column only where the meetings have facts."""
        with_facts = self.n_facts > 0
        header = f"{'model':<12}" + "".join(f"{ROUGE_NAMES[key]:>12}" for key in ROUGE_KEYS)
        header += f"{'facts':>10}" * with_facts + f"{'loss':>10}"
        facts = f" ({self.n_facts} facts)" if with_facts else ""
        lines = [
            f"{self.split}: {self.n_examples} meetings{facts}, greedy, at most {self.max_new_tokens} new tokens",
            header,
        ]
        for name, scores in (("base", self.base), ("fine-tuned", self.finetuned)):
            if scores is None:
                lines.append(f"{name:<12}{'(not scored: --no-base)':>{46 + 10 * with_facts}}")
                continue
            values = "".join(f"{100 * getattr(scores, key):>12.1f}" for key in ROUGE_KEYS)
            if with_facts:
                recall = scores.fact_recall
                values += f"{100 * recall:>10.1f}" if recall is not None else f"{'-':>10}"
            lines.append(f"{name:<12}{values}{scores.loss:>10.3f}")
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """Write eval.json through a temporary file and a rename."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(asdict(self), indent=2, ensure_ascii=False) + "\n")
        return path


def base_settings(
    config: Config, split: str, limit: int | None, max_new_tokens: int, examples: list[Example]
) -> dict[str, Any]:
    """Everything the base model's scores depend on: the model, the data and prompt settings, the seed (random
    init, synthetic data, hold-out), the split, its length, the generation cap, the scored examples themselves
    (a data file edited under the same name) and how facts are matched."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(json.dumps([e.transcript, e.summary, e.system, [f.keys for f in e.facts]]).encode())
    return {
        "model": asdict(config.model),
        "data": asdict(config.data),
        "seed": config.train.seed,
        "split": split,
        "limit": limit,
        "max_new_tokens": max_new_tokens,
        "examples_sha256": digest.hexdigest(),
        "fact_matching": f"keys in one clause, at most {MAX_GAP} words apart",
    }


def cached_base(path: Path, settings: dict[str, Any]) -> tuple[ModelScores, list[str]] | None:
    """The base scores and example summaries of an earlier eval.json made with the same settings, if any."""
    if not path.is_file():
        return None
    try:
        earlier = json.loads(path.read_text())
        if earlier.get("base_settings") != settings or earlier.get("base") is None:
            return None
        return ModelScores(**earlier["base"]), [example["base"] for example in earlier.get("examples", [])]
    except (ValueError, TypeError, KeyError):  # an older or hand-edited file: score again
        return None


def evaluate(
    config: Config,
    adapter_dir: str | Path,
    split: str = "validation",
    limit: int | None = None,
    max_new_tokens: int | None = None,
    batch_size: int = 8,
    progress: TaskProgress | None = None,
    base: str = "score",
    cache: Path | None = None,
) -> EvalResult:
    """Generate summaries of `split` with the base and the fine-tuned model; score ROUGE and token loss of each.

    `base`: "score", or "skip" (--no-base). Base scores found in `cache` (an earlier eval.json) made with the
    same settings are reused either way: the base model does not change between runs."""
    check_eval_arguments(limit, batch_size, max_new_tokens)
    max_new_tokens = config.data.max_summary_tokens if max_new_tokens is None else max_new_tokens
    progress = progress or TaskProgress(enabled=False)
    examples = split_examples(config, split)[:limit]
    scorer = rouge_scorer()  # a missing rouge-score fails here, before the model is built
    settings = base_settings(config, split, limit, max_new_tokens, examples)
    reused = cached_base(cache, settings) if cache is not None else None

    progress.note(f"eval: loading {config.model.name} + adapter {adapter_dir}")
    model, prepared = load_finetuned(config, adapter_dir)
    tokenized = tokenize_split(examples, prepared.prompts, prepared.pad_id)
    transcripts = [example.transcript for example in examples]
    references = [example.summary for example in examples]
    facts = [example.facts for example in examples]

    def score(name: str) -> tuple[ModelScores, list[str]]:
        progress.note(f"eval: {name} model: token loss, then summaries of {len(examples)} {split} meetings")
        loss = mean_token_loss(model, tokenized, batch_size)
        generated = summarize(
            model,
            prepared,
            transcripts,
            max_new_tokens,
            batch_size,
            progress=progress.task(name, len(examples)),
            systems=[example.system for example in examples],
        )
        recall = mean_fact_recall(generated, facts)
        return ModelScores(**rouge_scores(generated, references, scorer), loss=loss, fact_recall=recall), generated

    base_scores, base_summaries = None, None
    if reused is not None:
        base_scores, base_summaries = reused
        progress.note(f"eval: base model scores reused from {cache} (same model, data and generation settings)")
    elif base == "score":
        with model.disable_adapter():
            base_scores, base_summaries = score("base")
    finetuned, tuned_summaries = score("fine-tuned")
    shown = saved_examples(references, tuned_summaries, base_summaries, facts)
    base_record = settings if base_scores is not None else {}
    return EvalResult(
        split,
        len(examples),
        max_new_tokens,
        str(adapter_dir),
        base_scores,
        finetuned,
        shown,
        base_record,
        n_facts=sum(map(len, facts)),
    )


def check_eval_arguments(limit: int | None, batch_size: int, max_new_tokens: int | None) -> None:
    """`pipetune eval`'s counts: one line naming a bad one."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit {limit} must be at least 1 (or left out for the whole split)")
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be at least 1 (meetings generated together, e.g. 8)")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ConfigError(
            f"--max-new-tokens {max_new_tokens} must be at least 1 (or left out: data.max_summary_tokens)"
        )


def split_examples(config: Config, split: str) -> list:
    """The meetings of `split` of the run's data, or one line naming the splits there are and how to make one."""
    dataset = load_dataset(config.data, seed=config.train.seed)
    if split not in dataset.splits or not dataset.splits[split]:
        available = ", ".join(name for name, rows in dataset.splits.items() if rows) or "none"
        hold_out = (  # synthetic data draws its validation meetings apart; other sources split theirs off
            "draw validation meetings with data.synthetic_validation (e.g. 16)"
            if config.data.source == "synthetic"
            else "hold out a validation split with data.validation_fraction"
        )
        raise ConfigError(
            f"--split {split!r}: data.source = {config.data.source!r} has no such split (splits: {available}); "
            f"choose one of those, or {hold_out}"
        )
    return dataset.splits[split]


def saved_examples(
    references: list[str], tuned: list[str], base: list[str] | None, facts: list[list]
) -> list[dict[str, Any]]:
    """The first N_EXAMPLES_SAVED meetings as eval.json shows them: reference, fine-tuned (and base) summary, and
    the facts the fine-tuned one missed."""
    shown = []
    for i in range(min(N_EXAMPLES_SAVED, len(references))):
        example: dict[str, Any] = {"reference": references[i], "finetuned": tuned[i]}
        if base is not None and i < len(base):
            example["base"] = base[i]
        if facts[i]:
            example["fact_recall"] = fact_recall(tuned[i], facts[i])
            example["facts_missed"] = [fact.text for fact in facts[i] if not states(tuned[i], fact)]
        shown.append(example)
    return shown
