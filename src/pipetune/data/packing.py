"""Sample packing (data.packing): several whole samples in each row of data.max_length, so that rows carry
meetings instead of padding.

Rows are filled by first fit over the epoch's shuffled order (the same order an unpacked run takes): each sample
goes into the first row, in the order rows were opened, with room for it and fewer than data.max_samples_per_row
samples; else it opens a new row. First fit keeps the epoch's order random (no sort by length, so rows and
batches do not cluster by length, unlike first-fit-decreasing), wastes little more than best fit, and, like the
unpacked plan, is a pure function of (seed, epoch, lengths): a resumed run rebuilds the same rows and continues
at its batch index. A sample is never split across rows (one longer than the row was already cut to it by the
prompt builder).

A packed row is [max_length] input ids, labels and per-token position ids that restart at 0 with every sample
(and once more where the trailing padding starts): each pipeline stage derives its document mask and RoPE
positions from them (model/attention.py). Labels are per sample as unpacked: a sample's last token predicts
nothing, so no loss crosses from one sample into the next.
"""

from __future__ import annotations

import numpy as np
import torch

from pipetune.data.batching import IGNORE, SampleStore, epoch_order


def first_fit_rows(order: torch.Tensor, lengths: torch.Tensor, row_length: int, max_per_row: int) -> torch.Tensor:
    """[n_rows, max_per_row] sample indices (-1: no sample) of the samples in `order` packed by first fit into rows
    of `row_length` tokens, at most `max_per_row` samples a row; rows in the order they were opened."""
    sizes = lengths.clamp(max=row_length).numpy()
    smallest = int(sizes.min()) if len(sizes) else 0
    members: list[list[int]] = []
    room = np.empty(0, dtype=np.int64)  # free tokens of each open row
    open_rows = np.empty(0, dtype=np.int64)  # their indices in `members`
    for index in order.tolist():
        size = int(sizes[index])
        fits = np.flatnonzero(room >= size)
        if len(fits):
            slot = int(fits[0])
            row = int(open_rows[slot])
            members[row].append(index)
            room[slot] -= size
            if room[slot] < smallest or len(members[row]) == max_per_row:  # nothing fits any more: close it
                room, open_rows = np.delete(room, slot), np.delete(open_rows, slot)
        else:
            members.append([index])
            if row_length - size >= smallest and max_per_row > 1:
                room = np.append(room, row_length - size)
                open_rows = np.append(open_rows, len(members) - 1)
    rows = torch.full((len(members), max_per_row), -1, dtype=torch.long)
    for row, indices in enumerate(members):
        rows[row, : len(indices)] = torch.tensor(indices, dtype=torch.long)
    return rows


def epoch_rows(lengths: torch.Tensor, row_length: int, max_per_row: int, seed: int, epoch: int) -> torch.Tensor:
    """first_fit_rows over one epoch's order (batching.epoch_order), every row kept."""
    return first_fit_rows(epoch_order(len(lengths), seed, epoch), lengths, row_length, max_per_row)


def batches_of_rows(rows: torch.Tensor, batch_size: int) -> torch.Tensor:
    """An epoch's packed rows ([n_rows, max_per_row], `epoch_rows`) as [n_batches, batch_size, max_per_row] sample
    indices (-1: none): the rows that fill no whole batch dropped."""
    n_batches = len(rows) // batch_size
    return rows[: n_batches * batch_size].view(n_batches, batch_size, rows.shape[-1])


def members(rows: torch.Tensor) -> torch.Tensor:
    """The sample indices in packed rows (any shape), without the -1 fill."""
    return rows[rows >= 0]


def packed_batch(
    store: SampleStore, rows: torch.Tensor, length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([b, length] input ids, [b, length] labels, [b, length] position ids) of packed `rows` ([b, max_per_row]
    sample indices, -1: none): each row's samples one after another, then pad_id.

    Labels are shifted within each sample and IGNORE on its prompt, on its last token (whose next token is the
    following sample's) and on the pads. Position ids count from 0 in every sample and again in the trailing pads
    (a document of their own, which no real token attends to)."""
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    position_ids = torch.empty((len(rows), length), dtype=torch.long)
    for row, indices in enumerate(rows.tolist()):
        start = 0
        for i in indices:
            if i < 0:
                continue
            ids = torch.from_numpy(store.tokens[store.offsets[i] : store.offsets[i + 1]].astype(np.int64))
            n, prompt = ids.numel(), int(store.n_prompt[i])
            if start + n > length:
                raise ValueError(f"packed row {row}: sample {i} ({n} tokens) overruns the row of {length} at {start}")
            input_ids[row, start : start + n] = ids
            labels[row, start + prompt - 1 : start + n - 1] = ids[prompt:]
            position_ids[row, start : start + n] = torch.arange(n)
            start += n
        position_ids[row, start:] = torch.arange(length - start)
    return input_ids, labels, position_ids


def packed_rows_needed(lengths: torch.Tensor, row_length: int, max_per_row: int, seed: int = 0) -> int:
    """Rows that first fit packs `lengths` into, over the order of epoch 0 (for reports)."""
    return len(epoch_rows(lengths, row_length, max_per_row, seed, 0))


def packed_attention_share(lengths: torch.Tensor, row_length: int, max_per_row: int, seed: int = 0) -> float:
    """Attention work of epoch 0's packed rows against causal attention over each whole row (what an unpacked,
    padded row costs): the sum of every packed sample's length squared, and of every row's pad tail squared (the
    pads are a document of their own, which flex attention computes too), over rows x row_length squared (1.0 for
    no samples). Flex attention skips the block mask's tiles outside every document, so a packed row costs about
    this share of a whole row's attention (the tiles on a document's edge are computed whole: a little more)."""
    rows = epoch_rows(lengths, row_length, max_per_row, seed, 0)
    if not len(rows):
        return 1.0
    sizes = lengths.clamp(max=row_length).double()
    in_row = torch.where(rows >= 0, sizes[rows.clamp(min=0)], 0.0)
    squares = (in_row**2).sum() + ((row_length - in_row.sum(-1)) ** 2).sum()
    return float(squares) / (len(rows) * row_length**2)


def packed_pad_fraction(lengths: torch.Tensor, row_length: int, max_per_row: int, seed: int = 0) -> float:
    """Share of pad tokens in the packed rows of epoch 0's order (0 for no samples)."""
    rows = packed_rows_needed(lengths, row_length, max_per_row, seed)
    return 1 - int(lengths.clamp(max=row_length).sum()) / (rows * row_length) if rows else 0.0
