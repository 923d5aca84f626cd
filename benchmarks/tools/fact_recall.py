"""Whole meetings against meetings cut to 512 tokens: fact recall of the same model fine-tuned on each.

On the GPU machine (1 H200), from the repo root, with what smollm2_rouge.md lists (rouge-score's wheels and the
converted SmolLM2 checkpoint in .whl/):

    pip install --no-index --find-links .whl rouge-score
    PYTHONPATH=src PIPETUNE_CACHE=/tmp/pipetune-cache HF_HUB_OFFLINE=1 \
        python benchmarks/tools/fact_recall.py --model .whl/smollm2-135m --out $OUT/fact-recall

Trains the shipped demo-smollm2-meetings config (whole synthetic meetings, ~6,000 tokens each, read at
data.max_length 8192, batch 2) and its cut counterpart (data.max_length 512, batch 32: the same optimizer steps and
the same 16,384 tokens a step), then scores both with `pipetune eval` on the same held-out whole meetings, each
read through its own prompt (the cut model sees each meeting cut to 512 tokens, as in training; the base model is
scored at both lengths). A last row gives the cut-trained model the whole meetings to read, which separates what
training on whole meetings taught from what reading them gives. Fact recall: the share of each meeting's
decisions, action items and figures its summary states (evaluate.py); beside it, the share its prompt mentions at
each length ("facts in view": the most a summary of that prompt can recall). train.max_steps ends both runs (the
cut one goes round its meetings again), and the tool exits 1 when their step counts differ. On one H200 each run
of 300 steps takes ~6 min with its start (measured: the whole run 5 min 53 s), and each scored model generated for
~80 s per 24 meetings 8 at a time (now 32 at a time by default on a GPU: a 135M model's decoding step is
launch-bound, so 32 rows should cost about what 8 did; not yet measured): more than one 10-minute device call, so
split it over calls on a warm machine: `--only whole`, then `--only cut --reuse`, then `--reuse` (which keeps the
runs finished under --out with the same steps, trains none, and scores both). Prints the table, writes under
--out the two runs (whole/, cut/, each with its eval.json) and result.json; exits 1 when the whole model's fact
recall is not at least --target times the cut one's (2x).

`--vary KEY=V1,V2` trains the whole-meeting run once per value instead (no cut run, no base scores) and scores
each on the same held-out meetings: validation loss, fact recall, ROUGE-Lsum (result.json). The dropout check of
2026-12-06 (one H100, ~3 min; 128 meetings seen 3 times, the whole-meeting config's epochs):

    python benchmarks/tools/fact_recall.py --model /tmp/gg/smollm2.gguf --out $OUT/dropout --meetings 32 \
        --set data.synthetic_train=128 --set train.epochs=3 --set train.max_steps=-1 --vary lora.dropout=0.15,0

A CPU smoke run with the tiny random model (what tests/benchmarks/test_fact_recall.py runs):

    PYTHONPATH=src python benchmarks/tools/fact_recall.py --model tiny-qwen3 --out /tmp/fr --steps 1 \\
        --train-meetings 4 --meetings 2 --max-length 256 --cut-length 128 --max-new-tokens 4 --target 0
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

CONFIG = "demo-smollm2-meetings"
CUT_LENGTH = 512
"""The seed job's data.max_length: the cut counterpart's."""
TARGET = 2.0
"""The whole-meeting model's fact recall must be at least this many times the cut one's."""


def run_configs(args: argparse.Namespace):
    """The whole-meeting config and its cut counterpart: same data, steps and tokens a step."""
    from pipetune.config import load_config

    overrides = [f"model.name={args.model!r}", f"parallel.pp={args.nproc}", *args.set]
    if args.model in ("tiny-qwen3",) or args.model.startswith("qwen3-"):
        overrides.append("model.init='random'")  # built-in shapes have no weights
    overrides.append(f"model.dtype={args.dtype or ('bfloat16' if torch.cuda.is_available() else 'float32')!r}")
    if args.steps is not None:
        overrides.append(f"train.max_steps={args.steps}")
    if args.train_meetings is not None:
        overrides.append(f"data.synthetic_train={args.train_meetings}")
    if args.max_length is not None:
        overrides.append(f"data.max_length={args.max_length}")
    whole = load_config(CONFIG, overrides)
    whole.data.synthetic_validation = args.meetings  # the held-out meetings: validation loss and eval
    whole.data.max_summary_tokens = min(whole.data.max_summary_tokens, whole.data.max_length // 2)
    whole.output.dir = str(Path(args.out) / "whole")
    cut = load_config(CONFIG, overrides)
    cut.data = type(whole.data)(**asdict(whole.data))
    cut.data.max_length = args.cut_length
    cut.data.max_summary_tokens = min(whole.data.max_summary_tokens, args.cut_length // 2)
    cut.train.batch_size = whole.train.batch_size * whole.data.max_length // args.cut_length
    cut.output.dir = str(Path(args.out) / "cut")
    if not args.vary:  # --vary runs keep the config's (or --set's) epochs
        for config in (whole, cut):  # train.max_steps ends both: 1,024 meetings are ~375 packed steps of whole rows
            config.train.epochs = 10_000  # but only 32 of cut ones, which then come round again
    return whole, cut


def steps_done(config) -> int:
    """Optimizer steps a finished run logged (its metrics.csv)."""
    from pipetune.files import read_metrics_rows

    return max(int(row["step"]) for row in read_metrics_rows(Path(config.output.dir) / "metrics.csv")[0])


def finished(config) -> bool:
    """Whether a run under its output.dir trained all of its train.max_steps and saved its adapter."""
    metrics = Path(config.output.dir) / "metrics.csv"
    if not metrics.is_file() or not (Path(config.output.dir) / "adapter").is_dir():
        return False
    return steps_done(config) == config.train.max_steps


def facts_in_view(config, n_meetings: int) -> float:
    """Share of each held-out meeting's facts its prompt mentions as the model reads it (the transcript cut to
    data.max_length, head and tail kept): the most a summary of that prompt can recall without guessing."""
    from pipetune.data.facts import mean_fact_recall, mentions
    from pipetune.data.sources import load_dataset
    from pipetune.preflight import prepare

    prepared = prepare(config)
    examples = load_dataset(config.data, seed=config.train.seed).splits["validation"][:n_meetings]
    prompts = [prepared.tokenizer.decode(prepared.prompts.prompt_ids(e.transcript)) for e in examples]
    return mean_fact_recall(prompts, [e.facts for e in examples], mentions) or 0.0


def rescore(path: Path, whole) -> dict:
    """A result.json's stored summaries scored again with this version's fact matching: its meetings drawn again
    from the whole run's config (`whole`), whose reference summaries must be the ones stored."""
    from pipetune.data.facts import mean_fact_recall
    from pipetune.data.sources import load_dataset

    stored = json.loads(path.read_text())
    rescored = {}
    for name, result in stored["results"].items():
        rows = result["examples"]
        examples = load_dataset(whole.data, seed=whole.train.seed).splits["validation"][: len(rows)]
        if [e.summary for e in examples] != [row["reference"] for row in rows]:
            raise SystemExit(f"fact_recall: {path}'s meetings are not this config's (other --meetings or --set?)")
        facts = [e.facts for e in examples]
        rescored[name] = {
            which: {"stored": result[which]["fact_recall"], "now": mean_fact_recall([r[which] for r in rows], facts)}
            for which in ("finetuned", "base")
            if which in rows[0]
        }
    return rescored


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model.name: converted dir, .gguf, or smollm2-135m")
    parser.add_argument("--out", help="directory for both runs and result.json (not with --rescore)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps of each run (default: the config's)")
    parser.add_argument("--meetings", type=int, default=64, help="held-out whole meetings scored (default: 64)")
    parser.add_argument("--train-meetings", type=int, default=None, help="data.synthetic_train (default: config's)")
    parser.add_argument("--max-length", type=int, default=None, help="whole run's data.max_length (default: 8192)")
    parser.add_argument("--cut-length", type=int, default=CUT_LENGTH, help="cut run's data.max_length (512)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="generation cap (default: summary cap)")
    parser.add_argument("--dtype", default=None, help="model.dtype (default: bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--nproc", type=int, default=1, help="pipeline stages / processes per run (default: 1)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a key")
    parser.add_argument("--target", type=float, default=TARGET, help="required ratio of fact recalls (default: 2)")
    parser.add_argument("--only", choices=("whole", "cut"), help="train this run alone and stop (no scores)")
    parser.add_argument(
        "--reuse", action="store_true", help="keep runs under --out that finished their steps instead of training again"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=32 if torch.cuda.is_available() else 8,
        help="meetings generated together (default: 32 on a GPU, 8 on a CPU)",
    )
    parser.add_argument(
        "--vary",
        metavar="KEY=V1,V2[,...]",
        help="train the whole-meeting run once per value of KEY (e.g. lora.dropout=0.15,0; with --set's epochs and "
        "steps) and score each on the same held-out meetings: validation loss and fact recall; no cut run",
    )
    parser.add_argument(
        "--rescore",
        type=Path,
        metavar="RESULT_JSON",
        help="score a result.json's summaries again with this version's "
        "fact matching (with the --meetings and --set it ran with), print and write RESULT_JSON's *-rescored.json",
    )
    args = parser.parse_args()
    if args.out is None and not args.rescore:
        parser.error("--out is required: the directory for both runs and result.json")
    if args.rescore:
        args.out = args.out or str(args.rescore.parent)  # the configs' output.dir: nothing is written there
        rescored = rescore(args.rescore, run_configs(args)[0])
        print(json.dumps(rescored, indent=2))
        args.rescore.with_name(args.rescore.stem + "-rescored.json").write_text(json.dumps(rescored, indent=2) + "\n")
        return 0

    from pipetune.evaluate import evaluate, rouge_scorer
    from pipetune.launch import run_train

    rouge_scorer()  # fail before training when rouge-score is missing
    if args.vary:
        return vary(args)
    whole, cut = run_configs(args)
    if not args.reuse:
        shutil.rmtree(args.out, ignore_errors=True)
    started = time.perf_counter()
    seconds: dict[str, float] = {}
    for name, config in (("whole", whole), ("cut", cut)):
        if args.only not in (None, name):
            continue
        if args.reuse and finished(config):
            print(f"fact_recall: {name}: reusing {config.output.dir} ({config.train.max_steps} steps)")
        elif run_train(config, args.nproc, quiet=True) != 0:
            return 1
        seconds[f"train_{name}"] = round(time.perf_counter() - started - sum(seconds.values()), 1)
    if args.only:
        return 0
    steps = {name: steps_done(config) for name, config in (("whole", whole), ("cut", cut))}
    if steps["whole"] != steps["cut"] or steps["whole"] != whole.train.max_steps:
        print(f"fact_recall: the runs made {steps} optimizer steps, not {whole.train.max_steps} each", file=sys.stderr)
        return 1
    in_view = {name: facts_in_view(config, args.meetings) for name, config in (("whole", whole), ("cut", cut))}

    cap = args.max_new_tokens or whole.data.max_summary_tokens
    results = {}
    for name, config, adapter_of in (("whole", whole, whole), ("cut", cut, cut), ("cut_reading_whole", whole, cut)):
        base = "skip" if name == "cut_reading_whole" else "score"  # the base at full length: the "whole" row's
        adapter = Path(adapter_of.output.dir) / "adapter"
        result = evaluate(config, adapter, "validation", args.meetings, cap, args.batch_size, base=base)
        result.save(Path(adapter_of.output.dir) / f"eval-{name}.json")
        results[name] = result
    seconds["eval"] = round(time.perf_counter() - started - sum(seconds.values()), 1)

    recall = {name: result.finetuned.fact_recall or 0.0 for name, result in results.items()}
    ratio = recall["whole"] / recall["cut"] if recall["cut"] else None if recall["whole"] else 0.0  # None: unbounded
    met = ratio is None or ratio >= args.target
    print(table(results, whole, cut, cap, in_view))
    times = "unbounded" if ratio is None else f"{ratio:.2f}x"
    print(f"\nfact recall: whole {100 * recall['whole']:.1f}% vs cut {100 * recall['cut']:.1f}%: {times} "
          f"(target >= {args.target:g}x): {'met' if met else 'NOT met'}")  # fmt: skip
    summary = {
        **run_header(args),
        "steps": whole.train.max_steps,
        "tokens_per_step": {
            "whole": whole.train.batch_size * whole.data.max_length,
            "cut": cut.train.batch_size * cut.data.max_length,
        },
        "seconds": seconds,
        "results": {name: asdict(result) for name, result in results.items()},
        "fact_recall": recall,
        "facts_in_view": in_view,
        "ratio": ratio,
        "target_met": met,
    }
    write_result(args, summary)
    return 0 if met else 1


def vary(args: argparse.Namespace) -> int:
    """--vary KEY=V1,V2: the whole-meeting run trained once per value, each scored on the same held-out meetings
    (no base, no cut run); prints a row per value and writes result.json. Exits 1 when a run fails."""
    from pipetune.evaluate import evaluate
    from pipetune.launch import run_train

    key, _, values = args.vary.partition("=")
    if not key or not values:
        raise SystemExit(f"fact_recall: --vary {args.vary!r}: expected KEY=V1,V2 (e.g. lora.dropout=0.15,0)")
    if not args.reuse:
        shutil.rmtree(args.out, ignore_errors=True)
    rows = {}
    for value in values.split(","):
        one = argparse.Namespace(**{**vars(args), "set": [*args.set, f"{key}={value}"]})
        config = run_configs(one)[0]
        config.output.dir = str(Path(args.out) / f"{key}={value}")
        started = time.perf_counter()
        if args.reuse and (Path(config.output.dir) / "adapter").is_dir():
            print(f"fact_recall: {key}={value}: reusing {config.output.dir}")
        elif run_train(config, args.nproc, quiet=True) != 0:
            return 1
        trained = time.perf_counter() - started
        cap = args.max_new_tokens or config.data.max_summary_tokens
        adapter = Path(config.output.dir) / "adapter"
        result = evaluate(config, adapter, "validation", args.meetings, cap, args.batch_size, base="skip")
        result.save(Path(config.output.dir) / "eval.json")
        rows[value] = {
            "steps": steps_done(config),
            "epochs": config.train.epochs,
            "train_seconds": round(trained, 1),
            "eval_seconds": round(time.perf_counter() - started - trained, 1),
            "validation_loss": result.finetuned.loss,
            "fact_recall": result.finetuned.fact_recall,
            "rougeLsum": result.finetuned.rougeLsum,
            "n_examples": result.n_examples,
            "n_facts": result.n_facts,
        }
    lines = [f"{'':<22}{'steps':>7}{'val loss':>10}{'facts':>8}{'ROUGE-Lsum':>11}{'train s':>9}"]
    for value, row in rows.items():
        facts = f"{100 * row['fact_recall']:>8.1f}" if row["fact_recall"] is not None else f"{'-':>8}"
        lines.append(
            f"{key + '=' + value:<22}{row['steps']:>7}{row['validation_loss']:>10.4f}{facts}"
            f"{100 * row['rougeLsum']:>11.1f}{row['train_seconds']:>9.0f}"
        )
    first = next(iter(rows.values()))
    print(f"{first['n_examples']} held-out whole meetings ({first['n_facts']} facts), greedy\n" + "\n".join(lines))
    summary = {
        **run_header(args),
        "vary": key,
        "results": rows,
    }
    write_result(args, summary)
    return 0


def run_header(args: argparse.Namespace) -> dict:
    """What every result.json begins with: when, how, on what."""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": args.model,
    }


def write_result(args: argparse.Namespace, summary: dict) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")


def table(results: dict, whole, cut, cap: int, in_view: dict[str, float]) -> str:
    """One row per model and input length: ROUGE, fact recall and loss, in percent and nats per token; then the
    share of the facts each input length shows the model (facts_in_view)."""
    first = results["whole"]
    lines = [
        f"{first.split}: {first.n_examples} held-out whole meetings ({first.n_facts} facts), greedy, at most {cap} "
        f"new tokens; trained {whole.train.max_steps} steps on {whole.train.batch_size} x {whole.data.max_length} "
        f"(whole) or {cut.train.batch_size} x {cut.data.max_length} (cut) tokens a step",
        f"{'model':<28}{'reads':>7}{'ROUGE-1':>9}{'ROUGE-2':>9}{'ROUGE-Lsum':>11}{'facts':>8}{'loss':>8}",
    ]
    rows = [
        ("base", results["whole"].base, whole.data.max_length),
        ("trained on whole meetings", results["whole"].finetuned, whole.data.max_length),
        ("base", results["cut"].base, cut.data.max_length),
        ("trained on cut meetings", results["cut"].finetuned, cut.data.max_length),
        ("trained cut, reading whole", results["cut_reading_whole"].finetuned, whole.data.max_length),
    ]
    for name, scores, reads in rows:
        if scores is None:
            continue
        facts = f"{100 * scores.fact_recall:>8.1f}" if scores.fact_recall is not None else f"{'-':>8}"
        lines.append(
            f"{name:<28}{reads:>7}{100 * scores.rouge1:>9.1f}{100 * scores.rouge2:>9.1f}{100 * scores.rougeLsum:>11.1f}"
            f"{facts}{scores.loss:>8.3f}"
        )
    lines.append(
        f"facts the prompt itself mentions (the most a summary can recall): {100 * in_view['whole']:.1f}% at "
        f"{whole.data.max_length} tokens, {100 * in_view['cut']:.1f}% at {cut.data.max_length}"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
