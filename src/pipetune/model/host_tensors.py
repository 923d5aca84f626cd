"""Host tensors a step builds (the loss's positions and targets, the last layer's chosen rows) onto the GPU without
draining its queue.

A copy from pageable host memory may wait for the work already queued on the stream before it starts (CUDA's
runtime stages it through pinned memory and "may synchronize with the stream": its API synchronization notes), and
a step that waits there leaves the GPU idle while the host queues what follows. From pinned memory the copy is
queued like a kernel; torch's caching host allocator keeps the pinned block until the copy is done.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a host tensor bound for a GPU goes through pinned memory, without waiting."""
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
