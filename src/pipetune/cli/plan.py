"""`pipetune plan`: every layout's predicted memory and speed on N GPUs, and the fastest that fits (planner/)."""

from __future__ import annotations

import argparse
import math

from pipetune.cli.options import add_config_options
from pipetune.config import ConfigError, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan", help="predicted memory and speed of every layout on N GPUs, and the fastest that fits"
    )
    add_config_options(plan)
    plan.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs to spread over (default: this machine's, else the config's processes)",
    )
    plan.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GB",
        help="memory per GPU (default: train.memory_gb, else this machine's GPU, else an H200's 151 GB)",
    )
    plan.add_argument(
        "--host-memory",
        type=float,
        default=None,
        metavar="GB",
        help="host memory of the machine that trains, which offloaded layer inputs fill (default: this machine's)",
    )
    plan.add_argument(
        "--calibrate", action="store_true", help="time a layer and a transfer on this machine's GPUs first"
    )
    plan.add_argument("--all", action="store_true", help="list every layout (default: the 15 fastest that fit, ...)")


def run(args: argparse.Namespace) -> int:
    """Print the plan: every layout's predicted peak memory per rank and tokens/s, ranked, and the pick."""
    if args.gpu_memory is not None and not 0 < args.gpu_memory < math.inf:
        raise ConfigError(f"--gpu-memory {args.gpu_memory} must be a positive, finite number (GB per GPU, e.g. 141)")
    if args.host_memory is not None and not 0 <= args.host_memory < math.inf:
        raise ConfigError(
            f"--host-memory {args.host_memory} must be a finite number of GB, 0 or more (the machine's, e.g. 2048)"
        )
    from pipetune.parallel.memory import GB
    from pipetune.planner.plan import attention_share, available_gpus, format_plan, make_plan, no_gpu_line

    config = load_config(args.config, args.set, "pipetune plan")
    gpus = args.gpus if args.gpus is not None else available_gpus(config)
    if gpus < 1:
        raise ConfigError(f"--gpus {gpus} must be at least 1")
    budget = args.gpu_memory * GB if args.gpu_memory is not None else None
    rates = None
    if args.calibrate:
        from pipetune.planner.calibrate import calibrate

        rates = calibrate(config, gpus, budget)
    host = args.host_memory * GB if args.host_memory is not None else None
    plan = make_plan(config, gpus, budget, rates, attention_share=attention_share(config), host_memory=host)
    print(format_plan(plan, top=None if args.all else 15))
    note = no_gpu_line(config, plan)
    if note:
        print(note)
    return 0 if plan.pick is not None else 1
