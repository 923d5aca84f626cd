"""FSDP2 over the dp replicas (parallel.dp_shard, strategy "fsdp"): frozen base weights stored 1/dp per replica.

`fully_shard` wraps each decoder layer, then each StageModule (its root: embedding, norm, lm_head), on
the dp sub-mesh. Forward and backward all-gather one layer's weights at a time; the LoRA gradients are
reduce-scattered, so each replica holds, clips and updates its shard of them (DTensor parameters).
Inside a pipeline, torch's PipelineStage defers the reduce-scatter to the end of each schedule step.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from pipetune.model.stage import StageModule


def shard_stages(modules: list[StageModule], dp_mesh: DeviceMesh, pipelined: bool) -> None:
    """Shard this rank's stages over `dp_mesh` in place; build optimizers and pipeline stages afterwards.

    `pipelined`: keep the gathered weights between a schedule step's microbatches (torch's PipelineStage
    reshards once, after the step's last backward) instead of gathering them again for each one.
    """
    for module in modules:
        for layer in module.layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=not pipelined)
        # The root (embedding, norm, lm_head) stays gathered from its forward to its backward, as torch's
        # default does for a root: the loss may apply lm_head after the forward (train.fused_loss).
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
    for module in modules:
        for part in module.modules():
            if isinstance(part, FSDPModule):
                # The loss is already divided by the step's global supervised-token count: the replicas'
                # gradients must be summed, not averaged (FSDP's default divides by dp).
                part.set_gradient_divide_factor(1.0)
                # A plain SUM rather than PREMUL_SUM(1.0), which gloo lacks (and NCCL's SUM is zero-copy).
                part.set_force_sum_reduction_for_comms(True)
