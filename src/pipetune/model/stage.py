"""A pipeline stage over an HF decoder-only model: embedding (first), some decoder layers, norm + lm_head (last).

Only hidden states travel between stages. Positions are recomputed on every stage from the
(static) sequence length; samples are right-padded and attention is causal, so real tokens
never see pads and no mask needs to travel. Packed rows (data.packing) come with their position ids, which every
stage is given alongside (a [batch, seq] int tensor, not a mask); each stage builds its document mask from them
(model/attention.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import is_traceable_wrapper_subclass as is_subclass
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from pipetune.config import ConfigError
from pipetune.model.attention import document_mask
from pipetune.model.families import Family, LayerInputs, family_of
from pipetune.model.head_rows import HeadRows, HeadRowsLayer, head_rows_layer, mark_dynamic
from pipetune.model.host_tensors import to_device
from pipetune.model.kept_attention import KeptAttention
from pipetune.model.lora import ExtendedWeights
from pipetune.model.offload import ActivationOffload, offloading


def decoder_of(model: nn.Module) -> nn.Module:
    """The inner decoder (`model.model`) of a causal LM, also when wrapped by PEFT."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


class _GradInOwnMemory(torch.autograd.Function):
    """Identity whose backward copies the gradient out of the memory it was computed in.

    A CUDA-graphed layer's outputs, its input gradient among them, live in the graphs' memory pool, and a
    replay writes its outputs there with no regard for other streams. The multi-stage schedules send on
    NCCL's stream while the next actions' graphs replay; a copy from the caching allocator stays valid until
    NCCL is done with it. Without the copies (this one and the stage output's), a replay overwrites gradients
    that a slow transfer (fewer NCCL channels) is still sending, and training goes on with corrupted ones
    (benchmarks/journal/2026-11-29-speed-h200.md, third round, has the run that showed it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.clone()


@torch.no_grad()
def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (tensor parallelism, FSDP; the same memory: outside autograd `to_local`
    returns it), a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class CudaKernelsOnMeta(TorchFunctionMode):
    """On the meta device, attention and dropout as CUDA runs them, so that a layer saves the same tensors.

    Meta tensors take the reference paths: attention as explicit matmuls and softmax (saving [heads, seq, seq]
    scores: 34 GB per layer at 16k tokens), dropout as a multiplication by a mask in the input's dtype. CUDA runs
    flash attention (saving q, k, v, the output and one log-sum-exp per row; grouped key-value heads unrepeated),
    or with a boolean mask (a sliding window, model/families.py) memory-efficient attention, which also saves the
    mask as an additive bias (as sdpa converts it), and its fused dropout (a one-byte mask)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        mask = kwargs.get("attn_mask")
        if func is F.scaled_dot_product_attention and len(args) == 3 and (mask is None or mask.dtype == torch.bool):
            query, key, value = args
            dropout, causal, scale = kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False), kwargs.get("scale")
            if mask is None:
                flash = torch.ops.aten._scaled_dot_product_flash_attention
                return flash(query, key, value, dropout, causal, scale=scale)[0]
            bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
            bias = bias.expand(*query.shape[:-1], key.shape[-2])
            out = torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, True, dropout, causal, scale=scale
            )
            return out[0]
        if func is F.dropout and kwargs.get("training", args[2] if len(args) > 2 else True):
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            if p > 0:
                return torch.ops.aten.native_dropout(args[0], p, True)[0]
        return func(*args, **kwargs)


class LayerGroup(nn.Module):
    """Consecutive decoder layers called as one module: compiled, one graph (and one CUDA graph replay) for
    all of them (train.layers_per_graph)."""

    def __init__(self, layers: list[nn.Module], kinds: list[str]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.kinds = kinds
        """Each layer's kind: the key of its arguments in the inputs (`Family.layer_kind`)."""

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        for layer, kind in zip(self.layers, self.kinds, strict=True):
            hidden = hidden_states(layer(hidden, **inputs[kind]))
        return hidden


def layer_call_kwargs(
    family: Family, rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor, document: object = None
) -> LayerInputs:
    """The keyword arguments of the decoder layers' calls on `hidden` at `position_ids`, by layer kind: the one
    place they are made (the stage's forward, its memory measurement and calibrate.py's timing all call layers
    with them). The family says what its decoder computes outside its layers (model/families.py); `document`:
    packed rows' document mask (model/attention.py), which replaces the causal one."""
    inputs = family.layer_inputs(rotary, hidden, position_ids)
    if document is not None:
        for kind, kwargs in inputs.items():
            if kwargs["attention_mask"] is not None:  # a sliding window: a mask of its own to combine with
                raise ConfigError(
                    f"data.packing = true: {kind} layers ({', '.join(family.model_types)}) have a mask of their "
                    "own, which packed rows' document mask does not combine with yet; set data.packing = false"
                )
            kwargs["attention_mask"] = document
    return inputs


def hidden_states(out: torch.Tensor | tuple) -> torch.Tensor:
    """What a decoder layer (or a LayerGroup) returned, as hidden states: HF layers return them alone or first
    in a tuple, depending on the transformers version."""
    return out[0] if isinstance(out, tuple) else out


class StageModule(nn.Module):
    """Runs one stage over parts of a (possibly PEFT-wrapped, pruned) causal LM.

    It registers only its own parts, so its parameters are exactly the stage's, also when one rank's
    model holds several stages (interleaved schedules); names in checkpoints and adapters come from
    the PEFT model itself."""

    def __init__(
        self,
        model: nn.Module,
        layer_ids: list[int] | None = None,
        first: bool | None = None,
        last: bool | None = None,
    ) -> None:
        """`layer_ids` (full-model indices) picks this stage's layers when the model holds several stages'
        (interleaved schedules); `first` / `last` default to whether the model holds the embedding / lm_head."""
        super().__init__()
        decoder = decoder_of(model)
        base: PreTrainedModel = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = decoder.layers
        if layer_ids is None:
            chosen = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
        else:
            chosen = [layers[str(i)] if isinstance(layers, nn.ModuleDict) else layers[i] for i in layer_ids]
        first = decoder.embed_tokens is not None if first is None else first
        last = base.lm_head is not None if last is None else last
        self.embed = decoder.embed_tokens if first else None
        self.layers = nn.ModuleList(chosen)
        self.norm = decoder.norm if last else None
        self.lm_head = base.lm_head if last else None
        self.rotary = decoder.rotary_emb
        self.family = family_of(base.config)
        """What the decoder computes outside its layers (their call's arguments), model/families.py."""
        self.runs: list[nn.Module] | None = None
        """What forward calls in order on the hidden states when not the layers one by one: set by
        `compile_layers`, with groups of them (a plain list: not registered, so parameters keep their names)."""
        self.checkpoint_layers = 0
        """How many of the stage's layers (the first ones) recompute their forward in backward instead of keeping
        their activations (train.activation_checkpointing: all, none, or as many as memory needs)."""
        self.offload: ActivationOffload | None = None
        """Moves the inputs of the first `offload.layers` checkpointed layers to host memory (model/offload.py)."""
        self.keep_attention = False
        """Checkpointed layers keep their attention's output through recomputation (train.keep_attention)."""
        self.kept: KeptAttention | None = None
        """Those outputs while they wait for backward (model/kept_attention.py); None: attention is recomputed."""
        self.packed_attention = "flex"
        """Packed rows' document attention on a GPU (train.packed_attention, model/attention.py)."""
        self.documents_per_row = 0
        """The bound on a packed row's documents for the "documents" kernel's span tables (0: each batch's most)."""
        self.head_in_loss = False
        """The last stage returns normed hidden states; the loss applies lm_head (train.fused_loss)."""
        self.head_rows = False
        """The last layer runs on the rows the loss reads, where a training forward names them (`forward`'s
        `head_rows`) and the layer is not checkpointed; compiled, as a graph of its own (model/head_rows.py)."""
        self.own_boundary_memory = False
        """Hand the pipeline its sent tensors (this stage's output, the gradient of its input) in memory of their
        own, not in the CUDA graphs' pool (set with `compile_layers(cuda_graphs=True)`)."""
        self.extended_weights: ExtendedWeights | None = None
        """lora.adapter_in_matmul: the layers' extended weights, given lora_B's values before each forward where
        they changed (model/lora.py; found at the first forward)."""
        self.sequence_shards = 1
        """Ranks the hidden states' sequence positions are split over (tensor parallelism's sequence parallelism):
        this rank's share of them is hidden.shape[1] (parallel/tp.py sets it)."""

    def set_layer_modes(self, checkpointed: int, offloaded: int) -> None:
        """The first `checkpointed` layers recompute in backward, the first `offloaded` of those with their input
        in host memory; the rest keep their activations. With `keep_attention` the checkpointed layers keep
        their attention outputs, in host memory where they offload."""
        offloaded = min(offloaded, checkpointed)
        self.checkpoint_layers = checkpointed
        self.offload = ActivationOffload(offloaded) if offloaded else None
        self.kept = KeptAttention(offloaded) if checkpointed and self.keep_attention else None

    def compile_layers(self, cuda_graphs: bool = False, per_graph: int = 1) -> None:
        """torch.compile the decoder layers in place, `per_graph` consecutive layers traced as one graph (0: all
        of the stage's; train.layers_per_graph), checkpointed layers one each. Groups of the same size share one
        graph (parameters are graph inputs), so compilation happens once per size, at the first forward; and
        once more for the stage's first run, whose input needs no gradient on the first stage (the embeddings'
        output), which dynamo guards on. A group short of `per_graph` therefore comes first, where it is that
        extra trace, not another one after it: Qwen3-4B's 35 grouped layers are traced as 5 + 6 layers, not
        6 + 6 + 5 (`pipetune train` on the CPU with tiny-qwen3 at 36 layers, warm cache: the compile 10.9-11.8 s
        -> 8.5-9.7 s). `cuda_graphs`: replay each call as a CUDA graph ("reduce-overhead"); the runners mark each
        schedule step's start, after which the graphs may reuse the previous step's output memory, and the
        tensors the pipeline sends are copies (`own_boundary_memory`)."""
        mode = "reduce-overhead" if cuda_graphs else None
        layers = list(self.layers)
        alone = self.checkpoint_layers
        apart = self.head_rows and alone < len(layers)  # the last layer, on the loss's rows (`head_rows`)
        grouped = layers[:-1] if apart else layers
        size = per_graph or len(grouped) or 1
        count = len(grouped) - alone
        sizes = ([count % size] if count % size else []) + [size] * (count // size)  # the short group first
        runs: list[nn.Module] = layers[:alone]
        start = alone
        for n in sizes:
            group = grouped[start : start + n]
            runs.append(group[0] if size == 1 else LayerGroup(group, [self.family.layer_kind(x) for x in group]))
            start += n
        for run in runs:
            run.compile(mode=mode)
        if apart:  # a graph of its own, without CUDA graphs: its attention reads its runs on the host
            runs.append(HeadRowsLayer(layers[-1]))
            runs[-1].compile()
        self.runs = runs
        self.own_boundary_memory = cuda_graphs

    def layer_memory(self, batch: int, seq: int) -> tuple[int, int]:
        """Bytes one decoder layer keeps for backward per microbatch of [batch, seq] (measured by running one
        forward of the first layer, eagerly, leaving the random streams as they were) and bytes of its input,
        which is all a checkpointed layer keeps (with `keep_attention`: and its attention's output and log-sum-exp,
        counted with the input). A layer split over tensor-parallel ranks (parallel/tp.py) counts this
        rank's part (all ranks measure together). On the meta device the forward allocates and computes nothing
        (a plan for any size, on any machine) and saves what CUDA's kernels save (`CudaKernelsOnMeta`)."""
        layer = self.layers[0]
        # The hidden states' dtype is the frozen weights' compute dtype: a norm's, not an FP8 weight's (model.quantize).
        frozen = next(p for p in layer.parameters() if not p.requires_grad and p.element_size() > 1)
        device, dtype = frozen.device, frozen.dtype
        positions = seq // self.sequence_shards  # this rank's share of them with sequence parallelism
        hidden = torch.zeros(batch, positions, self.rotary.config.hidden_size, dtype=dtype, device=device)
        hidden.requires_grad_(True)  # as a received activation: gradients flow to the previous stage
        saved: dict[int, int] = {}
        # A linear layer saves its weight for the input gradient: memory the weights hold anyway, not activations.
        # So does a quantized one (model.quantize): an FP8 weight with its scales buffer, or the tensors inside an
        # NF4 weight (a tensor subclass with no storage of its own), which its operator saves for backward.
        # Storages are told apart by identity (views share one), which also holds on the meta device.
        weights = {
            storage for tensor in [*layer.parameters(), *layer.buffers()] for storage in _storages(local_part(tensor))
        }

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            local = local_part(tensor)
            if not is_subclass(local):
                storage = local.untyped_storage()
                if storage._cdata not in weights:
                    saved[storage._cdata] = storage.nbytes()
            # Held by the graph until `out` goes (no storage is freed and its address reused while counting),
            # as a detached alias: the tensor itself, where an operator saves its own output, would hold that
            # operator's node, which holds it: a cycle through autograd's C++ graph that Python's collector
            # cannot free. It kept one layer's activations for the rest of the run (36 GB at 400,000 tokens of
            # Qwen3-8B: that run ran out of memory).
            return tensor.detach()

        position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
        kwargs = layer_call_kwargs(self.family, self.rotary, hidden, position_ids)[self.family.layer_kind(layer)]
        devices = [device] if device.type == "cuda" else []
        kernels = CudaKernelsOnMeta() if device.type == "meta" else contextlib.nullcontext()
        kept = KeptAttention().call(0)
        keeping = kept.active("record") if self.keep_attention else contextlib.nullcontext()
        with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"), kernels, keeping:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):  # dropout draws
                out = layer(hidden, **kwargs)
        del out
        return sum(saved.values()), hidden.numel() * hidden.element_size() + kept.device_bytes()

    @property
    def is_first(self) -> bool:
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, head_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """input_ids [b, s] on the first stage, hidden states [b, s, h] elsewhere; logits [b, s, v] on the last
        (normed hidden states with head_in_loss). `position_ids` [b, s]: packed rows' positions, restarting with
        every sample; attention then stays within each sample (the model's attention must be
        model.attention.DOCUMENT_ATTENTION). On the host (pinned) or the device: the "documents" kernel reads them
        on the host, where a training step leaves them for it (no wait for the device). `head_rows` [b, s] bool,
        on the host: the rows the loss reads; with `self.head_rows` the last layer computes only those (its output
        elsewhere is its input: model/head_rows.py)."""
        hidden = self.embed(x) if self.is_first else x
        if self.extended_weights is None:
            self.extended_weights = ExtendedWeights.of(self.layers)
        self.extended_weights.refresh()  # lora_B as the optimizer (or a resume) left it
        if self.own_boundary_memory and not self.is_first:
            hidden = _GradInOwnMemory.apply(hidden)
        document = None
        if position_ids is None:
            batch, seq = hidden.shape[0], hidden.shape[1] * self.sequence_shards
            position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0).expand(batch, -1)
        else:
            host, position_ids = position_ids, to_device(position_ids, hidden.device)
            document = document_mask(position_ids, self.packed_attention, self.documents_per_row, host)
        inputs = layer_call_kwargs(self.family, self.rotary, hidden, position_ids, document)
        runs = self.layers if self.runs is None else self.runs
        rows = None
        if head_rows is not None and self.head_rows and self.is_last and torch.is_grad_enabled():
            rows = HeadRows.of(head_rows, None if document is None else host, hidden.device)
        for index, run in enumerate(runs):  # the first checkpoint_layers runs are single layers
            layer = run.layer if isinstance(run, HeadRowsLayer) else run
            kwargs = dict(inputs=inputs) if isinstance(run, LayerGroup) else inputs[self.family.layer_kind(layer)]
            if rows is not None and index == len(runs) - 1 and layer is self.layers[-1]:
                if index >= self.checkpoint_layers:  # a checkpointed layer recomputes the whole of it
                    if isinstance(run, HeadRowsLayer):  # compiled
                        mark_dynamic(rows)
                        hidden = run(hidden, rows=rows, **kwargs)
                    else:
                        hidden = head_rows_layer(run, hidden, rows, kwargs)
                    continue
            if index < self.checkpoint_layers and torch.is_grad_enabled():
                # Non-reentrant, with the RNG state restored for the recomputation: same dropout masks, same math.
                contexts = {} if self.kept is None else dict(context_fn=functools.partial(self.kept.contexts, index))
                with offloading(self.offload, index):
                    out = checkpoint(run, hidden, use_reentrant=False, **contexts, **kwargs)
            else:
                out = run(hidden, **kwargs)
            hidden = hidden_states(out)
        if not self.is_last:
            return hidden.clone() if self.own_boundary_memory else hidden
        hidden = self.norm(hidden)
        return hidden if self.head_in_loss else self.lm_head(hidden)


def _storages(tensor: torch.Tensor) -> list[int]:
    """The identities of the storages a tensor's values live in: its own, or a tensor subclass's inner tensors'."""
    if not is_subclass(tensor):
        return [tensor.untyped_storage()._cdata]
    names, _ = tensor.__tensor_flatten__()
    return [storage for name in names for storage in _storages(getattr(tensor, name))]
