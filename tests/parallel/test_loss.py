"""TokenLoss: a step whose supervised tokens are all masked gives loss 0 and zero gradients, never NaN."""

from __future__ import annotations

import torch

from pipetune.data.batching import IGNORE
from pipetune.parallel.pipeline import TokenLoss


def test_all_masked_labels_give_zero_loss_and_finite_gradients() -> None:
    logits = torch.randn(2, 5, 11, requires_grad=True)
    labels = torch.full((2, 5), IGNORE)
    loss_fn = TokenLoss()
    loss_fn.normalizer = max(int((labels != IGNORE).sum()), 1)  # as the training loop sets it

    loss = loss_fn(logits, labels)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_loss_is_token_sum_over_normalizer() -> None:
    logits = torch.randn(1, 4, 7)
    labels = torch.tensor([[IGNORE, 3, 5, IGNORE]])
    loss_fn = TokenLoss()
    loss_fn.normalizer = 10
    expected = torch.nn.functional.cross_entropy(logits[0, 1:3], labels[0, 1:3], reduction="sum") / 10
    torch.testing.assert_close(loss_fn(logits, labels), expected)
