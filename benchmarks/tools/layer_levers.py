"""One decoder layer of a config, timed forward + backward under each speed lever, and profiled as it runs.

Which non-matmul work a layer does, and which lever removes it, decides where the next speed-up comes from: this
times a fresh layer (random weights, the run's dtype, adapters and LoRA path; `pipetune plan --calibrate`'s
timing: CUDA events around calls issued back to back) as the config runs it and with one lever changed at a
time, then prints the layer's kernels by GPU time, grouped (matmuls, attention, fused elementwise / norms,
other), under the config's own settings.

    python3 benchmarks/tools/layer_levers.py --config configs/bench-qwen3-4b.toml --microbatch 8 --out levers.json

The LoRA levers: "LoRA dropout 0" (no dropout masks, each adapter's down-projection its own matmul), "grouped
(dropout 0)" (no masks, and the down-projections of q/k/v and of gate/up as one matmul each: what a run does
without dropout), "shared_dropout" (the config's dropout with one mask per shared input, grouped: lora.shared_dropout);
the last two on the fast LoRA path. "max-autotune" (only when --levers names it: its autotuning takes minutes)
compiles with inductor's max_autotune (Triton matmul templates timed against cuBLAS, elementwise work fused into
the template picked): a lever not in training, timed here first. `--levers a,b` times only those, in that order;
`--no-profile` skips the kernel profile. "adapter in matmul" times the layer with each LoRA term computed inside
its base matmul (lora.adapter_in_matmul; "... K8" with its inner size padded to 8, not 64). "coordinate-descent"
tunes the block sizes of inductor's own fused kernels (elementwise, norms) by timing, a lever a run takes with
TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1.

GPU only for the SDPA backends and CUDA graphs; on a CPU (--set model.name="tiny-qwen3") it checks that it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import unittest.mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pipetune.config import Config, load_config  # noqa: E402
from pipetune.model.shapes import resolve_model  # noqa: E402
from pipetune.model.split import estimate_costs  # noqa: E402
from pipetune.planner.calibrate import time_layer  # noqa: E402
from pipetune.planner.speed import LayerWork  # noqa: E402

PEAK = 790e12


def sdpa(backend: str | None):
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))


IN_MATMUL_VARIANTS = {
    "adapter in matmul K8": ("EXTENDED_MULTIPLE", 8),
    "adapter in matmul groups only": ("IN_MATMUL_ALONE", False),
}
"""lora.adapter_in_matmul's variants: the setting of model/lora.py each one changes for its timing."""


def inductor_options(lever: str):
    """The "max-autotune" lever: inductor times Triton templates against cuBLAS for each matmul and may fuse the
    elementwise work after one (the adapters' adds, SwiGLU, the residual) into the template it picks (compiling
    takes minutes); "coordinate-descent": inductor tunes each fused elementwise and norm kernel's block sizes by
    timing its neighbours (TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 does it for a run); the others compile as a
    run does; "adapter in matmul K8" pads the extended matmuls' inner size to a multiple of 8 (16-byte
    rows) instead of cuBLAS's 64-wide tiles; "adapter in matmul groups only" leaves o_proj and down_proj (an
    input of their own: their extended input is a copy) on the fast path."""
    import torch._inductor.config as inductor

    if lever == "max-autotune":
        return inductor.patch(max_autotune=True, epilogue_fusion=True)
    if lever == "coordinate-descent":
        return inductor.patch(coordinate_descent_tuning=True)
    if lever in IN_MATMUL_VARIANTS:
        from pipetune.model import lora

        return unittest.mock.patch.object(lora, *IN_MATMUL_VARIANTS[lever])
    return contextlib.nullcontext()


def kernel_group(name: str) -> str:
    lowered = name.lower()
    if any(k in lowered for k in ("sdpa", "flash", "fmha", "attention", "efficient_attention")):
        return "attention"
    if any(k in lowered for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "addmm")):
        return "matmul"
    if lowered.startswith("triton"):
        return "fused (triton)"
    return "other"


def profile(config, work: LayerWork, mode: str, device: torch.device) -> dict:
    """The layer's kernels by device time over one `time_layer` (its warm-up calls included); the operators that
    launched kernels (CPU entries carrying their kernels' time) are left out, so each kernel counts once."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        time_layer(config, work, mode, device)
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "self_device_time_total", 0) or 0
        if total > 0 and event.device_type != torch.autograd.DeviceType.CPU:
            rows.append((event.key, total / 1e3, event.count))
    rows.sort(key=lambda r: -r[1])
    groups: dict[str, float] = {}
    for name, ms, _ in rows:
        groups[kernel_group(name)] = groups.get(kernel_group(name), 0.0) + ms
    return {"top": rows[:20], "groups_ms": groups}


def with_lora(config: Config, **changes: object) -> Config:
    """`config` with the LoRA settings `changes` (a copy)."""
    return dataclasses.replace(config, lora=dataclasses.replace(config.lora, **changes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--microbatch", type=int, default=8)
    parser.add_argument("--out", default="layer-levers.json")
    parser.add_argument("--no-profile", action="store_true", help="time the levers only (no kernel profile)")
    parser.add_argument(
        "--levers",
        help="comma-separated lever names to time, in that order (default: every one but max-autotune; e.g. "
        "'as configured,SDPA CUDNN_ATTENTION'); without LoRA dropout, 'as configured', 'grouped (dropout 0)' "
        "and 'shared_dropout' time the same layer",
    )
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    seq = config.data.max_length
    resolved = resolve_model(dataclasses.replace(config.model, init="random"))
    costs = estimate_costs(resolved.config, seq)
    work = LayerWork(costs, resolved.config.hidden_size, args.microbatch * seq, args.microbatch, seq, 1, resolved.name)
    own_mode = "graphs" if config.train.cuda_graphs else ("compiled" if config.train.compile else "eager")
    no_dropout = with_lora(config, dropout=0.0)
    variants = [  # name, config, mode, SDPA backend, grouped down-projections where the config allows them
        ("as configured", config, own_mode, None, True),
        ("LoRA dropout 0", no_dropout, own_mode, None, False),
        ("grouped (dropout 0)", with_lora(no_dropout, fast_path=True), own_mode, None, True),
        ("shared_dropout", with_lora(config, fast_path=True, shared_dropout=True), own_mode, None, True),
        ("compiled, no graphs", config, "compiled", None, True),
    ]
    if device.type == "cuda":
        variants += [
            (f"SDPA {b}", config, own_mode, b, True)
            for b in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")
        ]
    in_matmul = with_lora(config, fast_path=True, adapter_in_matmul=True)
    variants += [(name, in_matmul, own_mode, None, True) for name in ("adapter in matmul", *IN_MATMUL_VARIANTS)]
    if own_mode != "eager":
        variants.append(("coordinate-descent", config, own_mode, None, True))
    if own_mode != "eager" and args.levers and "max-autotune" in args.levers:  # minutes of autotuning: asked only
        variants.append(("max-autotune", config, own_mode, None, True))
    if args.levers:
        chosen = [name.strip() for name in args.levers.split(",")]
        known = [variant[0] for variant in variants]
        if unknown := [name for name in chosen if name not in known]:
            parser.error(f"--levers: unknown {unknown}; known here: {known}")
        variants = [next(variant for variant in variants if variant[0] == name) for name in chosen]  # their order
    results = []
    for name, variant, mode, backend, grouped in variants:
        torch._dynamo.reset()
        try:
            with sdpa(backend), inductor_options(name):
                forward, backward = time_layer(variant, work, mode, device, grouped)
        except Exception as error:  # a backend that does not serve this shape: say so, go on
            print(f"lever {name}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
            results.append({"lever": name, "error": f"{type(error).__name__}: {error}"[:500]})
            continue
        mfu = work.tokens * costs.layer / (forward + backward) / PEAK
        print(
            f"lever {name:<26} forward {forward * 1e3:7.3f} ms  backward {backward * 1e3:7.3f} ms  "
            f"layer MFU {mfu:6.1%}",
            flush=True,
        )
        results.append(
            {"lever": name, "mode": mode, "forward_ms": forward * 1e3, "backward_ms": backward * 1e3, "mfu": mfu}
        )
    if args.no_profile:
        Path(args.out).write_text(json.dumps({"work": dataclasses.asdict(work), "levers": results}, indent=1))
        return
    # Profiled without graphs (each kernel shows), after one untimed pass that compiles and autotunes.
    torch._dynamo.reset()
    profiled_mode = "compiled" if own_mode == "graphs" else own_mode
    time_layer(config, work, profiled_mode, device)
    prof = profile(config, work, profiled_mode, device)
    print(
        "  kernel groups (ms over the profiled calls): "
        + ", ".join(f"{g} {ms:.1f}" for g, ms in sorted(prof["groups_ms"].items(), key=lambda x: -x[1]))
    )
    for name, ms, count in prof["top"][:15]:
        print(f"  {ms:8.2f} ms {count:5d}x  {name[:110]}")
    Path(args.out).write_text(
        json.dumps({"work": dataclasses.asdict(work), "levers": results, "profile": prof}, indent=1)
    )


if __name__ == "__main__":
    main()
