"""Predicted vs measured: `pipetune plan`'s memory and speed models against the device runs in journal/results.

    PYTHONPATH=src python3 benchmarks/tools/plan_check.py [--rates calibration.json] \
        [--out benchmarks/journal/plan-check.md]

Each run is rebuilt as the config it ran (the bench config of its day plus the overrides of its script, then the
bench's strategy mapping), predicted with `make_plan(..., layouts=[its layout])`, and set beside what it measured:
the bench JSON's medians (tokens/s) and maxima over timed steps (peak memory per rank), or the metrics CSV's rows
after the warm-up where only a CSV was kept. Runs with CUDA graphs are compared on reserved memory: their
replayed graphs keep tensors in pools that `max_memory_allocated` stops counting after recording.
`--rates` takes the JSON that benchmarks/tools/plan_calibrate.py writes (rates measured on the GPUs).
"""

from __future__ import annotations

import argparse
import csv
import json
import operator
import statistics
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "journal" / "results"
sys.path.insert(0, str(ROOT / "src"))

from pipetune.bench import strategy_config  # noqa: E402
from pipetune.config import load_config  # noqa: E402
from pipetune.parallel.memory import GB  # noqa: E402
from pipetune.planner.layouts import Layout  # noqa: E402
from pipetune.planner.plan import H200_MEMORY, attention_share, make_plan  # noqa: E402
from pipetune.planner.speed import GpuRates  # noqa: E402

B4 = "configs/bench-qwen3-4b.toml"
B72 = "configs/bench-qwen2.5-72b.toml"
AMI = "configs/qwen3-4b-ami.toml"
BEFORE_GRAPHS = ["train.cuda_graphs=false", "train.fused_loss=false"]
"""The 4B bench config before it switched CUDA graphs and the fused loss on (runs of 2026-11-29 up to part B)."""
CG = ["train.cuda_graphs=true", "train.fused_loss=true"]
V2 = ["parallel.schedule=interleaved_1f1b", "parallel.stages_per_rank=2"]
V3 = ["parallel.schedule=interleaved_1f1b", "parallel.stages_per_rank=3"]
V4 = ["parallel.schedule=interleaved_1f1b", "parallel.stages_per_rank=4"]
M32 = ['model.name="qwen3-32b"', "data.synthetic_validation=0"]
LONG8K = [
    "data.max_length=8192",
    "data.max_summary_tokens=1024",
    "train.batch_size=4",
    "parallel.n_microbatches=4",
    "train.fused_loss=true",
    "train.compile=false",
    "train.cuda_graphs=false",
]
LONG16K = [
    "data.max_length=16384",
    "data.max_summary_tokens=1024",
    "train.batch_size=4",
    "train.compile=false",
    "train.cuda_graphs=false",
]
REPLICAS = ["parallel.pp=1", "parallel.dp=2", "train.batch_size=2", "train.grad_accum=4", "parallel.n_microbatches=1"]
EAGER = ["train.compile=false", "train.cuda_graphs=false"]
TP16 = [
    'parallel.strategy="tp"',
    "parallel.pp=1",
    "parallel.tp=2",
    "parallel.n_microbatches=1",
    "train.cuda_graphs=false",
]
"""Qwen3-4B as tp=2, one microbatch of 16, compiled without graphs."""
NF4 = ['model.quantize="nf4"']
LONG_DATA = ["data.synthetic_train=32", "data.synthetic_validation=0"]
LONG = "configs/bench-qwen3-8b-long.toml"
"""Qwen3-8B, one row of 131,072 tokens, every layer offloaded (docs/long-context.md), on one H200."""
ROWS4K = ["data.max_length=4096", "train.grad_accum=8", "train.activation_checkpointing=false", "train.mlp_chunk=0"]
"""Qwen3-8B (LONG) as 8 rows of 4,096 tokens a step, nothing checkpointed, whole MLPs: eager unless compiled."""
PACKED4K = ["data.packing=true", "data.max_length=4096", "train.batch_size=2"]
"""The 4B bench config's meetings packed into rows of 4,096 tokens, 2 rows a step."""
SINGLE4 = ['parallel.strategy="single"', "parallel.pp=1", "parallel.n_microbatches=1", "train.cuda_graphs=false"]


@dataclass
class Run:
    name: str
    config: str
    overrides: list[str]
    strategy: str
    source: str
    """A bench JSON's "entry" (file:key) or a metrics CSV (file, with the warm-up steps to skip after a colon)."""
    note: str = ""
    speed: bool = True
    """False where the run's speed is not the layout's (profiler on, code since changed)."""
    overrides_after: list[str] = field(default_factory=list)
    host_gib: float = 0.0
    """The host memory of the machine the run ran on, where "auto" offloads within it (0: this machine's)."""


WHOLE16K = ["data.max_length=16384", 'data.synthetic_lengths="whole"', "data.synthetic_train=256"]
"""The whole-meeting rows of 2026-12-02's fx calls (4-6)."""


def _in_matmul_run(
    label: str, config: str, overrides: list[str], call: int, rows: int, in_matmul: bool, entry: str, tag: str = "im"
) -> Run:
    """A `single` run of 2026-12-02's calls since lora.adapter_in_matmul (results/2026-12-02-TAG-CALL-bench.json):
    `rows` rows a microbatch, with the switch or without."""
    switch = ["lora.adapter_in_matmul=true"] if in_matmul else []
    return Run(
        label,
        config,
        [*overrides, f"train.batch_size={rows}", *switch],
        "single",
        f"2026-12-02-{tag}-{call}-bench.json:{entry}:single",
    )


RUNS = [
    Run(
        "core: seed job shape, plain path, 8 x 1, accum 2",
        AMI,
        ["model.name=qwen3-4b", "model.init=random", "data.source=synthetic"],
        "pp",
        "2026-11-29-core-pp2-metrics.csv:2",
    ),
    Run("perf 1: compiled, 4 x 4", B4, BEFORE_GRAPHS, "pp", "2026-11-29-perf-run1-bench.json:optimized:pp"),
    Run("perf 1: compiled, one GPU", B4, BEFORE_GRAPHS, "single", "2026-11-29-perf-run1-bench.json:optimized:single"),
    Run(
        "perf 1: compiled, 8 x 2",
        B4,
        [*BEFORE_GRAPHS, "parallel.n_microbatches=8"],
        "pp",
        "2026-11-29-perf-run1-bench.json:optimized-m8:pp",
    ),
    Run(
        "perf 1: eager fast path, 4 x 4",
        B4,
        [*BEFORE_GRAPHS, "train.compile=false"],
        "pp",
        "2026-11-29-perf-run1-bench.json:eager-fast:pp",
    ),
    Run(
        "perf 1: plain path, 8 x 1, accum 2",
        B4,
        [
            *BEFORE_GRAPHS,
            "train.compile=false",
            "lora.fast_path=false",
            "train.batch_size=8",
            "parallel.n_microbatches=8",
            "train.grad_accum=2",
        ],
        "pp",
        "2026-11-29-perf-run1-bench.json:plain:pp",
    ),
    Run(
        "perf 2: compiled, 4 x 4, split 18/18",
        B4,
        [*BEFORE_GRAPHS, "parallel.layers_per_stage=[18, 18]"],
        "pp",
        "2026-11-29-perf-run2-bench.json:balanced18:pp",
    ),
    Run(
        "perf 2: compiled, 4 x 4, profiler",
        B4,
        BEFORE_GRAPHS,
        "pp",
        "2026-11-29-perf-run2-bench.json:m4-profile:pp",
        speed=False,
        note="profiler on",
    ),
    Run(
        "perf 2: compiled, 8 x 2, profiler",
        B4,
        [*BEFORE_GRAPHS, "parallel.n_microbatches=8"],
        "pp",
        "2026-11-29-perf-run2-bench.json:m8-profile:pp",
        speed=False,
        note="profiler on",
    ),
    Run(
        "speed A: compiled, fused loss, 4 x 4",
        B4,
        [*BEFORE_GRAPHS, "train.fused_loss=true"],
        "pp",
        "2026-11-29-speed-partA-bench.json:compiled:pp",
        speed=False,
        note="fused loss over all rows then",
    ),
    Run(
        "speed A: CUDA graphs, 4 x 4",
        B4,
        CG,
        "pp",
        "2026-11-29-speed-partA-bench.json:graphs:pp",
        speed=False,
        note="fused loss over all rows then",
    ),
    Run(
        "speed A: CUDA graphs, v=2",
        B4,
        [*CG, *V2],
        "pp",
        "2026-11-29-speed-partA-bench.json:interleaved-v2:pp",
        speed=False,
        note="fused loss over all rows then",
    ),
    Run("speed B: CUDA graphs, 4 x 4", B4, CG, "pp", "2026-11-29-speed-partB-bench.json:graphs:pp"),
    Run("speed B: CUDA graphs, v=2", B4, [*CG, *V2], "pp", "2026-11-29-speed-partB-bench.json:interleaved-v2:pp"),
    Run(
        "speed B: plain path, 4 x 4",
        B4,
        [*BEFORE_GRAPHS, "lora.fast_path=false", "train.compile=false"],
        "pp",
        "2026-11-29-speed-partB-bench.json:curve-plain:pp",
    ),
    Run("speed B+: 8192 tokens, 4 x 1", B4, [*BEFORE_GRAPHS, *LONG8K], "pp", "2026-11-29-long-8192-metrics.csv:1"),
    Run("speed C: 8192 tokens, 4 x 1", B4, LONG8K, "pp", "2026-11-30-speed-partC-bench.json:long:pp"),
    Run(
        "speed C: 8192 tokens, checkpointing",
        B4,
        [*LONG8K, "train.activation_checkpointing=true"],
        "pp",
        "2026-11-30-speed-partC-bench.json:long-ckpt:pp",
    ),
    Run("speed C: ddp, eager", B4, EAGER, "ddp", "2026-11-30-speed-partC-bench.json:fsdp:ddp"),
    Run("speed C: fsdp, eager", B4, EAGER, "fsdp", "2026-11-30-speed-partC-bench.json:fsdp:fsdp"),
    Run(
        "speed D: CUDA graphs, 4 x 4, split 18/18",
        B4,
        [*CG, "parallel.layers_per_stage=[18, 18]"],
        "pp",
        "2026-11-29-speed-partD-bench.json:graphs:pp",
    ),
    Run("speed D: CUDA graphs, v=2", B4, [*CG, *V2], "pp", "2026-11-29-speed-partD-bench.json:interleaved-v2:pp"),
    Run("speed D: CUDA graphs, v=3", B4, [*CG, *V3], "pp", "2026-11-29-speed-partD-bench.json:interleaved-v3:pp"),
    Run(
        "speed E: CUDA graphs, v=6",
        B4,
        [*CG, "parallel.schedule=interleaved_1f1b", "parallel.stages_per_rank=6"],
        "pp",
        "2026-11-30-speed-partE-interleaved-v6-partial-metrics.csv:5",
    ),
    Run("speed F: CUDA graphs, v=3", B4, [*CG, *V3], "pp", "2026-11-30-speed-partF-interleaved-v3-metrics.csv:5"),
    Run(
        "speed F: CUDA graphs, v=3, 1 channel",
        B4,
        [*CG, *V3],
        "pp",
        "2026-11-30-speed-partF-interleaved-v3-p2p1-corrupted-metrics.csv:5",
        note="corrupted gradients",
    ),
    Run("speed G: CUDA graphs, v=3", B4, [*CG, *V3], "pp", "2026-11-30-speed-partG-bench.json:interleaved-v3:pp"),
    Run(
        "speed G: CUDA graphs, v=3, 1 channel",
        B4,
        [*CG, *V3],
        "pp",
        "2026-11-30-speed-partG-bench.json:interleaved-v3-p2p1:pp",
    ),
    Run(
        "speed H: CUDA graphs, v=3, 1 channel",
        B4,
        [*CG, *V3, "parallel.p2p_channels=1"],
        "pp",
        "2026-11-30-speed-partH-bench.json:interleaved-v3-p2p1:pp",
    ),
    Run(
        "speed H: CUDA graphs, 1F1B, 1 channel",
        B4,
        [*CG, "parallel.p2p_channels=1"],
        "pp",
        "2026-11-30-speed-partH-bench.json:1f1b-p2p1:pp",
    ),
    Run(
        "speed H: plain path, v=3",
        B4,
        [*V3, "lora.fast_path=false", *EAGER, "train.fused_loss=false"],
        "pp",
        "2026-11-30-speed-partH-bench.json:curve-plain-v3:pp",
    ),
    Run(
        "speed I: CUDA graphs, v=3, 2 channels",
        B4,
        [*CG, *V3, "parallel.p2p_channels=2"],
        "pp",
        "2026-11-30-speed-partI-interleaved-v3-p2p2-metrics.csv:5",
    ),
    Run("big A: 72B, 1F1B 8 x 2", B72, [], "pp", "2026-11-30-big-partA-bench.json:pp-1f1b:pp"),
    Run("big A: 72B, v=2 8 x 2", B72, V2, "pp", "2026-11-30-big-partA-bench.json:pp-interleaved-v2:pp"),
    Run(
        "big A: 72B, fsdp, 2 x 4 accum",
        B72,
        [*REPLICAS, 'parallel.strategy="fsdp"'],
        "fsdp",
        "2026-11-30-big-partA-bench.json:fsdp:fsdp",
    ),
    Run(
        "big B: 4B, 16,384 tokens, 1F1B 4 x 1, auto",
        B4,
        [*LONG16K, "parallel.n_microbatches=4", 'train.activation_checkpointing="auto"'],
        "pp",
        "2026-11-30-big-partB-bench.json:long-pp-auto:pp",
    ),
    Run(
        "big B: 4B, 16,384 tokens, ddp, checkpointing",
        B4,
        [
            *LONG16K,
            'parallel.strategy="ddp"',
            "parallel.pp=1",
            "parallel.dp=2",
            "train.batch_size=2",
            "parallel.n_microbatches=1",
            "train.activation_checkpointing=true",
        ],
        "ddp",
        "2026-11-30-big-partB-bench.json:long-ddp-ckpt:ddp",
    ),
    Run("wave2 1: 4B, ddp 2 x 8", B4, [], "ddp", "2026-11-30-wave2-call1-bench.json:4b-ddp:ddp"),
    Run("wave2 1: 72B, 1F1B 8 x 2", B72, [], "pp", "2026-11-30-wave2-call1-bench.json:72b-pp:pp"),
    Run(
        "wave2 4: 4B, one GPU, 1 x 16", B4, SINGLE4, "single", "2026-11-30-wave2-call4-bench.json:4b-single-bf16:single"
    ),
    Run(
        "wave2 4: 4B fp8, one GPU, 1 x 16",
        B4,
        [*SINGLE4, 'model.quantize="fp8"'],
        "single",
        "2026-11-30-wave2-call4-bench.json:4b-single-fp8:single",
    ),
    Run(
        "wave2 4: 72B nf4, one GPU, 8 x 2",
        B72,
        ['model.quantize="nf4"'],
        "single",
        "2026-11-30-wave2-72b-single-nf4-metrics.csv:2",
        note="torchao's eager NF4 linear, since replaced",
        speed=False,
    ),
    Run(
        "wave2 5: 72B fp8, one GPU, 8 x 2",
        B72,
        ['model.quantize="fp8"'],
        "single",
        "2026-11-30-wave2-call5-bench.json:72b-single-fp8:single",
    ),
    Run(
        "wave3 1: 72B fp8, 1F1B 8 x 2",
        B72,
        ['model.quantize="fp8"'],
        "pp",
        "2026-11-30-wave3-call1-bench.json:72b-pp-fp8:pp",
    ),
    Run(
        "wave3 2: 72B, v=2 16 x 1, no graphs",
        B72,
        [*V2, "parallel.n_microbatches=16", "train.cuda_graphs=false"],
        "pp",
        "2026-11-30-wave3-call2-bench.json:72b-pp-v2-16:pp",
    ),
    Run(
        "wave3 3: 72B, tp=2, 8 x 2, no graphs",
        B72,
        ["train.cuda_graphs=false"],
        "tp",
        "2026-11-30-wave3-call3-bench.json:72b-tp:tp",
    ),
    Run("wave4 1: 72B, 1F1B 8 x 2", B72, [], "pp", "2026-11-30-wave4-call1-bench.json:72b-pp:pp"),
    Run(
        "wave4 1: 72B fp8, 1F1B 8 x 2",
        B72,
        ['model.quantize="fp8"'],
        "pp",
        "2026-11-30-wave4-call1-bench.json:72b-pp-fp8:pp",
    ),
    Run("wave4 1: 72B, v=4 8 x 2", B72, V4, "pp", "2026-11-30-wave4-call1-bench.json:72b-pp-v4:pp"),
    Run(
        "wave4 2: 32B, 1F1B 8 x 2",
        B4,
        [*M32, "parallel.n_microbatches=8"],
        "pp",
        "2026-11-30-wave4-call2-bench.json:32b-pp:pp",
    ),
    Run(
        "wave4 2: 32B fp8, 1F1B 8 x 2",
        B4,
        [*M32, "parallel.n_microbatches=8", 'model.quantize="fp8"'],
        "pp",
        "2026-11-30-wave4-call2-bench.json:32b-pp-fp8:pp",
        note="host-bound without CUDA graphs: the speed model knows no FP8 host cost",
        speed=False,
    ),
    Run(
        "wave4 2: 32B, ddp 4 x 2 accum",
        B4,
        [*M32, *REPLICAS, 'parallel.strategy="ddp"', "train.batch_size=4", "train.grad_accum=2"],
        "ddp",
        "2026-11-30-wave4-call2-bench.json:32b-ddp:ddp",
    ),
    Run(
        "wave4 2: 72B nf4, ddp 2 x 4 accum",
        B72,
        [*REPLICAS, 'parallel.strategy="ddp"', 'model.quantize="nf4"'],
        "ddp",
        "2026-11-30-wave4-72b-ddp-nf4-metrics.csv:2",
        note="NF4 linears outside the compiled layers, since moved inside",
        speed=False,
    ),
    Run("wave4 3: 4B, ddp 2 x 8", B4, [], "ddp", "2026-11-30-wave4-call3-bench.json:4b-ddp:ddp"),
    Run(
        "wave4 3: 4B, tp=2, 1 x 16, no graphs",
        B4,
        TP16,
        "tp",
        "2026-11-30-wave4-call3-bench.json:4b-tp-mb16:tp",
    ),
    Run(
        "wave4 3: 4B, ddp 2 x 8, eager",
        B4,
        [*EAGER, "data.synthetic_validation=0"],
        "ddp",
        "2026-11-30-wave4-4b-curve-none-metrics.csv:4",
    ),
    *(
        Run(
            f"wave6 1: 4B{'' if method == 'none' else ' ' + method}, one GPU, 2 x 8, eager",
            B4,
            [*EAGER, "data.synthetic_validation=0", "parallel.n_microbatches=2", f'model.quantize="{method}"'],
            "single",
            f"2026-11-30-wave6-call1-bench.json:4b-curve-{method}:single",
            note="eager FP8 quantization, compiled since" if method == "fp8" else "",
            speed=method != "fp8",
        )
        for method in ("none", "fp8", "nf4")
    ),
    Run(
        "wave6 3: 72B nf4, one GPU, 8 x 2",
        B72,
        ["parallel.n_microbatches=8", 'model.quantize="nf4"'],
        "single",
        "2026-11-30-wave6-call3-after-bench.json:72b-single-nf4:single",
        note="the NF4 dequantization rate was fitted to this run",
    ),
    *(
        Run(
            f"wave6 4: 4B, tp=2, 1 x 16, no graphs, {'fused' if fused else 'plain'} loss",
            B4,
            [*TP16, f"train.fused_loss={'true' if fused else 'false'}"],
            "tp",
            f"2026-11-30-wave6-call4-bench.json:4b-tp-{'fused' if fused else 'plain'}-loss:tp",
        )
        for fused in (True, False)
    ),
    Run("wave6 4: 4B, ddp 2 x 8", B4, [], "ddp", "2026-11-30-wave6-call4-bench.json:4b-ddp:ddp"),
    Run(
        "wave6 4: 4B, ddp 2 x 8, shared dropout",
        B4,
        ["lora.shared_dropout=true"],
        "ddp",
        "2026-11-30-wave6-call4-bench.json:4b-ddp-shared-dropout:ddp",
    ),
    *(
        Run(
            f"wave7 1: 4B, ddp 2 x 8, shared dropout, all-reduce {when}",
            B4,
            [
                "lora.shared_dropout=true",
                f"parallel.overlap_gradient_sum={'true' if when == 'overlapped' else 'false'}",
            ],
            "ddp",
            f"2026-11-30-wave7-call1-bench.json:4b-ddp-shared{'' if when == 'overlapped' else '-serial'}:ddp",
        )
        for when in ("overlapped", "after the backward")
    ),
    Run(
        "wave7 1: 4B, ddp 2 x 8, plain path (eager, PEFT)",
        B4,
        [*EAGER, "train.fused_loss=false", "lora.fast_path=false"],
        "ddp",
        "2026-11-30-wave7-call1-bench.json:4b-ddp-plain:ddp",
    ),
    Run(
        "wave7 2: 72B nf4, ddp 4 x 2 accum",
        B72,
        [
            *NF4,
            "parallel.pp=1",
            "parallel.dp=2",
            "train.batch_size=4",
            "train.grad_accum=2",
            "parallel.n_microbatches=1",
        ],
        "ddp",
        "2026-11-30-wave7-call2-bench.json:72b-ddp-nf4:ddp",
        note="the run's own checkpointing plan recomputed 10 of 80 layers, the plan's none",
    ),
    Run(
        "wave7 2: 72B nf4, v=4 4 x 4",
        B72,
        [*V4, "parallel.n_microbatches=4", *NF4],
        "pp",
        "2026-11-30-wave7-call2-bench.json:72b-pp-v4-nf4:pp",
    ),
    Run(
        "wave7 2: 72B, tp=2, 1 x 4 x 4 accum (step 4 profiled)",
        B72,
        ["parallel.pp=1", "parallel.tp=2", "parallel.n_microbatches=1", "train.batch_size=4", "train.grad_accum=4"],
        "tp",
        "2026-11-30-wave7-call2-bench.json:72b-tp:tp",
    ),
    Run(
        "wave7 3: 16,384 tokens, ddp 1 x 1 x 2 accum, eager (the plan's pick)",
        B4,
        [
            *LONG16K,
            *LONG_DATA,
            'parallel.strategy="ddp"',
            "parallel.pp=1",
            "parallel.dp=2",
            "train.batch_size=1",
            "train.grad_accum=2",
            "parallel.n_microbatches=1",
        ],
        "ddp",
        "2026-11-30-wave7-call3-bench.json:long-ddp-pick:ddp",
    ),
    Run(
        "wave7 3: 16,384 tokens, v=4 4 x 1, eager, checkpointing auto",
        B4,
        [*LONG16K, *LONG_DATA, "parallel.n_microbatches=4", *V4, 'train.activation_checkpointing="auto"'],
        "pp",
        "2026-11-30-wave7-call3-bench.json:long-pp-v4-auto:pp",
    ),
    Run(
        "wave7 3: 32B, fsdp 4 x 2 accum",
        B4,
        [
            *M32,
            "parallel.pp=1",
            "parallel.dp=2",
            "parallel.n_microbatches=1",
            "train.batch_size=4",
            "train.grad_accum=2",
        ],
        "fsdp",
        "2026-11-30-wave7-call3-bench.json:32b-fsdp:fsdp",
    ),
    Run(
        "wave7 3: 32B, tp=2, 1 x 8 x 2 accum",
        B4,
        [
            *M32,
            "parallel.pp=1",
            "parallel.tp=2",
            "parallel.dp=1",
            "parallel.n_microbatches=1",
            "train.batch_size=8",
            "train.grad_accum=2",
        ],
        "tp",
        "2026-11-30-wave7-call3-bench.json:32b-tp:tp",
    ),
    Run("wave8 3: 4B, v=3 4 x 4", B4, V3, "pp", "2026-11-30-wave8-call3-bench.json:4b-pp-v3:pp"),
    *(
        Run(
            f"wave8 {call}: 4B, {name}, shared dropout",
            B4,
            ["lora.shared_dropout=true", *layout],
            strategy,
            f"2026-11-30-wave8-call{call}-bench.json:{entry}:{strategy}",
        )
        for call, name, layout, strategy, entry in (
            (1, "ddp 2 x 8", [], "ddp", "4b-ddp-shared"),
            (3, "ddp 2 x 8", [], "ddp", "4b-ddp-shared"),
            (3, "v=3 4 x 4", V3, "pp", "4b-pp-v3-shared"),
            (4, "ddp 2 x 8", [], "ddp", "4b-ddp-shared"),
            (4, "v=4 4 x 4", V4, "pp", "4b-pp-v4-shared"),
        )
    ),
    Run(
        "wave9 3: 4B, one GPU, 1 x 8, shared dropout (step 30 profiled)",
        B4,
        ["parallel.pp=1", "parallel.n_microbatches=1", "train.batch_size=8", "lora.shared_dropout=true"],
        "single",
        "2026-11-30-wave9-3-bench.json:c-traced:single",
    ),
    Run(
        "wave9 3: 72B nf4, one GPU, 1 x 4 x 2 accum (wave 7's ddp layout)",
        B72,
        [
            *NF4,
            "parallel.pp=1",
            "parallel.n_microbatches=1",
            "train.batch_size=4",
            "train.grad_accum=2",
        ],
        "single",
        "2026-11-30-wave9-3-bench.json:72b-nf4-ddp-layout:single",
    ),
    Run(
        "long rows: 8B, 131,072 tokens, every layer offloaded, MLP chunks",
        LONG,
        [],
        "single",
        "2026-12-01-long-rows-1-bench-131k.json:long-offload:single",
    ),
    Run(
        "long rows: 8B, 262,144 tokens, every layer offloaded, MLP chunks",
        LONG,
        ["data.max_length=262144"],
        "single",
        "2026-12-01-long-rows-3-bench-262k.json:long-262k:single",
    ),
    Run(
        'long rows: 8B nf4, 400,000 tokens, "auto" within 125 GB',
        LONG,
        ["data.max_length=400000", *NF4, 'train.activation_checkpointing="auto"', "train.memory_gb=125"],
        "single",
        "2026-12-01-late-1-bench-nf4-400k.json:nf4-400k:single",
        host_gib=125,
    ),
    *(
        Run(
            f"4k rows: 8B {name}, 8 rows of 4,096 a step, compiled, kept",
            LONG,
            [*ROWS4K, "train.compile=true", *quant],
            "single",
            f"2026-12-02-4k-1-bench.json:{entry}:single",
        )
        for name, quant, entry in (("bf16", [], "bf16-4k-c"), ("fp8", ['model.quantize="fp8"'], "fp8-4k-c"))
    ),
    Run(
        "4k rows: 8B bf16, 8 rows of 4,096 a step, eager (night of 12-01)",
        LONG,
        ROWS4K,
        "single",
        "2026-12-01-night-4-bench-4k.json:bf16-4k:single",
    ),
    Run(
        "4k rows: 8B fp8, 8 rows of 4,096 a step, eager, quantization compiled",
        LONG,
        [*ROWS4K, 'model.quantize="fp8"'],
        "single",
        "2026-12-02-4k-4-bench.json:fp8-4k-e:single",
    ),
    *(
        Run(
            f"packed: 4B, 2 rows of 4,096 packed a step{note}",
            B4,
            ["data.packing=true", "data.max_length=4096", "train.batch_size=2", "parallel.n_microbatches=2", *extra],
            "single",
            f"2026-12-02-4k-{call}-bench.json:{entry}:single",
        )
        for call, note, extra, entry in (
            (2, "", [], "packed4096"),
            (4, ", LoRA dropout 0", ["lora.dropout=0.0"], "packed-d0"),
        )
    ),
    Run(
        "packed: the 4B bench config unpacked, same call",
        B4,
        [],
        "single",
        "2026-12-02-4k-2-bench.json:unpacked:single",
    ),
    Run(
        "packed: 4B, 2 rows of 4,096 packed a step, LoRA dropout 0 (second session)",
        B4,
        [*PACKED4K, "parallel.n_microbatches=2", "lora.dropout=0.0"],
        "single",
        "2026-12-02-pa-1-bench.json:packed-flex:single",
    ),
    Run(
        "packed: 4B, 2 rows of 4,096 packed in one microbatch, LoRA dropout 0",
        B4,
        [*PACKED4K, "parallel.pp=1", "parallel.n_microbatches=1", "lora.dropout=0.0"],
        "single",
        "2026-12-02-pa-4-bench.json:packed-mb1:single",
    ),
    *(
        Run(
            f"4k rows: 8B bf16, {rows} rows of 4,096 a microbatch, 8 a step, compiled{graphs}",
            LONG,
            [
                *ROWS4K,
                "train.compile=true",
                f"train.batch_size={rows}",
                f"train.grad_accum={8 // rows}",
                *(["train.cuda_graphs=true"] if graphs else []),
            ],
            "single",
            f"2026-12-02-pa-{call}-bench.json:bf16-4k-mb{rows}{'-graphs' if graphs else ''}:single",
        )
        for call, rows, graphs in ((3, 2, ""), (4, 4, ""), (5, 2, ", CUDA graphs"), (5, 4, ", CUDA graphs"))
    ),
    *(
        _in_matmul_run(
            f"4k rows: 8B bf16, {rows} rows of 4,096 a microbatch, 8 a step, compiled{note} (12-02 call {call})",
            LONG,
            [*ROWS4K, "train.compile=true", f"train.grad_accum={8 // rows}"],
            call,
            rows,
            bool(note),
            entry,
        )
        for call, rows, note, entry in (
            (2, 4, "", "bf16-4k-mb4"),
            (2, 4, ", the adapters in the matmuls", "bf16-4k-mb4-im"),
            (3, 4, "", "bf16-4k-mb4-b"),
            (3, 4, ", the adapters in the matmuls", "bf16-4k-mb4-im-b"),
            (3, 2, ", the adapters in the matmuls", "bf16-4k-mb2-im"),
        )
    ),
    *(
        _in_matmul_run(
            f"packed: 4B, {rows} rows of 4,096 packed in one microbatch, LoRA dropout 0{note} (12-02 call {call})",
            B4,
            [*PACKED4K, "parallel.pp=1", "parallel.n_microbatches=1", "lora.dropout=0.0"],
            call,
            rows,
            bool(note),
            entry,
        )
        for call, rows, note, entry in (
            (2, 2, "", "packed-mb1"),
            (2, 2, ", the adapters in the matmuls", "packed-mb1-im"),
            (4, 4, ", the adapters in the matmuls", "packed-4rows-im"),
        )
    ),
    *(
        _in_matmul_run(
            f"packed: 4B, {label}, one microbatch, LoRA dropout 0, the adapters in the matmuls (12-02 fx call {call})",
            B4,
            ["data.packing=true", *rows, "parallel.pp=1", "parallel.n_microbatches=1", "lora.dropout=0.0"],
            call,
            batch,
            True,
            entry,
            "fx",
        )
        for call, label, rows, batch, entry in (
            (3, "2 rows of 8,192", ["data.max_length=8192"], 2, "packed8k-2rows-im"),
            (4, "whole meetings in 1 row of 16,384", WHOLE16K, 1, "whole16k-1row-im"),
            (6, "whole meetings in 1 row of 16,384, best fit", WHOLE16K, 1, "whole16k-bestfit-24"),
        )
    ),
    Run(
        "packed: 4B, whole meetings in 1 row of 16,384, 109 steps of the first epoch timed, LoRA dropout 0, the "
        "adapters in the matmuls (12-02 we call 1)",
        B4,
        ["data.packing=true", *WHOLE16K, "parallel.pp=1", "parallel.n_microbatches=1", "lora.dropout=0.0"]
        + ["train.batch_size=1", "lora.adapter_in_matmul=true", "train.cuda_graphs=false"],
        "single",
        "2026-12-02-we-flexE-metrics.csv:2",
    ),
    Run(
        'packed: 4B, the same epoch (118 steps timed) with train.packed_attention = "documents", cuDNN\'s plans built '
        "per thread (12-02 sp call 2)",
        B4,
        ["data.packing=true", *WHOLE16K, "parallel.pp=1", "parallel.n_microbatches=1", "lora.dropout=0.0"]
        + ["train.batch_size=1", "lora.adapter_in_matmul=true", "train.cuda_graphs=false"]
        + ["data.synthetic_validation=0", 'train.packed_attention="documents"'],
        "single",
        "2026-12-02-sp-docsB-metrics.csv:2",
    ),
]
"""Every pipetune training run on 2x H200 in benchmarks/journal/results (the seed script and the baselines are not
pipetune's; the 72B runs of part A's first call ran a planner since fixed), and the long rows on one H200."""


def measured(run: Run) -> dict:
    """tokens/s, peak and reserved GB per rank, as the run recorded them."""
    file, *rest = run.source.split(":")
    path = RESULTS / file
    if file.endswith(".json"):
        key, strategy = rest
        entry = next(r for r in json.loads(path.read_text())[key] if r["strategy"] == strategy)
        return {
            "tokens_per_sec": entry["tokens_per_sec"],
            "peak": entry["peak_gb_per_rank"],
            "reserved": entry.get("reserved_gb_per_rank") or [],
        }
    warmup = int(rest[0])
    with open(path) as f:
        rows = [row for row in csv.DictReader(f) if int(row["step"]) > warmup]
    ranks = sorted(k for k in rows[0] if k.startswith("peak_gb_rank"))
    reserved = sorted(k for k in rows[0] if k.startswith("reserved_gb_rank") and rows[0][k])
    rates = [float(r["tokens_per_sec"]) for r in rows]
    seconds = [float(r["step_time_sec"]) for r in rows]
    # The plan predicts a steady step (the median's), and for packed rows, whose steps' work varies with their
    # documents, the epoch's mean: their timed steps' tokens over their time.
    packed = bool(rows[0].get("attention_share"))
    return {
        "tokens_per_sec": sum(map(operator.mul, rates, seconds)) / sum(seconds) if packed else statistics.median(rates),
        "peak": [max(float(r[k]) for r in rows) for k in ranks],
        "reserved": [max(float(r[k]) for r in rows) for k in reserved],
    }


BEFORE_AUTO = {
    "lora.fast_path": "false",
    "lora.adapter_in_matmul": "false",
    "train.compile": "false",
    "train.cuda_graphs": "false",
    "train.layers_per_graph": "1",
    "train.fused_loss": "false",
    "train.packed_attention": '"flex"',
    "train.activation_checkpointing": "false",
    "train.mlp_chunk": "0",
    "parallel.n_microbatches": "8",
}
"""The speed switches' defaults until 2026-12-06, when they became "auto": every run here ran with them wherever
its config file and its overrides set nothing else."""


def rebuild(run: Run):
    table = tomllib.loads((ROOT / run.config).read_text())
    written = {f"{section}.{key}" for section, keys in table.items() for key in keys}
    written |= {item.partition("=")[0].strip() for item in run.overrides}
    before = [f"{key}={value}" for key, value in BEFORE_AUTO.items() if key not in written]
    config = load_config(ROOT / run.config, [*before, *run.overrides])
    if run.strategy != config.parallel.strategy or run.strategy in ("ddp", "fsdp"):
        config = strategy_config(config, run.strategy, 1, 1, Path("/tmp/plan-check"))
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=None, help="rates JSON from benchmarks/tools/plan_calibrate.py")
    parser.add_argument("--out", default=None, help="write the markdown table here (default: stdout)")
    args = parser.parse_args()
    rates = GpuRates.load(args.rates) if args.rates else GpuRates()
    lines = [
        "# `pipetune plan` against the measured runs (2x H200; the long rows on one)",
        "",
        "Generated by `PYTHONPATH=src python3 benchmarks/tools/plan_check.py --out benchmarks/journal/plan-check.md`"
        + (f" --rates {args.rates}" if args.rates else "")
        + ": every pipetune training run in benchmarks/journal/results, rebuilt as the config it ran, predicted by the "
        "plan's models (memory: parallel/memory.py; speed: planner/speed.py) beside what it measured. Memory is "
        "compared per pipeline rank with `max_memory_allocated` (`peak_gb_rank<i>`), and with the allocator's "
        "reservation (`reserved_gb_rank<i>`) where CUDA graphs ran: their pools are not in the allocated figure "
        "(runs that recorded no reservation say so). Speed rows marked 'not counted' ran the profiler or code "
        "since changed.",
        "",
        "| run | layout | tokens/s measured | predicted | error | peak GB per rank measured | predicted | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    speed_errors, memory_errors = [], []
    for run in RUNS:
        config = rebuild(run)
        seen = measured(run)
        p = config.parallel
        gpus = p.pp * p.dp * getattr(p, "tp", 1)
        budget = None if config.train.memory_gb > 0 else H200_MEMORY  # None: train.memory_gb
        host = run.host_gib * 2**30 if run.host_gib else None  # None: this machine's
        share = attention_share(config)  # as `pipetune plan` counts packed rows' attention
        plan = make_plan(
            config, gpus, budget, rates, layouts=[Layout.of(config)], host_memory=host, attention_share=share
        )
        prediction = plan.predictions[0]
        graphs = prediction.mode == "graphs"
        figure = seen["reserved"] if graphs else seen["peak"]
        kind = " reserved" if graphs else ""
        predicted = [peak / GB for peak in prediction.peaks]
        if figure and len(figure) != len(predicted):  # dp replicas of one stage: one figure per pipeline rank
            figure = [max(figure[r * p.dp : (r + 1) * p.dp]) for r in range(p.pp)]
        errors = [(pr - m) / m for pr, m in zip(predicted, figure, strict=True)] if figure else []
        memory_errors += errors
        speed_error = (prediction.tokens_per_sec - seen["tokens_per_sec"]) / seen["tokens_per_sec"]
        if run.speed:
            speed_errors.append(speed_error)
        note = f" ({run.note})" if run.note else ""
        layout = f"{prediction.layout.describe()}, {prediction.layout.batching()}, ckpt {prediction.checkpointing()}"
        lines.append(
            f"| {run.name}{note} | {layout} | {seen['tokens_per_sec']:,.0f} | {prediction.tokens_per_sec:,.0f} | "
            f"{speed_error:+.0%}{'' if run.speed else ' (not counted)'} | "
            f"{' / '.join(f'{m:.1f}' for m in figure) or 'not recorded'}{kind} | "
            f"{' / '.join(f'{x:.1f}' for x in predicted)} | {' / '.join(f'{e:+.0%}' for e in errors)} |"
        )
    within = lambda errors, bound: sum(abs(e) <= bound for e in errors)  # noqa: E731
    lines += [
        "",
        f"Rates: {rates.name}. Speed: {len(speed_errors)} runs counted, median |error| "
        f"{statistics.median(abs(e) for e in speed_errors):.1%}, {within(speed_errors, 0.15)} within 15%. "
        f"Memory: {len(memory_errors)} ranks, median |error| {statistics.median(abs(e) for e in memory_errors):.1%}, "
        f"{within(memory_errors, 0.10)} within 10%.",
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
