"""`pipetune report`: charts and an HTML page comparing one or more runs (report.py builds them)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    report = subparsers.add_parser("report", help="charts and an HTML page comparing one or more runs")
    report.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (metrics.csv, config.toml, ...)")
    report.add_argument("--out", default=None, help="output directory (default: <first run>/report)")


def run(args: argparse.Namespace) -> int:
    """PNG charts and index.html for the given runs."""
    from pipetune.report import build_report

    index = build_report(args.runs, args.out)
    print(f"report -> {index}")
    return 0
