"""A decoder layer's base matmuls, each timed alone at the shape and layout the default path runs it, and stacked.

With lora.adapter_in_matmul each LoRA linear's matmul takes its input extended by its group's down-projections
(padded to model/lora.py's EXTENDED_MULTIPLE columns): forward `extended [M, K+R] @ weight [N, K+R]^T`, backward
`grad [M, N] @ weight [N, K+R]`. Where a run's time goes among them, and whether one matmul over the members of a
group (q, k and v; gate and up) would be faster than each alone plus the adds of their input gradients, is read
here on one GPU, without the rest of a layer around it: each shape timed with CUDA events over calls issued back
to back, its TFLOP/s beside a large square matmul's (the GPU's practical peak for this dtype). Under the GPU's
power limit one shape timed twice in a row differed by up to 12% on an H100 (gate's and up's forward,
2026-12-07-where-the-step-goes-one-h100.md): read differences of a few percent as noise.

    python3 benchmarks/tools/matmul_shapes.py --config configs/qwen3-4b-meetings.toml --set model.name=qwen3-4b \
        [--tokens 16384] [--repeats 20] [--out shapes.json]

On a CPU (--set model.name=tiny-qwen3 --tokens 64 --repeats 1) it checks that it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pipetune.config import load_config  # noqa: E402
from pipetune.model.lora import extended_padding  # noqa: E402
from pipetune.model.shapes import head_dim, resolve_model  # noqa: E402
from pipetune.planner.calibrate import Mark  # noqa: E402


def extended(width: int, ranks: int) -> int:
    """An extended input's columns: `width` and the group's `ranks`, padded as model/lora.py pads them."""
    return width + ranks + extended_padding(ranks)


def layer_matmuls(config, r: int) -> dict[str, list[tuple[str, int, int]]]:
    """Each group's matmuls as (name, N: outputs, K: the extended input's columns), by group."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * head_dim(config), config.num_key_value_heads * head_dim(config)
    qkv, gate_up = extended(hidden, 3 * r), extended(hidden, 2 * r)
    return {
        "qkv": [("q", q, qkv), ("k", kv, qkv), ("v", kv, qkv)],
        "o": [("o", hidden, extended(q, r))],
        "gate_up": [("gate", inter, gate_up), ("up", inter, gate_up)],
        "down": [("down", hidden, extended(inter, r))],
    }


def timed(fn, repeats: int, device: torch.device) -> float:
    """Seconds a call of `fn`, over `repeats` calls issued back to back after two untimed ones (the planner's
    marks: CUDA events on a GPU, the host's clock on a CPU)."""
    for _ in range(2):
        fn()
    start = Mark(device)
    for _ in range(repeats):
        fn()
    return start.seconds_to(Mark(device)) / repeats


def group_rows(name, members, tokens, dtype, device, repeats) -> list[dict]:
    """The group's forward and backward matmuls, each member alone and, for groups of several, stacked: one
    forward over the stacked weights, and one backward over the members' gradients side by side (no adds)."""
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
    width = members[0][2]
    x = make(tokens, width)
    weights = [make(n, k) for _, n, k in members]
    grads = [make(tokens, n) for _, n, _ in members]
    rows = []

    def add(label, fn, flops):
        seconds = timed(fn, repeats, device)
        rows.append({"matmul": label, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12})

    for (member, n, k), w, g in zip(members, weights, grads, strict=True):
        add(f"{member} forward [{tokens}, {k}] @ [{n}, {k}]^T", lambda x=x, w=w: x @ w.t(), 2 * tokens * n * k)
        add(f"{member} backward [{tokens}, {n}] @ [{n}, {k}]", lambda g=g, w=w: g @ w, 2 * tokens * n * k)
    if len(members) > 1:
        total = sum(n for _, n, _ in members)
        stacked, grad = torch.cat(weights), torch.cat(grads, dim=1)
        flops = 2 * tokens * total * width
        add(f"{name} stacked forward [{tokens}, {width}] @ [{total}, {width}]^T", lambda: x @ stacked.t(), flops)
        add(f"{name} stacked backward [{tokens}, {total}] @ [{total}, {width}]", lambda: grad @ stacked, flops)
        outs = [g @ w for g, w in zip(grads, weights, strict=True)]
        add(f"{name} adds of {len(members)} input gradients", lambda: sum(outs[1:], outs[0]), 0)
    return rows


def stacking(rows: list[dict], groups: dict[str, list[tuple[str, int, int]]]) -> list[str]:
    """For each group of several members: its members' forwards against the stacked forward, and their backwards
    with the adds of their input gradients against the stacked backward."""
    ms = {row["matmul"].split(" [")[0]: row["ms"] for row in rows}
    lines = []
    for group, members in groups.items():
        if len(members) < 2:
            continue
        alone_f = sum(ms[f"{m} forward"] for m, _, _ in members)
        alone_b = (
            sum(ms[f"{m} backward"] for m, _, _ in members) + ms[f"{group} adds of {len(members)} input gradients"]
        )
        lines.append(
            f"{group}: forward {alone_f:.3f} ms alone, {ms[f'{group} stacked forward']:.3f} stacked; backward "
            f"{alone_b:.3f} ms alone with the adds, {ms[f'{group} stacked backward']:.3f} stacked"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--tokens", type=int, help="a microbatch's tokens (default: data.max_length)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="matmul-shapes.json")
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.tokens or config.data.max_length
    shape = resolve_model(dataclasses.replace(config.model, init="random")).config
    rows = []
    side = 8192 if device.type == "cuda" else 64
    square = torch.randn(side, side, dtype=dtype, device=device)
    seconds = timed(lambda: square @ square, args.repeats, device)
    rows.append(
        {
            "matmul": f"square [{side}, {side}] @ [{side}, {side}]",
            "ms": seconds * 1e3,
            "tflops": 2 * side**3 / seconds / 1e12,
        }
    )
    groups = layer_matmuls(shape, config.lora.r)
    for name, members in groups.items():
        rows += group_rows(name, members, tokens, dtype, device, args.repeats)
    peak = rows[0]["tflops"]
    for row in rows:
        print(f"{row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s {row['tflops'] / peak:6.1%}  {row['matmul']}")
    for line in stacking(rows, groups):
        print(line)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    Path(args.out).write_text(json.dumps({"device": device_name, "tokens": tokens, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
