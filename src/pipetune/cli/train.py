"""`pipetune train`: a TOML config's run, through launch.py (local workers, torchrun, restarts)."""

from __future__ import annotations

import argparse

from pipetune.cli.options import add_config_options, add_quiet
from pipetune.config import load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="fine-tune with the settings of a TOML config")
    add_config_options(train)
    train.add_argument("--nproc", type=int, default=None, help="local processes (default: parallel.pp x dp x tp)")
    add_quiet(train)
    train.add_argument(
        "--resume", action="store_true", help="continue from the newest committed checkpoint in output.dir"
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart the workers up to K times after a failure; they resume from the newest checkpoint",
    )


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set, "pipetune train")
    if args.resume:
        from pipetune.checkpoint import require_run_to_resume

        require_run_to_resume(config.output.dir)  # --resume names a run; train.resume = "auto" may start one
        config.train.resume = "auto"
    from pipetune.launch import run_train
    from pipetune.planner.plan import layout_asked

    return run_train(config, args.nproc, args.quiet, args.max_restarts, layout_asked(args.set))
