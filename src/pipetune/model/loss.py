"""lm_head and token cross-entropy in one pass, a chunk of rows at a time (`train.fused_loss`).

The plain path materializes [tokens, vocab] logits, their float32 copy and, in backward, their
float32 gradient: at Qwen3's 151,936 columns that is ~2.4 GB per 2,048 tokens. Here only the
supervised rows (the summary, not the transcript) go through the head, a chunk at a time; each
chunk's logits live only inside the forward, which also computes the chunk's hidden-state gradient
((softmax - onehot) @ W, the only gradient needed: the head is frozen); backward just scales it.
Same operations and dtypes as `cross_entropy(lm_head(h).float())`, so the same math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from pipetune.model.head_rows import ROWS_STEP
from pipetune.model.host_tensors import to_device


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk: int,
        ignore_index: int,
        with_grad: bool,
        vocab: VocabShard | None,
    ) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        # Only supervised rows reach the head: the prompt's tokens have no loss and get no gradient. Their
        # positions are found where the labels live: on the host for a training batch (no wait for the GPU), on
        # the device for validation's (a host sync: their count sizes the rows).
        keep, targets = supervised_positions(labels, ignore_index, hidden.device)
        real = keep.shape[0]
        # zero rows to a multiple of ROWS_STEP: the head's matmuls meet a few shapes, not a new one each microbatch
        pad = -real % ROWS_STEP
        rows = F.pad(flat.index_select(0, keep), (0, 0, 0, pad))
        targets = F.pad(targets, (0, pad))
        if vocab is not None:  # this rank's columns: targets outside them pick nothing here
            targets = targets - vocab.start
            owned = ((targets >= 0) & (targets < weight.shape[0])).unsqueeze(1)
            targets = targets.clamp(0, weight.shape[0] - 1)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(rows) if with_grad else None
        for start in range(0, real, chunk):  # the last chunk's padding rides along
            part = slice(start, start + chunk)
            logits = F.linear(rows[part], weight, bias).float()
            picked = targets[part].unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1)
            target_logits = logits.gather(1, picked).squeeze(1)
            if vocab is not None:
                lse, target_logits = vocab.combine(lse, target_logits * owned[part].squeeze(1))
            total += (lse - target_logits)[: real - start].sum()  # the padding's rows left out of the loss
            if with_grad:  # d(sum of losses)/d logits = softmax - onehot
                probs = logits.sub_(lse.unsqueeze(1)).exp_()
                onehot = torch.ones_like(picked, dtype=probs.dtype) if vocab is None else owned[part].to(probs.dtype)
                probs.scatter_add_(1, picked, -onehot)
                grad[part] = probs.to(weight.dtype) @ weight
        if with_grad:
            grad = grad[:real]
            if vocab is not None:  # each rank holds its columns' share of the hidden states' gradient
                dist.all_reduce(grad, group=vocab.group)
            ctx.save_for_backward(torch.zeros_like(flat).index_copy_(0, keep, grad))
        ctx.shape = hidden.shape
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_output).view(ctx.shape), None, None, None, None, None, None, None


def supervised_positions(
    labels: torch.Tensor, ignore_index: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions of the labels that count, their targets), on `device`. Labels on the host are read there
    and copied without waiting for the device's queue, so the loss's launches never wait for the forward."""
    flat = labels.reshape(-1)
    keep = (flat != ignore_index).nonzero().squeeze(1)
    targets = flat.index_select(0, keep)
    return to_device(keep, device), to_device(targets, device)


@dataclass
class VocabShard:
    """The vocabulary columns of lm_head this rank holds (tensor parallelism) and how to combine with the others'."""

    start: int
    group: dist.ProcessGroup

    def combine(self, lse: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole-vocabulary log-sum-exp and target logits from every rank's (one all-gather)."""
        local = torch.stack([lse, target_logits])
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        stacked = torch.stack(parts)
        return torch.logsumexp(stacked[:, 0], dim=0), stacked[:, 1].sum(dim=0)


def linear_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, chunk: int = 2048, ignore_index: int = -100
) -> torch.Tensor:
    """Sum over supervised tokens (labels != ignore_index, as in F.cross_entropy) of
    cross_entropy(head(hidden).float(), labels); `head` must be frozen.

    A head split by vocabulary columns over tensor-parallel ranks (a DTensor weight, parallel/tp.py) computes
    its shard's logits only; the ranks combine their log-sum-exps and target logits per chunk, and sum their
    shares of the hidden states' gradient (vocabulary-parallel cross-entropy)."""
    if head.weight.requires_grad:
        raise ValueError("linear_cross_entropy computes no lm_head gradient: freeze the head (requires_grad=False)")
    with_grad = torch.is_grad_enabled() and hidden.requires_grad
    weight, bias, vocab = head.weight, head.bias, None
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        vocab = VocabShard(mesh.get_local_rank() * -(-weight.shape[0] // mesh.size()), mesh.get_group())
        weight, bias = weight.to_local(), bias.to_local() if bias is not None else None
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, chunk, ignore_index, with_grad, vocab)
