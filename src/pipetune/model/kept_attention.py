"""Attention kept through a checkpointed layer's recomputation (`train.keep_attention`).

A checkpointed layer (torch.utils.checkpoint, non-reentrant) recomputes its whole forward in backward. At long
rows that forward is mostly attention (Qwen3-8B at 131,072 tokens: 1.07 GFLOP a token and layer against 0.39 for
the projections and the MLP), which the backward then needs only for its output and log-sum-exp: flash
attention's backward recomputes the scores itself. So a layer that keeps those two (the output: as many bytes
as the layer's input; the log-sum-exp: 4 bytes a token and head) recomputes everything but attention.

How: the checkpoint's `context_fn` marks the layer's first forward (`recording`) and its recomputation
(`replaying`). Under the first, each causal, unmasked attention call runs the fused kernel SDPA itself picks for
it (`torch._fused_sdp_choice`: cuDNN's on an H200 with torch 2.11, flash attention's elsewhere and on the CPU) as
its own operator, and queues its output, log-sum-exp and the operator's other outputs per attention module; under
the second the same call takes them back from the queue instead of computing (first in, first out: every
schedule runs a stage's backwards in the order of its forwards). Both go through `_Kept`'s autograd function,
whose backward is that kernel's own backward operator on the recomputed query, key and value and the kept output:
SDPA's gradients. (Forcing flash attention where SDPA picks cuDNN costs more than the recomputation saves: at
131,072 tokens on an H200 cuDNN's forward took 246 ms a layer, flash attention's 429.)
Where the layer offloads its input (model/offload.py), the output goes to pinned host memory the same way, one
layer ahead in backward; the log-sum-exp stays on the GPU.

Any other attention call (a mask, a sliding window, soft-capping, dropout, float32 on a GPU, a compiled layer)
takes transformers' SDPA path in both passes, unchanged. On the CPU the operator is flash attention's CPU
kernel, so tests run the same code path.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import deque
from collections.abc import Iterator
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


@dataclass
class KeptAttention:
    """One stage's kept attention: per attention module, the queue of its calls' results awaiting recomputation.

    `offloaded`: how many of the stage's first checkpointed layers keep the output in host memory."""

    offloaded: int = 0
    _queues: dict[int, deque[_Kept]] = field(default_factory=dict)
    _host: ActivationOffload | None = None
    _mode: str | None = None
    _layer: int = 0

    def __post_init__(self) -> None:
        self._host = ActivationOffload(self.offloaded) if self.offloaded else None

    def contexts(self, index: int) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """The checkpoint's `context_fn` result for layer `index`: (its first forward's, its recomputation's)."""
        if index == 0 and self._host is not None:
            self._host.start()
        return self._active("record", index), self._active("replay", index)

    @contextlib.contextmanager
    def _active(self, mode: str, index: int) -> Iterator[None]:
        global _ACTIVE
        before, _ACTIVE = _ACTIVE, self
        self._mode, self._layer = mode, index
        try:
            yield
        finally:
            _ACTIVE, self._mode = before, None

    def held(self) -> int:
        """Attention calls whose results await their recomputation (0 between steps)."""
        return sum(len(queue) for queue in self._queues.values())

    def release(self) -> int:
        """Forget every result held (a forward with no backward: the memory probe); their bytes on the GPU."""
        held = sum(
            kept.out.nbytes + kept.logsumexp.nbytes
            for queue in self._queues.values()
            for kept in queue
            if isinstance(kept.out, torch.Tensor)
        )
        self._queues.clear()
        return held

    def record(self, module: nn.Module, kept: _Kept) -> None:
        if self._host is not None and self._layer < self.offloaded:
            kept.out = self._host.pack(kept.out)
        self._queues.setdefault(id(module), deque()).append(kept)

    def replay(self, module: nn.Module) -> _Kept:
        queue = self._queues.get(id(module))
        if not queue:
            raise RuntimeError(
                "train.keep_attention: a layer's recomputation found no kept attention output (its forward ran "
                "outside a checkpoint, or a schedule ran backwards out of order); set train.keep_attention = false"
            )
        kept = queue.popleft()
        if self._host is not None and not isinstance(kept.out, torch.Tensor):
            kept.out = self._host.unpack(kept.out)
        return kept


_ACTIVE: KeptAttention | None = None
"""The stage whose checkpointed layer is being run or recomputed right now (set by `KeptAttention.contexts`)."""


def keeps(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: object,
    dropout: float,
    kwargs: dict,
) -> bool:
    """Whether this attention call goes through `kept_attention`: inside a keeping layer's checkpoint, not being
    compiled, causal and unmasked, no dropout, sliding window or soft-capping, and SDPA would run one of KERNELS."""
    if _ACTIVE is None or _ACTIVE._mode is None or torch.compiler.is_compiling():
        return False
    if attention_mask is not None or dropout > 0 or not getattr(module, "is_causal", True) or query.shape[2] < 2:
        return False
    if kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        return False
    return _backend(query, key, value) in KERNELS


def _backend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> int:
    """The kernel SDPA picks for causal, unmasked attention of these tensors (SDPBackend's value)."""
    if query.device.type == "meta":  # the memory probe: what CUDA's kernels keep, flash attention's being one
        return FLASH if query.dtype in (torch.float16, torch.bfloat16) else -1
    return torch._fused_sdp_choice(query, key, value, None, 0.0, True, scale=None, enable_gqa=True)


def kept_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """[b, s, heads, d] causal attention of [b, heads, s, d] query and [b, kv heads, s, d] key and value, its
    output kept by the active stage in the first forward and taken back in the recomputation."""
    assert _ACTIVE is not None
    out = _KeptAttention.apply(query, key, value, scaling, _ACTIVE, module)
    return out.transpose(1, 2).contiguous()


def _forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None) -> _Kept:
    aten = torch.ops.aten
    if query.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, True, scale=scale)
        return _Kept(out, lse, FLASH, ())
    backend = _backend(query, key, value)
    if backend == CUDNN:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            query, key, value, None, True, 0.0, True, False, scale=scale
        )
    else:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            query, key, value, 0.0, True, False, scale=scale
        )
    return _Kept(out, lse, backend, (cum_q, cum_k, max_q, max_k, seed, offset))


def _backward(grad: torch.Tensor, query, key, value, out, lse, kept: _Kept, scale: float | None) -> tuple:
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


class _KeptAttention(torch.autograd.Function):
    """Fused attention that computes (first forward) or takes back (recomputation) its output; its backward is
    its kernel's backward operator."""

    @staticmethod
    def forward(ctx, query, key, value, scale, stage: KeptAttention, module: nn.Module):
        if stage._mode == "record":
            kept = _forward(query, key, value, scale)
            out = kept.out
            kept.out = out.detach()  # an alias of its own: the returned tensor gets this call's history
            stage.record(module, kept)
        else:
            kept = stage.replay(module)
            out = kept.out
        ctx.scale, ctx.kept = scale, dataclasses.replace(kept, out=None, logsumexp=None)  # the tensors are saved
        ctx.save_for_backward(query, key, value, out, kept.logsumexp)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        grad = grad.contiguous() if grad.stride(-1) != 1 else grad
        dq, dk, dv = _backward(grad, query, key, value, out, lse, ctx.kept, ctx.scale)
        return dq, dk, dv, None, None, None
