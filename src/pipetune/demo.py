"""What `pipetune demo` shows after training: validation loss (and, for a real model, ROUGE) before and after,
and a held-out meeting's summary beside its reference."""

from __future__ import annotations

import textwrap
from pathlib import Path

from pipetune.config import Config
from pipetune.data.batching import tokenize_split
from pipetune.data.sources import load_dataset
from pipetune.evaluate import EvalResult, evaluate
from pipetune.generate import load_finetuned, mean_token_loss, summarize

EVAL_MEETINGS = 16
"""Held-out meetings scored by the real-model demo."""


def show_results(config: Config) -> dict[str, float]:
    """Load the run's adapter with PEFT in this process, compare with the base model, print a summary."""
    run_dir = Path(config.output.dir)
    model, prepared = load_finetuned(config, run_dir / "adapter")
    validation = load_dataset(config.data, seed=config.train.seed).splits["validation"]
    split = tokenize_split(validation, prepared.prompts, prepared.pad_id)
    tuned = mean_token_loss(model, split)
    with model.disable_adapter():
        base = mean_token_loss(model, split)
    meeting = validation[0]
    generated = summarize(model, prepared, [meeting.transcript], max_new_tokens=config.data.max_summary_tokens)[0]

    print(f"\nvalidation loss on {len(split)} held-out meetings: {base:.3f} before, {tuned:.3f} after fine-tuning")
    print("\nheld-out meeting (start):")
    print(textwrap.indent(meeting.transcript[:400] + " ...", "  "))
    print("\nreference summary:")
    print(textwrap.indent(textwrap.fill(meeting.summary, 96), "  "))
    print("\nfine-tuned model's summary (greedy):")
    print(textwrap.indent(textwrap.fill(generated or "(empty)", 96), "  "))
    print(f"\nrun directory: {run_dir}  (config.toml, metrics.csv, adapter/)")
    return {"validation_loss_before": base, "validation_loss_after": tuned}


def show_evaluation(config: Config, limit: int = EVAL_MEETINGS) -> EvalResult:
    """ROUGE and loss of the base and the fine-tuned model on held-out meetings (eval.json), and one summary of each."""
    run_dir = Path(config.output.dir)
    result = evaluate(config, run_dir / "adapter", "validation", limit)
    result.save(run_dir / "eval.json")
    print()
    print(result.table())
    example = result.examples[0]
    for title, text in (
        ("reference summary", example["reference"]),
        ("base model's summary (greedy)", example["base"]),
        ("fine-tuned model's summary (greedy)", example["finetuned"]),
    ):
        print(f"\n{title}:")
        print(textwrap.indent(textwrap.fill(text or "(empty)", 96), "  "))
    print(f"\nrun directory: {run_dir}  (config.toml, metrics.csv, adapter/, eval.json)")
    return result
