"""What `pipetune demo` says before training (what runs, what to expect) and shows after: validation loss (and,
for a real model, ROUGE) before and after, and a held-out meeting's summary beside its reference."""

from __future__ import annotations

import textwrap
from pathlib import Path

import torch

from pipetune.config import Config
from pipetune.data.batching import tokenize_split
from pipetune.data.sources import load_dataset
from pipetune.evaluate import EvalResult, evaluate
from pipetune.generate import load_finetuned, mean_token_loss, summarize
from pipetune.metrics import TaskProgress

EVAL_MEETINGS = 16
"""Held-out meetings scored by the real-model demo."""


def few_steps_note(steps: int, default: Config) -> str | None:
    """A note when `--steps` is too few for the demo to show fine-tuning: no more than the learning-rate warm-up,
    or under a tenth of the steps the demo config was tuned for. None otherwise."""
    t = default.train
    if steps < 1 or (steps > t.warmup_steps and steps * 10 >= t.max_steps):  # -1: every epoch; 0: validation's
        return None
    return (
        f"--steps {steps} is too few to teach the model: the first {t.warmup_steps} steps only warm the learning rate "
        f"up, and the demo's default, {t.max_steps} steps, is what it is tuned for (the validation loss falls over "
        "most of them); expect the fine-tuned model to do little better than the base model"
    )


def intro(config: Config) -> str:
    """The demo's first lines: the model, the data and the layout, and why some of the output looks as it does."""
    from transformers import AutoModelForCausalLM

    from pipetune.model.shapes import resolve_model

    resolved = resolve_model(config.model)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(resolved.config).parameters())
    d, t, p = config.data, config.train, config.parallel
    layout = f"the model split into {p.pp} pipeline stages ({p.pp} processes, {p.schedule})"
    truncation = (
        f"The transcripts are longer than data.max_length = {d.max_length} tokens, so nearly every one is cut to "
        'fit: its head and tail are kept and its middle replaced by "[...]", as it would be for a real model.'
    )
    if config.model.init == "random":
        head = (
            f"pipetune demo: LoRA fine-tuning of {config.model.name}, a {n_params / 1e6:.1f}M-parameter Qwen3 with "
            f"random weights (it starts knowing no language), on {d.synthetic_train} synthetic design meetings for "
            f"{t.max_steps} optimizer steps, {layout}. No download."
        )
        notes = [
            truncation,
            "The validation loss is measured before the first step (the base model) and as training goes; it starts "
            "near 9 nats per summary token and falls as the adapters learn (to about 1.1 after the default 150 steps).",
            "A model this small, from random weights, learns the meetings' phrasing but not language: its summaries "
            "name the right kind of facts and often repeat or loop. That is expected here. A real model learns the "
            "task: pipetune train --config qwen3-4b-ami (Qwen3-4B on AMI meetings, on GPUs).",
        ]
    else:
        head = (
            f"pipetune demo: LoRA fine-tuning of {config.model.name}, a pretrained {n_params / 1e6:.0f}M-parameter "
            f"{resolved.config.model_type} model, on {d.synthetic_train} synthetic design meetings for {t.max_steps} "
            f"optimizer steps, {layout}."
        )
        notes = [
            truncation,
            f"After training, the base and the fine-tuned model summarize {EVAL_MEETINGS} held-out meetings "
            "(greedy decoding): ROUGE of both, and one meeting's summaries beside its reference.",
        ]
    lines = textwrap.wrap(head, 100)
    for note in notes:
        lines += textwrap.wrap(note, 100, initial_indent="  - ", subsequent_indent="    ")
    return "\n".join(lines) + "\n"


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
    print(
        "\n(a model this small, trained from random weights, writes in the meetings' phrasing and often repeats "
        "itself:\n expected here; the validation loss above measures what it learned. The commands above show more.)"
    )
    return {"validation_loss_before": base, "validation_loss_after": tuned}


def show_evaluation(config: Config, limit: int = EVAL_MEETINGS) -> EvalResult:
    """ROUGE and loss of the base and the fine-tuned model on held-out meetings (eval.json), and one summary of each."""
    run_dir = Path(config.output.dir)
    with TaskProgress() as progress:  # on stderr: a bar on a terminal, else a line per batch with elapsed time
        result = evaluate(config, run_dir / "adapter", "validation", limit, progress=progress)
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
