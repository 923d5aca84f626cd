"""Calibrate `pipetune plan` on the GPUs: time every layer shape of the benchmarks' runs, then predict again.

    OUT=dir PYTHONPATH=src python3 benchmarks/tools/plan_calibrate.py [--budget 540] [--only 'tp=2']

(device machine, repo root, 2 GPUs). For every run in benchmarks/tools/plan_check.py it times one decoder layer, as
that run ran it (model, microbatch shape, dtype, adapters, LoRA path, compilation, CUDA graphs), forward and
backward on GPU 0 (a tensor-parallel shape on GPUs 0 and 1, each with its share, the all-reduces included:
calibrate.time_tp_layers), and one transfer of a microbatch's hidden states from GPU 0 to GPU 1; the shapes that
matter most first (the accuracy targets' leading layouts, then the measured runs, larger models first), until
--budget seconds are spent. Untimed shapes are scaled by how far the model was off on the shapes timed alone. It
writes under $OUT:

    rates.json           the calibrated rates (`benchmarks/tools/plan_check.py --rates`, `GpuRates.load`)
    plan-check.md        every run's prediction with those rates beside its measurement
    picks.txt            the plan's pick, calibrated, for Qwen3-4B (512, 16,384 tokens), Qwen3-32B and the 72B shape
    calibrate.log        each timing as it was taken

    PYTHONPATH=src python3 benchmarks/tools/plan_calibrate.py --rates FILE   (any machine)

writes plan-check.md and picks.txt again from a rates.json a call brought back (no timing), by the rules above.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks" / "tools"))

import plan_check  # noqa: E402

from pipetune.config import load_config  # noqa: E402
from pipetune.planner.calibrate import can_time, time_shape, time_transfer, timed_alone, with_timings  # noqa: E402
from pipetune.planner.layouts import Layout  # noqa: E402
from pipetune.planner.plan import H200_MEMORY, format_plan, make_plan  # noqa: E402
from pipetune.planner.speed import GpuRates, layer_seconds  # noqa: E402

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
    parser.add_argument("--rates", default=None, help="a rates.json to predict from again instead of timing")
    parser.add_argument("--only", default="", help="time only the shapes whose key holds this text (e.g. 'tp=2')")
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/plan-calibrate"))
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log = open(out / "calibrate.log", "a" if args.rates else "w")  # noqa: SIM115

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
    gpu = torch.device("cuda", 0)
    shapes = {key: shape for key, shape in shapes.items() if args.rates or can_time(shape[1], gpu)}
    chosen = {key: shape for key, shape in shapes.items() if args.only in key}
    measured, link, name = {}, None, ""

    def rates() -> GpuRates:
        """The defaults with the timed layers, the others scaled by the timed ones' measured over modelled time."""
        ratios = [
            (shapes[k][1], sum(measured[k]) / sum(layer_seconds(shapes[k][1], GpuRates(), shapes[k][2])))
            for k in measured
        ]
        return with_timings(GpuRates(), name, measured, ratios, link)

    if args.rates:  # predict again from another call's timings, by this script's rules
        loaded = GpuRates.load(args.rates)
        measured = {  # tp shapes timed alone (files from before time_tp_layers) are left out
            k: tuple(v)
            for k, v in loaded.layer_seconds.items()
            if k in shapes and (loaded.split_tp_timings or timed_alone(shapes[k][1]))
        }
        link, name = loaded.link_bytes_per_s, f"{loaded.name}, predicted again by its rules of today"
        left = sorted(set(loaded.layer_seconds) - set(measured))
        say(f"from {args.rates}: {len(measured)} timed shapes used, {len(left)} left out ({', '.join(left)})")
    elif not torch.cuda.is_available():
        say("no GPU here: the shapes it would time, in order:\n  " + "\n  ".join(chosen))
        return 1
    else:
        name = f"calibrated on {torch.cuda.get_device_name(0)} (benchmarks/tools/plan_calibrate.py)"
        say(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}; torch {torch.__version__}")

    def time_shapes(todo: dict) -> None:
        nonlocal link
        for key, (config, work, mode) in todo.items():
            if key in measured or not can_time(work, gpu):
                continue
            shapes[key] = (config, work, mode)
            if time.time() - started > args.budget:
                say(f"{key}: not timed, budget spent")
                continue
            try:
                forward, backward = time_shape(config, work, mode, gpu)
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

    if not args.rates:
        time_shapes(chosen)
        # The targets' leading layouts once more, with the calibrated rates: a pick that moved gets its shape timed.
        for path, overrides in TARGETS.values():
            config = load_config(ROOT / path, overrides)
            leading = [p for p in make_plan(config, 2, rates=rates()).predictions if p.fits][:3]
            moved = {p.work.key(p.mode): (config, p.work, p.mode) for p in leading}
            time_shapes({key: shape for key, shape in moved.items() if args.only in key})
    say(f"layer scale for untimed shapes: {rates().layer_scale:.3f}")
    rates().save(out / "rates.json")
    check = [sys.executable, str(ROOT / "benchmarks" / "tools" / "plan_check.py"), "--rates", str(out / "rates.json")]
    subprocess.run([*check, "--out", str(out / "plan-check.md")], check=False)
    with open(out / "picks.txt", "w") as picks:
        for target, (path, overrides) in TARGETS.items():
            config = load_config(ROOT / path, overrides)
            text = format_plan(make_plan(config, 2, rates=rates()), top=10)
            picks.write(f"== {target}\n{text}\n\n")
            say(f"{target}: {text.splitlines()[-1]}")
    say(f"done in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
