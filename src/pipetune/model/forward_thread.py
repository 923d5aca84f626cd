"""The thread that runs the documents kernel's forwards on a GPU, so that cuDNN's forward plans are built there
while the model loads and compiles, off the first step's path.

Torch keeps cuDNN's attention plans per thread (aten/src/ATen/native/cudnn/MHA.cpp), and the thread that runs
the steps is busy from the data to the first step: it loads the model, builds the optimizer, then traces and
compiles the layer groups. Built there, at the first `document_sdpa` (model/attention.py), the forward's plans for
whole meetings' 68 lengths took 2.7-4.6 s of a warm first step of 43-45 s on one H100, after the first group's
compile and before the others' (2026-12-07-plan-lengths-and-an-eighth-machine-one-h100.md). A `ForwardThread`
builds them as soon as the lengths are known, then runs every forward call of the kernel: the caller hands it the
call and waits for its result, which the thread computes on the caller's CUDA stream, without autograd (as a
custom operator's implementation runs), so the kernels are queued exactly as the caller would queue them. On a
slow host's H100 the first step's part past the compile went from 17.0-19.5 s to 13.2-14.3 s, real tokens/s
-0.12% (pairs within +-0.4%: noise), 576 handoffs a step (2026-12-07-forward-thread-and-a-ninth-machine-one-h100.md).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class ForwardThread:
    """One thread for one device (a single-worker executor) that runs the calls handed to it (`run`, `submit`) in
    order, each on its caller's current CUDA stream, without autograd."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.thread: threading.Thread | None = None  # the executor's worker, once started
        self.executor = ThreadPoolExecutor(1, "pipetune-attention-forwards", initializer=self._started)

    def _started(self) -> None:
        self.thread = threading.current_thread()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is the thread's own

    def submit(self, fn: Callable, *args: Any) -> Future:
        """Queue `fn(*args)`, to run on the caller's current CUDA stream; its future, not waited for."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        return self.executor.submit(_on_stream, stream, fn, *args)

    def run(self, fn: Callable, *args: Any) -> Any:
        """`fn(*args)` run in this thread (in place where called from it), as `submit` queues it; its result, or its
        exception raised here."""
        if threading.current_thread() is self.thread:
            return fn(*args)
        return self.submit(fn, *args).result()

    def close(self) -> None:
        """End the thread once the calls queued before are done."""
        self.executor.shutdown()


def _on_stream(stream: torch.cuda.Stream | None, fn: Callable, *args: Any) -> Any:
    """`fn(*args)` without autograd (as a custom operator's implementation runs), on `stream` (None: as it is)."""
    with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        return fn(*args)


_THREADS: dict[torch.device, ForwardThread] = {}
"""The started thread of each device (`start_forward_thread`)."""


def start_forward_thread(device: torch.device) -> ForwardThread:
    """The device's `ForwardThread`, started here if it has none."""
    if device not in _THREADS:
        _THREADS[device] = ForwardThread(device)
    return _THREADS[device]


def forward_thread(device: torch.device) -> ForwardThread | None:
    """The device's started `ForwardThread`, or None: the caller's thread runs the forward itself."""
    return _THREADS.get(device)


def stop_forward_thread(device: torch.device) -> None:
    """End and forget the device's thread, if started: later forwards run in the caller's thread."""
    if (started := _THREADS.pop(device, None)) is not None:
        started.close()
