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
    export.add_argument(
        "--gguf",
        nargs="?",
        const="f16",
        default=None,
        metavar="TYPE",
        help="also write the merged model as one GGUF file for llama.cpp / Ollama, with a Modelfile: f32, f16 "
        "(default), bf16 or q8_0",
    )


def run(args: argparse.Namespace) -> int:
    """Write the export directory and say how to load it."""
    from pipetune.export import export_run

    path = export_run(Path(args.run), Path(args.out), args.merge, args.gguf)
    print(f"export -> {path}  (README.md there shows how to load it with transformers + PEFT, and with vLLM)")
    if args.gguf:
        print(f"Ollama: cd {path} && ollama create summarizer -f Modelfile && ollama run summarizer < meeting.txt")
    return 0
