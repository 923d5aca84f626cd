"""Tensor parallelism (parallel.tp): every decoder layer split over the tp ranks with torch's DTensor plans.

Megatron's layout, as torch's recipes apply it to a Llama-style decoder (torchtitan's `apply_tp`): q/k/v/gate/up
split by output columns (ColwiseParallel), o/down by input columns (RowwiseParallel). Each rank runs heads/tp
attention heads (HF's attention infers its local head count from the shapes) and intermediate/tp MLP columns,
with one all-reduce per attention block and per MLP in forward, as many in backward. The embedding is split by
vocabulary rows (RowwiseParallel, its output all-reduced), lm_head by vocabulary columns: its logits are
all-gathered for the plain loss; the fused loss (model/loss.py) runs vocabulary-parallel on the shard instead.

LoRA (PEFT's lora.Linear: base_layer, lora_A, lora_B) follows its base layer, so each product is PEFT's own:

    column-wise base: lora_A replicated (plain), lora_B split by output columns (ColwiseParallel)
    row-wise base:    lora_A split by input columns (RowwiseParallel: its rank-r output all-reduced), lora_B replicated

A replicated adapter gets the whole gradient, the same on every rank: the input gradient of a ColwiseParallel
module is all-reduced in backward. Dropout: the ranks of a tp group draw from one random stream (train.py seeds
them alike), so their masks over a replicated input agree; over a row-wise layer's split input each rank draws
the mask of the whole input and keeps its columns (`SplitInputDropout`), the mask one process would draw.

Sequence parallelism (parallel.sequence_parallel): between the blocks, the hidden states are split by sequence
positions instead of replicated (1/tp of the activation memory for norms, residuals and the pipeline's
transfers): the norms run on the split (SequenceParallel), attention and MLP all-gather their input and
reduce-scatter their output instead of all-reducing it. A row-wise adapter's lora_B then sees only this rank's
positions: its gradient is a partial sum (a Partial DTensor) that `sum_partial_gradients` completes.

The plans are applied to the model on the meta device, before each rank allocates and fills only its shards
(model/load.py: `materialize`), so shards are cut without communication (src_data_rank=None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pipetune.model.families import Family
from pipetune.model.stage import StageModule


def apply_tp(modules: list[StageModule], tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Split this rank's stages over `tp_mesh` in place; build optimizers and pipeline stages afterwards."""
    between: Placement = Shard(1) if sequence_parallel else Replicate()  # hidden states between the blocks
    for module in modules:
        trainable = {name for name, param in module.named_parameters() if param.requires_grad}
        for layer in module.layers:
            parallelize_module(layer, tp_mesh, layer_plan(layer, module.family, tp_mesh, sequence_parallel))
        if module.embed is not None:
            parallelize_module(
                module.embed, tp_mesh, _local(RowwiseParallel(input_layouts=Replicate(), output_layouts=between))
            )
            module.embed.register_forward_hook(_wait_for_output)
        if module.norm is not None and sequence_parallel:
            # Normed on the split, then gathered: lm_head (or the fused loss) takes whole sequences.
            parallelize_module(module.norm, tp_mesh, _local(SequenceParallel()))
            gather = PrepareModuleOutput(
                output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True
            )
            parallelize_module(module.norm, tp_mesh, gather)
        if module.lm_head is not None:
            parallelize_module(module.lm_head, tp_mesh, _local(ColwiseParallel(output_layouts=Replicate())))
        module.sequence_shards = tp_mesh.size() if sequence_parallel else 1
        # SequenceParallel re-registers the norms' weights as new Parameters, which require grad: freeze them again.
        for name, param in module.named_parameters():
            param.requires_grad_(name in trainable)


def layer_plan(
    layer: nn.Module, family: Family, tp_mesh: DeviceMesh, sequence_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The plan of one decoder layer (PEFT-wrapped or not) of `family`, whose column- and row-wise linears it
    names; row-wise adapters get a `SplitInputDropout`."""
    plan: dict[str, ParallelStyle] = {}
    if sequence_parallel:
        split, whole = (Shard(1),), (Replicate(),)
        for norm in family.block_norms:  # those feeding attention and MLP; a norm of their outputs runs on the split
            plan[norm] = _local(SequenceParallel())
        # HF's decoder layers pass the attention its input by keyword, the MLP by position.
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": split[0]},
            desired_input_kwarg_layouts={"hidden_states": whole[0]},
            use_local_output=True,
        )
        plan["mlp"] = PrepareModuleInput(input_layouts=split, desired_input_layouts=whole, use_local_output=True)
    row_output = Shard(1) if sequence_parallel else Replicate()
    for name, part in layer.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short not in family.projections:
            continue
        column = short in family.column_wise
        base = ColwiseParallel() if column else RowwiseParallel(output_layouts=row_output)
        if not isinstance(part, LoraLinear):
            plan[name] = _local(base)
            continue
        plan[f"{name}.base_layer"] = _local(base)
        for adapter in part.lora_A:
            if column:
                plan[f"{name}.lora_B.{adapter}"] = _local(ColwiseParallel())
                continue
            plan[f"{name}.lora_A.{adapter}"] = _local(RowwiseParallel(output_layouts=row_output))
            if sequence_parallel:  # applied to this rank's positions only
                plan[f"{name}.lora_B.{adapter}"] = _local(SequenceParallel(use_local_output=True))
            dropout = part.lora_dropout[adapter]
            if isinstance(dropout, nn.Dropout):
                width, rank, ranks = part.base_layer.in_features, tp_mesh.get_local_rank(), tp_mesh.size()
                part.lora_dropout[adapter] = SplitInputDropout(dropout.p, width, rank, ranks)
    return plan


def _wait_for_output(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output as a plain tensor: its all-reduce is issued asynchronously and the result is an
    AsyncCollectiveTensor, a type of its own, for which the first compiled layer would compile a second graph."""
    return output.wait() if isinstance(output, AsyncCollectiveTensor) else output


def _local(style: ParallelStyle) -> ParallelStyle:
    """`style` cutting each rank's shard from its own (meta) tensors, without a broadcast from rank 0."""
    style.src_data_rank = None
    return style


@torch.no_grad()
def sum_partial_gradients(params: list[torch.Tensor]) -> None:
    """Complete the gradients that are partial sums over the tp ranks (a replicated adapter applied to this rank's
    sequence positions, with sequence parallelism) by summing them: afterwards every gradient is whole."""
    for param in params:
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            param.grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])


class SplitInputDropout(nn.Module):
    """Dropout of this rank's columns of an input split over `ranks` ranks, with the mask of the whole input.

    Every rank of the tp group draws the whole `width`-column mask from the group's shared random stream, as
    one process would, and keeps the columns its shard holds (torch.chunk's split, as DTensor's Shard cuts)."""

    def __init__(self, p: float, width: int, rank: int, ranks: int) -> None:
        super().__init__()
        self.p, self.width, self.rank, self.ranks = p, width, rank, ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        mask = F.dropout(x.new_ones(*x.shape[:-1], self.width), self.p)  # ones x (bernoulli / (1 - p))
        start = self.rank * -(-self.width // self.ranks)
        # A copy of this rank's columns: backward keeps the mask, and a view would keep the whole one.
        return x * mask[..., start : start + x.shape[-1]].contiguous()

    def extra_repr(self) -> str:
        return f"p={self.p}, width={self.width}, rank={self.rank} of {self.ranks}"
