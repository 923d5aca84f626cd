"""Data that scales: time to the first optimizer step and peak RSS of a run on 1,000,000 short rows, before/after.

    python benchmarks/tools/data_scale.py write /tmp/scale --rows 1000000 --rows 1000
    git archive <commit before the token cache> src | tar -x -C /tmp/before
    python benchmarks/tools/data_scale.py run /tmp/scale --src /tmp/before/src --label before --out before.json
    python benchmarks/tools/data_scale.py run /tmp/scale --src src --label after --out after.json

Each measurement is a fresh `pipetune train` process (tiny-qwen3, one process, 128 tokens, batch 8, one
optimizer step) on a JSONL of N short synthetic meetings, run from the given source tree. Time to first
step: from the process start until metrics.csv holds its first row (and the CPU time of the whole run, which
a busy shared machine distorts less). Peak RSS: the process's ru_maxrss.
With the token cache each size runs twice on one cache directory: cold (it tokenizes) and warm (it finds
the cache); the growth of peak RSS with the data is the difference between the largest and the smallest
size, scaled to a million rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROLES = ("Project Manager", "Marketing Expert", "Industrial Designer", "User Interface Designer")
ITEMS = ("the battery cover", "the scroll wheel", "the rubber case", "the logo", "the colours", "the buttons")


def write_rows(directory: Path, n: int) -> Path:
    """N short meetings: two turns and a one-sentence summary (about 40 tokens each under the demo tokenizer)."""
    path = directory / f"rows-{n}.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            role, other = ROLES[i % 4], ROLES[(i + 1) % 4]
            item = ITEMS[i % len(ITEMS)]
            dialogue = f"{role}: shall we keep {item}, version {i}? {other}: yes, {item} stays."
            f.write(json.dumps({"dialogue": dialogue, "summary": f"The team kept {item} (version {i})."}) + "\n")
    return path


def measure(source: Path, src: Path, cache: Path, work: Path) -> dict:
    """One fresh training process: seconds until the first metrics row, and its peak RSS in GB."""
    run_dir = Path(tempfile.mkdtemp(dir=work))
    config = run_dir / "config.toml"
    config.write_text(
        f'[model]\nname = "tiny-qwen3"\ndtype = "float32"\ninit = "random"\n'
        f'[data]\nsource = "{source}"\nmax_length = 128\nmax_summary_tokens = 32\n'
        f"[train]\nepochs = 1\nmax_steps = 1\nbatch_size = 8\ngrad_accum = 1\nlog_every = 1\n"
        f'[parallel]\nstrategy = "single"\npp = 1\nn_microbatches = 1\n[output]\ndir = "{run_dir / "run"}"\n'
    )
    env = dict(os.environ, PYTHONPATH=str(src), PIPETUNE_CACHE=str(cache), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    metrics = run_dir / "run" / "metrics.csv"
    started = time.perf_counter()
    with open(run_dir / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipetune", "train", "--config", str(config), "--quiet"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    first_step = None
    while True:  # wait4, not Popen.poll: it also returns the process's own resource usage
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if first_step is None and metrics.is_file() and len(metrics.read_text().splitlines()) > 1:
            first_step = time.perf_counter() - started
        if pid:
            break
        time.sleep(0.05)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"run failed: {(run_dir / 'stderr.txt').read_text()[-2000:]}")
    return {
        "first_step_s": round(first_step, 1),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_rss_gb": round(usage.ru_maxrss / 1e6, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    write = commands.add_parser("write")
    write.add_argument("dir", type=Path)
    write.add_argument("--rows", type=int, action="append", required=True)
    run = commands.add_parser("run")
    run.add_argument("dir", type=Path, help="the directory `write` filled")
    run.add_argument("--src", type=Path, required=True, help="the source tree to run (its src/ directory)")
    run.add_argument("--label", required=True)
    run.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    if args.command == "write":
        args.dir.mkdir(parents=True, exist_ok=True)
        for n in args.rows:
            print(write_rows(args.dir, n))
        return
    sources = sorted(args.dir.glob("rows-*.jsonl"), key=lambda p: int(p.stem.split("-")[1]))
    work = Path(tempfile.mkdtemp(prefix="data-scale-"))
    results = {}
    for source in sources:
        rows = int(source.stem.split("-")[1])
        cache = work / f"cache-{rows}"
        results[rows] = {"cold": measure(source, args.src, cache, work), "warm": measure(source, args.src, cache, work)}
        print(rows, results[rows], flush=True)
    smallest, largest = min(results), max(results)
    growth = {
        kind: round(
            (results[largest][kind]["peak_rss_gb"] - results[smallest][kind]["peak_rss_gb"])
            * 1e6
            / (largest - smallest),
            3,
        )
        for kind in ("cold", "warm")
    }
    report = {
        "label": args.label,
        "src": str(args.src),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "versions": _versions(),
        "results": results,
        "peak_rss_growth_gb_per_million_rows": growth,
        "warm_speedup": round(results[largest]["cold"]["first_step_s"] / results[largest]["warm"]["first_step_s"], 1),
        "warm_speedup_cpu": round(results[largest]["cold"]["cpu_s"] / results[largest]["warm"]["cpu_s"], 1),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


def _versions() -> str:
    import tokenizers
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}"


if __name__ == "__main__":
    main()
