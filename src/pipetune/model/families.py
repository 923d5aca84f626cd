"""What pipetune knows about each model family, in one place: one `Family` per family, read by loading (prune,
tie, buffers, random init), GGUF intake, tensor parallelism, LoRA, the memory model, calibration and the stage.

A family is a transformers decoder-only causal LM with the `model.embed_tokens` / `model.layers` / `model.norm` /
`model.rotary_emb` + `lm_head` layout. Whatever its decoder computes outside its layers (rotary position
embeddings, attention masks) the stage computes again through `Family.layer_inputs`, so that a stage's layers are
called as the whole model's decoder calls them. Adding a family is adding one instance to `FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from pipetune.config import ConfigError

LayerInputs = dict[str, dict[str, Any]]
"""Layer kind (`Family.layer_kind`) -> the keyword arguments the decoder calls its layers of that kind with."""

CAUSAL = "causal"
"""The one layer kind of a family whose layers all attend causally to every earlier position."""


def causal_layer_inputs(rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> LayerInputs:
    """Llama-style decoders: one rotary embedding for every layer, causal attention (no mask: sdpa's is_causal)."""
    return {
        CAUSAL: dict(
            attention_mask=None,
            position_ids=position_ids,
            position_embeddings=rotary(hidden, position_ids),
            use_cache=False,
        )
    }


def sliding_window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor | None:
    """[1, 1, seq, seq] boolean mask (True: attend) of causal attention to the last `window` positions, as
    transformers' sliding-window causal mask; None where the window covers the sequence (plain causal)."""
    if seq <= window:
        return None
    index = torch.arange(seq, device=device)
    query, key = index[:, None], index[None, :]
    return ((key <= query) & (key > query - window))[None, None]


def gemma3_layer_inputs(rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor) -> LayerInputs:
    """Gemma 3: a rotary embedding per attention kind (local for sliding-window layers, global for full ones),
    and a sliding-window mask for the sliding layers."""
    config, seq = rotary.config, position_ids.shape[-1]
    inputs: LayerInputs = {}
    for kind in sorted(set(config.layer_types)):
        sliding = kind == "sliding_attention"
        inputs[kind] = dict(
            attention_mask=sliding_window_mask(seq, config.sliding_window, hidden.device) if sliding else None,
            position_ids=position_ids,
            position_embeddings=rotary(hidden, position_ids, kind),
            use_cache=False,
        )
    return inputs


def gemma3_layer_kind(layer: nn.Module) -> str:
    """A Gemma 3 layer's attention kind ("sliding_attention" or "full_attention"), from its own config."""
    return layer.self_attn.config.layer_types[layer.self_attn.layer_idx]


def gemma3_buffers(model: PreTrainedModel) -> None:
    """The embedding's scale (sqrt(hidden size)), a buffer that allocation on the target device leaves empty."""
    embed = model.model.embed_tokens
    if embed is not None:
        embed.embed_scale.fill_(embed.scalar_embed_scale)


def gemma3_check(config: PretrainedConfig) -> str | None:
    """What a Gemma 3 config asks for that the stage does not compute, or None."""
    if getattr(config, "final_logit_softcapping", None) is not None:
        return f"final_logit_softcapping = {config.final_logit_softcapping} (the stage's lm_head does not cap logits)"
    if getattr(config, "use_bidirectional_attention", False):
        return "use_bidirectional_attention = true (the stage's layers attend causally)"
    return None


@dataclass(frozen=True)
class Family:
    """One model family: its names, its projections' roles, and what its decoder does outside its layers."""

    name: str
    """Display name in messages ("Qwen3")."""
    model_types: tuple[str, ...]
    """transformers' `config.model_type`(s) of the family."""
    gguf_architecture: str | None
    """llama.cpp's `general.architecture` of its GGUF files; None: not read from GGUF."""
    column_wise: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    """Decoder-layer linears split by output columns under tensor parallelism (their input replicated)."""
    row_wise: tuple[str, ...] = ("o_proj", "down_proj")
    """Decoder-layer linears split by input columns under tensor parallelism (their output summed)."""
    shared_inputs: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
    """Linears of one module that read one input: the attention's q/k/v, the MLP's gate/up (model/lora.py)."""
    block_norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    """A decoder layer's norms whose outputs are the attention's and the MLP's inputs: sequence parallelism runs
    them on this rank's positions and gathers their outputs (parallel/tp.py)."""
    layer_inputs: Callable[[nn.Module, torch.Tensor, torch.Tensor], LayerInputs] = causal_layer_inputs
    """(rotary embedding module, hidden states, position ids [b, s]) -> keyword arguments of its layers by kind."""
    layer_kind: Callable[[nn.Module], str] = lambda layer: CAUSAL
    """A decoder layer's kind: the key of its arguments in `layer_inputs`' result."""
    first_stage_only: tuple[str, ...] = ("model.embed_tokens",)
    """Modules only the first pipeline stage keeps (a stage without them has them set to None)."""
    last_stage_only: tuple[str, ...] = ("model.norm", "lm_head")
    """Modules only the last pipeline stage keeps."""
    tied: tuple[tuple[str, str], ...] = (("lm_head.weight", "model.embed_tokens.weight"),)
    """(weight, the weight it is read from) when `config.tie_word_embeddings`: the checkpoint lacks the first."""
    norm_init: float = 1.0
    """A norm weight's value in a random-weight model (Gemma's norms scale by 1 + weight: 0)."""
    restore_buffers: Callable[[PreTrainedModel], None] = lambda model: None
    """Recompute the buffers, besides the rotary embedding's, that allocating the meta model leaves empty."""
    unsupported: Callable[[PretrainedConfig], str | None] = lambda config: None
    """What a config of the family asks for that the stage does not compute (a refusal), or None."""
    pre_norm_layers: bool = True
    """Its decoder layers compute h = x + self_attn(input_layernorm(x)), then h + mlp(post_attention_layernorm(h)),
    nothing else: the last one may run on the loss's rows alone (model/head_rows.py)."""

    @property
    def projections(self) -> tuple[str, ...]:
        """The decoder layer's linears (LoRA's target modules are among these)."""
        return self.column_wise + self.row_wise

    def layer_counts(self, model: PreTrainedModel) -> tuple[int, int, int]:
        """Parameters of `model`'s first decoder layer, of its token embedding, and of its final norm + lm_head."""
        layer = sum(param.numel() for param in model.model.layers[0].parameters())
        embedding = sum(param.numel() for name in self.first_stage_only for param in _module(model, name).parameters())
        head = sum(param.numel() for name in self.last_stage_only for param in _module(model, name).parameters())
        return layer, embedding, head

    def prune(self, model: PreTrainedModel, first: bool, last: bool) -> None:
        """Drop the modules a stage without the embedding (`first` false) or the head (`last` false) does not run."""
        for keep, names in ((first, self.first_stage_only), (last, self.last_stage_only)):
            for name in () if keep else names:
                parent, _, child = name.rpartition(".")
                setattr(_module(model, parent) if parent else model, child, None)


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


FAMILIES = (
    Family("Llama", ("llama",), "llama"),
    Family("Mistral", ("mistral",), "llama"),  # llama.cpp writes Mistral files as "llama"
    Family("Qwen2", ("qwen2",), "qwen2"),
    Family("Qwen3", ("qwen3",), "qwen3"),
    Family(
        "Gemma 3",
        ("gemma3_text",),
        "gemma3",
        block_norms=("input_layernorm", "pre_feedforward_layernorm"),
        layer_inputs=gemma3_layer_inputs,
        layer_kind=gemma3_layer_kind,
        norm_init=0.0,
        restore_buffers=gemma3_buffers,
        unsupported=gemma3_check,
        pre_norm_layers=False,  # its layers norm the attention's and the MLP's outputs too
    ),
)
"""Every family pipetune builds pipeline stages for."""

SUPPORTED_MODEL_TYPES = tuple(model_type for family in FAMILIES for model_type in family.model_types)


def family_of(model_config: PretrainedConfig, where: str = "the model") -> Family:
    """The family of a transformers config; ConfigError naming the supported model types (or the option the
    stage does not compute) otherwise. `where` names the model in the message (e.g. "model.name = 'x'")."""
    model_type = getattr(model_config, "model_type", None)
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is None:
        raise ConfigError(
            f"{where} has model_type {model_type!r}; pipetune builds pipeline stages for "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} decoder-only models"
        )
    refusal = family.unsupported(model_config)
    if refusal is not None:
        raise ConfigError(f"{where} is a {family.name} model with {refusal}; pipetune cannot train it")
    return family


def gguf_architectures() -> tuple[str, ...]:
    """The GGUF architectures pipetune reads, in the families' order."""
    return tuple(dict.fromkeys(f.gguf_architecture for f in FAMILIES if f.gguf_architecture is not None))


def gguf_family_names() -> str:
    """The families read from GGUF files, for messages: "Llama, Mistral, Qwen2, Qwen3, Gemma 3"."""
    return ", ".join(f.name for f in FAMILIES if f.gguf_architecture is not None)
