"""Static-shape batches: every sample padded to max_length (or to its length bucket), labels shifted, a
deterministic order per epoch; bucketing and the pad fraction it leaves.

`PipelineStage` fixes its shapes at the first step, so every batch has exactly the shape
[batch_size, max_length] (with data.buckets, one such shape per bucket). Labels are already shifted (labels[t]
is the target of position t), so the loss needs no copy of the logits; pads and prompt positions carry IGNORE.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipetune.data.example import Example
from pipetune.data.prompt import PromptBuilder, Sample

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


@dataclass
class SampleStore:
    """Tokenized samples, unpadded: every sample's ids one after another in one flat array (memory-mapped when
    read from the token cache), each sample's start, and its prompt length. Batches are cut from it by index."""

    tokens: np.ndarray
    """[total tokens] int32: the samples' ids, concatenated."""
    offsets: np.ndarray
    """[n + 1] int64: sample i is tokens[offsets[i]:offsets[i + 1]]."""
    n_prompt: np.ndarray
    """[n] int32: the unsupervised prompt's length of each sample."""
    truncated: int = 0
    """Samples whose transcript or summary was cut to fit."""
    summaries_capped: int = 0
    """Samples whose summary was capped at max_summary_tokens (or the room the transcript leaves it)."""

    @classmethod
    def from_samples(cls, samples: list[Sample]) -> SampleStore:
        lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
        return cls(
            np.array([t for s in samples for t in s.input_ids], dtype=np.int32),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            np.array([s.n_prompt for s in samples], dtype=np.int32),
            sum(bool(s.transcript_tokens_cut or s.summary_tokens_cut) for s in samples),
            sum(bool(s.summary_tokens_cut) for s in samples),
        )

    def __len__(self) -> int:
        return len(self.n_prompt)

    @property
    def lengths(self) -> torch.Tensor:
        """[n] int64 tokens per sample (real, non-pad)."""
        return torch.from_numpy(np.diff(self.offsets))

    @property
    def supervised(self) -> torch.Tensor:
        """[n] int64 supervised tokens per sample: the summary and, when it was not capped, the closing token."""
        return self.lengths - torch.from_numpy(self.n_prompt.astype(np.int64))

    def batch(self, indices: torch.Tensor | list[int], length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([b, length] input ids right-padded with pad_id, [b, length] labels) of the samples at `indices`.

        Labels are shifted (position t holds the target of position t + 1) and IGNORE on the prompt and the pads:
        they come from each sample's prompt length, never from the pad id (which may equal the closing token).
        """
        indices = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        input_ids = torch.full((len(indices), length), pad_id, dtype=torch.long)
        labels = torch.full((len(indices), length), IGNORE, dtype=torch.long)
        for row, i in enumerate(indices):
            ids = torch.from_numpy(self.tokens[self.offsets[i] : self.offsets[i + 1]].astype(np.int64))
            n, prompt = ids.numel(), int(self.n_prompt[i])
            input_ids[row, :n] = ids
            labels[row, prompt - 1 : n - 1] = ids[prompt:]
        return input_ids, labels

    def capped_summaries_note(self, max_summary_tokens: int) -> str:
        """The note a run starts with when summaries were capped: their ends are never trained (the model learns
        to stop writing at the cap), which the count of samples cut to fit alone does not say."""
        return (
            f"note: {self.summaries_capped} of {len(self)} training summaries are capped at data.max_summary_tokens "
            f"= {max_summary_tokens} (or the room the transcript leaves): their ends are never trained; raise "
            "data.max_summary_tokens to train whole summaries (pipetune data inspect shows the longest cut)"
        )

    def dense(self, length: int, pad_id: int) -> TokenizedSplit:
        """Every sample padded to `length`, in one pair of tensors (small splits: validation, evaluation)."""
        input_ids, labels = self.batch(range(len(self)), length, pad_id)
        return TokenizedSplit(input_ids, labels, self.lengths.clone(), self.truncated)


def tokenize_split(examples: list[Example], builder: PromptBuilder, pad_id: int) -> TokenizedSplit:
    """Examples tokenized as in training and padded to max_length."""
    samples = builder.build_examples(examples)
    return SampleStore.from_samples(samples).dense(builder.max_length, pad_id)


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The random stream of one epoch's order, the same for every way of batching it."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def epoch_order(n_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The samples of one epoch, shuffled by (seed, epoch)."""
    return torch.randperm(n_samples, generator=epoch_generator(seed, epoch))


def epoch_batches(n_samples: int, batch_size: int, seed: int, epoch: int) -> torch.Tensor:
    """[n_batches, batch_size] sample indices of one epoch, shuffled by (seed, epoch); the remainder is dropped."""
    order = epoch_order(n_samples, seed, epoch)
    n_batches = n_samples // batch_size
    return order[: n_batches * batch_size].view(n_batches, batch_size)


def bucket_lengths(real_tokens: torch.Tensor, buckets: list[int]) -> torch.Tensor:
    """[n] padded length of each sample: the smallest bucket that holds it."""
    bounds = torch.tensor(buckets)
    return bounds[torch.searchsorted(bounds, real_tokens)]


def bucket_boundaries(max_length: int, n_buckets: int = 4) -> list[int]:
    """Lengths max_length * k / n for k = 1..n (the last is max_length itself)."""
    return sorted({max(1, max_length * k // n_buckets) for k in range(1, n_buckets + 1)})


def pad_fraction(real_tokens: torch.Tensor, buckets: list[int]) -> float:
    """Share of pad tokens when every sample is padded to the smallest bucket that holds it (buckets =
    [max_length]: the one static shape)."""
    return 1 - int(real_tokens.sum()) / int(bucket_lengths(real_tokens, buckets).sum())


def bucketed_epoch_batches(
    lengths: torch.Tensor, batch_size: int, seed: int, epoch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batches of one bucket each: ([n_batches, batch_size] indices, [n_batches] padded length).

    Within each bucket samples are shuffled and cut into full batches (the remainder is dropped);
    then the batches of all buckets are shuffled together. Deterministic in (seed, epoch).
    """
    generator = epoch_generator(seed, epoch)
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
