"""Decoder-layer MLPs run a chunk of the sequence at a time (`train.mlp_chunk`).

An MLP's workspace is 3 x intermediate_size per token (gate, up, and the activation product), 3-4x a layer's
input: at long rows its forward alone briefly needs more than all the checkpointed inputs. Chunked, each piece
is its own non-reentrant checkpoint: the forward keeps only the piece's input (a view of the MLP's input, which
the layer holds anyway) and backward recomputes one piece at a time, so the workspace is one chunk's, whatever
the row's length. The math per token is unchanged; with LoRA dropout the masks are drawn per chunk (same
distribution, other draws than an unchunked run's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def chunked(forward: Callable[[torch.Tensor], torch.Tensor], chunk: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`forward` over [batch, seq, hidden] applied `chunk` positions at a time, each chunk recomputed in backward."""

    def chunked_forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[1] <= chunk:
            return forward(hidden)
        pieces = hidden.split(chunk, dim=1)
        if not torch.is_grad_enabled():
            return torch.cat([forward(piece) for piece in pieces], dim=1)
        keep_rng = hidden.device.type != "meta"  # the meta device has no random state to restore
        return torch.cat(
            [checkpoint(forward, piece, use_reentrant=False, preserve_rng_state=keep_rng) for piece in pieces], dim=1
        )

    chunked_forward.chunk = chunk  # type: ignore[attr-defined]
    return chunked_forward


def chunk_mlps(layers: list[nn.Module], chunk: int) -> None:
    """Run each decoder layer's `mlp` `chunk` tokens at a time (0: as it was). Replaces the module's forward in
    place, so parameter names (adapters, checkpoints) stay the same."""
    for layer in layers:
        mlp = layer.mlp
        original = getattr(mlp.forward, "unchunked", mlp.forward)
        if chunk <= 0:
            if original is not mlp.forward:
                mlp.forward = original
            continue
        mlp.forward = chunked(original, chunk)
        mlp.forward.unchunked = original  # type: ignore[attr-defined]
