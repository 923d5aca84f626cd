"""`pipetune config show` (the resolved config as TOML with each key's docstring) and `config list`."""

from __future__ import annotations

import argparse

from pipetune.cli.options import add_config_options
from pipetune.config import load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    config_parser = subparsers.add_parser(
        "config", help="the resolved config with its documentation; the shipped configs"
    )
    config_commands = config_parser.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config_commands.add_parser("show", help="the resolved config as TOML, each key with its docstring")
    add_config_options(show, required=False, help_text="TOML config file or shipped config name (default: defaults)")
    config_commands.add_parser("list", help="the configs shipped with pipetune (use them by name with --config)")


def run(args: argparse.Namespace) -> int:
    from pipetune.config_docs import annotated_toml, config_listing

    if args.config_command == "list":
        print(config_listing())
    else:
        print(annotated_toml(load_config(args.config, args.set, "pipetune config show")))
    return 0
