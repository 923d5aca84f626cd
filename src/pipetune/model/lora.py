"""LoRA through PEFT: apply with a layout-independent initialisation, gather and save one PEFT adapter."""

from __future__ import annotations

import math
import types
import weakref
import zlib
from pathlib import Path

import peft
import torch
import torch.nn.functional as F
from safetensors.torch import save as save_tensors
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from pipetune.config import LoraConfig
from pipetune.files import write_atomic
from pipetune.model.families import family_of

ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(lora: LoraConfig, base_name: str) -> peft.LoraConfig:
    return peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        base_model_name_or_path=base_name,
    )


def apply_lora(model: nn.Module, lora: LoraConfig, base_name: str, seed: int) -> peft.PeftModel:
    """Wrap the (possibly pruned) model with LoRA adapters whose initial values depend only on `seed`.

    On a meta-device model the adapters get their values when the model is materialized (model/load.py).
    """
    model.name_or_path = base_name  # PEFT records it as base_model_name_or_path
    peft_model = peft.get_peft_model(model, peft_config(lora, base_name))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name and not param.is_meta:
                param.copy_(initial_adapter_value(name, param.shape, seed, param.device))
    return peft_model


def initial_adapter_value(name: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """The initial value of the adapter tensor `name` (its name in the PEFT model), the same in every layout.

    PEFT draws lora_A from the global RNG in module order, so a stage holding layers 18-35 would get
    different values than a full model; each lora_A is drawn from a generator seeded by its full-model
    name instead (same distribution: kaiming-uniform with a = sqrt(5)). lora_B starts at 0.
    """
    if ".lora_B." in name:
        return torch.zeros(shape, device=device)
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.empty(shape, dtype=torch.float32, device=device).uniform_(-bound, bound, generator=generator)


def adapter_state(peft_model: peft.PeftModel) -> dict[str, torch.Tensor]:
    """This model's adapter tensors under PEFT's saved names (full-model module names), whole, on the CPU.

    With FSDP (parallel.dp_shard) each one is gathered from its dp shards: a collective over the dp
    replicas, which must all call this (they hold the same tensors in the same order)."""
    return whole_on_cpu(adapter_parameters(peft_model))


def whole_on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies of the whole tensors (DTensors gathered: a collective over their mesh)."""
    return {name: full_tensor(tensor).detach().to("cpu", copy=True).contiguous() for name, tensor in tensors.items()}


def adapter_parameters(peft_model: peft.PeftModel) -> dict[str, torch.Tensor]:
    """The adapter tensors themselves (DTensor shards under FSDP and tp) under PEFT's saved names; no copy: a
    checkpoint's resume writes into them.

    PEFT picks and names them (`get_peft_model_state_dict`) over empty stand-ins for the model's state: from peft
    0.22 on, that function gathers DTensors into whole CPU copies, which a resume would load into instead of the
    model (its first resumed step then trained from the initial adapters)."""
    live = peft_model.state_dict()  # detached views of the parameters (DTensor shards stay shards)
    stand_ins = {name: torch.empty(0) for name in live}
    names = {id(t): name for name, t in stand_ins.items()}
    # save_embedding_layers=False: the embeddings are frozen; True makes PEFT look the base up on the hub.
    picked = peft.get_peft_model_state_dict(peft_model, state_dict=stand_ins, save_embedding_layers=False)
    return {key: live[names[id(t)]] for key, t in picked.items()}


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (all-gathered over its mesh), a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def save_adapter(state: dict[str, torch.Tensor], lora: LoraConfig, base_name: str, out_dir: str | Path) -> Path:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_config(lora, base_name).save_pretrained(str(out_dir))
    write_atomic(out_dir / ADAPTER_WEIGHTS, save_tensors(dict(sorted(state.items())), metadata={"format": "pt"}))
    return out_dir


def use_fast_path(
    peft_model: peft.PeftModel,
    shared_dropout: bool = False,
    tp: int = 1,
    grouped: bool = True,
    in_matmul: bool = False,
) -> int:
    """Switch every LoRA linear of the model to the fast path (`_fast_lora_forward`); returns how many were switched.

    PEFT keeps float32 adapters and casts each activation to float32 for them, then back: with a
    bfloat16 base that is an extra read and write of every adapted activation, and float32 matmuls.
    The fast path casts the (tiny) adapter weights to the activation dtype instead and applies the
    scaling to the rank-r intermediate. Gradients still flow into the float32 adapter weights. The
    adapter linears stay modules, so hooks on them (tensor parallelism's plans) run as before.

    The LoRA linears of one module that read one input (the family's `shared_inputs`) compute their
    down-projections as one matmul (`SharedInput`) where that is PEFT's math, without LoRA dropout, or where
    `shared_dropout` (lora.shared_dropout) draws one mask for all of them. That matmul bypasses their lora_A
    modules, so it is off under tensor parallelism (`tp`: parallel.tp > 1), whose plans hook them, and where
    `grouped` is false (benchmarks).

    `in_matmul` (lora.adapter_in_matmul): every LoRA linear computes its LoRA term inside its base matmul
    (`ExtendedInput`), once `extend_base_weights` has given the materialized model its extended weights.
    """
    from peft.tuners.lora import Linear as LoraLinear

    switched = 0
    for module in peft_model.modules():
        if isinstance(module, LoraLinear):
            module.forward = types.MethodType(_fast_lora_forward, module)
            for adapter in (*module.lora_A.values(), *module.lora_B.values()):
                adapter.forward = types.MethodType(_linear_in_input_dtype, adapter)
            switched += 1
    shared_inputs = family_of(peft_model.get_base_model().config).shared_inputs
    if in_matmul:  # every LoRA linear: its input's group, or alone (IN_MATMUL_ALONE)
        accept = lambda m: len(m.lora_A) == 1  # noqa: E731
        for members in _input_groups(peft_model, shared_inputs, accept, alone=IN_MATMUL_ALONE):
            _share(ExtendedInput(members, shared_dropout), members)
        return switched
    if grouped and tp == 1:
        for members in _input_groups(peft_model, shared_inputs, lambda m: _groupable(m, shared_dropout)):
            if len(members) > 1:
                _share(SharedInput(members), members)
    return switched


def _input_groups(peft_model: peft.PeftModel, shared_inputs, accept, alone: bool = False):
    """The LoRA linears `accept` takes, as the groups of one module's linears that read one input (the family's
    `shared_inputs`; a group may hold one); with `alone` also every other one, as a group of its own."""
    from peft.tuners.lora import Linear as LoraLinear

    for module in peft_model.modules():
        grouped: set[int] = set()
        for names in shared_inputs:
            members = [getattr(module, name, None) for name in names]
            members = [m for m in members if isinstance(m, LoraLinear) and accept(m)]
            grouped.update(id(m) for m in members)
            if members:
                yield members
        for child in module.children() if alone else ():
            if isinstance(child, LoraLinear) and accept(child) and id(child) not in grouped:
                yield [child]


def _share(group: SharedInput, members: list[nn.Module]) -> None:
    for index, member in enumerate(members):
        member.shared_input, member.shared_input_index = group, index


def _groupable(module: nn.Module, shared_dropout: bool) -> bool:
    """A LoRA linear (one adapter, no lora_A bias) whose down-projection may be one of a group's: its dropout is
    none (PEFT's math) or shared."""
    if len(module.lora_A) != 1:
        return False
    (name,) = module.lora_A.keys()
    return module.lora_A[name].bias is None and (shared_dropout or isinstance(module.lora_dropout[name], nn.Identity))


def _fast_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    # Training path only: one active, unmerged adapter (what pipetune trains).
    if self.disable_adapters or self.merged or len(self.active_adapters) != 1:
        return type(self).forward(self, x, *args, **kwargs)
    name = self.active_adapters[0]
    group = getattr(self, "shared_input", None)  # a SharedInput computes the down-projections of its members
    if getattr(self, "extended_weight", None) is not None:  # lora.adapter_in_matmul (extend_base_weights)
        extended, down = group.take(self.shared_input_index, x, name)
        return _AdapterInMatmul.apply(extended, self.extended_weight, down, self.lora_B[name].weight)
    if group is not None:
        down = group.take(self.shared_input_index, x, name)
    else:
        down = self.lora_A[name](self.lora_dropout[name](x)) * self.scaling[name]
    return self.base_layer(x, *args, **kwargs) + self.lora_B[name](down)


class SharedInput:
    """The LoRA linears of one module that read one input: their down-projections as one matmul over their
    concatenated lora_A weights, on the input dropped out once, then split per linear.

    The first member called with an input computes every member's down-projection and holds the others' until
    each is called with that same tensor, in whatever order the model calls them; the last one called lets go,
    so no tensor outlives the layer's call (a CUDA-graphed layer must leave none behind, and a compiled one then
    ends with the state it started with). A member called with another input computes the group's anew: slower,
    never wrong. Without dropout (nn.Identity) this is PEFT's math; with dropout all members see one mask, drawn
    by the first member's dropout module (lora.shared_dropout)."""

    def __init__(self, members: list[nn.Module]) -> None:
        self.members = members
        self.source: torch.Tensor | None = None
        """The input of the held down-projections (None when none is held)."""
        self.held: list[torch.Tensor | None] = [None] * len(members)

    def take(self, index: int, x: torch.Tensor, name: str):
        """What the group computed for member `index` from `x` for adapter `name`: its scaled down-projection."""
        if self.source is not x or self.held[index] is None:
            self.source = x
            for i, computed in enumerate(self._compute(x, name)):
                self.held[i] = computed
        taken = self.held[index]
        self.held[index] = None
        if all(other is None for other in self.held):
            self.source = None
        return taken

    def _compute(self, x: torch.Tensor, name: str) -> list:
        return grouped_downs(self.members, x, name)


def grouped_downs(members: list[nn.Module], x: torch.Tensor, name: str) -> list[torch.Tensor]:
    """The members' scaled down-projections of `x` as one matmul over their concatenated lora_A weights, on `x`
    dropped out once (by the first member's dropout module), split per member."""
    weights = [member.lora_A[name].weight for member in members]
    dropped = members[0].lora_dropout[name](x)
    downs = F.linear(dropped, torch.cat(weights).to(x.dtype)).split([w.shape[0] for w in weights], dim=-1)
    return [down * member.scaling[name] for down, member in zip(downs, members, strict=True)]


def _linear_in_input_dtype(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An adapter linear computing in its input's dtype; on PEFT's own path (float32 inputs) a plain linear."""
    bias = None if self.bias is None else self.bias.to(x.dtype)
    return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


# --------------------------------------------------------------------------- the LoRA term inside the base matmul

IN_MATMUL_ALONE = True
"""lora.adapter_in_matmul also for the linears that read an input of their own (o_proj, down_proj), whose
extended input is a copy of theirs (o's comes from the attention kernel: inductor cannot write it in place);
False keeps those on the fast path (`layer_levers.py`'s "adapter in matmul groups only" times it)."""

EXTENDED_MULTIPLE = 64
"""The extended weights' added columns are padded with zeros to a multiple of this, so that the inner size
in + R is a whole number of cuBLAS's 64-wide tiles: one Qwen3-8B layer at 4,096 tokens, compiled, on an H200
(benchmarks/journal/2026-12-02-in-matmul-one-h200.md) took 4.3% less time with the adapters inside than
without, 3.1% less with R padded to 8 (16-byte rows only)."""


class ExtendedInput(SharedInput):
    """lora.adapter_in_matmul: the LoRA linears of one module that read one input (q/k/v; gate/up), or one alone,
    and their extended input [x | each member's scaled down-projection | zeros to EXTENDED_MULTIPLE].

    Each member's base weight lives in an extended weight [W | its lora_B in its own columns, zeros in the
    others'] (`extend_base_weights`), so x_ext @ W_ext^T is the base output plus the LoRA term in one matmul:
    the up-projection's output is never written and read on its own. In backward, grad @ W_ext is the input's
    gradient and the down-projections' in one matmul (`_AdapterInMatmul`). The down-projections are one matmul
    where the members' dropout allows it (none, or lora.shared_dropout), else one per member on its own mask.
    Held and handed out as SharedInput holds its down-projections: `take` gives a member (the extended input, its
    down-projection)."""

    def __init__(self, members: list[nn.Module], shared_dropout: bool) -> None:
        super().__init__(members)
        self.one_mask = all(_groupable(m, shared_dropout) for m in members)

    def ranks(self, name: str) -> list[int]:
        return [member.lora_A[name].weight.shape[0] for member in self.members]

    def _compute(self, x: torch.Tensor, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.one_mask and len(self.members) > 1:
            downs = grouped_downs(self.members, x, name)
        else:
            downs = [m.lora_A[name](m.lora_dropout[name](x)) * m.scaling[name] for m in self.members]
        pad = extended_padding(sum(self.ranks(name)))
        extra = [x.new_zeros(*x.shape[:-1], pad)] if pad else []
        extended = torch.cat([x, *downs, *extra], dim=-1)
        return [(extended, down) for down in downs]


def extended_padding(ranks: int) -> int:
    """The zero columns after a group's `ranks` down-projections in its extended input (to EXTENDED_MULTIPLE)."""
    return -ranks % EXTENDED_MULTIPLE


class _AdapterInMatmul(torch.autograd.Function):
    """out = extended @ weight^T (the base output with the LoRA term); `weight` is frozen, so backward gives the
    extended input its gradient (grad @ weight: the input's and the down-projections') and lora_B its own from
    the saved down-projection (grad^T @ down, as the fast path's up-projection would)."""

    @staticmethod
    def forward(ctx, extended, weight, down, lora_b):
        ctx.save_for_backward(weight, down)
        ctx.b_dtype = lora_b.dtype
        return F.linear(extended, weight)

    @staticmethod
    def backward(ctx, grad):
        weight, down = ctx.saved_tensors
        grad_b = grad.flatten(0, -2).t() @ down.flatten(0, -2)
        return grad @ weight, None, None, grad_b.to(ctx.b_dtype)


def extend_base_weights(peft_model: peft.PeftModel) -> ExtendedWeights:
    """Give each LoRA linear marked by use_fast_path(in_matmul=True) its extended weight: a buffer
    [out, in + R] holding the base weight W (the base linear's weight becomes a view of it: no second copy) and
    lora_B's values in the member's columns (zeros elsewhere; R: its group's ranks, padded), filled now. On a
    materialized model with plain weights (no quantized base, tensor parallelism or FSDP: the config refuses
    those), or a shape-only one on the meta device (a memory probe's)."""
    for module in peft_model.modules():
        group = getattr(module, "shared_input", None)
        if not isinstance(group, ExtendedInput):
            continue
        (name,) = module.lora_A.keys()
        weight = module.base_layer.weight
        if type(weight.data) is not torch.Tensor or weight.dtype.itemsize < 2:
            raise ValueError(
                f"lora.adapter_in_matmul needs plain base weights; {type(module.base_layer).__name__} holds "
                f"{type(weight.data).__name__} {weight.dtype}: set lora.adapter_in_matmul = false"
            )
        ranks = group.ranks(name)
        out, width = weight.shape
        offset = width + sum(ranks[: module.shared_input_index])
        columns = sum(ranks) + extended_padding(sum(ranks))
        extended = torch.zeros(out, width + columns, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            extended[:, :width] = weight
        module.base_layer.weight = nn.Parameter(extended[:, :width], requires_grad=False)
        module.register_buffer("extended_weight", extended, persistent=False)
        module.extended_columns = extended[:, offset : offset + ranks[module.shared_input_index]]
    extended = ExtendedWeights.of(peft_model)
    extended.refresh()
    return extended


class ExtendedWeights:
    """The lora_B columns of the extended weights under a module (lora.adapter_in_matmul) and the lora_B weights
    they copy: `refresh` before a forward copies them where lora_B may have changed since: after any optimizer's
    step (a fused AdamW writes without moving a tensor's version: a hook of torch.optim tells), or any other
    in-place write (a resume, a test: the versions tell). Between an optimizer step's microbatches nothing is
    copied: a pipeline's forwards run while earlier microbatches' backwards, which saved the extended weights,
    still wait."""

    live: weakref.WeakSet[ExtendedWeights] = weakref.WeakSet()
    """Every instance, so that an optimizer step marks them all (`_after_optimizer_step`)."""
    hooked = False

    def __init__(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.slots = slots
        self.versions: list[int] | None = None
        if not slots:
            return
        ExtendedWeights.live.add(self)
        if not ExtendedWeights.hooked:
            register_optimizer_step_post_hook(_after_optimizer_step)
            ExtendedWeights.hooked = True

    @classmethod
    def of(cls, root: nn.Module) -> ExtendedWeights:
        return cls(
            [
                (module.extended_columns, next(iter(module.lora_B.values())).weight)
                for module in root.modules()
                if getattr(module, "extended_columns", None) is not None
            ]
        )

    def __len__(self) -> int:
        return len(self.slots)

    def refresh(self) -> None:
        if not self.slots:
            return
        versions = [weight._version for _, weight in self.slots]
        if versions == self.versions:
            return
        with torch.no_grad():
            torch._foreach_copy_([columns for columns, _ in self.slots], [weight.detach() for _, weight in self.slots])
        self.versions = versions


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    for extended in ExtendedWeights.live:
        extended.versions = None  # copied again before the next forward
