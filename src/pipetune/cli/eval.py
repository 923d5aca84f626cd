"""`pipetune eval`: ROUGE and loss of the base and the fine-tuned model on a split (evaluate.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipetune.cli.options import add_config_options, add_quiet, add_trust_remote_code
from pipetune.config import ConfigError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    evaluate = subparsers.add_parser("eval", help="ROUGE and loss of the base and the fine-tuned model on a split")
    evaluate_source = evaluate.add_mutually_exclusive_group(required=True)
    evaluate_source.add_argument("--run", default=None, help="run directory (its config.toml and adapter/)")
    evaluate_source.add_argument("--adapter", default=None, help="adapter directory (with --config)")
    add_config_options(
        evaluate, required=False, help_text="TOML config (default: the run's config.toml)", overrides=False
    )
    evaluate.add_argument("--split", default="validation", help="split to score: validation (default), test, ...")
    evaluate.add_argument("--limit", type=int, default=None, help="score only the first N meetings of the split")
    evaluate.add_argument("--max-new-tokens", type=int, default=None, help="(default: data.max_summary_tokens)")
    evaluate.add_argument("--batch-size", type=int, default=8, help="meetings generated together (default: 8)")
    evaluate.add_argument("--out", default=None, help="eval.json path or directory (default: the run directory)")
    evaluate.add_argument(
        "--no-base",
        action="store_true",
        help="skip scoring the base model (an earlier eval.json's base scores with equal settings are reused anyway)",
    )
    add_quiet(evaluate, "no progress lines")
    add_trust_remote_code(evaluate)


def run(args: argparse.Namespace) -> int:
    """ROUGE and token loss of base and fine-tuned model; a table on stdout, eval.json in the run directory."""
    from pipetune.evaluate import evaluate
    from pipetune.generate import inference_config
    from pipetune.metrics import TaskProgress

    if args.run is not None:
        run_dir = Path(args.run)
        adapter = run_dir / "adapter"
        if not adapter.is_dir():
            raise ConfigError(f"--run {args.run!r} has no adapter/ directory; give a finished run's directory")
    else:
        adapter = Path(args.adapter)
        run_dir = adapter.parent
        if args.config is None and not (run_dir / "config.toml").is_file():
            raise ConfigError(
                f"--adapter {args.adapter!r} has no config.toml beside it; pass --config FILE.toml "
                "(the data and prompt settings of the run)"
            )
    source = inference_config(adapter, None, args.config, args.trust_remote_code)
    if source.warning:
        print(f"pipetune: warning: {source.warning}", file=sys.stderr)
    out = Path(args.out) if args.out else run_dir
    path = out if out.suffix == ".json" else out / "eval.json"
    with TaskProgress(enabled=not args.quiet) as progress:
        result = evaluate(
            source.config,
            adapter,
            args.split,
            args.limit,
            args.max_new_tokens,
            args.batch_size,
            progress,
            base="skip" if args.no_base else "score",
            cache=path,
        )
    result.save(path)
    print(result.table())
    print(f"\nscores -> {path}")
    return 0
