"""Static-shape batches: every sample padded to max_length, labels shifted, a deterministic order per epoch.

`PipelineStage` fixes its shapes at the first step, so every batch has exactly the shape
[batch_size, max_length]. Labels are already shifted (labels[t] is the target of position t),
so the loss needs no copy of the logits; pads and prompt positions carry IGNORE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipetune.data.prompt import PromptBuilder
from pipetune.data.sources import Example

IGNORE = -100


@dataclass
class TokenizedSplit:
    input_ids: torch.Tensor
    """[n, max_length] int64, right-padded."""
    labels: torch.Tensor
    """[n, max_length] int64: next-token targets on supervised positions, IGNORE elsewhere."""
    real_tokens: torch.Tensor
    """[n] non-pad tokens per sample."""
    truncated: int = 0
    """Samples whose transcript or summary was cut to fit."""

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def tokenize_split(examples: list[Example], builder: PromptBuilder, pad_id: int) -> TokenizedSplit:
    length = builder.max_length
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    real = torch.zeros(len(examples), dtype=torch.long)
    truncated = 0
    for i, example in enumerate(examples):
        sample = builder.build(example.transcript, example.summary)
        ids = torch.tensor(sample.input_ids, dtype=torch.long)
        n = ids.numel()
        input_ids[i, :n] = ids
        # position t predicts token t+1: supervised targets are ids[n_prompt:], seen from positions n_prompt-1 ...
        labels[i, sample.n_prompt - 1 : n - 1] = ids[sample.n_prompt :]
        real[i] = n
        truncated += bool(sample.transcript_tokens_cut or sample.summary_tokens_cut)
    return TokenizedSplit(input_ids, labels, real, truncated)


def epoch_batches(n_samples: int, batch_size: int, seed: int, epoch: int) -> torch.Tensor:
    """[n_batches, batch_size] sample indices of one epoch, shuffled by (seed, epoch); the remainder is dropped."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n_samples, generator=generator)
    n_batches = n_samples // batch_size
    return order[: n_batches * batch_size].view(n_batches, batch_size)


def bucket_lengths(real_tokens: torch.Tensor, buckets: list[int]) -> torch.Tensor:
    """[n] padded length of each sample: the smallest bucket that holds it."""
    bounds = torch.tensor(buckets)
    return bounds[torch.searchsorted(bounds, real_tokens)]


def bucketed_epoch_batches(
    lengths: torch.Tensor, batch_size: int, seed: int, epoch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batches of one bucket each: ([n_batches, batch_size] indices, [n_batches] padded length).

    Within each bucket samples are shuffled and cut into full batches (the remainder is dropped);
    then the batches of all buckets are shuffled together. Deterministic in (seed, epoch).
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    batches, batch_lengths = [], []
    for length in sorted(set(lengths.tolist())):
        members = (lengths == length).nonzero().flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        n_batches = len(members) // batch_size
        batches.append(members[: n_batches * batch_size].view(n_batches, batch_size))
        batch_lengths += [length] * n_batches
    order = torch.randperm(len(batch_lengths), generator=generator)
    return torch.cat(batches)[order], torch.tensor(batch_lengths, dtype=torch.long)[order]


def supervised_tokens(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())
