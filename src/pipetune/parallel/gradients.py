"""The LoRA gradients over the process layout (parallel/mesh.py): summed over the dp replicas (overlapped with the
backward where the replicas hold whole models), then clipped by their global norm with one all-reduce that also
carries every rank's non-finite flag.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from pipetune.model.stage import local_part

BUCKET_BYTES = 25 * 2**20
"""At most about how many bytes of gradients one overlapped all-reduce carries (DDP's default bucket size)..."""
MIN_BUCKETS = 4
"""... and at least how many buckets the gradients make, so that a small model's all-reduce overlaps too."""


class GradientSync:
    """The LoRA gradients summed over the dp replicas, once per optimizer step (the loss is already normalized by
    the step's global supervised-token count, so the sum is the gradient of the global mean). Tensor-parallel
    gradients (DTensors over the tp mesh) are reduced as the local shards they are.

    Whole-model replicas (`overlap`: pp = 1, no tp, not sharded) overlap it with the backward: the parameters in
    buckets (BUCKET_BYTES, MIN_BUCKETS) in the order the backward finishes them (the last layer's first); a hook after
    each accumulation into a parameter's gradient counts them, and when every parameter of a bucket has had the
    step's last one (`accumulations`: its backwards per step), the bucket's gradients are copied into one flat
    tensor whose all-reduce starts at once. Buckets start in bucket order, the same on every rank. `finish()`
    waits for them, copies the sums back, and all-reduces whatever no hook started (every gradient, without
    `overlap`) in one flat tensor."""

    def __init__(
        self, params: list[torch.Tensor], group: dist.ProcessGroup | None, accumulations: int, overlap: bool
    ) -> None:
        self.group, self.accumulations = group, accumulations
        self.params = params
        self.buckets: list[list[torch.Tensor]] = []
        self._bucket_of: list[int] = []  # by the parameter's place in reversed(params)
        self._hooks = []  # kept for as long as the run
        if group is not None and overlap:
            limit = min(BUCKET_BYTES, sum(param.numel() * param.element_size() for param in params) / MIN_BUCKETS)
            size = limit
            for param in reversed(params):
                if size > 0 and size + param.numel() * param.element_size() > limit:
                    self.buckets.append([])
                    size = 0
                self.buckets[-1].append(param)
                hook = functools.partial(self._accumulated, len(self._bucket_of))
                self._hooks.append(param.register_post_accumulate_grad_hook(hook))
                self._bucket_of.append(len(self.buckets) - 1)
                size += param.numel() * param.element_size()
        self._reset()

    def _reset(self) -> None:
        self._counts = [0] * len(self._bucket_of)
        self._missing = [len(bucket) for bucket in self.buckets]  # parameters short of their last accumulation
        self._started: list[tuple[torch.Tensor, dist.Work]] = []

    def _accumulated(self, index: int, _: torch.Tensor) -> None:
        self._counts[index] += 1
        if self._counts[index] == self.accumulations:
            self._missing[self._bucket_of[index]] -= 1
            while len(self._started) < len(self.buckets) and self._missing[len(self._started)] == 0:
                flat = flatten_gradients(self.buckets[len(self._started)])
                self._started.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        """The step's gradients summed over the replicas (every rank calls it once per optimizer step)."""
        if self.group is None:
            return
        over = sum(count > self.accumulations for count in self._counts)
        if over:
            raise RuntimeError(
                f"{over} LoRA gradients were accumulated more than {self.accumulations} times in one step: their "
                "overlapped all-reduce started before their last backward"
            )
        for bucket, (flat, work) in zip(self.buckets, self._started, strict=False):
            work.wait()
            unflatten_gradients(flat, bucket)
        rest = [p for bucket in self.buckets[len(self._started) :] for p in bucket] if self.buckets else self.params
        if any(param.grad is not None for param in rest):
            flat = flatten_gradients(rest)
            dist.all_reduce(flat, group=self.group)
            unflatten_gradients(flat, rest)
        self._reset()


def flatten_gradients(params: list[torch.Tensor]) -> torch.Tensor:
    """The (local parts of the) gradients of `params` that exist, in one new flat tensor."""
    return torch.cat([local_part(param.grad).flatten() for param in params if param.grad is not None])


def unflatten_gradients(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Copy `flat` (flatten_gradients' layout) back into the gradients of `params`."""
    offset = 0
    for param in params:
        if param.grad is not None:
            grad = local_part(param.grad)
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def clip_global_grad_norm(
    params: list[torch.Tensor],
    max_norm: float,
    device: torch.device,
    loss: torch.Tensor | None = None,
    stage_ranks: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm of all stages' gradients together, and one flag per rank (1: it saw a non-finite loss or
    gradient norm), both on the device: nothing here waits for it (`bad_ranks` reads the flags).

    One all-reduce over the world carries the squared norms and the flags. Each of a stage's `stage_ranks`
    (dp x tp) ranks adds its gradients' squares divided by the number of ranks holding the same values: all of
    them for a plain (replicated) gradient, fewer for a DTensor split over some of them (by tp: the dp replicas;
    by FSDP over dp: one), so every value counts once. Clips by the norm when no rank's flag is set, scaling each
    rank's own tensors (shards included); otherwise leaves the gradients as they are.
    """
    grads = [param.grad for param in params if param.grad is not None]
    by_copies: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        by_copies.setdefault(stage_ranks // shard_count(grad), []).append(local_part(grad))
    squared = torch.zeros((), device=device)
    for copies, tensors in sorted(by_copies.items()):
        squared = squared + torch.nn.utils.get_total_norm(tensors, 2.0).float().pow(2) / copies
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    finite = torch.isfinite(squared)
    if loss is not None:
        finite &= torch.isfinite(loss)
    packed = torch.zeros(1 + world, device=device)
    packed[0] = squared
    packed[1 + rank] = (~finite).float()
    if dist.is_initialized():
        dist.all_reduce(packed)
    flags = packed[1:]
    total = packed[0].sqrt()
    if max_norm > 0 and grads:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_([local_part(grad) for grad in grads], torch.where(flags.any(), 1.0, scale))
    return total, flags


def bad_ranks(flags: torch.Tensor) -> list[int]:
    """The ranks whose flag (clip_global_grad_norm's) is set (a host sync for flags on the device)."""
    return [rank for rank, flag in enumerate(flags.tolist()) if flag > 0]


def shard_count(tensor: torch.Tensor) -> int:
    """Into how many disjoint parts a DTensor is split over its mesh (1 for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return 1
    # Not `is_shard()`: FSDP over tensor-parallel shards places them as a _StridedShard, which is not a Shard.
    return math.prod(tensor.device_mesh.size(i) for i, p in enumerate(tensor.placements) if not p.is_replicate())
