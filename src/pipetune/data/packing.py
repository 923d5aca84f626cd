"""Sample packing (data.packing): several whole samples in each row of data.max_length, so that rows carry
meetings instead of padding.

Rows are filled by best fit, longest first, over windows of the epoch's shuffled order (`best_fit_rows`): each
window of PACK_WINDOW samples is taken longest first, each sample going into the open row it leaves the least
room in (fewer than data.max_samples_per_row samples, room for it), else into a new row; rows stay open from one
window to the next until nothing fits. The long samples laid first leave gaps the short ones fill: on the
synthetic whole meetings (~7,400 tokens, rows of 16,384) 0.9% of the tokens are padding against 4.6% by first fit
over the shuffled order, which this replaced; on the bench config's ~650-token meetings in rows of 4,096, 2.5%
against 3.6% (the rows still open at an epoch's end hold most of what is left). The rows are then shuffled with
the epoch's stream, so no stretch of an epoch holds its emptiest rows or its longest samples, and every step's
padding is a draw of the epoch's. Over more samples than a window, which samples share a row changes with the
epoch's order; a split of one window packs nearly the same rows every epoch (as a dataset packed once does),
shuffled anew. All of it is a pure function of (seed, epoch, lengths): a resumed run rebuilds the same rows and
continues at its batch index. A sample is never split across rows (one longer than the row was already cut to it
by the prompt builder).

A packed row is [max_length] input ids, labels and per-token position ids that restart at 0 with every sample
(and once more where the trailing padding starts): each pipeline stage derives its document mask and RoPE
positions from them (model/attention.py). Labels are per sample as unpacked: a sample's last token predicts
nothing, so no loss crosses from one sample into the next.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from pipetune.data.batching import IGNORE, SampleStore, epoch_generator

PACK_WINDOW = 1024
"""Samples of the epoch's order that best fit takes longest first at a time (`best_fit_rows`)."""


def best_fit_rows(
    order: torch.Tensor, lengths: torch.Tensor, row_length: int, max_per_row: int, window: int = 0
) -> torch.Tensor:
    """[n_rows, width] sample indices (-1: no sample) of the samples in `order` packed into rows of
    `row_length` tokens, at most `max_per_row` samples a row, in the order the rows were opened: each `window` of
    the order longest first (ties in the order's), each sample into the open row with the least room that holds it
    (of equal rooms, the row that reached it last), else a new row. A row closes when it holds max_per_row samples
    or less room than the shortest sample. `window` 0: PACK_WINDOW. `width`: max_per_row, or the most samples a
    row can hold (row_length // the shortest) where that is fewer."""
    window = window or PACK_WINDOW
    sizes = lengths.clamp(max=row_length).numpy()
    smallest = int(sizes.min()) if len(sizes) else 0
    members: list[list[int]] = []
    rooms: list[int] = []  # the distinct free token counts of the open rows, ascending
    rows_with: dict[int, list[int]] = {}  # free token count -> the open rows with it
    indices = order.numpy()
    for begin in range(0, len(indices), window):
        part = indices[begin : begin + window]
        for index in part[np.argsort(-sizes[part], kind="stable")].tolist():
            size = int(sizes[index])
            at = bisect.bisect_left(rooms, size)
            if at < len(rooms):  # the least room that holds it
                room = rooms[at]
                row = rows_with[room].pop()
                if not rows_with[room]:
                    del rows_with[room], rooms[at]
                members[row].append(index)
            else:
                row, room = len(members), row_length
                members.append([index])
            room -= size
            if room >= smallest and len(members[row]) < max_per_row:
                if room not in rows_with:
                    rows_with[room] = []
                    bisect.insort(rooms, room)
                rows_with[room].append(row)
    # No row holds more than row_length // smallest samples: a larger max_per_row never binds, nor sizes the rows.
    width = min(max_per_row, row_length // smallest) if smallest else max_per_row
    rows = torch.full((len(members), width), -1, dtype=torch.long)
    for row, indices_of_row in enumerate(members):
        rows[row, : len(indices_of_row)] = torch.tensor(indices_of_row, dtype=torch.long)
    return rows


def epoch_rows(lengths: torch.Tensor, row_length: int, max_per_row: int, seed: int, epoch: int) -> torch.Tensor:
    """One epoch's packed rows, every one: `best_fit_rows` over the epoch's order (batching.epoch_order), the rows
    then shuffled by the same stream."""
    stream = epoch_generator(seed, epoch)
    order = torch.randperm(len(lengths), generator=stream)  # batching.epoch_order's
    rows = best_fit_rows(order, lengths, row_length, max_per_row)
    return rows[torch.randperm(len(rows), generator=stream)]


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
    following sample's) and on the pads. Position ids count from 0 in every sample; the trailing pads' run 0, -1,
    -2, ...: a document of their own to flex attention's mask (no real token attends to it), which the documents
    kernel leaves out altogether (model/attention.py's `span_table`)."""
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
        position_ids[row, start:] = -torch.arange(length - start)
    return input_ids, labels, position_ids


def packed_rows_needed(lengths: torch.Tensor, row_length: int, max_per_row: int, seed: int = 0) -> int:
    """Rows that epoch 0 packs `lengths` into (for reports)."""
    return len(epoch_rows(lengths, row_length, max_per_row, seed, 0))


def packed_attention_share(lengths: torch.Tensor, row_length: int, max_per_row: int, seed: int = 0) -> float:
    """Attention work of epoch 0's packed rows against causal attention over each whole row (what an unpacked,
    padded row costs): the sum of every packed sample's length squared, and of every row's pad tail squared (the
    pads are a document of their own, which flex attention computes too), over rows x row_length squared (1.0 for
    no samples). Flex attention skips the block mask's tiles outside every document, so a packed row costs about
    this share of a whole row's attention (the tiles on a document's edge are computed whole: a little more)."""
    return rows_attention_share(epoch_rows(lengths, row_length, max_per_row, seed, 0), lengths, row_length)


def row_documents(rows: torch.Tensor, lengths: torch.Tensor, row_length: int) -> torch.Tensor:
    """The lengths of the documents in these packed rows ([n, max_per_row] sample indices, -1: none), flat: each
    sample's (cut to the row) and each row's pad tail (a document of its own to flex attention, which computes it;
    the "documents" kernel leaves it out), no empty tails: what `rows_attention_share` counts."""
    in_row = torch.where(rows >= 0, lengths[rows.clamp(min=0)].clamp(max=row_length), 0)
    tails = row_length - in_row.sum(-1)
    return torch.cat([in_row[rows >= 0], tails[tails > 0]])


def rows_attention_share(rows: torch.Tensor, lengths: torch.Tensor, row_length: int) -> float:
    """Attention work of these packed rows ([n, max_per_row] sample indices, -1: none) against causal attention
    over each whole row: their documents' lengths squared (`row_documents`: the samples' and each pad tail's),
    over n x row_length squared (1.0 for no rows). The metrics record it for each step's rows, the bench's MFU
    counts it (a packed step's attention is its own rows', not the epoch's)."""
    if not len(rows):
        return 1.0
    squares = (row_documents(rows, lengths, row_length).double() ** 2).sum()
    return float(squares) / (len(rows) * row_length**2)


def packed_pad_fraction(lengths: torch.Tensor, row_length: int, max_per_row: int, seed: int = 0) -> float:
    """Share of pad tokens in the packed rows of epoch 0's order (0 for no samples)."""
    rows = packed_rows_needed(lengths, row_length, max_per_row, seed)
    return 1 - int(lengths.clamp(max=row_length).sum()) / (rows * row_length) if rows else 0.0


def packing_line(rows: torch.Tensor, lengths: torch.Tensor, row_length: int, max_per_row: int) -> str:
    """The startup line on the packed `rows` an epoch trains: their pad share against the same samples' one a row
    (never more: a row holds at least one sample), so that both figures are of the same samples."""
    packed, n_rows = members(rows), rows[..., 0].numel()
    real = int(lengths[packed].sum())
    pad_share = 1 - real / (n_rows * row_length) if n_rows else 0.0
    alone = 1 - real / (len(packed) * row_length) if len(packed) else 0.0
    return (
        f"{len(packed)} of the {len(lengths)} samples in {n_rows} rows of {row_length} tokens (at most {max_per_row} "
        f"a row), pad share {pad_share:.1%} (the same samples one a row: {alone:.1%})"
    )
