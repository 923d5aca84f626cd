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
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

from pipetune import cli, launch, train
from pipetune.checkpoint import checkpoint_dir
from pipetune.config import load_config
from pipetune.parallel.process_group import restart_count


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


if __name__ == "__main__":
    train.HOOKS = FaultInjection()
    launch.WORKER_MODULE = "tests.faults"
    cli.run()
