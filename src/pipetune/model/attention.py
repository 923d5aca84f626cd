"""Document-masked attention for packed rows (data.packing): each token attends, causally, to its own sample only.

A stage gets each packed microbatch's position ids (restarting at 0 with every sample, data/packing.py) and
builds its mask from them (`document_mask`), once per microbatch for all its layers:

- on a GPU, a flex-attention BlockMask (`document_block_mask`): which 128 x 128 tiles of the [seq, seq] score
  matrix hold any pair of one document (and the diagonal's causal cut), computed from each tile's first and last
  document: [seq / 128]^2 entries per row, never [seq, seq]. Flex attention then skips the empty tiles.
- on the CPU, each row's document spans (`DocumentSpans`), and causal SDPA runs on each span alone: torch's flex
  attention has no backward on the CPU ("FlexAttention does not support backward on CPU", torch 2.11-2.13).

Flex attention is also the faster kernel on an H200: torch's flash attention variable-length kernel (each
document attended exactly, no tiles) measured 1.45x slower on the bench config's packed 4,096-token rows and 1.27x
on a 16,384-token row of whole meetings (benchmarks/journal/2026-12-02-packed-attention-one-h200.md). Torch's own
choice of flex's tiles, warps and stages is within 3% of the best of eleven other choices and of inductor's
autotuned search on those rows (2026-12-02-flex-and-best-fit-one-h200.md), so no kernel options are passed.

The decoder layers' attention goes through `document_attention` (registered with transformers as
DOCUMENT_ATTENTION); a call without such a mask (validation, which stays unpacked; the memory probe) takes
transformers' SDPA path as before.

Compile and CUDA graphs: the BlockMask is built eagerly, outside the compiled layers, from tensors of static shape
([batch, seq] position ids; tile tables of [batch, 1, seq / 128, seq / 128]), so a compiled layer sees the same
shapes every step and traces flex attention into its own graph. Without train.compile, flex attention runs
through one torch.compile of its own (eager flex attention is a dense reference implementation).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pipetune.model.kept_attention import kept_attention, kept_kernel

DOCUMENT_ATTENTION = "pipetune_document"
"""The attention implementation name a packed run's model config carries."""
BLOCK = 128
"""Tile size of the block mask (flex attention's default sparse block)."""


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] index of the document each token belongs to: a new one wherever the position restarts at 0."""
    return (position_ids == 0).cumsum(-1)


def document_block_mask(position_ids: torch.Tensor, block: int = BLOCK) -> BlockMask:
    """The causal document mask of packed rows ([b, s] position ids) as a flex-attention BlockMask.

    Documents are contiguous and numbered in order, so a query tile i and a key tile j <= i share a document
    exactly when the key tile's last document is at least the query tile's first; the pair is full (no mask
    needed inside) when j < i and both tiles lie in one document. Partial tiles apply the exact mask_mod."""
    batch, seq = position_ids.shape
    n_blocks = -(-seq // block)
    docs = document_ids(position_ids)
    # Positions past seq (the last tile's padding) get a document of their own: never attended.
    padded = F.pad(docs, (0, n_blocks * block - seq), value=-1).view(batch, n_blocks, block)
    padded = torch.where(padded < 0, docs[:, -1:].unsqueeze(-1) + 1, padded)
    first, last = padded[..., 0], padded[..., -1]
    q_first, q_last = first.unsqueeze(2), last.unsqueeze(2)  # [b, q tiles, 1]
    k_first, k_last = first.unsqueeze(1), last.unsqueeze(1)  # [b, 1, k tiles]
    tiles = torch.arange(n_blocks, device=position_ids.device)
    below = tiles.view(-1, 1) >= tiles.view(1, -1)  # key tile at or before the query tile
    any_pair = below & (k_last >= q_first)
    full = (tiles.view(-1, 1) > tiles.view(1, -1)) & (k_first == k_last) & (q_first == q_last) & (k_first == q_first)
    partial = any_pair & ~full
    flat_docs = padded.view(batch, -1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (flat_docs[b, q_idx] == flat_docs[b, kv_idx]) & (q_idx >= kv_idx)

    return BlockMask.from_kv_blocks(
        *_kv_table(partial),
        *_kv_table(full),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(seq, seq),
    )


def _kv_table(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([b, 1, q tiles] count, [b, 1, q tiles, k tiles] indices, the chosen ones first) of a [b, q, k] bool table."""
    counts = tiles.sum(-1, dtype=torch.int32)
    # A stable sort of the negated flags lists each query tile's chosen key tiles first, in ascending order.
    indices = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts.unsqueeze(1), indices.unsqueeze(1)


@dataclass(frozen=True)
class DocumentSpans:
    """Each row's documents as (start, end) token spans, on the host: the CPU's document mask."""

    rows: tuple[tuple[tuple[int, int], ...], ...]

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> DocumentSpans:
        rows = []
        for positions in position_ids.tolist():
            starts = [i for i, p in enumerate(positions) if p == 0] or [0]
            rows.append(tuple(zip(starts, [*starts[1:], len(positions)], strict=True)))
        return cls(tuple(rows))


def document_mask(position_ids: torch.Tensor) -> BlockMask | DocumentSpans:
    """The mask every layer of a stage uses for packed rows of these [b, s] position ids (see the module's doc)."""
    if position_ids.device.type == "cpu":
        return DocumentSpans.of(position_ids)
    return document_block_mask(position_ids)


def spans_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: DocumentSpans, scale: float | None
) -> torch.Tensor:
    """[b, heads, s, d] causal attention within each document span of each row (grouped key-value heads)."""
    gqa = key.shape[1] != query.shape[1]
    rows = []
    for row, row_spans in enumerate(spans.rows):
        parts = [
            F.scaled_dot_product_attention(
                query[row : row + 1, :, start:end],
                key[row : row + 1, :, start:end],
                value[row : row + 1, :, start:end],
                is_causal=True,
                scale=scale,
                enable_gqa=gqa,
            )
            for start, end in row_spans
        ]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows)


@functools.cache
def _compiled_flex_attention():
    return torch.compile(flex_attention, dynamic=False)


def document_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: BlockMask | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: within documents under a document mask (flex attention with a
    BlockMask, SDPA per span with DocumentSpans); inside a checkpointed layer that keeps attention
    (train.keep_attention), SDPA's fused kernel with its output kept (model/kept_attention.py); transformers'
    SDPA otherwise."""
    kernel = kept_kernel(module, query, key, value, attention_mask, dropout, kwargs)
    if kernel is not None:
        return kept_attention(query, key, value, scaling, kernel), None
    if not isinstance(attention_mask, (BlockMask, DocumentSpans)):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout > 0:
        raise ValueError(f"attention dropout {dropout} is not supported with data.packing")
    if isinstance(attention_mask, DocumentSpans):
        out = spans_attention(query, key, value, attention_mask, scaling)
    else:
        attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
        gqa = key.shape[1] != query.shape[1]
        out = attend(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)


def use_document_attention(model: nn.Module) -> None:
    """Switch a (PEFT-wrapped) HF model's attention to `document_attention`: packed microbatches, with a mask,
    or attention kept through recomputation."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config._attn_implementation = DOCUMENT_ATTENTION
