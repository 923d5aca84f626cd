"""Packed rows' document attention, each kernel against a float32 reference and timed: one layer's attention.

A config's training samples are packed as a run packs them (data.packing: first fit, at most
data.max_samples_per_row a row, rows of data.max_length); the first `--rows` rows' position ids give each kernel
its document mask, and random query / key / value of the model's heads go through forward and backward:

- "flash": flash attention's variable-length kernel over the document offsets (what a packed run uses on a GPU,
  train.packed_attention = "auto"; on a CPU its reference kernel),
- "flex": flex attention, compiled, with the block mask of 128 x 128 tiles (train.packed_attention = "flex";
  GPU only: torch has no flex backward on the CPU),

each checked against causal SDPA on each sample alone in float32 (output and the query / key / value gradients:
the largest absolute error, and the error's norm over the reference's) and timed forward + backward (CUDA events
around `--repeats` calls after `--warmup`; milliseconds a row).

    python3 benchmarks/tools/packed_attention.py --config configs/bench-qwen3-4b.toml \
        --set data.packing=true --set data.max_length=4096 --rows 2 --out packed-attention.json

`--probes` adds variants no run uses (`kernels`). On a CPU it checks that it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pipetune.config import load_config  # noqa: E402
from pipetune.data.cache import tokenized_data  # noqa: E402
from pipetune.data.packing import epoch_rows  # noqa: E402
from pipetune.model.attention import (  # noqa: E402
    DocumentOffsets,
    DocumentSpans,
    document_block_mask,
    document_offsets,
    spans_attention,
    varlen_attention,
)
from pipetune.preflight import prepare  # noqa: E402


def packed_positions(config, rows: int) -> tuple[torch.Tensor, int]:
    """([rows, max_length] position ids, their samples' tokens) of the first packed rows of the config's training
    split (epoch 0)."""
    d = config.data
    prompts = prepare(config, speak=False).prompts
    lengths = tokenized_data(d, prompts, config.train.seed).splits["train"].lengths
    packed = epoch_rows(lengths, d.max_length, d.max_samples_per_row, config.train.seed, 0)[:rows]
    positions, real = [], 0
    for members in packed.tolist():
        sizes = [min(int(lengths[i]), d.max_length) for i in members if i >= 0]
        pads = d.max_length - sum(sizes)
        positions.append(torch.cat([torch.arange(n) for n in [*sizes, pads] if n > 0]))
        real += sum(sizes)
    return torch.stack(positions), real


def kernels(position_ids: torch.Tensor, per_row: int, device: torch.device, probes: bool) -> dict:
    """name -> attention(query, key, value) as [b, s, heads, d], for the kernels this device runs; with `probes`
    also variants no run uses (measurements of what a lever could give):

    - "flash-tight": the offsets of the rows' documents alone (no empty ones) and their longest length rounded up
      to 128 as the kernel's bound (not static from step to step: what the static bound costs),
    - "flex-tma": flex with TMA loads and every row known to attend somewhere (kernel options),
    - "flex-64": flex over a block mask of 64 x 64 tiles (fewer pairs of two documents computed and dropped)."""
    documents = document_offsets(position_ids, per_row)
    chosen = {"flash": lambda q, k, v: varlen_attention(q, k, v, documents, None)}
    if probes:
        spans = DocumentSpans.of(position_ids.cpu())
        seq = position_ids.shape[1]
        bounds = [row * seq + start for row, row_spans in enumerate(spans.rows) for start, _ in row_spans]
        offsets = torch.tensor([*bounds, position_ids.numel()], dtype=torch.int32, device=device)
        longest = max(end - start for row in spans.rows for start, end in row)
        tight = DocumentOffsets(offsets, -(-longest // 128) * 128)
        chosen["flash-tight"] = lambda q, k, v: varlen_attention(q, k, v, tight, None)
    if device.type == "cuda":
        mask = document_block_mask(position_ids)
        flex = torch.compile(flex_attention, dynamic=False)
        chosen["flex"] = lambda q, k, v: flex(q, k, v, block_mask=mask, enable_gqa=True).transpose(1, 2)
        if probes:
            options = {"USE_TMA": True, "ROWS_GUARANTEED_SAFE": True}
            chosen["flex-tma"] = lambda q, k, v: flex(
                q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options
            ).transpose(1, 2)
            small = document_block_mask(position_ids, 64)
            chosen["flex-64"] = lambda q, k, v: flex(q, k, v, block_mask=small, enable_gqa=True).transpose(1, 2)
    return chosen


def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    names = ("out", "grad_q", "grad_k", "grad_v")
    return {
        name: {
            "max_abs": float((g.float() - w).abs().max()),
            "relative": float((g.float() - w).norm() / w.norm()),
        }
        for name, g, w in zip(names, got, want, strict=True)
    }


def run(kernel, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    for tensor in inputs:
        tensor.grad = None
    out = kernel(*inputs)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in inputs)]


def timed(kernel, inputs: list[torch.Tensor], grad: torch.Tensor, warmup: int, repeats: int) -> float:
    """Milliseconds of one forward + backward (CUDA events around `repeats` calls; wall time on a CPU)."""
    import time

    for _ in range(warmup):
        run(kernel, inputs, grad)
    cuda = inputs[0].is_cuda
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    for _ in range(repeats):
        run(kernel, inputs, grad)
    if cuda:
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats
    return (time.perf_counter() - began) * 1e3 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rows", type=int, default=2, help="packed rows (one microbatch)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--probes", action="store_true", help="also the variants no run uses (see kernels)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    config = load_config(args.config, args.set)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf = prepare(config, speak=False).model.config
    heads, kv_heads = hf.num_attention_heads, hf.num_key_value_heads
    dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    position_ids, real = packed_positions(config, args.rows)
    spans = DocumentSpans.of(position_ids)
    position_ids = position_ids.to(device)
    rows, seq = position_ids.shape
    torch.manual_seed(0)
    inputs = [torch.randn(rows, n, seq, dim, device=device, dtype=dtype) for n in (heads, kv_heads, kv_heads)]
    inputs = [t.requires_grad_(True) for t in inputs]
    grad = torch.randn(rows, seq, heads, dim, device=device, dtype=dtype)
    reference_inputs = [t.detach().float().requires_grad_(True) for t in inputs]
    want = run(lambda q, k, v: spans_attention(q, k, v, spans, None).transpose(1, 2), reference_inputs, grad.float())

    results = {
        "config": args.config,
        "overrides": args.set,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rows": rows,
        "seq": seq,
        "heads": [heads, kv_heads, dim],
        "documents_a_row": [len(row) for row in spans.rows],
        "pad_share": 1 - real / (rows * seq),
        "kernels": {},
    }
    per_row = config.data.max_samples_per_row + 1
    for name, kernel in kernels(position_ids, per_row, device, args.probes).items():
        try:
            got = run(kernel, inputs, grad)
        except Exception as error:  # a probe a torch version lacks: said, and the others still measured
            if name in ("flash", "flex"):  # what runs use must work
                raise
            print(f"{name:11s} failed: {type(error).__name__}: {str(error)[:300]}")
            results["kernels"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        ms = timed(kernel, inputs, grad, args.warmup, args.repeats)
        results["kernels"][name] = {"ms_a_row": ms / max(rows, 1), "errors": errors(got, want)}
        worst = max(e["relative"] for e in results["kernels"][name]["errors"].values())
        print(f"{name:11s} {ms / max(rows, 1):8.3f} ms a row (forward + backward)  worst relative error {worst:.2e}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
