"""Checkpointed layer inputs kept in host memory (`train.activation_checkpointing = "offload"`).

A checkpointed layer (torch.utils.checkpoint, non-reentrant) keeps only its input for backward, saved through
autograd's saved-tensor hooks by the checkpoint's own input saver; inside the layer the checkpoint's hooks win,
so hooks set around the checkpoint call see exactly that input. Here they copy it to pinned host memory on a
side CUDA stream (the GPU copy is freed once the copy is done: `record_stream`), and in backward copy it back
on that stream, one layer ahead: unpacking layer i's input starts the copy of layer i - 1's, so the transfer
hides behind layer i's recompute and backward. What a layer computes is untouched: same values, same RNG.

On a CPU the "host copy" is a plain copy (the same code path, so tests run it); streams, events and pinned
memory are CUDA's only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass
class _Offloaded:
    """One saved tensor while it is away: its host copy, and its device copy once fetched back."""

    host: torch.Tensor
    device: torch.device
    previous: _Offloaded | None
    """The input saved just before this one in the same forward: the next one backward unpacks."""
    fetched: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None


class ActivationOffload:
    """Saved-tensor hooks that move checkpointed layer inputs to host memory and back, one per stage module.

    `layers`: how many of the stage's layers (the first ones, all checkpointed) offload their input."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._last: _Offloaded | None = None
        self._stream: torch.cuda.Stream | None = None
        self.host_bytes = 0
        """Bytes copied to the host so far (for tests and reports)."""

    def saving(self, index: int) -> contextlib.AbstractContextManager:
        """Hooks for the checkpoint call of layer `index`; layer 0 starts a new forward's chain."""
        if index == 0:
            self.start()
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def start(self) -> None:
        """A new forward begins: its first saved tensor is the last backward unpacks (no one to fetch after it)."""
        self._last = None

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | _Offloaded:
        if tensor.numel() == 0 or isinstance(tensor, torch.nn.Parameter) or type(tensor) is not torch.Tensor:
            return tensor  # the checkpoint's empty marker, weights, tensor subclasses: left as they are
        if tensor.device.type == "cuda":
            compute = torch.cuda.current_stream(tensor.device)
            stream = self._copy_stream(tensor.device)
            stream.wait_stream(compute)  # the input is written before it is copied
            with torch.cuda.stream(stream):
                host = torch.empty_like(tensor, device="cpu", pin_memory=True)  # same strides: one plain copy
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its memory is reused only after the copy
        else:
            host = tensor.detach().clone()
        self.host_bytes += host.numel() * host.element_size()
        self._last = _Offloaded(host, tensor.device, self._last)
        return self._last

    def unpack(self, saved: torch.Tensor | _Offloaded) -> torch.Tensor:
        if not isinstance(saved, _Offloaded):
            return saved
        if saved is self._last:  # backward began with the newest forward's last input: the chain's hold ends
            self._last = None
        if saved.fetched is None:
            self._fetch(saved)
        tensor, ready = saved.fetched, saved.ready
        saved.fetched = saved.ready = None  # the caller holds it now: freed after this layer's backward
        if ready is not None:
            torch.cuda.current_stream(saved.device).wait_event(ready)
        if saved.previous is not None and saved.previous.fetched is None:
            self._fetch(saved.previous)  # prefetch: the layer before this one is backward's next
        saved.previous = None
        return tensor

    def _fetch(self, saved: _Offloaded) -> None:
        if saved.device.type != "cuda":
            saved.fetched = saved.host.to(saved.device, copy=True)
            return
        compute = torch.cuda.current_stream(saved.device)
        # Allocated on the compute stream, which waits for `ready` before any use: no record_stream needed.
        saved.fetched = torch.empty_like(saved.host, device=saved.device)
        stream = self._copy_stream(saved.device)
        stream.wait_stream(compute)
        with torch.cuda.stream(stream):
            saved.fetched.copy_(saved.host, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(stream)


def offloading(offload: ActivationOffload | None, index: int) -> contextlib.AbstractContextManager:
    """The hooks for layer `index`'s checkpoint call when it offloads its input; nothing otherwise."""
    if offload is None or index >= offload.layers:
        return contextlib.nullcontext()
    return offload.saving(index)
