"""Build a causal LM, or one pipeline stage of it, without ever holding the whole model.

The model is constructed on the meta device (`build_meta`), pruned to the stage's layers (kept under
their full-model names: `model.layers.17` stays `model.layers.17`), optionally wrapped with LoRA and
sharded (FSDP2) while still on meta, then materialized on the target device (`materialize`), each rank
allocating only its part. Values come from the checkpoint's safetensors files, reading only this rank's
tensors (of a sharded parameter, only its slice), or from a random initialisation keyed by parameter
name, so every layout gets the same weights.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from pipetune.config import ConfigError
from pipetune.model.families import family_of
from pipetune.model.shapes import ResolvedModel
from pipetune.model.stage import local_part

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
    quantize: str = "none",
) -> tuple[PreTrainedModel, LoadStats]:
    """The causal LM restricted to `layers` (None: all, as a plain HF model usable for generate()), on `device`.

    `first` keeps the token embedding, `last` keeps the final norm and lm_head; `quantize` stores the decoder
    layers' linear weights in NF4 or FP8 (model/quantize.py).
    """
    from pipetune.model.quantize import quantize_linears

    model = build_meta(resolved, dtype, layers, first, last)
    quantize_linears(model, quantize)
    return model, materialize(model, resolved, device, seed)


def build_meta(
    resolved: ResolvedModel,
    dtype: torch.dtype,
    layers: Sequence[int] | None = None,
    first: bool = True,
    last: bool = True,
) -> PreTrainedModel:
    """The model (or stage) on the meta device: shapes and names, no memory; `materialize` allocates it."""
    config = copy.deepcopy(resolved.config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    model.name_or_path = resolved.name
    if layers is not None:
        _prune(model, layers, first, last)
        family_of(config).prune(model, first, last)
        # A stage owns its lm_head outright (a frozen copy of the embedding when the checkpoint ties them).
        model.config.tie_word_embeddings = False
        if model.lm_head is not None and first:
            model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))
    model.requires_grad_(False)
    return model


@torch.no_grad()
def materialize(
    model: nn.Module,
    resolved: ResolvedModel,
    device: torch.device,
    seed: int = 0,
    roots: Iterable[nn.Module] | None = None,
) -> LoadStats:
    """Allocate a meta model (possibly LoRA-wrapped and sharded) on `device` and fill every tensor.

    `roots`: the modules to allocate, which together hold all of the model's parameters; FSDP's roots
    (the stage modules) must allocate their own, so that FSDP re-points its shards. Each parameter gets
    its values as the unsharded model would, and a rank keeps its slice: for a sharded parameter
    (DTensor), one whole tensor is live at a time (random init) or only the slice is read (safetensors).
    """
    for root in roots if roots is not None else [model]:
        root.to_empty(device=device)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # Buffers computed in __init__ (rotary inv_freq) are lost by to_empty: compute them again, and keep them in
    # the float32 that transformers computes them in (the model's .to(dtype) made them bfloat16: ~3 significant
    # digits of each frequency, so positions far into a long row were rotated by the wrong angles).
    rotary = base.model.rotary_emb
    with torch.device(device):
        fresh = type(rotary)(config=resolved.config)
    for name, buffer in fresh.named_buffers():
        owner_name, _, leaf = name.rpartition(".")
        owner = rotary.get_submodule(owner_name) if owner_name else rotary
        owner._buffers[leaf] = buffer
    for name, value in vars(fresh).items():  # tensors kept as plain attributes (original_inv_freq)
        if isinstance(value, torch.Tensor) and name not in fresh._buffers:
            setattr(rotary, name, value)
    family = family_of(resolved.config)
    family.restore_buffers(base)

    from pipetune.model.lora import initial_adapter_value
    from pipetune.model.quantize import weight_writers

    tie = bool(getattr(resolved.config, "tie_word_embeddings", False)) and base.lm_head is not None
    tied = dict(family.tied) if tie else {}
    weights: dict[str, list[torch.Tensor]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if _is_adapter(name):
            fill(param, lambda shape, device, name=name: initial_adapter_value(name, shape, seed, device))
            continue
        weights.setdefault(base_name(name), []).append(param)
    quantized = weight_writers(model)  # model.quantize: these are quantized as they are written
    if resolved.weights_dir is None:
        _random_init(weights, resolved.config.initializer_range, seed, tied, quantized, family.norm_init)
        stats = LoadStats()
    else:
        stats = _load_safetensors(weights, resolved.weights_dir, tied, quantized)
    if base.config.tie_word_embeddings and base.lm_head is not None:
        base.tie_weights()  # the whole model: lm_head is the embedding again
    return stats


def _is_adapter(name: str) -> bool:
    return ".lora_" in name


def base_name(name: str) -> str:
    """A base parameter's name in the HF model (and its checkpoint) from its name in a PEFT-wrapped model."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def local_slices(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The part of the whole tensor that this rank holds, for a sharded parameter (DTensor); None: all of it."""
    if not isinstance(param, DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


Writers = dict[int, Callable[[torch.Tensor, slice], None]]
"""model/quantize.py's `weight_writers`: for a quantized weight (by id), what stores a whole tensor of its values
given the rows this rank holds (`local_rows`)."""


def local_rows(param: torch.Tensor) -> slice:
    """The rows of the whole tensor that this rank holds (all, unless FSDP sharded the parameter)."""
    slices = local_slices(param)
    return slice(None) if slices is None else slices[0]


def fill(
    param: torch.Tensor,
    make_whole: Callable[[torch.Size, torch.device], torch.Tensor],
    quantized: Writers | None = None,
) -> None:
    """Set a parameter to `make_whole(shape, device)`, keeping only this rank's slice of a sharded one."""
    local = local_part(param)
    whole = make_whole(param.shape, local.device)
    if quantized and id(param) in quantized:
        quantized[id(param)](whole, local_rows(param))
        return
    slices = local_slices(param)
    local.copy_(whole if slices is None else whole[slices])


def _prune(model: PreTrainedModel, layers: Sequence[int], first: bool, last: bool) -> None:
    """Keep only this stage's decoder layers, under their full-model indices as names (the family drops the
    embedding or head a stage does not run)."""
    decoder = model.model
    decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in layers})


def _param_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


def _random_init(
    weights: dict[str, list[torch.Tensor]],
    std: float,
    seed: int,
    tied: dict[str, str],
    quantized: Writers,
    norm_init: float = 1.0,
) -> None:
    """Normal(0, std) matrices, norm weights of `norm_init` (the family's identity) and zero biases, each drawn
    from a generator seeded by its name."""

    def normal(shape: torch.Size, device: torch.device, source: str) -> torch.Tensor:
        generator = torch.Generator(device=device).manual_seed(_param_seed(seed, source))
        return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator)

    for name, params in weights.items():
        source = tied.get(name, name)
        for param in params:
            if source.endswith("norm.weight"):
                fill(param, lambda shape, device: torch.full(shape, norm_init, device=device))
            elif source.endswith(".bias"):
                fill(param, lambda shape, device: torch.zeros(shape, device=device))
            else:
                fill(param, lambda shape, device, source=source: normal(shape, device, source), quantized)


def _load_safetensors(
    weights: dict[str, list[torch.Tensor]], weights_dir: Path, tied: dict[str, str], quantized: Writers
) -> LoadStats:
    """Copy this model's tensors, and only those (only its slice of a sharded one), from the checkpoint.

    A quantized weight is read whole, also when sharded: it is quantized whole, so every layout holds the same
    values."""
    file_of = checkpoint_index(weights_dir)
    wanted: dict[str, list[torch.Tensor]] = {}
    for name, params in weights.items():
        source = name if name in file_of else tied.get(name, name)
        if source not in file_of:
            raise ConfigError(f"checkpoint {weights_dir} has no tensor {source!r} (needed for {name!r})")
        wanted.setdefault(source, []).extend(params)

    by_file: dict[str, list[str]] = {}
    for source in wanted:
        by_file.setdefault(file_of[source], []).append(source)
    stats = LoadStats()
    for file_name, sources in sorted(by_file.items()):
        device = local_part(wanted[sources[0]][0]).device
        sharded = any(isinstance(p, DTensor) for s in sources for p in wanted[s])
        # Whole tensors are read straight to the device; slices of sharded ones through the host.
        with safe_open(weights_dir / file_name, framework="pt", device="cpu" if sharded else str(device)) as f:
            for source in sources:
                whole = None
                for param in wanted[source]:
                    slices = local_slices(param)
                    view = f.get_slice(source)
                    if tuple(view.get_shape()) != tuple(param.shape):
                        raise ConfigError(
                            f"checkpoint tensor {source!r} has shape {tuple(view.get_shape())}, "
                            f"the model expects {tuple(param.shape)}: config.json and weights disagree"
                        )
                    if id(param) in quantized:
                        part = f.get_tensor(source).to(local_part(param).device)
                        quantized[id(param)](part, local_rows(param))
                    elif slices is not None:
                        part = view[slices]
                        local_part(param).copy_(part)
                    elif whole is None:
                        part = whole = f.get_tensor(source)
                        local_part(param).copy_(part)
                    else:
                        local_part(param).copy_(whole)  # a second parameter from the same tensor: no second read
                        continue
                    stats.tensors += 1
                    stats.bytes += part.numel() * part.element_size()
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
