"""The demo trained with an unquantized and a quantized base, side by side: validation loss and ROUGE after training.

    PYTHONPATH=src python3 benchmarks/tools/quant_quality.py OUT_DIR [--steps N] [--methods none,nf4]
        [--set KEY=VALUE ...]

Each method is one `pipetune train` of the demo config (one process: a pipeline computes the same, see
tests/parallel/test_quantized.py) and one `pipetune eval --run` of it. val_loss is the last validation loss of
training (on the quantized base); the eval columns score the fine-tuned model on the base as trained. The first
method is the reference; the last columns give each metric's relative difference from it. Writes
OUT_DIR/quality.json. "fp8" needs a GPU with FP8 and model.dtype = "bfloat16" (--set model.dtype=...).
Without rouge-score installed (the H200 image), only val_loss is measured.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
METRICS = ("val_loss", "eval_loss", "rouge1", "rouge2", "rougeLsum")


def run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pipetune", *args], check=True, cwd=REPO)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (the demo's: 150)")
    parser.add_argument("--methods", default="none,nf4", help="model.quantize values, the first the reference")
    parser.add_argument("--set", action="append", default=[], help="more config overrides for every run")
    args = parser.parse_args()
    rouge = importlib.util.find_spec("rouge_score") is not None
    metrics = METRICS if rouge else METRICS[:1]
    results = {}
    for method in args.methods.split(","):
        run_dir = args.out / method
        overrides = [
            f'model.quantize="{method}"',
            f"train.max_steps={args.steps}",
            'parallel.strategy="single"',
            "parallel.pp=1",
            f'output.dir="{run_dir}"',
            *args.set,
        ]
        run("train", "--config", str(REPO / "configs" / "demo.toml"), "--quiet", *[f"--set={o}" for o in overrides])
        with open(run_dir / "metrics.csv") as f:
            val_losses = [float(row["val_loss"]) for row in csv.DictReader(f) if row.get("val_loss")]
        results[method] = {"val_loss": val_losses[-1]}
        if rouge:
            run("eval", "--run", str(run_dir))
            scores = json.loads((run_dir / "eval.json").read_text())["finetuned"]
            results[method] |= {"eval_loss": scores["loss"]} | {key: scores[key] for key in METRICS[2:]}
    reference = next(iter(results.values()))
    print(f"{'method':<8}" + "".join(f"{m:>11}" for m in metrics) + "  relative to " + next(iter(results)))
    for method, values in results.items():
        gaps = " ".join(f"{(values[m] - reference[m]) / reference[m]:+.1%}" if reference[m] else "-" for m in metrics)
        print(f"{method:<8}" + "".join(f"{values[m]:>11.4f}" for m in metrics) + f"  {gaps}")
    (args.out / "quality.json").write_text(json.dumps({"steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
