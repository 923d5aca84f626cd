"""Document-masked attention for packed rows (data.packing): each token attends, causally, to its own sample only.

A stage gets each packed microbatch's position ids (restarting at 0 with every sample, data/packing.py) and
builds its mask from them (`document_mask`), once per microbatch for all its layers:

- on a GPU, a flex-attention BlockMask (`document_block_mask`): which 128 x 128 tiles of the [seq, seq] score
  matrix hold any pair of one document (and the diagonal's causal cut), computed from each tile's first and last
  document: [seq / 128]^2 entries per row, never [seq, seq]. Flex attention then skips the empty tiles.
- on the CPU, each row's document spans (`DocumentSpans`), and causal SDPA runs on each span alone: torch's flex
  attention has no backward on the CPU ("FlexAttention does not support backward on CPU", torch 2.11-2.13).

- on a GPU where flash attention runs (bfloat16 or float16, head dim <= 256, compute capability 8.0 or newer) and
  train.packed_attention = "auto": each document's start in the flattened rows (`DocumentOffsets`), and flash
  attention's variable-length kernel (`varlen_attention`) attends within each document exactly: no tile holds
  two documents' pairs, no per-element mask is looked up, and no tile past a document's causal cut is computed.
  The offsets have a static size (data.max_samples_per_row + 1 documents a row, the trailing pads one of them;
  a row with fewer ends in empty ones) and the longest document is bounded by the row: compiled and graphed
  layers see the same call every step. On one H200 (Qwen3-4B heads, the bench config's meetings in rows of
  4,096) flex attention took 13% of the packed step (benchmarks/journal/2026-12-02-4k-one-h200.md).

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


@dataclass(frozen=True)
class DocumentOffsets:
    """Packed rows' documents as flash attention's variable-length input: `offsets` [rows x per_row + 1] int32,
    where each document of each row starts among the rows' tokens laid end to end (the last entry: their count;
    a row with fewer than per_row documents ends in empty ones), and `longest`, the row length: a bound on a
    document's length that is the same every step."""

    offsets: torch.Tensor
    longest: int


def document_offsets(position_ids: torch.Tensor, per_row: int) -> DocumentOffsets:
    """The DocumentOffsets of packed rows of these [b, s] position ids, at most `per_row` documents a row.

    A document starts where the position restarts at 0; documents are contiguous and in order, so the start of
    a row's document j is the number of its tokens in documents before j (a search in the sorted document ids:
    no host synchronization, a static shape). More documents than `per_row` is an error (checked on the host
    for host tensors, by the GPU otherwise)."""
    batch, seq = position_ids.shape
    docs = (document_ids(position_ids) - 1).contiguous()  # [b, s]: 0 for the row's first document
    if position_ids.device.type == "cpu":
        most = int(docs[:, -1].max()) + 1
        if most > per_row:
            raise ValueError(
                f"a packed row holds {most} documents, more than its bound {per_row} "
                "(data.max_samples_per_row + 1, the trailing pads one of them)"
            )
    else:
        torch._assert_async(docs[:, -1].max() < per_row, "a packed row holds more documents than its bound")
    wanted = torch.arange(per_row, device=docs.device, dtype=docs.dtype).expand(batch, per_row).contiguous()
    starts = torch.searchsorted(docs, wanted) + torch.arange(batch, device=docs.device).unsqueeze(1) * seq
    total = torch.full((1,), batch * seq, dtype=starts.dtype, device=starts.device)
    return DocumentOffsets(torch.cat([starts.flatten(), total]).to(torch.int32), seq)


@functools.cache
def flash_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash attention's variable-length kernel runs here: a CUDA GPU of compute capability 8.0 or newer
    with torch's flash attention built in, bfloat16 or float16, a head dim of at most 256 in steps of 8."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dim <= 256
        and head_dim % 8 == 0
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def document_mask(position_ids: torch.Tensor, flash_per_row: int = 0) -> BlockMask | DocumentSpans | DocumentOffsets:
    """The mask every layer of a stage uses for packed rows of these [b, s] position ids (see the module's doc):
    DocumentOffsets for flash attention with at most `flash_per_row` documents a row (0: not flash attention)."""
    if flash_per_row:
        return document_offsets(position_ids, flash_per_row)
    if position_ids.device.type == "cpu":
        return DocumentSpans.of(position_ids)
    return document_block_mask(position_ids)


def _spans_of(offsets: torch.Tensor) -> list[tuple[int, int]]:
    bounds = offsets.tolist()
    return [(start, end) for start, end in zip(bounds, bounds[1:], strict=False) if end > start]


def _reference_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor, scale: float
) -> torch.Tensor:
    """[total, heads, d] causal attention within each document of `offsets`: SDPA on each (any device, dtype)."""
    gqa = key.shape[1] != query.shape[1]
    parts = [
        F.scaled_dot_product_attention(
            *(t[start:end].transpose(0, 1).unsqueeze(0) for t in (query, key, value)),
            is_causal=True,
            scale=scale,
            enable_gqa=gqa,
        )[0].transpose(0, 1)
        for start, end in _spans_of(offsets)
    ]
    return torch.cat(parts).contiguous()


def _reference_varlen_backward(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `_reference_varlen`, written out (an operator's implementation runs without autograd)."""
    group = query.shape[1] // key.shape[1]
    grads = [torch.zeros_like(t) for t in (query, key, value)]
    for start, end in _spans_of(offsets):
        q, do = (t[start:end].transpose(0, 1) for t in (query, grad))  # [heads, n, d]
        k, v = (t[start:end].transpose(0, 1).repeat_interleave(group, 0) for t in (key, value))
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        probs = torch.softmax((q @ k.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")), dim=-1)
        d_probs = do @ v.transpose(1, 2)
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * scale
        parts = (d_scores @ k, d_scores.transpose(1, 2) @ q, probs.transpose(1, 2) @ do)
        for total, part, grouped in zip(grads, parts, (1, group, group), strict=True):
            part = part.unflatten(0, (-1, grouped)).sum(1)  # key-value heads: summed over their query heads
            total[start:end] = part.transpose(0, 1)
    return tuple(grads)


@torch.library.custom_op("pipetune::varlen_attention", mutates_args=())
def _varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, offsets: torch.Tensor, longest: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp, and the two tensors flash attention's backward takes back) of causal attention within
    each document; on a GPU torch's flash attention kernel, elsewhere the reference (CPU tests)."""
    if not query.is_cuda:  # the reference, with the kernel's other outputs' shapes (unused by its backward)
        meta = _varlen_attention_fake(*(t.to("meta") for t in (query, key, value, offsets)), longest, scale)
        out = _reference_varlen(query, key, value, offsets, scale)
        return out, *(torch.zeros(t.shape, dtype=t.dtype, device=query.device) for t in meta[1:])
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        query, key, value, offsets, offsets, longest, longest, 0.0, True, False, scale=scale
    )
    return out, lse, rng_state, unused


@_varlen_attention.register_fake
def _varlen_attention_fake(query, key, value, offsets, longest, scale):
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        query, key, value, offsets, offsets, longest, longest, 0.0, True, False, scale=scale
    )
    return out, lse, rng_state, unused


@torch.library.custom_op("pipetune::varlen_attention_backward", mutates_args=())
def _varlen_attention_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    rng_state: torch.Tensor,
    unused: torch.Tensor,
    offsets: torch.Tensor,
    longest: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of query, key and value (grouped key-value heads: summed over their query heads)."""
    if not query.is_cuda:
        return _reference_varlen_backward(grad, query, key, value, offsets, scale)
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return torch.ops.aten._flash_attention_backward(
        grad, query, key, value, out, lse, offsets, offsets, longest, longest, 0.0, True, rng_state, unused, scale=scale
    )


@_varlen_attention_backward.register_fake
def _varlen_attention_backward_fake(grad, query, key, value, out, lse, rng_state, unused, offsets, longest, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, offsets, longest, scale = inputs
    out, lse, rng_state, unused = output
    ctx.save_for_backward(query, key, value, out, lse, rng_state, unused, offsets)
    ctx.longest, ctx.scale = longest, scale


def _backward(ctx, grad, *_):
    query, key, value, out, lse, rng_state, unused, offsets = ctx.saved_tensors
    grads = _varlen_attention_backward(
        grad, query, key, value, out, lse, rng_state, unused, offsets, ctx.longest, ctx.scale
    )
    return *grads, None, None, None


_varlen_attention.register_autograd(_backward, setup_context=_setup_context)


def varlen_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: DocumentOffsets, scale: float | None
) -> torch.Tensor:
    """[b, s, heads, d] causal attention within each document of packed rows, from [b, heads, s, d] query, key
    and value (fewer key-value heads: grouped): one flash attention call over the rows laid end to end."""
    batch, heads, seq, dim = query.shape
    flat = [t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value)]
    scale = dim**-0.5 if scale is None else scale
    out = _varlen_attention(*flat, documents.offsets, documents.longest, scale)[0]
    return out.view(batch, seq, heads, dim)


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
    attention_mask: BlockMask | DocumentSpans | DocumentOffsets | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: within documents under a document mask (flash attention's
    variable-length kernel with DocumentOffsets, flex attention with a BlockMask, SDPA per span with
    DocumentSpans); inside a checkpointed layer that keeps attention (train.keep_attention), SDPA's fused kernel
    with its output kept (model/kept_attention.py); transformers' SDPA otherwise."""
    kernel = kept_kernel(module, query, key, value, attention_mask, dropout, kwargs)
    if kernel is not None:
        return kept_attention(query, key, value, scaling, kernel), None
    if not isinstance(attention_mask, (BlockMask, DocumentSpans, DocumentOffsets)):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout > 0:
        raise ValueError(f"attention dropout {dropout} is not supported with data.packing")
    if isinstance(attention_mask, DocumentOffsets):
        return varlen_attention(query, key, value, attention_mask, scaling), None
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
