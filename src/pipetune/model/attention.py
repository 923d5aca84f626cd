"""Document-masked attention for packed rows (data.packing): each token attends, causally, to its own sample only.

A stage gets each packed microbatch's position ids (restarting at 0 with every sample, data/packing.py) and
builds its mask from them (`document_mask`), once per microbatch for all its layers, by train.packed_attention:

- "flex" on a GPU: a flex-attention BlockMask (`document_block_mask`): which 128 x 128 tiles of the [seq, seq]
  score matrix hold any pair of one document (and the diagonal's causal cut), computed from each tile's first and
  last document: [seq / 128]^2 entries per row, never [seq, seq]. Flex attention then skips the empty tiles.
- "documents", and every CPU run: a `DocumentTable`, each row's documents as (start, end) spans on the host, and
  `document_sdpa` runs SDPA's fused kernel on each document alone (cuDNN's on an H200, flash attention's on other
  GPUs and on the CPU; torch's flex attention has no backward on the CPU, torch 2.11-2.13). Each document is
  attended with the kernel full rows use, over a window of the row (`_window`), a row's long documents
  alternating over two CUDA streams (`_on_streams`). The price is a call per document: ~0.13 ms of the GPU's a
  layer (forward and backward) on an H200 and ~0.29 ms of the host's, hidden behind long documents' kernels, not
  behind short ones'. On whole meetings (~7,400 tokens) its attention runs ~1.4x faster than flex's: 1.34x
  Unsloth's real tokens/s over an epoch in rows of 16,384 (flex 1.18-1.19x); on the bench config's ~550-token
  meetings 6-7x slower than flex's a layer (2026-12-02-documents-streams-and-plans-one-h200.md): a run with short
  samples says so (`documents_advice`). With cuDNN, a plan is built for each new (padded) document length and
  kept for the process, per thread: a training run names its lengths ahead (`expect_document_lengths`) and
  builds them all before its first step, the forward's in the thread that will run every forward
  (model/forward_thread.py), the backward's in autograd's (`prebuild_plans`, `_build_plans`).

Tried and dropped (benchmarks/journal/): torch's flash attention variable-length kernel measured 1.45x slower
than flex on the bench config's packed 4,096-token rows and 1.27x on a 16,384-token row of whole meetings
(2026-12-02-packed-attention-one-h200.md); cuDNN's variable-length kernel (`aten._cudnn_attention_forward` over
the rows' offsets, torch 2.11) gave the right output but wrong query and key gradients, 13x slower than flex
(2026-12-02-documents-attention-one-h200.md). Torch's own choice of flex's tiles, warps and stages is within 3%
of the best of eleven other choices and of inductor's autotuned search (2026-12-02-flex-and-best-fit-one-h200.md),
so no kernel options are passed.

The decoder layers' attention goes through `document_attention` (registered with transformers as
DOCUMENT_ATTENTION); a call without such a mask (validation, which stays unpacked; the memory probe) takes
transformers' SDPA path as before.

Compile and CUDA graphs: both masks are built eagerly, outside the compiled layers, as tensors of static shape
([batch, seq] position ids; tile tables of [batch, 1, seq / 128, seq / 128]; span tables of [batch,
data.max_samples_per_row + 1, 2]), so a compiled layer sees the same shapes every step. It traces flex attention
into its own graph; `document_sdpa` is an operator of its own (torch.library), which a graph calls with the span
table as an input, and which reads it on the host at every call: CUDA graphs cannot replay it. Without
train.compile, flex attention runs through one torch.compile of its own (eager flex attention is a dense
reference implementation).
"""

from __future__ import annotations

import bisect
import functools
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pipetune.model.forward_thread import forward_thread, start_forward_thread
from pipetune.model.head_rows import HeadRows, head_rows_attention
from pipetune.model.kept_attention import (
    CUDNN,
    KERNELS,
    dense_kept,
    kept_attention,
    kept_kernel,
    lse_slice,
    register_table_autograd,
    row_like,
    sdpa_backend,
    sdpa_backward,
    sdpa_forward,
)
from pipetune.model.plan_lengths import choose_lengths, octave_length
from pipetune.switches import LONG_DOCUMENT

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
class DocumentTable:
    """Packed rows' documents as a `span_table` on the host: the "documents" kernel's mask (`document_sdpa`)."""

    spans: torch.Tensor


def document_mask(
    position_ids: torch.Tensor, kernel: str = "flex", per_row: int = 0, host: torch.Tensor | None = None
) -> BlockMask | DocumentTable:
    """The mask every layer of a stage uses for packed rows of these [b, s] position ids (see the module's doc):
    `kernel` (train.packed_attention) "flex" on a GPU: a BlockMask; "documents", or on the CPU: a DocumentTable of
    `per_row` spans a row (0: these rows' most), read from `host` (the position ids on the host, where the batch
    was made: no wait for the GPU) if given."""
    if position_ids.device.type == "cpu" or kernel == "documents":
        return DocumentTable(span_table(position_ids if host is None else host, per_row))
    return document_block_mask(position_ids)


def span_table(position_ids: torch.Tensor, per_row: int = 0) -> torch.Tensor:
    """[b, per_row, 2] int64 (start, end) of each row's documents, on the host: a document starts where its position
    is 0; a row's pad tail (positions 0, -1, -2, ...: data/packing.py) gets no span, so the documents kernel spends
    nothing on it; rows with fewer end in empty spans (start = end = seq), so a compiled layer sees one shape every
    step. `per_row` 0: the most documents of these rows."""
    positions = position_ids.cpu()
    batch, seq = positions.shape
    rows = []
    for row in positions:
        negative = torch.nonzero(row < 0).flatten()
        end = int(negative[0]) - 1 if len(negative) else seq  # the tail's 0 just before its first negative
        starts = torch.nonzero(row[:end] == 0).flatten().tolist() or [0]
        rows.append((starts, [*starts[1:], end]))
    per_row = per_row or max(len(starts) for starts, _ in rows)
    table = torch.full((batch, per_row, 2), seq, dtype=torch.int64)
    for row, (starts, ends) in enumerate(rows):
        if len(starts) > per_row:
            raise ValueError(f"a packed row holds {len(starts)} documents, over the bound of {per_row}")
        table[row, : len(starts)] = torch.tensor([starts, ends]).T
    return table


def _documents(table: torch.Tensor, seq: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """A `span_table` read once: the (row, start, end) of each non-empty span, and the (row, start) of each row
    whose positions from `start` on lie past its last span (a pad tail left out)."""
    spans, tails = [], []
    for row, pairs in enumerate(table.tolist()):
        kept = [(start, end) for start, end in pairs if end > start]
        spans += [(row, start, end) for start, end in kept]
        end = max((e for _, e in kept), default=0)
        if end < seq:
            tails.append((row, end))
    return spans, tails


def _documents_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """The fused kernel `document_sdpa` runs these tensors with (kept_attention.KERNELS; the CPU's flash attention
    on a CPU), or a clear error where SDPA would pick neither (float32 on a GPU)."""
    backend = sdpa_backend(query, key, value)
    if query.device.type == "cpu" or backend in KERNELS:
        return backend
    raise ValueError(
        f"train.packed_attention = \"documents\" runs SDPA's fused kernels (cuDNN's, flash attention's), which "
        f"this {query.device.type} device does not run for {query.dtype} attention: set model.dtype = "
        '"bfloat16", or train.packed_attention = "flex"'
    )


def projection_layout(t: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] laid out [b, s, heads, d] (`plan_rows`' and `row_like`'s layout: one projection's output,
    transposed): `t` itself where it is (its strides row_like's, a dimension of size 1 aside), else a copy. The
    plans built ahead take the rows, and the output's gradient, in that layout (cuDNN keys a plan by the strides
    too), so a value in another (a view of a wider output: q, k and v from one matmul, its tokens 6,144 apart on
    Qwen3-4B) would meet no plan built ahead and have the steps build them: 3-9% slower steps on one H100
    (benchmarks/journal/2026-12-07-stacked-adapters-one-h100.md)."""
    batch, heads, seq, dim = t.shape
    rows = (seq * heads * dim, dim, heads * dim, 1)
    if all(size == 1 or got == want for size, got, want in zip(t.shape, t.stride(), rows, strict=True)):
        return t
    return row_like(t).copy_(t)


def padded_length(length: int) -> int:
    """The length `document_sdpa` runs a document of `length` tokens at: the shortest of the run's chosen lengths
    that holds it (`expect_document_lengths`, model/plan_lengths.py), else `octave_length`'s (a thirty-second of its
    power of two, at least 64). cuDNN builds an execution plan (~65 ms a length, forward and backward) for every
    shape it has not seen, so few lengths keep a first step short: on one H200 the octave rule's 107 lengths for
    `qwen3-4b-meetings`' epoch (a sixty-fourth: 166) built in 13 s against 27-31 s, the first step 39 s against
    50-57 s, real tokens/s 0.2% lower (2026-12-07-head-rows-and-pad32-one-h200.md); the run's own lengths are 68
    there, for the same attention work: on one H100 the plans 0.63x forward and 0.73x backward, the first step
    43-45 s against 47-48 s, real tokens/s unchanged (2026-12-07-plan-lengths-and-an-eighth-machine-one-h100.md)."""
    at = bisect.bisect_left(_PLAN_LENGTHS, length)
    return _PLAN_LENGTHS[at] if at < len(_PLAN_LENGTHS) else octave_length(length)


def _window(t: torch.Tensor, row: int, start: int, length: int) -> torch.Tensor:
    """[1, heads, length, d] of a [b, heads, s, d] row from `start`: a view where the row has the room (past the
    document it holds the next one's tokens), else a copy, zeros past the row's end, laid out as the rows are
    ([b, s, heads, d]: the projections' layout) with the row's batch stride, so that with such rows a length
    meets cuDNN in one layout either way and one plan serves it (cuDNN keeps a plan per shape and strides)."""
    seq = t.shape[2]
    if start + length <= seq:
        return t[row : row + 1, :, start : start + length]
    window = t.new_zeros(1, length, t.shape[1], t.shape[3]).transpose(1, 2)
    window = window.as_strided(window.shape, (t.stride(0), *window.stride()[1:]))
    window[:, :, : seq - start] = t[row : row + 1, :, start:]
    return window


_LSE_SHAPES: dict[tuple, torch.Size] = {}
"""The log-sum-exp's shape each kernel returned at a (padded) length, by (kernel, device type, heads, length):
kernels differ ([1, heads, length]; cuDNN's [heads, length, 1] with torch 2.11), so `document_sdpa` keeps each
document's as [heads, its tokens] and its backward gives it back padded, in the shape its kernel made."""

_NO_WEIGHT = 1e30
"""The log-sum-exp a backward gives the window's queries past the document: every attention weight it implies is
exp(score - 1e30) = 0, so they add nothing to any gradient, whatever their output gradient."""


def _lse_shape(backend: int, device_type: str, heads: int, length: int) -> torch.Size | None:
    """The log-sum-exp's shape a kernel returns at a padded `length`: as recorded (`_LSE_SHAPES`), else as recorded
    at another length of the same kernel and heads, that length replaced (the backward's plans, built in a thread
    where that length's forward has not run yet); None where nothing is recorded."""
    shape = _LSE_SHAPES.get((backend, device_type, heads, length))
    if shape is not None:
        return shape
    for (b, d, h, n), known in list(_LSE_SHAPES.items()):
        if (b, d, h) == (backend, device_type, heads) and n != heads and list(known).count(n) == 1:
            return torch.Size(length if size == n else size for size in known)
    return None


def _document_forward(query, key, value, row: int, start: int, end: int, scale: float, backend: int) -> tuple:
    """Causal attention of the document at [start, end) of a row, run over a window of its `padded_length` from
    its start (causal: the tokens past the document change none of its outputs): its [1, heads, n, d] output and
    [heads, n] float32 log-sum-exp."""
    n, heads = end - start, query.shape[1]
    length = padded_length(n)
    kept = sdpa_forward(*(_window(t, row, start, length) for t in (query, key, value)), scale, backend)
    _LSE_SHAPES.setdefault((backend, query.device.type, heads, length), kept.logsumexp.shape)
    return kept.out[:, :, :n], kept.logsumexp.reshape(heads, length)[:, :n]


def _document_backward(grad, query, key, value, out, lse, row: int, start: int, end: int, scale: float, backend: int):
    """`_document_forward`'s query, key and value gradients ([1, heads, n, d] each): its kernel's backward operator
    over the same window, the queries past the document given `_NO_WEIGHT` as their log-sum-exp."""
    n, heads = end - start, query.shape[1]
    length = padded_length(n)
    pieces = [_window(t, row, start, length) for t in (grad, query, key, value, out)]
    padded = lse.new_full((heads, length), _NO_WEIGHT)
    padded[:, :n] = lse
    pieces.append(padded.view(_lse_shape(backend, query.device.type, heads, length)))
    grads = sdpa_backward(*pieces, dense_kept(query, backend, length), scale)
    return tuple(g[:, :, :n] for g in grads)


DOCUMENT_STREAMS = int(os.environ.get("PIPETUNE_DOCUMENT_STREAMS", "2"))
"""CUDA streams a row's long documents alternate over in `document_sdpa` (1: the current stream alone);
PIPETUNE_DOCUMENT_STREAMS sets it (for diagnosis)."""


def documents_advice(lengths: torch.Tensor, gpu: bool = True) -> str | None:
    """A line for the run's log when train.packed_attention = "documents" meets short samples (`lengths`: the
    training samples' tokens) on a GPU, where flex attention is the faster kernel; None otherwise (on a CPU both
    kernels take each sample alone)."""
    if not gpu:
        return None
    mean = float(lengths.double().mean()) if len(lengths) else 0.0
    if mean >= LONG_DOCUMENT:
        return None
    return (
        f'train.packed_attention = "documents" with samples of {mean:,.0f} tokens on average: on an H200 it ran '
        f'6-7x slower than "flex" a layer at ~550-token samples and 1.4x faster at ~7,400 (docs/packing.md); '
        f'"flex" is likely the faster kernel here'
    )


@functools.cache
def _side_streams(device: torch.device, count: int) -> tuple[torch.cuda.Stream, ...]:
    return tuple(torch.cuda.Stream(device) for _ in range(count))


def _on_streams(device: torch.device, spans: Iterable[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
    """Yield the (row, start, end) spans of documents, each with the CUDA stream it is to run on made current: on
    a GPU, documents of LONG_DOCUMENT tokens or more alternate over DOCUMENT_STREAMS side streams, so one document's
    kernels can overlap the last, part-empty waves of another's; shorter ones, and every document elsewhere, run in
    order on the current stream. A side stream waits for the current stream's work before its first document, and
    the current stream waits for every side stream used when the spans end. What a document allocates on a side
    stream it also frees there (the caching allocator keeps each stream's blocks apart); what it writes (the
    output, the gradients, allocated on the current stream) the current stream reads only after its wait."""
    if device.type != "cuda" or DOCUMENT_STREAMS < 2:
        yield from spans
        return
    current = torch.cuda.current_stream(device)
    streams = _side_streams(device, DOCUMENT_STREAMS)
    used = 0
    try:
        for span in spans:
            if span[2] - span[1] < LONG_DOCUMENT:
                yield span
                continue
            stream = streams[used % len(streams)]
            if used < len(streams):
                stream.wait_stream(current)
            used += 1
            with torch.cuda.stream(stream):
                yield span
    finally:
        for stream in streams[:used]:
            current.wait_stream(stream)


_SEEN_LENGTHS: list[int] = []
"""The document lengths (tokens) named so far (`expect_document_lengths`)."""
_PLAN_LENGTHS: list[int] = []
"""The padded lengths chosen for them (model/plan_lengths.py), sorted: `padded_length`'s, and those cuDNN's plans
are built for ahead (`_build_plans`)."""
_BUILT = threading.local()
"""Per thread (`.shapes`), as torch keeps cuDNN's plans: (backward, attention shape: kernel, device, dtype, heads,
key-value heads, head size, scale, and the query's, key's and value's strides) of each build of the plans for every
expected length. Thread-local, not keyed by the thread's ident: a new thread may get an ended one's ident, and
none of its plans."""
PLAN_BUILDS: list[tuple[int, float, str]] = []
"""(lengths, seconds, passes) of each build of cuDNN's plans ahead (`_build_plans`), for the run's log."""


def expect_document_lengths(lengths) -> None:
    """Name the document lengths (tokens: the samples') this process's packed rows will hold. cuDNN builds an
    execution plan (forward and backward) for every attention shape it has not seen, which a first epoch of whole
    meetings otherwise pays step after step (0.79x flex's speed, 2026-12-02-documents-attention-one-h200.md); with
    the lengths known, `document_sdpa`'s first call builds the plans of all their padded lengths at once, and its
    backward's first call those of the backward (`_build_plans`: ~65 ms a length on an H200, ~4 s for whole
    meetings'). The lengths padded to are chosen for these (`choose_lengths`: the fewest that cost no more
    attention work than `octave_length`'s); a length not named pads to the shortest of them that holds it, or
    costs its own build when it comes. Named once, before the steps: a change between a microbatch's forward and
    its backward would pad a document two ways."""
    _SEEN_LENGTHS.extend(int(n) for n in lengths if int(n) > 0)
    _PLAN_LENGTHS[:] = choose_lengths(_SEEN_LENGTHS) if _SEEN_LENGTHS else []


def _build_plans(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, backend: int, backward: bool
) -> None:
    """Run one zero document of every expected padded length through cuDNN at this call's shape, forward (and
    backward if `backward`), once per shape and thread: the plans the steps will use, built before the first
    step's documents. Torch keeps cuDNN's attention plans per thread (aten/src/ATen/native/cudnn/MHA.cpp), and
    autograd runs a GPU's backward, a checkpointed layer's recomputed forward with it, in a thread of its own:
    `document_sdpa` builds the forward's plans in the thread that runs its forwards (model/forward_thread.py's,
    where one was started), its backward the backward's in autograd's (built in the forward's thread alone, every
    backward plan was built again in the steps, ~55 ms each: the whole-meeting epoch's missing 5%,
    2026-12-02-documents-streams-and-plans-one-h200.md). Where no forward thread runs, a forward in autograd's
    thread (a checkpointed layer's recomputation) builds its own there, at its first call, as any thread's first
    forward does. The backward's builds run no forward where the length's log-sum-exp shape is known
    (`_lse_shape`: recorded, or inferred from another length's): Qwen3-4B's 166 whole-meeting lengths took 7.1 s
    forward and 15.1 s forward and backward again on one H100, then 7.5 s forward and 8.9 s backward alone
    (2026-12-06). A run starts both before its model loads (`prebuild_plans`)."""
    shape = (backend, query.device, query.dtype, query.shape[1], key.shape[1], query.shape[3], scale)
    layout = tuple(t.stride() for t in (query, key, value))  # cuDNN keys a plan by its strides as well
    built, here = (backward, *shape, layout), _BUILT.__dict__.setdefault("shapes", set())
    if backend != CUDNN or built in here or not _PLAN_LENGTHS:
        return
    here.add(built)
    started = time.perf_counter()
    q, k, v, out = (torch.zeros_like(t[:1]) for t in (query, key, value, row_like(query)))  # the rows' strides
    heads = query.shape[1]
    for length in _PLAN_LENGTHS:  # one document at the row's start: windows as the steps' are
        known = _lse_shape(backend, query.device.type, heads, length) is not None
        if backward and known:  # the backward's plan alone: a forward here would build one no step may use
            lse = torch.zeros(heads, length, dtype=torch.float32, device=query.device)
        else:
            _, lse = _document_forward(q, k, v, 0, 0, length, scale, backend)
        if backward:
            _document_backward(out, q, k, v, out, lse, 0, 0, length, scale, backend)
    if query.device.type == "cuda":
        torch.cuda.synchronize(query.device)
    passes = "backward" if backward else "forward"  # a backward build runs forwards only for lengths not met yet
    PLAN_BUILDS.append((len(_PLAN_LENGTHS), time.perf_counter() - started, passes))


class _BackwardPlans(torch.autograd.Function):
    """The identity, whose backward builds cuDNN's backward plans (`_build_plans`) for zero rows of the given
    shapes, in the thread autograd runs the device's backward in: the thread the steps' backward plans must be
    built in (torch keeps them per thread)."""

    @staticmethod
    def forward(ctx, x, query, key, value, scale, backend):
        ctx.rows, ctx.scale, ctx.backend = (query, key, value), scale, backend
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _build_plans(*ctx.rows, ctx.scale, ctx.backend, backward=True)
        ctx.rows = None
        return grad, None, None, None, None, None


_PREBUILDS: set[tuple] = set()
"""The shapes whose plans `prebuild_plans` started building."""

BUILD_SWITCH_INTERVAL = 5e-4
"""The interpreter's switch interval (seconds; Python's default 0.005) while `prebuild_plans`' builds run beside the
model's load and compile. A build gives up the interpreter's lock in each operator call (cuDNN's plan build,
tens of ms, among them) and may then wait a whole interval to take it back from the thread that loads and traces,
which holds it most of the time: on one H100 the builds took 1.5x as long there as in a step
(2026-12-07-forward-thread-and-a-ninth-machine-one-h100.md). Whether the lock is what slowed them there is not yet
measured on a GPU (benchmarks/journal/NOTES.md, twenty-first round: the call and its keep rule); on a CPU the wait
halves (benchmarks/tools/switch_interval.py). Restored when the last builds running end."""


class FastSwitching:
    """The switch interval set to BUILD_SWITCH_INTERVAL while at least one build runs: the first `enter` sets it,
    the last `leave` puts back the interval the first found."""

    def __init__(self) -> None:
        self.runs, self.interval, self.lock = 0, 0.0, threading.Lock()

    def enter(self) -> None:
        with self.lock:
            if self.runs == 0:
                self.interval = sys.getswitchinterval()
                sys.setswitchinterval(min(self.interval, BUILD_SWITCH_INTERVAL))
            self.runs += 1

    def leave(self) -> None:
        with self.lock:
            self.runs -= 1
            if self.runs == 0:
                sys.setswitchinterval(self.interval)


_FAST_SWITCHING = FastSwitching()


def plan_rows(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seq: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero query, key and value of one row of `seq` tokens as `document_sdpa` receives them from a transformers
    attention layer: [1, heads, seq, head_dim] laid out [1, seq, heads, head_dim] (the projections' layout, then
    transposed), so that the plans built with them are the steps' (cuDNN keys a plan by the strides too)."""
    return tuple(
        torch.zeros(1, seq, n, head_dim, dtype=dtype, device=device).transpose(1, 2)
        for n in (heads, kv_heads, kv_heads)
    )


def prebuild_plans(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, seq: int, scale: float
) -> bool:
    """Build cuDNN's plans for every expected length (`_build_plans`) now, beside the model's load and compile,
    rather than at the first step's forward and backward: the forward's in the thread that will run every forward
    of the documents kernel (model/forward_thread.py), then the backward's in autograd's thread, where the steps'
    backward runs, by a second thread's backward of zeros through `_BackwardPlans` (its own forward holds no plan;
    the first step's backward waits for it in that thread's queue). One after the other: cuDNN's plan builds do not
    run side by side (the forward's and the backward's at once both took 2.3x as long, the first step no shorter:
    17.0 s and 21.8 s against 7.5 s and 8.9 s, one H100, 2026-12-06), and the forward's builds record each length's
    log-sum-exp shape, which the backward's builds need (so they run no forward). The backward's alone, started
    here with the forward's left to the first step, gave a first step of 46.5 s from launch against 52.2 s without,
    on one H100 in one call (2026-12-06-fast-by-default-sixth-round-one-h100.md); the forward's too: the first
    step's part past the compile 13.2-14.3 s against 17.0-19.5 s, both builds slower beside the load and the
    tracing, which hold the interpreter's lock, but ended before the first backward
    (2026-12-07-forward-thread-and-a-ninth-machine-one-h100.md); the switch interval is shortened while they run
    (`BUILD_SWITCH_INTERVAL`). True where the builds were started (cuDNN's kernel, on a GPU, with expected
    lengths); should one fail, the steps build what is missing."""
    if device.type != "cuda" or not _PLAN_LENGTHS:
        return False
    query, key, value = plan_rows(device, dtype, heads, kv_heads, head_dim, seq)
    try:
        backend = _documents_backend(query, key, value)
    except ValueError:  # no fused kernel for this dtype: the steps say so
        return False
    shape = (backend, device, dtype, heads, kv_heads, head_dim, scale)
    if backend != CUDNN or shape in _PREBUILDS:
        return False
    _PREBUILDS.add(shape)
    _FAST_SWITCHING.enter()
    try:
        forwards = start_forward_thread(device).submit(_build_plans, query, key, value, scale, backend, False)
    except BaseException:
        _FAST_SWITCHING.leave()
        raise

    def build() -> None:
        forwards.exception()  # waits; an error there: the steps' first forward meets it again, naming its layer
        try:
            x = torch.zeros(1, device=device, requires_grad=True)
            _BackwardPlans.apply(x, query, key, value, scale, backend).sum().backward()
        except Exception:  # noqa: BLE001 - the steps' first backward builds the plans then
            pass
        finally:
            _FAST_SWITCHING.leave()

    threading.Thread(target=build, name="pipetune-backward-plans", daemon=True).start()
    return True


@torch.library.custom_op("pipetune::document_sdpa", mutates_args=())
def document_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of [b, heads, s, d] query and [b, kv heads, s, d] key and value within each span of
    `spans` (a `span_table`), each span through SDPA's fused kernel (kept_attention's operators: cuDNN's on an H200,
    flash attention's elsewhere and on the CPU) over a window of its `padded_length` from its start (a view of the
    row; causal attention keeps the document's outputs exact whatever follows it): the [b, heads, s, d] output
    (laid out as [b, s, heads, d]) and the documents' float32 log-sum-exps, flat ([b x heads x s], `lse_slice`),
    for the backward."""
    started = forward_thread(query.device)  # where one runs the forwards (its plans built ahead): there
    if started is not None:
        return started.run(_document_sdpa, query, key, value, spans, scale)
    return _document_sdpa(query, key, value, spans, scale)


def _document_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spans: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`document_sdpa`'s work, in the thread that runs it."""
    batch, heads, seq, dim = query.shape
    query, key, value = (projection_layout(t) for t in (query, key, value))
    out = row_like(query)
    lse = query.new_empty(batch * heads * seq, dtype=torch.float32)
    backend = _documents_backend(query, key, value)
    _build_plans(query, key, value, scale, backend, backward=False)
    documents, tails = _documents(spans, seq)
    for row, start, end in _on_streams(query.device, documents):
        doc_out, doc_lse = _document_forward(query, key, value, row, start, end, scale, backend)
        out[row : row + 1, :, start:end] = doc_out
        lse[lse_slice(row, start, end, heads, seq)] = doc_lse.flatten()
    for row, start in tails:  # a pad tail: zeros, and no gradient to or through it
        out[row : row + 1, :, start:] = 0
    return out, lse


@torch.library.custom_op("pipetune::document_sdpa_backward", mutates_args=())
def document_sdpa_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    spans: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`document_sdpa`'s query, key and value gradients: each span through `_document_backward`."""
    heads, seq = query.shape[1], query.shape[2]
    grads = [torch.empty_like(t) for t in (query, key, value)]
    grad, query, key, value = (projection_layout(t) for t in (grad, query, key, value))
    backend = _documents_backend(query, key, value)
    _build_plans(query, key, value, scale, backend, backward=True)
    documents, tails = _documents(spans, seq)
    for row, start, end in _on_streams(query.device, documents):
        doc_lse = lse[lse_slice(row, start, end, heads, seq)].view(heads, end - start)
        pieces = _document_backward(grad, query, key, value, out, doc_lse, row, start, end, scale, backend)
        for whole, piece in zip(grads, pieces, strict=True):
            whole[row : row + 1, :, start:end] = piece
    for row, start in tails:
        for whole in grads:
            whole[row : row + 1, :, start:] = 0
    return tuple(grads)


register_table_autograd(document_sdpa, document_sdpa_backward)


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
    BlockMask, `document_sdpa` with a DocumentTable); the chosen rows' queries alone under a HeadRows (the last
    layer on the rows the loss reads, model/head_rows.py); inside a checkpointed layer that keeps attention
    (train.keep_attention), SDPA's fused kernel with its output kept (model/kept_attention.py); transformers'
    SDPA otherwise."""
    kernel = kept_kernel(module, query, key, value, attention_mask, dropout, kwargs)
    if kernel is not None:
        return kept_attention(query, key, value, scaling, kernel), None
    if isinstance(attention_mask, HeadRows):  # the last layer, on the rows the loss reads (model/head_rows.py)
        if dropout > 0:
            raise ValueError(f"attention dropout {dropout} is not supported on the loss's rows")
        return head_rows_attention(query, key, value, attention_mask, scaling), None
    if not isinstance(attention_mask, (BlockMask, DocumentTable)):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout > 0:
        raise ValueError(f"attention dropout {dropout} is not supported with data.packing")
    if isinstance(attention_mask, DocumentTable):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out, _ = document_sdpa(query, key, value, attention_mask.spans, scale)
    else:
        attend = flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention()
        gqa = key.shape[1] != query.shape[1]
        out = attend(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(DOCUMENT_ATTENTION, document_attention)


def use_document_attention(model: nn.Module) -> None:
    """Switch a (PEFT-wrapped) HF model's attention to `document_attention`: packed microbatches, with a mask,
    attention kept through recomputation, or the last layer on the loss's rows."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.config._attn_implementation = DOCUMENT_ATTENTION
