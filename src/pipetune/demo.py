"""What `pipetune demo` shows after training: validation loss before/after, and a held-out summary."""

from __future__ import annotations

import textwrap
from pathlib import Path

from pipetune.config import Config
from pipetune.data.batching import tokenize_split
from pipetune.data.sources import load_dataset
from pipetune.generate import load_finetuned, mean_token_loss, summarize


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
