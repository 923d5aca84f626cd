"""The options several commands share, declared once: each command's add_parser calls the ones it takes."""

from __future__ import annotations

import argparse

CONFIG_HELP = "TOML config file or shipped config name"


def add_config_options(
    parser: argparse.ArgumentParser, required: bool = True, help_text: str = CONFIG_HELP, overrides: bool = True
) -> None:
    """`--config` (a TOML file or a shipped config's name) and, with `overrides`, `--set SECTION.KEY=VALUE`
    (repeatable; main() turns a `--set` without its `=` into one error line)."""
    parser.add_argument("--config", required=required, default=None, help=help_text)
    if overrides:
        parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")


def add_quiet(parser: argparse.ArgumentParser, help_text: str = "no progress bar or per-step lines") -> None:
    parser.add_argument("--quiet", action="store_true", help=help_text)


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="run the base model's own code (never taken from a config)"
    )
