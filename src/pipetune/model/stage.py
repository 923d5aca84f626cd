"""A pipeline stage over an HF decoder-only model: embedding (first), some decoder layers, norm + lm_head (last).

Only hidden states travel between stages. Positions are recomputed on every stage from the
(static) sequence length; samples are right-padded and attention is causal, so real tokens
never see pads and no mask needs to travel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel


def decoder_of(model: nn.Module) -> nn.Module:
    """The inner decoder (`model.model`) of a causal LM, also when wrapped by PEFT."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


class _Parts(NamedTuple):
    """Plain references into the model (a tuple, so nn.Module does not register them twice)."""

    embed: nn.Module | None
    layers: list[nn.Module]
    norm: nn.Module | None
    lm_head: nn.Module | None
    rotary: nn.Module


class StageModule(nn.Module):
    """Runs one stage. Holds the (possibly PEFT-wrapped) pruned causal LM so parameter names stay full-model names."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        decoder = decoder_of(model)
        base: PreTrainedModel = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = decoder.layers
        self._parts = _Parts(
            embed=decoder.embed_tokens,
            layers=list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers),
            norm=decoder.norm,
            lm_head=base.lm_head,
            rotary=decoder.rotary_emb,
        )

    def compile_layers(self) -> None:
        """torch.compile each decoder layer in place. All layers share one graph (parameters are graph
        inputs), so compilation happens once, at the first forward."""
        for layer in self._parts.layers:
            layer.compile()

    @property
    def is_first(self) -> bool:
        return self._parts.embed is not None

    @property
    def is_last(self) -> bool:
        return self._parts.lm_head is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s] on the first stage, hidden states [b, s, h] elsewhere; logits [b, s, v] on the last."""
        parts = self._parts
        hidden = parts.embed(x) if self.is_first else x
        batch, seq = hidden.shape[:2]
        position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0).expand(batch, -1)
        position_embeddings = parts.rotary(hidden, position_ids)
        for layer in parts.layers:
            out = layer(
                hidden,
                attention_mask=None,
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                use_cache=False,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        if not self.is_last:
            return hidden
        return parts.lm_head(parts.norm(hidden))
