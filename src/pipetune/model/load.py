"""Build a causal LM, or one pipeline stage of it, without ever holding the whole model.

The model is constructed on the meta device, pruned to the stage's layers (kept under their
full-model names: `model.layers.17` stays `model.layers.17`), materialized on the target device,
then filled: from the checkpoint's safetensors files, reading only the stage's tensors, or
with a random initialisation keyed by parameter name, so every layout gets the same weights.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from pipetune.config import ConfigError
from pipetune.model.shapes import ResolvedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadStats:
    """What one rank read from the checkpoint (zero for random init)."""

    tensors: int = 0
    bytes: int = 0


def build_model(
    resolved: ResolvedModel,
    dtype: torch.dtype,
    device: torch.device,
    layers: Sequence[int] | None = None,
    first: bool = True,
    last: bool = True,
    seed: int = 0,
) -> tuple[PreTrainedModel, LoadStats]:
    """The causal LM restricted to `layers` (None: all, as a plain HF model usable for generate()).

    `first` keeps the token embedding, `last` keeps the final norm and lm_head.
    """
    config = copy.deepcopy(resolved.config)
    tie = bool(getattr(config, "tie_word_embeddings", False))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    model.name_or_path = resolved.name
    if layers is not None:
        _prune(model, layers, first, last)
        # A stage owns its lm_head outright (a frozen copy of the embedding when the checkpoint ties them).
        model.config.tie_word_embeddings = False
    model.to_empty(device=device)
    # Buffers computed in __init__ (rotary inv_freq, kept in float32) are lost by to_empty: rebuild on device.
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)

    tied = {"lm_head.weight": "model.embed_tokens.weight"} if tie and model.lm_head is not None else {}
    if resolved.weights_dir is None:
        _random_init(model, config.initializer_range, seed, tied)
        stats = LoadStats()
    else:
        stats = _load_safetensors(model, resolved.weights_dir, tied)
    if layers is None and tied:
        model.tie_weights()
    model.requires_grad_(False)
    return model, stats


def _prune(model: PreTrainedModel, layers: Sequence[int], first: bool, last: bool) -> None:
    """Drop what this stage does not run; the kept layers keep their full-model indices as names."""
    decoder = model.model
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = None
        model.lm_head = None


def _param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


@torch.no_grad()
def _random_init(model: nn.Module, std: float, seed: int, tied: dict[str, str]) -> None:
    """Normal(0, std) matrices and unit norm weights, each drawn from a generator seeded by its name."""
    for name, param in model.named_parameters(remove_duplicate=False):
        source = tied.get(name, name)
        if source.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        generator = torch.Generator(device=param.device).manual_seed(_param_seed(seed, source))
        values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
        values.normal_(0.0, std, generator=generator)
        param.copy_(values)


@torch.no_grad()
def _load_safetensors(model: nn.Module, weights_dir: Path, tied: dict[str, str]) -> LoadStats:
    """Copy this model's tensors, and only those, from the (possibly sharded) safetensors checkpoint."""
    file_of = checkpoint_index(weights_dir)
    wanted: dict[str, list[torch.Tensor]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        source = name if name in file_of else tied.get(name, name)
        if source not in file_of:
            raise ConfigError(f"checkpoint {weights_dir} has no tensor {source!r} (needed for {name!r})")
        wanted[source].append(param)

    by_file: dict[str, list[str]] = defaultdict(list)
    for source in wanted:
        by_file[file_of[source]].append(source)
    stats = LoadStats()
    for file_name, sources in sorted(by_file.items()):
        device = str(next(iter(wanted[sources[0]])).device)
        with safe_open(weights_dir / file_name, framework="pt", device=device) as f:
            for source in sources:
                tensor = f.get_tensor(source)
                stats.tensors += 1
                stats.bytes += tensor.numel() * tensor.element_size()
                for param in wanted[source]:
                    if param.shape != tensor.shape:
                        raise ConfigError(
                            f"checkpoint tensor {source!r} has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(param.shape)}: config.json and weights disagree"
                        )
                    param.copy_(tensor)
    return stats


def checkpoint_index(weights_dir: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, for single-file and sharded checkpoints."""
    index = weights_dir / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = weights_dir / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return {key: single.name for key in f.keys()}
    raise ConfigError(
        f"{weights_dir} has no model.safetensors nor model.safetensors.index.json; "
        "pipetune reads safetensors checkpoints only (convert .bin files with transformers' save_pretrained)"
    )
