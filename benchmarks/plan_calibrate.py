"""Calibrate `pipetune plan` on the GPUs: time every layer shape of the benchmarks' runs, then predict again.

    OUT=dir PYTHONPATH=src python3 benchmarks/plan_calibrate.py [--budget 540]

(device machine, repo root, 2 GPUs). For every run in benchmarks/plan_check.py it times one decoder layer, as
that run ran it (model, microbatch shape, dtype, adapters, LoRA path, compilation, CUDA graphs), forward and
backward on GPU 0, and one transfer of a microbatch's hidden states from GPU 0 to GPU 1; the shapes that matter
most first (the accuracy targets' rows: Qwen3-4B at 512 and 16,384 tokens, the 72B shape), until --budget seconds
are spent. It writes under $OUT:

    rates.json           the calibrated rates (`benchmarks/plan_check.py --rates`, `GpuRates.load`)
    plan-check.md        every run's prediction with those rates beside its measurement
    picks.txt            the plan's pick, calibrated, for Qwen3-4B (512, 16,384 tokens), Qwen3-32B and the 72B shape
    calibrate.log        each timing as it was taken
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_check  # noqa: E402

from pipetune.config import load_config  # noqa: E402
from pipetune.calibrate import time_layer, time_transfer  # noqa: E402
from pipetune.parallel.layouts import Layout  # noqa: E402
from pipetune.parallel.speed import GpuRates  # noqa: E402
from pipetune.plan import H200_MEMORY, format_plan, make_plan  # noqa: E402

TARGETS = {
    "qwen3-4b-512": (plan_check.B4, []),
    "qwen3-4b-16384": (plan_check.B4, plan_check.LONG16K + ["parallel.n_microbatches=4"]),
    "qwen3-32b-512": (plan_check.B4, ["model.name=qwen3-32b", "parallel.n_microbatches=8"]),
    "qwen2.5-72b-512": (plan_check.B72, []),
}
"""The accuracy targets' rows: config and overrides."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=540, help="seconds to spend timing layers (default: 540)")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/plan-calibrate"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log = open(out / "calibrate.log", "w")  # noqa: SIM115

    def say(line: str) -> None:
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()

    # The shapes to time, those that matter most first: the targets' leading layouts (each pick predicted from
    # timed layers), then the measured runs, the larger models and longer sequences before Qwen3-4B at 512.
    shapes = {}
    for path, overrides in TARGETS.values():
        config = load_config(ROOT / path, overrides)
        for p in [p for p in make_plan(config, 2).predictions if p.fits][:3]:
            shapes.setdefault(p.work.key(p.mode), (config, p.work, p.mode))
    runs = [plan_check.rebuild(run) for run in plan_check.RUNS]
    for config in sorted(runs, key=lambda c: (c.model.name == "qwen3-4b", c.data.max_length <= 512)):
        p = config.parallel
        plan = make_plan(config, p.pp * p.dp, H200_MEMORY, layouts=[Layout.of(config)])
        prediction = plan.predictions[0]
        shapes.setdefault(prediction.work.key(prediction.mode), (config, prediction.work, prediction.mode))
    if not torch.cuda.is_available():
        say("no GPU here: the shapes it would time, in order:\n  " + "\n  ".join(shapes))
        return 1
    say(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    measured, link = {}, None

    def time_shapes(todo: dict) -> None:
        nonlocal link
        for key, (config, work, mode) in todo.items():
            if key in measured:
                continue
            if time.time() - started > args.budget:
                say(f"{key}: not timed, budget spent")
                continue
            try:
                forward, backward = time_layer(config, work, mode, torch.device("cuda", 0))
            except Exception as e:  # one shape that does not run must not cost the others
                say(f"{key}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            measured[key] = (forward, backward)
            spent = time.time() - started
            say(f"{key}: forward {forward * 1e3:.2f} ms, backward {backward * 1e3:.2f} ms ({spent:.0f} s)")
            if link is None and torch.cuda.device_count() >= 2:
                nbytes = work.tokens * work.hidden * 2
                link = nbytes / time_transfer(nbytes)
                say(f"transfer: {nbytes / 1e6:.1f} MB GPU 0 -> 1 at {link / 1e9:.0f} GB/s")

    def rates() -> GpuRates:
        return dataclasses.replace(
            GpuRates(),
            name=f"calibrated on {torch.cuda.get_device_name(0)} (benchmarks/plan_calibrate.py)",
            layer_seconds=dict(measured),
            **({"link_bytes_per_s": link, "link_latency_s": 0.0} if link else {}),
        )

    time_shapes(shapes)
    # The targets' leading layouts once more, with the calibrated rates: a pick that moved gets its shape timed.
    for path, overrides in TARGETS.values():
        config = load_config(ROOT / path, overrides)
        leading = [p for p in make_plan(config, 2, rates=rates()).predictions if p.fits][:3]
        time_shapes({p.work.key(p.mode): (config, p.work, p.mode) for p in leading})
    rates().save(out / "rates.json")
    check = [sys.executable, str(ROOT / "benchmarks" / "plan_check.py"), "--rates", str(out / "rates.json")]
    subprocess.run([*check, "--out", str(out / "plan-check.md")], check=False)
    with open(out / "picks.txt", "w") as picks:
        for name, (path, overrides) in TARGETS.items():
            config = load_config(ROOT / path, overrides)
            text = format_plan(make_plan(config, 2, rates=rates()), top=10)
            picks.write(f"== {name}\n{text}\n\n")
            say(f"{name}: {text.splitlines()[-1]}")
    say(f"done in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
