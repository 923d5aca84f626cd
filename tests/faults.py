"""The tests' entry: `python -m tests.faults ARGS` runs `pipetune ARGS` with fault injection installed, in the
local workers it starts too. Each fault is read from the environment and off unless set:

    PIPETUNE_TEST_KILL_AT_STEP=N[:saved]  the highest rank SIGKILLs itself right after optimizer step N, before
                                          that step's checkpoint (":saved": after it is committed); only in a
                                          worker group's first attempt, so a restarted group runs through
    PIPETUNE_TEST_NAN_AT=S:N[,N...]       stage S's gradients become NaN at steps N, ...
    PIPETUNE_TEST_HANG_AT=R:N             rank R stops responding before the gradient-norm all-reduce of step N
    PIPETUNE_TEST_DISK_FULL_AT=N          every rank writes step N's checkpoint to a full disk: its first file's
                                          temporary name (this process's) is a link to /dev/full
    PIPETUNE_TEST_TERM_AT=N               every rank sends itself SIGTERM right after optimizer step N

And two that are not faults: PIPETUNE_TEST_THEN=FILE[:FILE...] has each worker train these configs too, one after
another, once the command's own run is done: several runs of one world size for one start of the workers
(tests/conftest.py: train_in_turn). A FILE beside which FILE + COPIES_SUFFIX lists [source, destination] pairs
(JSON) has them copied first, once every rank is done with the runs before it: a checkpoint to resume from.
PIPETUNE_TEST_RESIDENT_GB=X has every rank's CPU memory plan read the process's resident memory as X GB, so that a
test's train.memory_gb decides a plan whatever else the worker holds (earlier runs of its start, the libraries).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from pipetune import cli, launch, train
from pipetune.checkpoint import checkpoint_dir
from pipetune.config import load_config
from pipetune.parallel.process_group import exit_finished, restart_count, under_launcher
from pipetune.run_lock import TOKEN_ENV

THEN_ENV = "PIPETUNE_TEST_THEN"
RESIDENT_ENV = "PIPETUNE_TEST_RESIDENT_GB"
COPIES_SUFFIX = ".copies.json"


class FaultInjection(train.TrainHooks):
    """The faults the environment asks for, at the loop's hooks."""

    def start(self, rank: int, world_size: int) -> None:
        self.kill_at: tuple[int, bool] | None = None
        kill = os.environ.get("PIPETUNE_TEST_KILL_AT_STEP", "")
        if kill and rank == world_size - 1 and restart_count() == 0:
            step, _, when = kill.partition(":")
            self.kill_at = (int(step), when == "saved")
        self.nan_at: set[int] = set()
        stage, _, steps = os.environ.get("PIPETUNE_TEST_NAN_AT", "").partition(":")
        if stage and int(stage) == rank:
            self.nan_at = {int(s) for s in steps.split(",")}
        self.hang_at: int | None = None
        hang_rank, _, hang_step = os.environ.get("PIPETUNE_TEST_HANG_AT", "").partition(":")
        if hang_rank and int(hang_rank) == rank:
            self.hang_at = int(hang_step)
        self.term_at = int(os.environ.get("PIPETUNE_TEST_TERM_AT", "0")) or None
        full_at = os.environ.get("PIPETUNE_TEST_DISK_FULL_AT", "")
        if full_at:
            run_dir = Path(load_config(sys.argv[sys.argv.index("--config") + 1]).output.dir)
            path = checkpoint_dir(run_dir, int(full_at))
            path.mkdir(parents=True, exist_ok=True)
            (path / f".adapter.rank{rank}.safetensors.{os.getpid()}.tmp").symlink_to("/dev/full")

    def before_grad_norm(self, step: int, params: list[torch.Tensor]) -> None:
        if step in self.nan_at:
            params[0].grad = torch.full_like(params[0], float("nan"))
        if step == self.hang_at:
            time.sleep(3600)  # the peers' timeout ends the run; the launcher then ends this process

    def after_step(self, step: int, saved: bool) -> None:
        if self.kill_at == (step, saved):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.term_at and not saved:
            os.kill(os.getpid(), signal.SIGTERM)


def train_in_turn(config_files: list[str]) -> None:
    """A worker: the command's run, then a run of each config file in turn, as `pipetune train --config FILE
    --quiet` would run it in a worker, in this process and its process group (joined once, left at the end)."""
    joined = []
    join, leave = launch.init_distributed, launch.close_distributed

    def join_once(*args: object):
        if not joined:
            joined.append(join(*args))
        return joined[0]

    launch.init_distributed, launch.close_distributed = join_once, lambda: None
    code = cli.main()
    os.environ.pop(TOKEN_ENV, None)  # the launcher locked the first run's output.dir only: rank 0 locks the others
    for config_file in config_files:
        if code != 0:
            break
        if os.environ.get("RANK") == "0":  # which run a failure below belongs to
            print(f"tests.faults: next: pipetune train --config {config_file} --quiet", flush=True)
        _copy_before(config_file)
        code = cli.main(["train", "--config", config_file, "--quiet"])
    leave()
    exit_finished(code)


def _copy_before(config_file: str) -> None:
    """Copy what config_file + COPIES_SUFFIX lists (rank 0), between barriers: after every rank has ended the
    runs before, and before any starts this one."""
    copies = Path(config_file + COPIES_SUFFIX)
    if not copies.exists():
        return
    torch.distributed.barrier()
    if os.environ.get("RANK") == "0":
        for source, destination in json.loads(copies.read_text()):
            Path(destination).parent.mkdir(parents=True, exist_ok=True)
            if Path(source).is_dir():
                shutil.copytree(source, destination)
            else:
                shutil.copy(source, destination)
    torch.distributed.barrier()


if __name__ == "__main__":
    train.HOOKS = FaultInjection()
    if resident := os.environ.get(RESIDENT_ENV):
        from pipetune.parallel import memory

        memory.resident_bytes = lambda: float(resident) * 1e9
    launch.WORKER_MODULE = "tests.faults"
    then = os.environ.get(THEN_ENV)
    if then and under_launcher():
        train_in_turn(then.split(os.pathsep))
    cli.run()
