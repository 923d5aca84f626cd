"""Host tensors a step builds (the loss's positions and targets, the last layer's chosen rows) onto the GPU through
pinned memory, as the step's ids and positions go (train.py).

CUDA documents a copy from pinned memory as asynchronous; from pageable memory the runtime stages it and "may
synchronize with the stream". Measured on an H100 (torch 2.11, driver 580) behind 100 ms of queued work, neither
waited for the queue, but the pageable copy cost the host more: 1.0 ms for 4 KB against 0.12 pinned, 0.63 ms for
2 MB against 0.18 (benchmarks/journal/2026-12-07-loss-rows-in-few-shapes-one-h100.md). torch's caching host allocator
keeps a pinned block until its copy is done.
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
