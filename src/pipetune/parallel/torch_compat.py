"""Where pipetune works around torch, each with the torch version that makes it removable.

pyproject.toml requires torch >= 2.11 (the GPU machines' version); the CPU machines run 2.13. When the
minimum rises past a version named here, its workaround goes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def schedule_step_options(step: Callable[..., Any]) -> dict[str, Any]:
    """Options for a pipeline schedule's `step`: torch >= 2.12 can skip merging the last stage's outputs (the
    full logits) after each step. Removable (always pass return_outputs=False) with torch >= 2.12."""
    return {"return_outputs": False} if "return_outputs" in inspect.signature(step).parameters else {}


def keep_rng_out_of_no_grad_forwards(module: torch.nn.Module, device: torch.device) -> None:
    """A forward under no_grad leaves the random streams as it found them. Removable with torch >= 2.12.

    torch < 2.12's PipelineStage infers shapes with one real no_grad forward at the first schedule
    step, whose LoRA dropout draws from the training stream: at step 1 of a fresh run but at the first
    step after a resume, so a resumed run would draw other masks. Training forwards run with grad.
    """
    saved: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def before(_module: torch.nn.Module, _args: tuple) -> None:
        if not torch.is_grad_enabled():
            cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
            saved.append((torch.get_rng_state(), cuda))

    def after(_module: torch.nn.Module, _args: tuple, _output: object) -> None:
        if saved:
            cpu, cuda = saved.pop()
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def stash_gradients(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Take the accumulated gradients off the parameters (see `restore_gradients`)."""
    saved = [param.grad for param in params]
    for param in params:
        param.grad = None
    return saved


def restore_gradients(params: list[torch.Tensor], saved: list[torch.Tensor | None]) -> None:
    """Add back gradients taken by `stash_gradients` to those computed since.

    Needed from torch 2.12 on, until PipelineStage stops doing this: it clears the .grad of FSDP parameters
    after it infers shapes, which it
    does at a stage's first schedule step and at the first after a forward-only (validation) one: with
    length buckets that can be a later schedule step of an optimizer step, whose earlier gradients
    would be lost.
    """
    for param, grad in zip(params, saved, strict=True):
        if grad is not None:
            param.grad = grad if param.grad is None else param.grad + grad


def attempt_store(rank: int, world: int, timeout_s: float, restart: int) -> dist.Store | None:
    """A key space of its own for attempt `restart` of a worker group (None: the first attempt uses env:// as is).

    torchrun shares its rendezvous store with the workers, and a restarted group would read the
    previous attempt's gloo addresses from it and hang or fail (pytorch/pytorch#135712). Removable once torch
    gives a restarted group a store of its own.
    """
    if restart == 0:
        return None
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)))
    return dist.PrefixStore(f"pipetune/attempt-{restart}", store)
