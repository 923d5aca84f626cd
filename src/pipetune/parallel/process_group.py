"""Process-group setup: one process per stage, NCCL when every local rank has a GPU, else gloo."""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from pipetune.parallel.torch_compat import attempt_store


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def restart_count() -> int:
    """How many times the launcher restarted this worker group (torch's elastic agent counts; 0: the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def under_launcher() -> bool:
    """True inside torchrun / the elastic launcher (it sets WORLD_SIZE and RANK)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_distributed(timeout_s: float = 600.0, p2p_channels: int = 0) -> DistEnv:
    """Join the process group set up by the launcher (or run alone without one).

    `p2p_channels` > 0 caps NCCL's channels for point-to-point transfers (parallel.p2p_channels); NCCL reads
    it when it creates a communicator, so it is set before any."""
    if p2p_channels > 0:
        os.environ["NCCL_MAX_P2P_NCHANNELS"] = str(p2p_channels)
    if not under_launcher() or int(os.environ["WORLD_SIZE"]) == 1:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return DistEnv(0, 1, 0, device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    if use_gpu:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend="nccl" if use_gpu else "gloo",
        timeout=timedelta(seconds=timeout_s),
        device_id=device if use_gpu else None,
        store=attempt_store(rank, world, timeout_s, restart_count()),
        rank=rank,
        world_size=world,
    )
    return DistEnv(rank, world, local_rank, device)


def close_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_skipping_teardown(code: int = 0) -> NoReturn:
    """End this process at once with `code`, its output flushed, without the interpreter's shutdown.

    - Every finished command and worker (exit_finished): the shutdown frees every module imported, ~1.2 s on a
      2-core CPU once torch, transformers and PEFT are in, and each file pipetune writes is closed by then.
    - It also keeps a finished worker clear of gloo's worker threads. FSDP keeps its process groups alive after
      destroy_process_group (seen with torch 2.13), and a tensor-parallel collective can still be releasing
      its tensors at the end. A gloo thread that does so during the shutdown needs the GIL, cannot take it,
      and aborts the process ("terminate called without an active exception": ~1 run in 15 of FSDP on CPU).
    - A stopped or failed worker ends this way too: its process group's teardown could wait on a peer that
      waits on it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_finished(code: int = 0) -> NoReturn:
    """End a process whose work is done (a command, a worker, a calibration rank): its exit handlers first
    (loggers, temporary directories, inductor's compile workers, child processes), then exit_skipping_teardown.
    A stopped or failed worker skips the handlers too (exit_skipping_teardown alone)."""
    atexit._run_exitfuncs()
    exit_skipping_teardown(code)
