"""One assembly line for pipeline stages: what training, the memory probe and calibration all build.

The order is fixed, and this is the one place that says it:

    meta build -> LoRA -> quantize (placeholders) -> fast path -> StageModules -> parallelize -> materialize

`parallelize` applies, on the meta device, tensor parallelism (tp), the activation checkpointing a config fixes
(true / false; "auto" is planned later, from measured memory) and FSDP, in that order; each rank then allocates
only its shards. Compilation comes last (`compile_stages`), after the stages are materialized and "auto"
checkpointing is planned: a compiled stage runs its checkpointed layers one graph each, so it must know how many
there are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from peft import PeftModel
from torch.distributed.device_mesh import DeviceMesh

from pipetune.config import Config, LoraConfig
from pipetune.model.attention import use_document_attention
from pipetune.model.chunked import chunk_mlps
from pipetune.model.load import LoadStats, build_meta, materialize
from pipetune.model.lora import apply_lora, extend_base_weights, use_fast_path
from pipetune.model.quantize import quantize_linears
from pipetune.model.shapes import ResolvedModel
from pipetune.model.stage import StageModule
from pipetune.parallel.fsdp import shard_stages
from pipetune.parallel.mesh import Mesh
from pipetune.parallel.tp import apply_tp
from pipetune.switches import mlp_chunk_tokens


@dataclass(frozen=True)
class StagePart:
    """One pipeline stage of the model: its decoder layers (full-model indices), and whether it holds the
    embedding (first) and the final norm and lm_head (last)."""

    layers: list[int]
    first: bool = False
    last: bool = False


@dataclass(frozen=True)
class Parallelism:
    """How `parallelize` splits and shards the stages; the defaults leave them whole."""

    tp_mesh: DeviceMesh | None = None
    """Split each layer over this mesh (parallel/tp.py); None: no tensor parallelism."""
    sequence_parallel: bool = False
    fsdp_mesh: DeviceMesh | None = None
    """Shard the stages over this mesh with FSDP2 (parallel/fsdp.py); None: not sharded."""
    pipelined: bool = False
    """The stages run in a pipeline: FSDP keeps weights gathered through a schedule step."""
    checkpointing: bool | str = False
    """train.activation_checkpointing: true checkpoints every layer, "offload" also keeps their inputs in host
    memory; false and "auto" none (yet: "auto" is planned with the schedule, train.build_runners)."""
    keep_attention: bool = False
    """train.keep_attention: checkpointed layers keep attention's output (model/kept_attention.py)."""
    mlp_chunk: int = 0
    """Tokens per MLP chunk (switches.mlp_chunk_tokens: train.mlp_chunk resolved, 0 under tp; 0: whole rows)."""
    packed_attention: str = "flex"
    """train.packed_attention: packed rows' document attention kernel on a GPU (model/attention.py)."""
    documents_per_row: int = 0
    """data.max_samples_per_row + 1: the span tables' static bound (a pad tail of one token, position 0 alone, is a
    document to `attention.span_table`; longer tails get no span)."""


def run_parallelism(config: Config, mesh: Mesh) -> Parallelism:
    """A training run's: split over this rank's tp mesh, sharded over its dp replicas where the config says."""
    p = config.parallel
    return Parallelism(
        tp_mesh=mesh.tp_mesh,
        sequence_parallel=p.sequence_parallel,
        fsdp_mesh=mesh.dp_mesh if p.sharded else None,
        pipelined=p.pipelined,
        checkpointing=config.train.activation_checkpointing,
        keep_attention=config.train.keep_attention,
        mlp_chunk=mlp_chunk_tokens(config.train, config.data.max_length, p.tp),
        packed_attention=config.train.packed_attention,
        documents_per_row=config.data.max_samples_per_row + 1,
    )


@dataclass
class BuiltStages:
    """The stages of one model, in one PEFT wrapper (which names the adapters as the whole model does)."""

    peft_model: PeftModel
    modules: list[StageModule]
    loaded: LoadStats
    """What materialize read (nothing for random weights or on the meta device)."""


def build_stage_modules(
    resolved: ResolvedModel,
    dtype: torch.dtype,
    lora: LoraConfig,
    parts: Sequence[StagePart],
    device: torch.device,
    parallelism: Parallelism = Parallelism(),
    *,
    seed: int = 0,
    quantize: str = "none",
    tp: int = 1,
    grouped: bool = True,
    name: str | None = None,
    packing: bool = False,
) -> BuiltStages:
    """The stages `parts` of `resolved`, in training mode, on `device` (left shape-only on the meta device).

    `seed`: LoRA's and random weights' initialisation; `quantize`: model.quantize of the decoder layers' linears;
    `tp`, `grouped`: the fast LoRA path's grouping (`use_fast_path`); `name`: the base model's name in the
    adapter (default `resolved.name`); `packing`: rows of several samples (data.packing), whose layers attend
    within each sample through a document mask (model/attention.py)."""
    model = build_meta(
        resolved,
        dtype,
        layers=sorted(i for part in parts for i in part.layers),
        first=any(part.first for part in parts),
        last=any(part.last for part in parts),
    )
    peft_model = apply_lora(model, lora, name or resolved.name, seed)
    quantize_linears(peft_model, quantize)  # placeholders, quantized as materialize fills them
    if lora.fast_path is True:  # "auto" left unresolved (a probe of a raw config): the plain path
        use_fast_path(peft_model, lora.shared_dropout, tp, grouped, in_matmul=lora.adapter_in_matmul is True)
    peft_model.train()
    if packing or parallelism.keep_attention:
        use_document_attention(peft_model)
    modules = [StageModule(peft_model, list(part.layers), first=part.first, last=part.last) for part in parts]
    parallelize(modules, parallelism)
    loaded = LoadStats()
    if device.type != "meta":
        loaded = materialize(peft_model, resolved, device, seed, roots=modules)
    if lora.fast_path is True and lora.adapter_in_matmul is True:  # shape-only on the meta device (memory probes)
        extend_base_weights(peft_model)  # the base weights become views of the extended ones
    return BuiltStages(peft_model, modules, loaded)


def parallelize(modules: list[StageModule], parallelism: Parallelism) -> None:
    """Split (tp), set the layers' fixed modes (checkpointed, offloaded, MLPs in chunks), and shard (FSDP) the
    stages in place, in that order, on the meta device: parameters become DTensor shards before the optimizer and
    the pipeline stages are built."""
    if parallelism.tp_mesh is not None:
        apply_tp(modules, parallelism.tp_mesh, parallelism.sequence_parallel)
    every = parallelism.checkpointing in (True, "offload")
    for module in modules:
        layers = len(module.layers) if every else 0
        module.keep_attention = parallelism.keep_attention
        module.packed_attention = parallelism.packed_attention
        module.documents_per_row = parallelism.documents_per_row
        module.set_layer_modes(layers, layers if parallelism.checkpointing == "offload" else 0)
        chunk_mlps(list(module.layers), parallelism.mlp_chunk)
    if parallelism.fsdp_mesh is not None:
        shard_stages(modules, parallelism.fsdp_mesh, pipelined=parallelism.pipelined)


def compile_stages(modules: Sequence[StageModule], cuda_graphs: bool = False, per_graph: int = 1) -> None:
    """The assembly's last step, on materialized stages whose checkpointed layers are settled: torch.compile
    their layers in place (`StageModule.compile_layers`; compilation itself happens at the first forward).

    AOTAutograd's cache may keep graphs that hold custom autograd functions (lora.adapter_in_matmul's, FP8's):
    dynamo traces their forward and backward into the graph its cache key is made of. Left at torch's default it
    bypassed them, and a warm compile cache still traced every joint graph again: Qwen3-4B's whole-meeting run
    spent 18.8 s of its first step in the compilers with inductor's cache warm (one H100, 2026-12-06)."""
    from torch._functorch import config as functorch_config

    if hasattr(functorch_config, "autograd_cache_allow_custom_autograd_functions"):
        functorch_config.autograd_cache_allow_custom_autograd_functions = True
    for module in modules:
        module.compile_layers(cuda_graphs=cuda_graphs, per_graph=per_graph)
