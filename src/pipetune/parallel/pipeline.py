"""Forward + backward of one batch, through a pipeline schedule or (pp = 1) in one process.

Both runners use the same loss: the sum of token cross-entropies divided by the number of
supervised tokens in the whole optimizer step (`TokenLoss.normalizer`, set before each step).
Summed over microbatches and accumulation steps this is exactly the step's mean token loss,
and its gradient is the gradient of that mean, whatever the microbatching. Hence
`scale_grads=False`: torch's default divides by n_microbatches, a mean of per-microbatch means.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules

from pipetune.data.batching import IGNORE
from pipetune.model.graphs import mark_graph_step
from pipetune.model.host_tensors import to_device
from pipetune.model.loss import linear_cross_entropy
from pipetune.parallel.torch_compat import schedule_step_options
from pipetune.schedules import SCHEDULES, stage_ids

SCHEDULE_CLASSES = {name: getattr(schedules, spec.torch_class) for name, spec in SCHEDULES.items()}


Action = tuple[str, int, int]
"""(kind, stage, microbatch): "F" forward, "B" backward, "I" / "W" a backward's input / weight-gradient part."""


@functools.cache
def schedule_actions(schedule: str, pp: int, stages_per_rank: int, n_microbatches: int) -> dict[int, list[Action]]:
    """Every pipeline rank's compute actions in the order it runs them, without a process group or a model.

    Multi-stage schedules are torch's own plan (`pipeline_order`, built over stand-in stages: it needs only their
    indices); GPipe and 1F1B run loops of their own, written out here: GPipe all forwards then all backwards,
    1F1B min(m, pp - rank) forwards, then a backward before each further forward, then the remaining backwards.
    Used to predict a schedule's memory (microbatches in flight) and its step time (pipetune plan); cached: the
    result is shared, not to be changed."""
    m = n_microbatches
    if not SCHEDULES[schedule].multi_stage:
        order = {}
        for rank in range(pp):
            warmup = m if schedule == "gpipe" else min(m, pp - rank)
            actions: list[Action] = [("F", rank, i) for i in range(warmup)]
            for i in range(warmup, m):
                actions += [("B", rank, i - warmup), ("F", rank, i)]
            actions += [("B", rank, i) for i in range(m - warmup, m)]
            order[rank] = actions
        return order
    schedule_class = SCHEDULE_CLASSES[schedule]
    n_stages = pp * stages_per_rank
    stages = [
        _StandInStage(stage, n_stages, pp, rank)
        for rank in range(1)
        for stage in stage_ids(schedule, rank, pp, stages_per_rank)
    ]
    plan = schedule_class(stages, n_microbatches=m, loss_fn=lambda output, target: output, scale_grads=False)
    order = {}
    for rank, actions in plan.pipeline_order.items():
        flat = []
        for action in _flatten(actions):
            kind = getattr(action.computation_type, "value", str(action.computation_type))
            if kind in ("F", "B", "I", "W"):
                flat.append((kind, action.stage_index, action.microbatch_index))
        order[rank] = flat
    return order


class _StandInStage:
    """What a multi-stage schedule reads of its stages to plan every rank's actions."""

    def __init__(self, stage_index: int, num_stages: int, group_size: int, group_rank: int) -> None:
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = nn.Module()  # the zero-bubble schedules check that it is not compiled


def _flatten(actions: list[object]) -> list[object]:
    """The actions of a plan in order, overlapped pairs (DualPipeV) as their parts."""
    flat = []
    for action in actions:
        if action is None:
            continue
        sub = getattr(action, "sub_actions", None)
        flat.extend(_flatten(sub) if sub else [action])
    return flat


class TokenLoss:
    """Sum of token cross-entropies / `normalizer` (the optimizer step's supervised-token count).

    With a `head` (train.fused_loss) the last stage hands over its final hidden states, and the loss
    applies the lm_head itself, chunk by chunk (model/loss.py)."""

    def __init__(self, head: nn.Linear | None = None, chunk: int = 2048) -> None:
        self.normalizer = 1.0
        self.head = head
        self.chunk = chunk

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return linear_cross_entropy(output, self.head, labels, self.chunk, ignore_index=IGNORE) / self.normalizer
        labels = to_device(labels.flatten(), output.device)
        total = F.cross_entropy(output.flatten(0, 1).float(), labels, ignore_index=IGNORE, reduction="sum")
        return total / self.normalizer


class PipelineRunner:
    """This rank's stages of a pipeline schedule; `step` returns the summed loss on the last stage, None elsewhere.

    `modules[i]` runs pipeline stage `stage_ids[i]` of `n_stages`: one stage per rank for gpipe/1f1b,
    several for the interleaved, looped and V-shaped schedules.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        stage_ids: list[int],
        n_stages: int,
        device: torch.device,
        group: dist.ProcessGroup | None,
        schedule: str,
        n_microbatches: int,
        loss_fn: TokenLoss,
    ) -> None:
        self.is_first = 0 in stage_ids
        self.is_last = n_stages - 1 in stage_ids
        self.device = device
        self.stages = [
            PipelineStage(module, index, n_stages, device, group=group)
            for module, index in zip(modules, stage_ids, strict=True)
        ]
        schedule_class = SCHEDULE_CLASSES[schedule]
        stages = self.stages[0] if issubclass(schedule_class, schedules.PipelineScheduleSingle) else self.stages
        self.schedule = schedule_class(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        self._step_options = schedule_step_options(self.schedule.step)

    def step(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """`position_ids` (packed rows): given to every stage of every rank, microbatch by microbatch."""
        return self._run(self.schedule.step, input_ids, labels, position_ids, **self._step_options)

    @torch.no_grad()
    def eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward only (the schedule's eval): the summed loss on the last stage, None elsewhere. A forward-only
        step keeps every microbatch's output until the next step starts (no backward takes them): on the last
        stage the logits of the whole batch, which validation's own stages would hold through the training steps
        that follow (8,192-token rows of SmolLM2: 3.2 GB). They go when the step ends."""
        try:
            return self._run(self.schedule.eval, input_ids, labels, None, **self._step_options)
        finally:
            for stage in self.stages:
                stage.clear_runtime_states()

    def _run(
        self, run, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None, **options
    ) -> torch.Tensor | None:
        # The rank holding stage 0 feeds the ids, the one holding the last stage the labels: with V-shaped
        # schedules that is the same rank. Keyword inputs reach every stage (torch splits them into microbatches
        # as it does the ids): packed rows' position ids, from which each stage builds its document mask.
        mark_graph_step(self.device)  # CUDA-graphed layers (train.cuda_graphs): a new step
        losses: list[torch.Tensor] = []
        if self.is_last:
            options.update(target=labels, losses=losses)
            if run == self.schedule.step and any(getattr(stage.submod, "head_rows", False) for stage in self.stages):
                options.update(head_rows=labels != IGNORE)  # the last layer on the loss's rows
        if position_ids is not None:
            options.update(position_ids=position_ids)
        run(*((input_ids,) if self.is_first else ()), **options)
        return torch.stack([loss.detach() for loss in losses]).sum() if self.is_last else None


class SingleRunner:
    """The whole model in one process, microbatch by microbatch: the reference for parity tests."""

    is_first = is_last = True

    def __init__(self, module: nn.Module, n_microbatches: int, loss_fn: TokenLoss) -> None:
        self.module = module
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn

    def step(
        self, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        mark_graph_step(input_ids.device)
        total = torch.zeros((), device=input_ids.device)
        chunks = zip(input_ids.chunk(self.n_microbatches), labels.chunk(self.n_microbatches), strict=True)
        positions = [None] * self.n_microbatches if position_ids is None else position_ids.chunk(self.n_microbatches)
        for (ids, target), pos in zip(chunks, positions, strict=True):
            inputs = {} if pos is None else dict(position_ids=pos)
            if getattr(self.module, "head_rows", False):  # the last layer on the loss's rows (model/head_rows.py)
                inputs.update(head_rows=target != IGNORE)
            loss = self.loss_fn(self.module(ids, **inputs), target)
            loss.backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def eval_step(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mark_graph_step(input_ids.device)
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

    Compiled layers run eagerly here: forward-only calls would compile every layer again for no_grad and
    record its CUDA graphs once more, as the first training steps do (~60 s for the benchmark job on an
    H200), for a validation that takes seconds eagerly.
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
        with torch.compiler.set_stance("force_eager"):
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


def evaluate_validation(
    runner: PipelineRunner | SingleRunner,
    module: torch.nn.Module,
    validation: tuple[torch.Tensor, torch.Tensor],
    batch_size: int,
    loss_fn: TokenLoss,
    device: torch.device,
    replicas: int = 1,
) -> float:
    """Validation loss, computed on the last stage and shared with every rank (one all-reduce).

    Each of the `replicas` (dp x tp) ranks holding the last stage computes it over the whole split."""
    loss = validation_loss(runner, module, *validation, batch_size, loss_fn)
    value = loss if loss is not None else torch.zeros((), device=device)
    if dist.is_initialized():
        dist.all_reduce(value)
    return float(value) / replicas
