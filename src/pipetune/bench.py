"""`pipetune bench`: run strategies one after another on the same model, data and batch; compare them.

Each strategy is a normal `pipetune train` run in its own process group (so GPU memory is
released between them) of warmup + timed optimizer steps; figures come from its metrics.csv.
Warm-up steps (which include compilation) are excluded; tokens/s are the timed steps' tokens over their time and
step time their time over their count (until 2026-12-02: medians of the metrics rows, which packed rows, whose
steps' work varies, overstated: 20,103 real tokens/s for whole meetings' 19,062 over the same 117 steps), from
the metrics rows, one per step by default (--rows N: one every N steps, between which the host runs ahead of the
GPU, as in a run that logs every few steps).

MFU = tokens/s x FLOPs per token / (GPUs x peak FLOP/s), FLOPs per token from the stage cost
model of model/split.py (4 x weights of every matmul: frozen-base LoRA training is forward plus
input-gradient backward; plus causal attention; the lm_head on every token, or with train.fused_loss on the
supervised share of them, data.max_summary_tokens + 1 of data.max_length, which is all it runs on) and
peak = --peak-tflops, else the GPU's dense bf16 peak by its datasheet, read from its name (`spec_peak_tflops`: 989
for an H100 or H200 SXM), as the field counts MFU (PaLM's definition; torchtitan's and Megatron's figures). Until
2026-12-06 the peak was 790, a bf16 matmul measured on an H200: MFU figures before then are 790 / 989 = 0.80 of
theirs by this count (75% is 60%); bench.json keeps that share beside it as "mfu_of_measured_peak".
Until 2026-12-02 the bench counted the head on every token with the fused loss too: its MFU figures before then are
~7% higher than this count at Qwen3-8B's 4,096-token rows (256 summary tokens; 69.4% is 64.6%) and ~5% at
Qwen3-4B's 512-token rows. Packed rows' causal attention is their documents' own: the epoch's share of a whole
row's (`data inspect`), and since 2026-12-02 each timed step's own rows' share (metrics' attention_share), which
at whole meetings varies by step (a step's time
with it: 0.66-1.19 s at 16,384 tokens) and had MFU follow the draw of rows before.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pipetune.config import RUN_STRATEGIES, Config, ConfigError, save_config
from pipetune.data.inspect import training_attention_share
from pipetune.files import rank_columns, read_metrics_rows
from pipetune.metrics import read_phases
from pipetune.model.split import run_split
from pipetune.planner.layouts import Layout
from pipetune.preflight import prepare
from pipetune.report import plot_bench
from pipetune.strategies import STRATEGY_SPECS
from pipetune.switches import AUTO, SWITCHES, Hardware, resolve


def strategy_config(config: Config, strategy: str, steps: int, warmup: int, out_dir: Path, rows: int = 1) -> Config:
    """The config's run as `strategy`, on as many ranks and at the same effective batch (`Layout.for_strategy`).
    A metrics row every `rows` steps (each waits for the GPU; between them the host runs ahead)."""
    m = resolve(config, Hardware.here()).config.parallel.n_microbatches  # the config's own layout's
    counted = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, n_microbatches=m))
    variant = Layout.for_strategy(counted, strategy).apply(config)
    p = variant.parallel
    if config.parallel.n_microbatches == AUTO:  # each strategy's run chooses its own, as `pipetune train` would
        p.n_microbatches = AUTO
    if not STRATEGY_SPECS[strategy].pipeline:
        p.layers_per_stage, p.sequence_parallel = [], p.sequence_parallel and p.tensor_parallel
    variant.train.max_steps = warmup + steps
    variant.train.epochs = 10_000  # max_steps ends the run
    variant.train.log_every = rows
    variant.train.save_every = 0
    variant.train.timeline_step = warmup + 1 if variant.parallel.pipelined else 0
    variant.output.dir = str(out_dir / strategy)
    return variant


def run_bench(
    config: Config,
    strategies: list[str],
    steps: int,
    warmup: int,
    out_dir: Path,
    peak_tflops: float | None = None,
    timeout_s: float = 0.0,
    rows: int = 1,
) -> list[dict]:
    """Each strategy in turn, saying live where it is; `timeout_s` > 0 ends a strategy that runs longer (it is
    reported as timed out, with its last phase and the figures of the timed steps it finished, and the next
    one runs)."""
    unknown = [s for s in strategies if s not in RUN_STRATEGIES]
    if unknown:
        raise ConfigError(f"--strategies {unknown} unknown; available: {', '.join(RUN_STRATEGIES)}")
    prepared = prepare(resolve(config, Hardware.here()).config)
    vocab = prepared.model.config.vocab_size
    counted = resolve(config, Hardware.here(), vocab=vocab).config  # the switches the FLOP count depends on (the loss)
    share = training_attention_share(counted, prepared.prompts)  # packed rows attend within their samples
    costs, _ = run_split(counted, prepared.model.config, share)  # with the fused loss: the head on supervised rows
    flops_per_token = prepared.n_layers * costs.layer + costs.head
    # A packed step attends its own rows, not the epoch's: MFU counts each metrics row's attention share
    # (metrics' attention_share) with this many FLOPs a token per unit of share.
    whole = run_split(counted, prepared.model.config, 1.0)[0] if counted.data.packing else costs
    attention_flops = prepared.n_layers * (whole.layer - costs.layer) / (1 - share) if share < 1 else 0.0
    count = FlopCount(flops_per_token, peak_tflops or spec_peak_tflops(), attention_flops, share)
    out_dir.mkdir(parents=True, exist_ok=True)
    setup = bench_setup(config) | {"attention_share": round(share, 4)}  # MFU counts this share of attention
    results = []
    for strategy in strategies:
        variant = strategy_config(config, strategy, steps, warmup, out_dir, rows)
        clear_previous_run(Path(variant.output.dir))
        path = out_dir / f"{strategy}.toml"
        save_config(variant, path)
        n_gpus = variant.parallel.world_size
        print(f"bench: {strategy} ({n_gpus} process{'es' if n_gpus > 1 else ''}), {warmup} + {steps} steps", flush=True)
        run_dir = Path(variant.output.dir)
        run = run_strategy(path, run_dir, out_dir / f"{strategy}.log", strategy, warmup, timeout_s)
        result = strategy_result(run, run_dir, strategy, warmup, n_gpus, count)
        if (run_dir / "speed.json").is_file():  # the switches as the run resolved them, and why
            result["resolved_switches"] = json.loads((run_dir / "speed.json").read_text())
        layout = layout_of(variant, result.get("resolved_switches", {}).get("switches", {}))
        results.append({**result, "setup": {**setup, "layout": layout}})
        (out_dir / "bench.json").write_text(json.dumps(results, indent=1))  # after each: a later one may fail
    print_table(results, describe_setup(setup))
    plot_bench(results, out_dir / "bench.png", "pipetune bench")
    return results


SPEC_PEAK_TFLOPS = (("GH200", 989.4), ("H200", 989.4), ("H100 PCIe", 756.5), ("H100", 989.4), ("A100", 312.0))
"""Dense bf16 TFLOP/s by the vendor's datasheet, by a part of the GPU's name (first match): MFU's denominator."""
DEFAULT_PEAK_TFLOPS = 989.4
"""Where the GPU is not in SPEC_PEAK_TFLOPS, or there is none: an H100 / H200 SXM's (--peak-tflops to set it)."""
MEASURED_PEAK_TFLOPS = 790.0
"""An 8192^3 bf16 matmul measured on an H200 (and 798 on an H100): the older MFU's denominator."""


def spec_peak_tflops(name: str | None = None) -> float:
    """The datasheet's dense bf16 peak of the GPU named `name` (this machine's first GPU by default)."""
    import torch

    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((peak for part, peak in SPEC_PEAK_TFLOPS if part in name), DEFAULT_PEAK_TFLOPS)


RECORDED = (*SWITCHES, ("lora", "shared_dropout"), ("data", "buckets"), ("data", "packing"))
RECORDED += (("data", "max_samples_per_row"),)
"""The config keys that change speed or memory but not the math (the speed switches, as the config asks for them,
and the data's layout): each bench row records them; its "resolved_switches", what its run made of them."""


def bench_setup(config: Config) -> dict:
    """What every strategy of a bench measures alike: the model, the rows, the speed switches, the libraries and
    the GPU (bench.json's "setup" of each row; the table's caption)."""
    import peft
    import torch
    import transformers

    m, t, p = config.model, config.train, config.parallel
    switches = {f"{section}.{key}": getattr(getattr(config, section), key) for section, key in RECORDED}
    gpu = f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}" if torch.cuda.is_available() else ""
    return {
        "model": m.name,
        "dtype": m.dtype,
        "quantize": m.quantize,
        "row_tokens": config.data.max_length,
        "rows_per_step": t.batch_size * t.grad_accum * p.dp,
        "lora_r": config.lora.r,
        "switches": switches,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "gpu": gpu or f"none (CPU, {os.cpu_count()} cores)",
    }


def layout_of(config: Config, resolved: dict | None = None) -> dict:
    """A strategy's layout as its run had it (`resolved`: the run's switches, speed.json's: its microbatch count
    where the config left it to "auto")."""
    p = config.parallel
    return {
        "pp": p.pp,
        "dp": p.dp,
        "tp": p.tp,
        "microbatches": (resolved or {}).get("parallel.n_microbatches", p.n_microbatches),
        "schedule": p.schedule,
        "stages_per_rank": p.stages_per_rank,
        "rows_per_rank_step": config.train.batch_size,
    }


def describe_setup(setup: dict) -> str:
    """The bench table's caption: what was measured, on what."""
    on = []
    for key, value in setup["switches"].items():
        name = key.split(".", 1)[1]
        if value is True:
            on.append(name)
        elif value not in (False, None, [], 0, 1):  # 1: layers_per_graph's default
            on.append(f"{name}={value}")
    quantize = f", {setup['quantize']} base" if setup["quantize"] != "none" else ""
    versions = " ".join(f"{name} {version}" for name, version in setup["versions"].items())
    return (
        f"{setup['model']} ({setup['dtype']}{quantize}, LoRA r{setup['lora_r']}), {setup['rows_per_step']} rows x "
        f"{setup['row_tokens']} tokens a step; switches: {', '.join(on) or 'none'}\n{setup['gpu']}; {versions}"
    )


def clear_previous_run(run_dir: Path) -> None:
    """Remove an earlier bench run of this strategy (a run directory: config.toml with progress.jsonl or
    metrics.csv); refuse anything else, which bench did not create."""
    if not run_dir.exists():
        return
    made_by_a_run = (run_dir / "config.toml").is_file() and any(
        (run_dir / name).is_file() for name in ("progress.jsonl", "metrics.csv")
    )
    if not made_by_a_run:
        raise ConfigError(
            f"{run_dir} exists and is not an earlier bench run of this strategy; bench writes each strategy's run "
            "there: pass another --out"
        )
    shutil.rmtree(run_dir)


def run_strategy(config_path: Path, run_dir: Path, log: Path, name: str, warmup: int, timeout_s: float) -> dict:
    """Train one strategy in its own process group, printing each phase it enters (from its progress.jsonl)
    with the seconds since launch. Returns load_s and first_step_s (launch to the end of optimizer step 1),
    or an error with the last phase."""
    cmd = [sys.executable, "-m", "pipetune", "train", "--config", str(config_path), "--quiet"]
    started = time.time()
    shown, phase, timing = 0, "launch", {}
    print(f"bench: {name}: launch", flush=True)
    with open(log, "w") as output:
        process = subprocess.Popen(cmd, stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            try:
                code = process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                code = None
            phases = read_phases(run_dir / "progress.jsonl")
            for entry in phases[shown:]:
                phase = describe_phase(entry, warmup)
                print(f"bench: {name}: {phase} ({entry['time'] - started:.0f} s)", flush=True)
            shown, timing = len(phases), phase_times(phases, started)
            if code is not None:
                break
            if timeout_s > 0 and time.time() - started > timeout_s:
                _stop(process)
                print(f"bench: {name}: timed out after {timeout_s:.0f} s in {phase}", flush=True)
                return {"error": f"timed out after {timeout_s:.0f} s in {phase}", "last_phase": phase, **timing}
    if code != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-5:]
        print(f"bench: {name}: exit code {code} in {phase}; last lines of {log}:", *tail, sep="\n  ", flush=True)
        return {"error": f"exit code {code} in {phase}", "last_phase": phase, **timing}
    return timing


def describe_phase(entry: dict, warmup: int) -> str:
    """A phase as the bench shows it: warm-up steps (the first compiles) apart from timed ones."""
    if entry["phase"] != "step":
        return entry["phase"] + (f" ({entry['load_s']:.0f} s to load)" if "load_s" in entry else "")
    step = entry["step"]
    if step <= warmup:
        return f"warm-up step {step}/{warmup}" + (" (compiles, records graphs)" if step == 1 else "")
    return f"timed step {step - warmup}"


READY_FIELDS = {"load_s": "load_s", "peak_gb": "load_peak_gb"}
"""What the run's "ready" phase records, under the names bench.json gives them."""


def phase_times(phases: list[dict], started: float) -> dict:
    """load_s (building the stages), load_peak_gb (rank 0's peak memory after it) and first_step_s (launch to
    the end of optimizer step 1), when known."""
    timing = {name: entry[key] for entry in phases for key, name in READY_FIELDS.items() if key in entry}
    steps = [i for i, entry in enumerate(phases) if entry["phase"] == "step"]
    if steps and steps[0] + 1 < len(phases):  # whatever follows step 1 (step 2, a checkpoint, ...) ends it
        timing["first_step_s"] = round(phases[steps[0] + 1]["time"] - started, 1)
    return timing


def _stop(process: subprocess.Popen) -> None:
    """End a strategy's launcher and its workers (its own process session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


@dataclass(frozen=True)
class FlopCount:
    """How the bench counts MFU: `per_token` FLOPs a token at the epoch's attention `share`, against
    `peak_tflops` a GPU; where metrics rows record their packed rows' own attention share, each row's FLOPs a
    token move from the epoch's share to the row's by `per_share` a unit of share (0: not packed)."""

    per_token: float
    peak_tflops: float
    per_share: float = 0.0
    share: float = 1.0

    def mfu(self, rows: list[dict], seconds: list[float], n_gpus: int) -> float:
        """The timed rows' MFU: their FLOPs (tokens x per_token; with rows' own shares, each row's tokens x its own
        FLOPs a token) over their `seconds`."""
        moved = [0.0] * len(rows)
        if self.per_share and rows[0].get("attention_share"):
            moved = [self.per_share * (float(r["attention_share"]) - self.share) for r in rows]
        flops = sum(
            float(r["tokens_per_sec"]) * t * (self.per_token + m) for r, t, m in zip(rows, seconds, moved, strict=True)
        )
        return flops / sum(seconds) / (n_gpus * self.peak_tflops * 1e12)


def strategy_result(run: dict, run_dir: Path, strategy: str, warmup: int, n_gpus: int, count: FlopCount) -> dict:
    """bench.json's entry for a strategy: the figures of its timed steps, or its error. One that the timeout
    ended after some timed steps (or in its final checkpoint, with all of them) keeps their figures, marked
    "timed_out"."""
    if not timed_rows(run_dir, warmup) and "error" not in run:  # ended without a timed step (max_steps reached?)
        run = {**run, "error": "no timed step in metrics.csv"}
    if "error" in run and not (run["error"].startswith("timed out") and timed_rows(run_dir, warmup)):
        return {"strategy": strategy, **run}
    result = {**summarize_run(run_dir, strategy, warmup, n_gpus, count), **run}
    if "error" in result:
        result["timed_out"] = result.pop("error")
    return result


def timed_rows(run_dir: Path, warmup: int) -> list[dict]:
    """metrics.csv's training rows after the warm-up (a validation row before step 1 has no loss)."""
    metrics = run_dir / "metrics.csv"
    if not metrics.is_file():
        return []
    return [row for row in read_metrics_rows(metrics)[0] if int(row["step"]) > warmup and row["loss"]]


def summarize_run(run_dir: Path, strategy: str, warmup: int, n_gpus: int, count: FlopCount) -> dict:
    """The timed rows' figures (MFU: `count`), and where they record packed rows' attention share, its mean."""
    rows = timed_rows(run_dir, warmup)
    peaks = rank_columns(rows[0], "peak_gb_rank")
    reserved = [k for k in rank_columns(rows[0], "reserved_gb_rank") if rows[0][k]]
    seconds = _row_seconds(rows, warmup)
    timed, steps = sum(seconds), int(rows[-1]["step"]) - warmup
    all_tokens = sum(float(r["tokens_per_sec"]) * t for r, t in zip(rows, seconds, strict=True))
    real_tokens = sum(float(r["real_tokens_per_sec"]) * t for r, t in zip(rows, seconds, strict=True))
    loss = float(rows[-1]["loss"])
    result = {
        "strategy": strategy,
        "gpus": n_gpus,
        "timed_steps": steps,
        "tokens_per_sec": all_tokens / timed,
        "tokens_per_sec_per_gpu": all_tokens / timed / n_gpus,
        "real_tokens_per_sec": real_tokens / timed,
        "pad_share": 1 - real_tokens / all_tokens if all_tokens > 0 else 0.0,
        "step_time_sec": timed / steps,
        "mfu": count.mfu(rows, seconds, n_gpus),
        "mfu_peak_tflops": count.peak_tflops,
        "mfu_of_measured_peak": count.mfu(rows, seconds, n_gpus) * count.peak_tflops / MEASURED_PEAK_TFLOPS,
        "peak_gb_per_rank": [max(float(r[k]) for r in rows) for k in peaks],
        "reserved_gb_per_rank": [max(float(r[k] or 0) for r in rows) for k in reserved],
        "final_loss": loss if math.isfinite(loss) else None,  # every step of the last row skipped: no loss
    }
    if rows[0].get("attention_share"):  # packed rows: the share the timed steps drew, beside the epoch's
        result["timed_attention_share"] = statistics.fmean(float(r["attention_share"]) for r in rows)
    if rows[0].get("host_wait_frac"):  # GPU runs
        result["host_wait_frac"] = statistics.median(float(r["host_wait_frac"]) for r in rows)
    timeline = run_dir / "timeline.json"
    if timeline.is_file():
        summary = json.loads(timeline.read_text())
        result["bubble_per_rank"] = summary["bubble"]
        result["expected_bubble"] = summary["expected_bubble"]
    return result


def _row_seconds(rows: list[dict], warmup: int) -> list[float]:
    """Seconds of training each timed metrics row covers: its step time (the mean over its steps) x its steps."""
    steps = [warmup, *(int(r["step"]) for r in rows)]
    pairs = zip(rows, steps[:-1], steps[1:], strict=True)
    return [float(r["step_time_sec"]) * (later - earlier) for r, earlier, later in pairs]


def print_table(results: list[dict], caption: str = "") -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pipetune bench", caption=caption)
    for column in (
        "strategy",
        "GPUs",
        "real tokens/s",
        "pad",
        "tokens/s",
        "tokens/s/GPU",
        "MFU",
        "step s",
        "peak GB/rank",
        "reserved GB",
        "bubble",
        "load s",
        "1st step s",
    ):
        table.add_column(column, justify="right")
    for r in results:
        if "error" in r:
            table.add_row(r["strategy"], "-", r["error"], *[""] * 8, *_timing_cells(r))
            continue
        bubble = ""
        if "bubble_per_rank" in r:
            bubble = " ".join(f"{b:.0%}" for b in r["bubble_per_rank"]) + f" (ideal {r['expected_bubble']:.0%})"
        table.add_row(
            r["strategy"] + (f" ({r['timed_out']}, {r['timed_steps']} timed steps)" if "timed_out" in r else ""),
            str(r["gpus"]),
            f"{r['real_tokens_per_sec']:,.0f}",
            f"{r['pad_share']:.0%}",
            f"{r['tokens_per_sec']:,.0f}",
            f"{r['tokens_per_sec_per_gpu']:,.0f}",
            f"{r['mfu']:.1%}",
            f"{r['step_time_sec']:.3f}",
            " ".join(f"{p:.1f}" for p in r["peak_gb_per_rank"]),
            " ".join(f"{p:.1f}" for p in r.get("reserved_gb_per_rank", [])),
            bubble,
            *_timing_cells(r),
        )
    console = Console()
    if not console.is_terminal:  # a log file: no terminal width to fit, keep every column readable
        console.width = 160
    console.print(table)
    for line in drawn_rows_notes(results):
        console.print(line)


def drawn_rows_notes(results: list[dict]) -> list[str]:
    """A line for each strategy whose timed steps drew packed rows of an attention share 5% or more off the
    epoch's: its tokens/s are those rows', not the epoch's (a long packed row's step time follows its documents'
    squared lengths)."""
    notes = []
    for r in results:
        timed, epoch = r.get("timed_attention_share"), r.get("setup", {}).get("attention_share")
        if timed is not None and epoch and abs(timed / epoch - 1) >= 0.05:
            notes.append(
                f"note: {r['strategy']}'s timed steps drew packed rows of {timed:.0%} attention share against the "
                f"epoch's {epoch:.0%}: its tokens/s are theirs (more timed steps come closer to the epoch's)"
            )
    return notes


def _timing_cells(result: dict) -> list[str]:
    return [f"{result[key]:.0f}" if key in result else "" for key in ("load_s", "first_step_s")]
