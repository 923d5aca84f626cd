"""`pipetune export`: a directory that plain transformers + PEFT (and vLLM) load (export.py writes it)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export", help="a directory that plain transformers + PEFT (and vLLM) load: base, tokenizer, adapter, card"
    )
    export.add_argument("--run", required=True, help="run directory (its config.toml, adapter/ and prompt.json)")
    export.add_argument("--out", required=True, help="directory to write (new or empty, outside the run directory)")
    export.add_argument("--merge", action="store_true", help="also write the model with the adapter merged in")


def run(args: argparse.Namespace) -> int:
    """Write the export directory and say how to load it."""
    from pipetune.export import export_run

    path = export_run(Path(args.run), Path(args.out), args.merge)
    print(f"export -> {path}  (README.md there shows how to load it with transformers + PEFT, and with vLLM)")
    return 0
