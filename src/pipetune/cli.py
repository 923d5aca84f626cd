"""Command line: `pipetune demo` and `pipetune train`, and the local multi-process launcher.

Outside torchrun, `train --nproc N` (N > 1) starts N local workers through torch's elastic
launcher; under torchrun (WORLD_SIZE set) it just runs. Multi-node runs use torchrun's c10d
rendezvous directly.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from importlib import resources
from pathlib import Path

from pipetune.config import Config, ConfigError, load_config, save_config
from pipetune.parallel.process_group import under_launcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipetune", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="fine-tune the built-in tiny Qwen3 on synthetic meetings (CPU ok)")
    demo.add_argument("--out", default="runs/demo", help="run directory (default: runs/demo)")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo config's)")
    demo.add_argument("--nproc", type=int, default=2, help="pipeline stages / processes (default: 2)")

    train = commands.add_parser("train", help="fine-tune with the settings of a TOML config")
    train.add_argument("--config", required=True, help="TOML config file")
    train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    train.add_argument("--nproc", type=int, default=None, help="local processes (default: parallel.pp x dp)")
    train.add_argument("--quiet", action="store_true", help="no progress bar or per-step lines")

    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            return run_demo(Path(args.out), args.steps, args.nproc)
        return run_train(load_config(args.config, args.set), args.nproc, args.quiet)
    except ConfigError as e:
        print(f"pipetune: error: {e}", file=sys.stderr)
        return 2


def demo_config() -> Config:
    """The embedded default: tiny Qwen3, synthetic meetings, 2 pipeline stages."""
    with resources.as_file(resources.files("pipetune") / "configs" / "demo.toml") as path:
        return load_config(path)


def run_train(config: Config, nproc: int | None = None, quiet: bool = False) -> int:
    """Validate, then train here (under torchrun, or one process) or start nproc local workers."""
    from pipetune.preflight import preflight
    from pipetune.train import run_training

    if under_launcher():
        run_training(config, quiet)
        return 0
    world_size = nproc or config.parallel.pp * config.parallel.dp
    preflight(config, world_size)  # fail here, once, before any process starts
    if world_size == 1:
        run_training(config, quiet)
        return 0
    return launch_local(config, world_size, quiet)


def launch_local(config: Config, nproc: int, quiet: bool = False, max_restarts: int = 0) -> int:
    """Start nproc workers on this machine through torch's elastic launcher (torchrun --standalone)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_dir = Path(config.output.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    save_config(config, config_path)
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.5,
    )
    argv = ["-m", "pipetune", "train", "--config", str(config_path)] + (["--quiet"] if quiet else [])
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        elastic_launch(launch, sys.executable)(*argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(
            f"pipetune: worker {rank} failed (exit code {failure.exitcode}); its output is above",
            file=sys.stderr,
        )
        return 1
    return 0


def run_demo(out: Path, steps: int | None, nproc: int) -> int:
    from pipetune.demo import show_results

    config = demo_config()
    config.output.dir = str(out)
    config.parallel.pp = nproc
    if steps is not None:
        config.train.max_steps = steps
    code = run_train(config, nproc)
    if code == 0:
        show_results(config)
    return code


if __name__ == "__main__":
    sys.exit(main())
