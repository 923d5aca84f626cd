"""LoRA dropout in compiled layers: inductor's own random numbers vs ATen's, and no dropout as the floor.

The profile of a compiled Qwen3-4B stage (2026-11-29-speed-h200.md) shows the largest non-matmul kernels
to be inductor's fusions of the norm or residual with LoRA dropout; the norm + dropout one takes ~100 us per
call for [2048, 2560] at a fraction of the memory rate. Dropout draws 54.5 M random numbers per layer
forward (its input, for each of the 7 adapted projections). Inductor draws each with a full Philox round
and keeps one of its four outputs; ATen's dropout kernel keeps all four. `torch._inductor.config.fallback_random`
makes compiled code call ATen's random ops.

Prediction (written before the run): with fallback_random a layer's forward + backward at [4, 512] takes
>= 0.15 ms less than with inductor's random numbers (of ~2.3 ms); without dropout, ~0.3 ms less.

Layers are compiled without CUDA graphs, so the batch must be large enough for the GPU, not the host, to
set the pace: measured (NOTES.md) with

    python3 benchmarks/tools/dropout_rng.py --layers 4 --batch 16 --steps 10
"""

from __future__ import annotations

import argparse
import time

import torch

from pipetune.config import LoraConfig, ModelConfig
from pipetune.model.shapes import resolve_model
from pipetune.parallel.assemble import StagePart, build_stage_modules, compile_stages


def layer_ms(args: argparse.Namespace, device: torch.device, fallback_random: bool, dropout: float) -> float:
    """Median milliseconds of one layer's forward + backward, over `args.steps` steps after warm-up."""
    torch._dynamo.reset()
    torch._inductor.config.fallback_random = fallback_random
    resolved = resolve_model(ModelConfig(name=args.model, init="random"))
    lora = LoraConfig(r=16, alpha=32, dropout=dropout, fast_path=True)
    # grouped=False: without dropout too, the same 7 down-projections, without masks
    built = build_stage_modules(
        resolved, torch.bfloat16, lora, [StagePart(list(range(args.layers)))], device, grouped=False
    )
    (stage,) = built.modules
    compile_stages([stage])  # no CUDA graphs: a leaf input reused across steps trips their output checks
    hidden = resolved.config.hidden_size
    x = torch.randn(args.batch, args.seq, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    times = []
    for step in range(args.warmup + args.steps):
        torch.compiler.cudagraph_mark_step_begin()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        stage(x).backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append((time.perf_counter() - start) * 1000 / args.layers)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-4b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)
    results = {}
    for name, fallback, dropout in (
        ("inductor random", False, 0.15),
        ("ATen random (fallback_random)", True, 0.15),
        ("no dropout", False, 0.0),
    ):
        started = time.perf_counter()
        results[name] = layer_ms(args, device, fallback, dropout)
        print(f"{name}: {results[name]:.3f} ms per layer forward + backward ({time.perf_counter() - started:.0f} s)")
    base = results["inductor random"]
    for name, ms in results.items():
        print(f"  {name}: {ms:.3f} ms, {ms / base:.3f}x")


if __name__ == "__main__":
    main()
