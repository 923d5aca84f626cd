"""The 3-D process layout: pp pipeline stages (outer) x dp data-parallel replicas x tp tensor shards (inner).
The gradients over it (summed over the replicas, clipped by their global norm) are parallel/gradients.py's.

Rank = (pp_rank * dp + dp_rank) * tp + tp_rank: the tp ranks of one stage replica are neighbours (one node,
where the all-reduces of every layer stay on the fastest links), then the dp replicas of one stage, and the
stages of one pipeline replica are dp x tp ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    tp: int = 1
    tp_rank: int = 0
    tp_mesh: DeviceMesh | None = None
    """The tensor-parallel shards of this rank's stage replica as a 1-D DeviceMesh (None when tp = 1)."""

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The replicas of this rank's stage as a process group (None when dp = 1)."""
        return self.dp_mesh.get_group() if self.dp_mesh is not None else None

    @property
    def replica_rank(self) -> int:
        """This rank's place in the pp x dp grid: the ranks of one tp group share it (and their random stream)."""
        return self.pp_rank * self.dp + self.dp_rank


def build_mesh(env: DistEnv, pp: int, dp: int, tp: int = 1) -> Mesh:
    if not env.distributed:
        return Mesh(pp, dp, 0, 0, None, None, tp)
    if dp == 1 and tp == 1:  # a plain pipeline: the world is the pipeline, no sub-groups needed
        return Mesh(pp, dp, env.rank, 0, None, None)
    mesh = init_device_mesh(env.device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    return Mesh(
        pp,
        dp,
        mesh.get_local_rank("pp"),
        mesh.get_local_rank("dp"),
        mesh.get_group("pp"),
        mesh["dp"] if dp > 1 else None,
        tp,
        mesh.get_local_rank("tp"),
        mesh["tp"] if tp > 1 else None,
    )
