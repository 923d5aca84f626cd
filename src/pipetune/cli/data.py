"""`pipetune data inspect`: what a config's data looks like to the model, before training."""

from __future__ import annotations

import argparse

from pipetune.cli.options import add_config_options
from pipetune.config import Config, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser("data", help="look at a config's data before training")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    inspect = data_commands.add_parser("inspect", help="rows, skipped rows, token lengths, truncation, pad waste")
    add_config_options(inspect)
    inspect.add_argument("--json", action="store_true", help="write the report as JSON to stdout")


def run(args: argparse.Namespace) -> int:
    return run_data_inspect(load_config(args.config, args.set, "pipetune data inspect"), args.json)


def run_data_inspect(config: Config, as_json: bool = False) -> int:
    """Print what the config's data looks like to the model: rows, skipped rows, lengths, truncation, padding."""
    from pipetune.data.inspect import format_report, inspect_data
    from pipetune.preflight import check_data_source, check_layout, prepare

    check_data_source(config.data)  # a missing file fails before the model and tokenizer are resolved
    check_layout(config, config.parallel.world_size)
    report = inspect_data(config, prepare(config).prompts)
    print(report.to_json() if as_json else format_report(report))
    return 0
