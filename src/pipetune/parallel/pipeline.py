"""Forward + backward of one batch, through a pipeline schedule or (pp = 1) in one process.

Both runners use the same loss: the sum of token cross-entropies divided by the number of
supervised tokens in the whole optimizer step (`TokenLoss.normalizer`, set before each step).
Summed over microbatches and accumulation steps this is exactly the step's mean token loss,
and its gradient is the gradient of that mean, whatever the microbatching. Hence
`scale_grads=False`: torch's default divides by n_microbatches, a mean of per-microbatch means.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from pipetune.data.batching import IGNORE

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# torch >= 2.12 can skip merging the last stage's outputs (full logits) after each step.
_HAS_RETURN_OUTPUTS = "return_outputs" in inspect.signature(PipelineScheduleSingle.step).parameters


class TokenLoss:
    """Sum of token cross-entropies / `normalizer` (the optimizer step's supervised-token count)."""

    def __init__(self) -> None:
        self.normalizer = 1.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
        return total / self.normalizer


class PipelineRunner:
    """One stage of a pipeline schedule; `step` returns the summed loss on the last stage, None elsewhere."""

    def __init__(
        self,
        module: nn.Module,
        stage_index: int,
        n_stages: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        schedule: str,
        n_microbatches: int,
        loss_fn: TokenLoss,
    ) -> None:
        self.is_first = stage_index == 0
        self.is_last = stage_index == n_stages - 1
        self.stage = PipelineStage(module, stage_index, n_stages, device, group=group)
        self.schedule = SCHEDULE_CLASSES[schedule](
            self.stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False
        )

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        extra = {"return_outputs": False} if _HAS_RETURN_OUTPUTS else {}
        if self.is_first:
            self.schedule.step(input_ids, **extra)
            return None
        if self.is_last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=labels, losses=losses, **extra)
            return torch.stack([loss.detach() for loss in losses]).sum()
        self.schedule.step(**extra)
        return None

    @torch.no_grad()
    def eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward only (the schedule's eval): the summed loss on the last stage, None elsewhere."""
        if self.is_first:
            self.schedule.eval(input_ids)
            return None
        if self.is_last:
            losses: list[torch.Tensor] = []
            self.schedule.eval(target=labels, losses=losses)
            return torch.stack(losses).sum()
        self.schedule.eval()
        return None


class SingleRunner:
    """The whole model in one process, microbatch by microbatch: the reference for parity tests."""

    is_first = is_last = True

    def __init__(self, module: nn.Module, n_microbatches: int, loss_fn: TokenLoss) -> None:
        self.module = module
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=input_ids.device)
        for ids, target in zip(input_ids.chunk(self.n_microbatches), labels.chunk(self.n_microbatches), strict=True):
            loss = self.loss_fn(self.module(ids), target)
            loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), device=input_ids.device)
        for ids, target in zip(input_ids.chunk(self.n_microbatches), labels.chunk(self.n_microbatches), strict=True):
            total += self.loss_fn(self.module(ids), target)
        return total


def validation_loss(
    runner: PipelineRunner | SingleRunner,
    module: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    loss_fn: TokenLoss,
) -> torch.Tensor | None:
    """Mean token loss over a whole split, forward only, in batches of the training shape.

    The last batch is filled with rows whose labels are all IGNORE (static shapes), so every sample
    counts once. Returns the loss on the last stage (None elsewhere); every rank must call it.
    """
    n = input_ids.shape[0]
    n_batches = -(-n // batch_size)
    pad = n_batches * batch_size - n
    if pad:
        input_ids = torch.cat([input_ids, input_ids[:1].expand(pad, -1)])
        labels = torch.cat([labels, torch.full_like(labels[:1], IGNORE).expand(pad, -1)])
    normalizer, loss_fn.normalizer = loss_fn.normalizer, 1.0
    module.eval()
    total = torch.zeros((), device=input_ids.device)
    try:
        for b in range(n_batches):
            rows = slice(b * batch_size, (b + 1) * batch_size)
            out = runner.eval_step(input_ids[rows], labels[rows])
            if out is not None:
                total += out
    finally:
        module.train()
        loss_fn.normalizer = normalizer
    if not runner.is_last:
        return None
    return total / max(int((labels != IGNORE).sum()), 1)
