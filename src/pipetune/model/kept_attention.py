"""Attention kept through a checkpointed layer's recomputation (`train.keep_attention`).

A checkpointed layer (torch.utils.checkpoint, non-reentrant) recomputes its whole forward in backward. At long
rows that forward is mostly attention (Qwen3-8B at 131,072 tokens: 1.07 GFLOP a token and layer against 0.39 for
the projections and the MLP), which the backward then needs only for its output and log-sum-exp: flash
attention's backward recomputes the scores itself. So a layer that keeps those two (the output: as many bytes
as the layer's input; the log-sum-exp: 4 bytes a token and head) recomputes everything but attention.

How: the checkpoint's `context_fn` gives each checkpoint call of a layer two contexts bound to one `_Call`: its
first forward's (`record`) and its recomputation's (`replay`). Under the first, each causal, unmasked attention
call runs the fused kernel SDPA itself picks for it (`torch._fused_sdp_choice`: cuDNN's on an H200 with torch
2.11, flash attention's elsewhere and on the CPU) as its own operator, and the call keeps its output, log-sum-exp
and the operator's other outputs; under the second the same attention calls take them back in order instead of
computing. No queue spans calls, so no schedule's order matters, and a forward whose backward never comes (torch's
pipeline stages infer their shapes with one) leaves nothing behind. Both passes go through `_KeptAttention`, whose
backward is that kernel's own backward operator on the recomputed query, key and value and the kept output:
SDPA's gradients. (Forcing flash attention where SDPA picks cuDNN costs more than the recomputation saves: at
131,072 tokens on an H200 cuDNN's forward took 246 ms a layer, flash attention's 429.)

Where the layer offloads its input (model/offload.py), the output goes to pinned host memory the same way, one
layer ahead in backward; the log-sum-exp stays on the GPU.

Any other attention call (a mask, a sliding window, soft-capping, dropout, a compiled layer, a kernel other than
those two, such as float32 on a GPU) takes transformers' SDPA path in both passes, unchanged. On the CPU the
operator is flash attention's CPU kernel, so tests run the same code path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from pipetune.model.offload import ActivationOffload

FLASH, CUDNN = SDPBackend.FLASH_ATTENTION.value, SDPBackend.CUDNN_ATTENTION.value
KERNELS = (FLASH, CUDNN)
"""The SDPA kernels whose operators `kept_attention` runs (both return the log-sum-exp their backward needs)."""


@dataclass
class _Kept:
    """One attention call's results from the first forward: what its recomputation takes back."""

    out: torch.Tensor | object
    """The output ([b, heads, s, d]), or its host copy's handle (ActivationOffload.pack)."""
    logsumexp: torch.Tensor
    backend: int
    """The SDPA kernel (torch.nn.attention.SDPBackend's value) that computed it, whose backward runs."""
    extra: tuple
    """The CUDA operator's other outputs its backward takes (sequence tables, maxima, RNG state); () on the CPU."""


class KeptAttention:
    """One stage's kept attention: makes each checkpoint call of its layers a `_Call`, which holds what that call's
    first forward kept until the call's recomputation takes it back.

    `offloaded`: how many of the stage's first checkpointed layers keep the output in host memory."""

    def __init__(self, offloaded: int = 0) -> None:
        self.offloaded = offloaded
        self.host = ActivationOffload(offloaded) if offloaded else None

    def contexts(self, index: int) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """The checkpoint's `context_fn` result for a call of layer `index`: (its first forward's, its
        recomputation's), both bound to one `_Call`."""
        call = self.call(index)
        return call.active("record"), call.active("replay")

    def call(self, index: int) -> _Call:
        """A new checkpoint call of layer `index` (layer 0 begins a forward: a new chain of host copies)."""
        if index == 0 and self.host is not None:
            self.host.start()
        return _Call(self.host if index < self.offloaded else None)


@dataclass
class _Call:
    """One checkpoint call of a layer: its attention calls' results, in call order. It lives as long as the
    checkpoint's recomputation context, i.e. the autograd graph of that forward: a forward whose backward never
    comes (torch's pipeline stages infer their shapes with one) leaves nothing behind and shifts nothing."""

    host: ActivationOffload | None
    """Where the outputs go while they wait (None: they stay where they are)."""
    kept: list[_Kept] = field(default_factory=list)
    mode: str | None = None
    taken: int = 0

    def active(self, mode: str) -> _Active:
        """A context in which this call is the active one, in `mode`, each time it is entered (the checkpoint enters
        its recomputation context once per recomputation: a second backward pass recomputes again)."""
        return _Active(self, mode)

    def record(self, kept: _Kept) -> None:
        if self.host is not None:
            kept.out = self.host.pack(kept.out)
        self.kept.append(kept)

    def replay(self) -> _Kept:
        if self.taken >= len(self.kept):
            raise RuntimeError(
                f"train.keep_attention: a layer's recomputation made attention call {self.taken + 1}, its forward "
                f"{len(self.kept)}; set train.keep_attention = false"
            )
        kept = self.kept[self.taken]
        self.taken += 1
        if isinstance(kept.out, torch.Tensor):
            return kept
        # Fetched anew for this recomputation, held by it alone: freed with the layer's backward.
        return dataclasses.replace(kept, out=self.host.unpack(kept.out))

    def device_bytes(self) -> int:
        """Bytes of the kept results that stay on the device (the memory probe's count)."""
        return sum(k.out.nbytes + k.logsumexp.nbytes for k in self.kept if isinstance(k.out, torch.Tensor))


_ACTIVE: _Call | None = None
"""The checkpoint call being run or recomputed right now (set by `_Call.active`)."""


class _Active:
    """`_Call.active`'s context: re-entrant, unlike a generator's (each entry reads the kept results from the
    start, and restores the call that was active before)."""

    def __init__(self, call: _Call, mode: str) -> None:
        self.call, self.mode, self.before = call, mode, []

    def __enter__(self) -> None:
        global _ACTIVE
        self.before.append(_ACTIVE)
        _ACTIVE = self.call
        self.call.mode, self.call.taken = self.mode, 0

    def __exit__(self, *exc: object) -> None:
        global _ACTIVE
        _ACTIVE, self.call.mode = self.before.pop(), None


def kept_kernel(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    dropout: float,
    kwargs: dict,
) -> int | None:
    """The kernel (one of KERNELS) with which this attention call goes through `kept_attention`, or None: inside a
    keeping layer's checkpoint, not being compiled, causal and unmasked, no dropout, sliding window or
    soft-capping, and SDPA would run one of KERNELS."""
    if _ACTIVE is None or _ACTIVE.mode is None or torch.compiler.is_compiling():
        return None
    if attention_mask is not None or dropout > 0 or not getattr(module, "is_causal", True) or query.shape[2] < 2:
        return None
    if kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        return None
    backend = sdpa_backend(query, key, value)
    return backend if backend in KERNELS else None


def sdpa_backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """The kernel SDPA picks for causal, unmasked attention of these tensors (SDPBackend's value)."""
    if query.device.type == "meta":  # the memory probe: what CUDA's kernels keep, flash attention's being one
        return FLASH if query.dtype in (torch.float16, torch.bfloat16) else -1
    return torch._fused_sdp_choice(query, key, value, None, 0.0, True, scale=None, enable_gqa=True)


def kept_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, kernel: int
) -> torch.Tensor:
    """[b, s, heads, d] causal attention of [b, heads, s, d] query and [b, kv heads, s, d] key and value by
    `kernel` (kept_kernel's), its output kept by the active call in the first forward and taken back in the
    recomputation."""
    assert _ACTIVE is not None
    out = _KeptAttention.apply(query, key, value, scaling, _ACTIVE, kernel)
    return out.transpose(1, 2).contiguous()


def sdpa_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None, backend: int
) -> _Kept:
    """Causal attention by SDPA's fused `backend` (one of KERNELS; the CPU's flash attention on a CPU), as its own
    operator: the output, the log-sum-exp and the operator's other outputs its backward takes."""
    aten = torch.ops.aten
    if query.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True, scale=scale)
        return _Kept(out, lse, FLASH, ())
    if backend == CUDNN:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, True, False, scale=scale
        )
    else:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, True, False, scale=scale
        )
    return _Kept(out, lse, backend, (cum_q, cum_k, max_q, max_k, seed, offset))


def dense_kept(query: torch.Tensor, backend: int, length: int, keys: int | None = None) -> _Kept:
    """What `sdpa_backward` takes of `sdpa_forward`'s results beside the tensors it is given, made anew for causal,
    dropout-free attention over whole rows of `length` queries and `keys` keys (default: as many) by `backend` (no
    sequence tables; the random state unused without dropout)."""
    zero = query.new_zeros((), dtype=torch.int64)
    return _Kept(None, None, backend, (None, None, length, length if keys is None else keys, zero, zero))


def sdpa_backward(grad: torch.Tensor, query, key, value, out, lse, kept: _Kept, scale: float | None) -> tuple:
    """`sdpa_forward`'s query, key and value gradients: its kernel's backward operator."""
    aten = torch.ops.aten
    if query.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, lse, 0.0, True, scale=scale
        )
    cum_q, cum_k, max_q, max_k, seed, offset = kept.extra
    if kept.backend == CUDNN:
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, query, key, value, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True, scale=scale
        )
    return aten._scaled_dot_product_flash_attention_backward(
        grad, query, key, value, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset, scale=scale
    )


def row_like(query: torch.Tensor, zeros: bool = False) -> torch.Tensor:
    """An [b, heads, s, d] tensor like `query` laid out [b, s, heads, d] (empty, or `zeros`): a table-driven
    operator's output, and the layout its backward takes the output's gradient in."""
    batch, heads, seq, dim = query.shape
    make = query.new_zeros if zeros else query.new_empty
    return make(batch, seq, heads, dim).transpose(1, 2)


def lse_slice(row: int, start: int, end: int, heads: int, seq: int) -> slice:
    """Where the log-sum-exp ([heads, end - start]) of the queries at [start, end) of a row lies in a table-driven
    operator's flat one ([b x heads x s]): rows after each other, a row's queries in order."""
    return slice((row * seq + start) * heads, (row * seq + end) * heads)


def register_table_autograd(forward, backward) -> None:
    """Autograd for an attention operator `forward(query, key, value, table, scale) -> (out, lse)` whose gradients
    are the operator `backward(grad, query, key, value, out, lse, table, scale) -> (dq, dk, dv)` (the table: a
    tensor that says which queries attend to which keys), and both operators' fakes (`out` as `row_like`, `lse`
    flat as `lse_slice` reads it): the documents kernel's (model/attention.py) and the last layer's on the loss's
    rows (model/head_rows.py)."""

    @forward.register_fake
    def _(query, key, value, table, scale):
        batch, heads, seq, _ = query.shape
        return row_like(query), query.new_empty(batch * heads * seq, dtype=torch.float32)

    @backward.register_fake
    def _(grad, query, key, value, out, lse, table, scale):
        return tuple(torch.empty_like(t) for t in (query, key, value))

    def setup(ctx, inputs, output) -> None:
        query, key, value, table, scale = inputs
        ctx.save_for_backward(query, key, value, *output, table)
        ctx.scale = scale

    def grads(ctx, grad, _lse_grad):
        query, key, value, out, lse, table = ctx.saved_tensors
        grad = grad.contiguous() if grad.stride(-1) != 1 else grad
        return *backward(grad, query, key, value, out, lse, table, ctx.scale), None, None

    forward.register_autograd(grads, setup_context=setup)


class _KeptAttention(torch.autograd.Function):
    """Fused attention that computes (first forward) or takes back (recomputation) its output; its backward is
    its kernel's backward operator."""

    @staticmethod
    def forward(ctx, query, key, value, scale, call: _Call, kernel: int):
        if call.mode == "record":
            kept = sdpa_forward(query, key, value, scale, kernel)
            out = kept.out
            kept.out = out.detach()  # an alias of its own: the returned tensor gets this call's history
            call.record(kept)
        else:
            kept = call.replay()
            out = kept.out
        ctx.scale, ctx.kept = scale, dataclasses.replace(kept, out=None, logsumexp=None)  # the tensors are saved
        ctx.save_for_backward(query, key, value, out, kept.logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        grad = grad.contiguous() if grad.stride(-1) != 1 else grad
        dq, dk, dv = sdpa_backward(grad, query, key, value, out, lse, ctx.kept, ctx.scale)
        return dq, dk, dv, None, None, None
