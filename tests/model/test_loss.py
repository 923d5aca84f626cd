"""The fused lm_head + cross-entropy (train.fused_loss) against the plain cross_entropy(lm_head(h).float())."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pipetune.data.batching import IGNORE
from pipetune.model.head_rows import ROWS_STEP
from pipetune.model.loss import linear_cross_entropy


@pytest.mark.parametrize("chunk", [5, 4096])  # chunk boundaries inside the batch, and one chunk for all rows
def test_fused_loss_and_gradient_match_plain(chunk: int) -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    hidden = torch.randn(3, 8, 16, requires_grad=True)
    labels = torch.randint(0, 50, (3, 8))
    labels[0, :5] = IGNORE  # prompt tokens
    labels[2] = IGNORE  # a row with nothing supervised

    plain = F.cross_entropy(head(hidden).flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    (plain_grad,) = torch.autograd.grad(plain / 7, hidden)
    fused = linear_cross_entropy(hidden, head, labels, chunk)
    (fused_grad,) = torch.autograd.grad(fused / 7, hidden)

    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-5, atol=1e-7)
    assert fused_grad[2].abs().max() == 0  # unsupervised rows get no gradient
    with torch.no_grad():  # forward only (validation): the loss alone
        torch.testing.assert_close(linear_cross_entropy(hidden, head, labels, chunk), plain, rtol=1e-6, atol=1e-6)


def test_the_heads_matmuls_take_a_multiple_of_the_rows_step(monkeypatch) -> None:
    """Microbatches with other counts of supervised rows meet the head's matmul in a few shapes (zero rows pad them
    to ROWS_STEP; the loss is the same: the test above)."""
    seen, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, *args: seen.append(x.shape[0]) or linear(x, *args))
    head = torch.nn.Linear(16, 50, bias=False).requires_grad_(False)
    for supervised in (3, 100, 130):
        labels = torch.full((2, 80), IGNORE)
        labels.view(-1)[:supervised] = 1
        linear_cross_entropy(torch.randn(2, 80, 16, requires_grad=True), head, labels).backward()
    assert seen == [ROWS_STEP, ROWS_STEP, 2 * ROWS_STEP]


def test_fused_loss_refuses_a_trainable_head() -> None:
    head = torch.nn.Linear(4, 6)
    with pytest.raises(ValueError, match="freeze the head"):
        linear_cross_entropy(torch.randn(1, 2, 4), head, torch.zeros(1, 2, dtype=torch.long))
