"""The 2-D process layout: pp pipeline stages (outer) x dp data-parallel replicas (inner), on a DeviceMesh.

Rank = pp_rank * dp + dp_rank: the dp replicas of one stage are neighbours (on one node when the
node has dp GPUs or more), the stages of one pipeline replica are dp ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipetune.parallel.process_group import DistEnv


@dataclass
class Mesh:
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    pp_group: dist.ProcessGroup | None
    """The ranks of this rank's pipeline replica (None: the whole world, or no process group)."""
    dp_mesh: DeviceMesh | None
    """The replicas of this rank's stage as a 1-D DeviceMesh, what FSDP shards over (None when dp = 1)."""

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The replicas of this rank's stage as a process group (None when dp = 1)."""
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None


def build_mesh(env: DistEnv, pp: int, dp: int) -> Mesh:
    if not env.distributed:
        return Mesh(pp, dp, 0, 0, None, None)
    if dp == 1:  # a plain pipeline: the world is the pipeline, no sub-groups needed
        return Mesh(pp, dp, env.rank, 0, None, None)
    mesh = init_device_mesh(env.device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    return Mesh(pp, dp, mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), mesh.get_group("pp"), mesh["dp"])


def all_reduce_gradients(params: list[torch.Tensor], mesh: Mesh) -> None:
    """Sum the LoRA gradients over the dp replicas, in one flat buffer (the loss is already normalized by
    the step's global supervised-token count, so the sum is the gradient of the global mean)."""
    if mesh.dp_group is None:
        return
    grads = [param.grad for param in params if param.grad is not None]
    flat = torch.cat([grad.flatten() for grad in grads])
    dist.all_reduce(flat, group=mesh.dp_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
