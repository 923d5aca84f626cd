"""Inference in one process: the base model plus a saved PEFT adapter, prompts built exactly as in training."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from peft import PeftModel
from torch import nn

from pipetune.config import Config
from pipetune.data.batching import IGNORE, TokenizedSplit
from pipetune.model.load import DTYPES, build_model
from pipetune.preflight import Prepared, prepare


def load_finetuned(
    config: Config, adapter_dir: str | Path, device: torch.device | None = None
) -> tuple[PeftModel, Prepared]:
    """The full base model of `config` with the adapter loaded by PEFT, in eval mode."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    prepared = prepare(config)
    base, _ = build_model(prepared.model, DTYPES[config.model.dtype], device, seed=config.train.seed)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    return model, prepared


@torch.no_grad()
def mean_token_loss(model: nn.Module, split: TokenizedSplit, batch_size: int = 8) -> float:
    """Sum of summary-token cross-entropies / number of summary tokens, over the whole split."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(split), batch_size):
        ids = split.input_ids[start : start + batch_size].to(device)
        labels = split.labels[start : start + batch_size].to(device)
        logits = model(input_ids=ids, use_cache=False).logits
        total += float(
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        )
        count += int((labels != IGNORE).sum())
    return total / max(count, 1)


@torch.no_grad()
def summarize(
    model: nn.Module,
    prepared: Prepared,
    transcripts: list[str],
    max_new_tokens: int = 128,
    batch_size: int = 8,
) -> list[str]:
    """Greedy summaries, left-padded batches; generation stops at the token that closes the assistant turn."""
    tokenizer, prompts = prepared.tokenizer, prepared.prompts
    device = next(model.parameters()).device
    stop_id = prompts.end_ids[0]
    outputs: list[str] = []
    for start in range(0, len(transcripts), batch_size):
        batch = [prompts.prompt_ids(text) for text in transcripts[start : start + batch_size]]
        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), prepared.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        generated = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop_id,
            pad_token_id=prepared.pad_id,
            use_cache=True,
        )
        for row in generated[:, width:].tolist():
            if stop_id in row:
                row = row[: row.index(stop_id)]
            outputs.append(tokenizer.decode(row, skip_special_tokens=True).strip())
    return outputs
