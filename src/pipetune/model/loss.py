"""lm_head and token cross-entropy in one pass, a chunk of rows at a time (`train.fused_loss`).

The plain path materializes [tokens, vocab] logits, their float32 copy and, in backward, their
float32 gradient: at Qwen3's 151,936 columns that is ~2.4 GB per 2,048 tokens. Here only the
supervised rows (the summary, not the transcript) go through the head, a chunk at a time; each
chunk's logits live only inside the forward, which also computes the chunk's hidden-state gradient
((softmax - onehot) @ W, the only gradient needed: the head is frozen); backward just scales it.
Same operations and dtypes as `cross_entropy(lm_head(h).float())`, so the same math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipetune.data.batching import IGNORE


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk: int,
        with_grad: bool,
    ) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        # Only supervised rows reach the head: the prompt's tokens have no loss and get no gradient.
        # Reading their count is the one host sync of the loss.
        keep = (labels.reshape(-1) != IGNORE).nonzero().squeeze(1)
        rows, targets = flat.index_select(0, keep), labels.reshape(-1).index_select(0, keep)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(rows) if with_grad else None
        for start in range(0, rows.shape[0], chunk):
            part = slice(start, start + chunk)
            logits = F.linear(rows[part], weight, bias).float()
            picked = targets[part].unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, picked).squeeze(1)).sum()
            if with_grad:  # d(sum of losses)/d logits = softmax - onehot
                probs = logits.sub_(lse.unsqueeze(1)).exp_()
                probs.scatter_add_(1, picked, -torch.ones_like(picked, dtype=probs.dtype))
                grad[part] = probs.to(weight.dtype) @ weight
        if with_grad:
            ctx.save_for_backward(torch.zeros_like(flat).index_copy_(0, keep, grad))
        ctx.shape = hidden.shape
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return (grad * grad_output).view(ctx.shape), None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, chunk: int = 2048
) -> torch.Tensor:
    """Sum over supervised tokens of cross_entropy(head(hidden).float(), labels); `head` must be frozen."""
    if head.weight.requires_grad:
        raise ValueError("linear_cross_entropy computes no lm_head gradient: freeze the head (requires_grad=False)")
    with_grad = torch.is_grad_enabled() and hidden.requires_grad
    return _LinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk, with_grad)
