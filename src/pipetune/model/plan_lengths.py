"""The lengths the "documents" attention kernel (model/attention.py) runs documents at: each document is attended
over a window of one of a few padded lengths, because cuDNN builds an execution plan (~37 ms forward, ~69 ms
backward on one H100) for every length it has not seen, and a run of whole meetings holds ~1,000 lengths.

Two ways to pad, one chosen per run by `choose_lengths`:

- `octave_length`: up to a thirty-second of the length's power of two (at least 64): at most 32 lengths an
  octave, whatever the data.
- the run's own lengths, known ahead (`expect_document_lengths`): the fewest lengths, each the longest of a group
  of the run's sorted lengths, whose padding costs no more attention work than the octave rule's on these
  lengths. Work is counted as a causal kernel does it: in 128 x 128 tiles of the score matrix, T (T + 1) / 2 for
  T = ceil(n / 128). The groups come from a dynamic programme over the distinct lengths rounded up to 64 (a
  rounding that adds no tile). `qwen3-4b-meetings`' 1,024 synthetic whole meetings: 68 lengths rather than 107,
  for the same attention work (0.61% more tiles than unpadded, both): on one H100 cuDNN's plans took 0.63x the
  time forward and 0.73x backward, the warm first step 2-4 s less, real tokens/s unchanged
  (benchmarks/journal/2026-12-07-plan-lengths-and-an-eighth-machine-one-h100.md).
"""

from __future__ import annotations

import torch

TILE = 128
"""The side of a score-matrix tile a causal kernel computes whole (cuDNN's and flash attention's on Hopper)."""
STEP = 64
"""Lengths are rounded up to a multiple of this before grouping (no tile added: TILE is a multiple of it)."""
MAX_DISTINCT = 1024
"""Above this many distinct rounded lengths, `choose_lengths` keeps the octave rule (the programme's cost grows
with its square): rows of 65,536+ tokens holding documents of every length."""


def octave_length(length: int) -> int:
    """`length` rounded up to a thirty-second of its power of two, at least 64: at most 32 lengths an octave, for
    ~1.9% more attention work than unpadded by FLOPs (~0.6% by tiles) on whole meetings."""
    step = max(STEP, 1 << max(length.bit_length() - 6, 0))
    return -(-length // step) * step


def tiles(length: torch.Tensor | int) -> torch.Tensor | int:
    """The 128 x 128 tiles a causal kernel computes for a document of `length` tokens."""
    count = -(-length // TILE)
    return count * (count + 1) // 2


def choose_lengths(lengths: list[int]) -> list[int]:
    """The padded lengths (sorted) for documents of these `lengths` (tokens, > 0): the fewest, each covering the
    lengths up to it, whose tiles over all documents are no more than `octave_length`'s; the octave rule's own
    where there are too many distinct lengths (MAX_DISTINCT)."""
    distinct, repeats = torch.unique(torch.as_tensor(lengths, dtype=torch.int64), return_counts=True)
    octave_of = {n: octave_length(n) for n in distinct.tolist()}
    octave = sorted(set(octave_of.values()))
    rounded = -(-distinct // STEP) * STEP
    values = torch.unique(rounded)
    counts = torch.zeros_like(values).index_add_(0, torch.searchsorted(values, rounded), repeats)
    if len(values) > MAX_DISTINCT or len(values) <= 1:
        return octave if len(values) > 1 else values.tolist()
    budget = sum(int(r) * (tiles(octave_of[n]) - tiles(n)) for n, r in zip(distinct.tolist(), repeats, strict=True))
    groups = _fewest_groups(values.double(), counts.double(), float(budget))
    return octave if groups is None or len(groups) >= len(octave) else groups


def _fewest_groups(values: torch.Tensor, counts: torch.Tensor, budget: float) -> list[int] | None:
    """The ends of the fewest groups of the sorted distinct `values` (each with its `counts`) whose extra tiles, each
    value padded to its group's last, stay within `budget`; None if no count of groups under len(values) does.

    cost[i, j]: the extra tiles of the group values[i..j] (i <= j); best[j]: the least extra tiles of values[0..j]
    in k groups, k = 1, 2, ...; `starts` keeps each k's choice of the last group's start, to walk back."""
    m = len(values)
    own = torch.cumsum(torch.cat([values.new_zeros(1), counts * tiles(values)]), 0)
    number = torch.cumsum(torch.cat([counts.new_zeros(1), counts]), 0)
    i, j = torch.arange(m).view(-1, 1), torch.arange(m).view(1, -1)
    cost = (number[j + 1] - number[i]) * tiles(values)[j] - (own[j + 1] - own[i])
    cost = torch.where(i <= j, cost, torch.inf)
    best, starts = cost[0].clone(), []
    while best[-1] > budget + 1e-6:
        if len(starts) + 2 >= m:
            return None
        # a new last group from i to j, after the best of values[0..i-1] in one group fewer
        options = torch.cat([values.new_full((1, m), torch.inf), best[:-1].view(-1, 1) + cost[1:]], 0)
        best, start = options.min(0)
        starts.append(start)
    ends, j = [], m - 1
    for start in reversed(starts):
        ends.append(int(values[j]))
        j = int(start[j]) - 1
    ends.append(int(values[j]))
    return sorted(ends)
