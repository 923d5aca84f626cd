"""`pipetune summarize`: summaries of transcripts from base + adapter in this process, printed to stdout."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipetune.cli.options import add_config_options, add_quiet, add_trust_remote_code
from pipetune.config import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    summarize = subparsers.add_parser("summarize", help="summarize meeting transcripts with a fine-tuned adapter")
    summarize.add_argument(
        "input", nargs="?", default="-", metavar="FILE|-", help="a transcript (text), JSONL records, or - for stdin"
    )
    summarize.add_argument("--adapter", required=True, help="adapter directory (a run's adapter/)")
    summarize.add_argument("--base", default=None, help="base model (default: the adapter's base_model_name_or_path)")
    add_config_options(
        summarize,
        required=False,
        help_text="TOML config: dtype, seed, tokenizer, lengths (default: the config.toml beside the adapter, a run's "
        "or an export's)",
        overrides=False,
    )
    summarize.add_argument("--column", default=None, help="transcript field of JSONL records (data.transcript_column)")
    summarize.add_argument("--max-new-tokens", type=int, default=None, help="(default: data.max_summary_tokens)")
    summarize.add_argument("--batch-size", type=int, default=8, help="transcripts generated together (default: 8)")
    summarize.add_argument(
        "--max-batch-tokens",
        type=int,
        default=65_536,
        help="KV cache a batch may hold, in tokens: rows x (longest prompt + max new tokens); whole meetings go in "
        "smaller batches, one alone if it is longer (default: 65536)",
    )
    summarize.add_argument("--sample", action="store_true", help="nucleus sampling instead of greedy decoding")
    summarize.add_argument("--temperature", type=float, default=None, help="with --sample (default: 0.7)")
    summarize.add_argument("--top-p", type=float, default=None, help="with --sample (default: 0.9)")
    add_quiet(summarize, "no progress bar or settings line")
    add_trust_remote_code(summarize)


def run(args: argparse.Namespace) -> int:
    """Summaries of a transcript, JSONL records or stdin from base + adapter in this process, printed to stdout."""
    from pipetune.generate import (
        GenerationStats,
        Sampling,
        format_summaries,
        inference_config,
        load_finetuned,
        prompt_change,
        read_transcripts,
        summarize,
    )
    from pipetune.metrics import TaskProgress

    if not args.sample and (args.temperature is not None or args.top_p is not None):
        raise ConfigError("--temperature and --top-p set sampling; add --sample (decoding is greedy by default)")
    counts = (("--batch-size", args.batch_size), ("--max-batch-tokens", args.max_batch_tokens))
    counts += (("--max-new-tokens", args.max_new_tokens),)
    below = [f"{flag} {value}" for flag, value in counts if value is not None and value < 1]
    if below:
        raise ConfigError(f"{' and '.join(below)} must be at least 1")
    source = inference_config(args.adapter, args.base, args.config, args.trust_remote_code)
    config = source.config
    sampling = None
    if args.sample:
        temperature = 0.7 if args.temperature is None else args.temperature
        top_p = 0.9 if args.top_p is None else args.top_p
        sampling = Sampling(temperature, top_p, seed=config.train.seed)
    if args.column:
        config.data.transcript_column = args.column
    inputs = read_transcripts(args.input, config.data)
    if source.warning:
        print(f"pipetune: warning: {source.warning}", file=sys.stderr)
    if inputs.skipped:  # the other rows are still summarized; the output has one line per usable row
        print(f"pipetune: warning: {inputs.skipped_line()}", file=sys.stderr)
    model, prepared = load_finetuned(config, args.adapter)
    changed = prompt_change(Path(args.adapter), prepared, config)
    if changed:
        print(f"pipetune: warning: {changed}", file=sys.stderr)
    if not args.quiet:
        settings = source.config_path or "defaults"
        print(
            f"base {config.model.name} ({config.model.dtype}, settings: {settings}) + adapter {args.adapter} "
            f"on {next(model.parameters()).device}; {len(inputs.transcripts)} transcript(s)",
            file=sys.stderr,
        )
    stats = GenerationStats()
    with TaskProgress(enabled=not args.quiet) as progress:
        summaries = summarize(
            model,
            prepared,
            inputs.transcripts,
            args.max_new_tokens or config.data.max_summary_tokens,
            args.batch_size,
            sampling,
            progress.task("summarize", len(inputs.transcripts)),
            inputs.systems,
            args.max_batch_tokens,
            stats,
        )
    print(format_summaries(summaries, inputs))
    if not args.quiet:
        print(f"pipetune: {stats.line()}", file=sys.stderr)
    return 0
