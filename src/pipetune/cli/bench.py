"""`pipetune bench`: strategies compared on the same model, data and batch (bench.py runs them)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pipetune.cli.options import add_config_options
from pipetune.config import ConfigError, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="compare strategies on the same model, data and batch")
    add_config_options(bench)
    bench.add_argument(
        "--strategies",
        default=None,
        help="comma-separated: pp, tp, ddp, fsdp, single (default: the one `pipetune train --config C` runs here: the "
        "config's strategy, on fewer GPUs than it names the layout that fits them; with \"auto\", the plan's pick)",
    )
    bench.add_argument("--steps", type=int, default=20, help="timed optimizer steps per strategy (default: 20)")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first, compilation included (default: 5)")
    bench.add_argument(
        "--rows",
        type=int,
        default=1,
        metavar="N",
        help="a metrics row every N steps, each waiting for the GPU (default: 1)",
    )
    bench.add_argument("--out", default="runs/bench", help="output directory (default: runs/bench)")
    bench.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="per-GPU dense bf16 peak for MFU (default: the GPU's datasheet figure, 989 for an H100 / H200 SXM)",
    )
    bench.add_argument(
        "--timeout",
        type=float,
        default=0,
        metavar="S",
        help="end a strategy that runs longer than S seconds, report it as timed out, go on (default: no limit)",
    )


def run(args: argparse.Namespace) -> int:
    from pipetune.bench import run_bench
    from pipetune.preflight import preflight

    if args.steps < 1 or args.warmup < 0:
        raise ConfigError(
            f"--steps {args.steps} must be >= 1 and --warmup {args.warmup} >= 0 (timed steps after the warm-up ones, "
            "e.g. --steps 10 --warmup 4)"
        )
    if args.rows < 1 or args.steps % args.rows or args.warmup % args.rows:
        raise ConfigError(
            f"--rows {args.rows} must be >= 1 and divide --steps {args.steps} and --warmup {args.warmup} "
            "(rows start after the warm-up), e.g. --rows 5 --steps 40 --warmup 5"
        )
    if not args.timeout >= 0:  # nan too
        raise ConfigError(f"--timeout {args.timeout} must be >= 0 seconds (0: no limit)")
    if args.peak_tflops is not None and not 0 < args.peak_tflops < math.inf:
        raise ConfigError(f"--peak-tflops {args.peak_tflops} must be a positive, finite TFLOP/s per GPU (e.g. 790)")
    import torch

    config = load_config(args.config, args.set, "pipetune bench")
    if config.parallel.strategy == "auto":
        from pipetune.planner.plan import available_gpus, resolve_auto

        config = resolve_auto(config, available_gpus(config))
    elif args.strategies is None and torch.cuda.is_available():  # what `pipetune train --config C` runs here
        from pipetune.planner.plan import fit_to_gpus, layout_asked

        config = fit_to_gpus(config, torch.cuda.device_count(), layout_asked(args.set))
    default = config.parallel.strategy
    strategies = [s.strip() for s in (args.strategies or default).split(",") if s.strip()]
    preflight(config, config.parallel.world_size)  # one clear error before any run starts
    results = run_bench(
        config, strategies, args.steps, args.warmup, Path(args.out), args.peak_tflops, args.timeout, args.rows
    )
    return 0 if all("error" not in r and "timed_out" not in r for r in results) else 1
