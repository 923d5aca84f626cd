"""Packed rows' document attention timed and checked: flex attention as a run calls it, against kernel-option
variants and inductor's own autotuned search (one layer's attention, forward + backward).

A config's training samples are packed as a run packs them (data.packing, epoch 0); the first `--rows` rows'
position ids give the document mask (model/attention.py: 128 x 128 tiles), and random query / key / value of the
model's heads go through forward and backward:

- "as run": flex attention, compiled, as a run calls it: no kernel options (torch's own heuristic config for
  this GPU),
- each variant of VARIANTS: kernel options (tile sizes, warps, stages of the forward or of the backward kernels),
- "autotuned" (`--autotune`): flex compiled with mode="max-autotune-no-cudagraphs", where inductor times its own
  list of forward and backward configs and keeps the fastest (its choice is printed in inductor's AUTOTUNE lines),
- "cudnn varlen" (`--varlen`): cuDNN's variable-length attention (torch's `aten._cudnn_attention_forward` /
  `_backward` with the documents' offsets in the rows laid end to end, the row length as the static bound), each
  document attended exactly, no tiles, the key-value heads repeated to the query heads ("cudnn varlen gqa" passes
  them grouped, which torch's own varlen wrapper refuses for cuDNN); "cudnn varlen static" over
  data.max_samples_per_row + 1 offsets a row, the rows with fewer ending in empty documents (the static shape a
  compiled, graphed run needs). On whole meetings in rows of 16,384, flex's attention cost ~1.4x Unsloth's per
  token pair (~407 against ~575 TFLOP/s: journal/2026-12-02-flex-and-best-fit-one-h200.md).

Each is checked against causal SDPA on each sample alone in float32 (output and the query / key / value gradients:
the error's norm over the reference's) and timed (CUDA events around `--repeats` calls after `--warmup`;
milliseconds a row, forward + backward; the variants change the forward's kernel or the backward's, so the name
says which moved).

    python3 benchmarks/tools/packed_attention.py --config configs/bench-qwen3-4b.toml \
        --set data.packing=true --set data.max_length=4096 --rows 4 --autotune --out packed-attention.json

On a CPU (no flex backward there, no cuDNN) it runs what a CPU run uses, SDPA per document, and with `--varlen`
the variable-length layout (`varlen_layout`, `from_varlen`) around SDPA per document: a check that the tool
starts and packs, and that the layout the cuDNN kernel is given is the rows' documents.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pipetune.config import load_config  # noqa: E402
from pipetune.data.cache import tokenized_data  # noqa: E402
from pipetune.data.packing import epoch_rows  # noqa: E402
from pipetune.model.attention import (  # noqa: E402
    DocumentSpans,
    document_block_mask,
    document_ids,
    spans_attention,
)
from pipetune.preflight import prepare  # noqa: E402

VARIANTS: dict[str, dict] = {
    # the forward kernel (torch 2.11-2.13 on an H100/H200: 128 x 64 tiles, 8 warps, 3 stages)
    "fwd 128x128 w8 s2": {"BLOCK_M": 128, "BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd 128x64 w8 s2": {"BLOCK_M": 128, "BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd 128x64 w4 s3": {"BLOCK_M": 128, "BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd 64x64 w4 s3": {"BLOCK_M": 64, "BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd 64x128 w4 s3": {"BLOCK_M": 64, "BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
    # the backward kernels (torch's H100/H200 choice: M1 64, N1 128, M2 128, N2 64, 8 warps, 3 stages)
    "bwd 64/64 w4 s3": {
        "BLOCK_M1": 64,
        "BLOCK_N1": 64,
        "BLOCK_M2": 64,
        "BLOCK_N2": 64,
        "bwd_num_warps": 4,
        "bwd_num_stages": 3,
    },
    "bwd 32/64 w4 s3": {
        "BLOCK_M1": 32,
        "BLOCK_N1": 64,
        "BLOCK_M2": 64,
        "BLOCK_N2": 32,
        "bwd_num_warps": 4,
        "bwd_num_stages": 3,
    },
    "bwd 64/128 w4 s3": {
        "BLOCK_M1": 64,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 64,
        "bwd_num_warps": 4,
        "bwd_num_stages": 3,
    },
    "bwd 64/128 w8 s2": {
        "BLOCK_M1": 64,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 64,
        "bwd_num_warps": 8,
        "bwd_num_stages": 2,
    },
    "bwd 32/128 w4 s3": {
        "BLOCK_M1": 32,
        "BLOCK_N1": 128,
        "BLOCK_M2": 128,
        "BLOCK_N2": 32,
        "bwd_num_warps": 4,
        "bwd_num_stages": 3,
    },
    # what the kernels may assume of this mask: every row attends somewhere (its own token)
    "rows safe": {"ROWS_GUARANTEED_SAFE": True},
}
"""Kernel options tried beside a run's (`--variants` picks some by name)."""


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


def varlen_layout(position_ids: torch.Tensor, per_row: int = 0) -> torch.Tensor:
    """int32 offsets of packed rows' documents in their tokens laid end to end (rows one after another; the last
    entry their count): a document starts where its position is 0 (the pad tail is one too). `per_row` 0: the
    documents there are ([documents + 1]); else a static [rows x per_row + 1], each row's list ending in empty
    documents (what a compiled, graphed run would pass: the same shape every step)."""
    flat = position_ids.flatten()
    if not per_row:
        starts = torch.nonzero(flat == 0).flatten()
        return torch.cat([starts, starts.new_tensor([flat.numel()])]).to(torch.int32)
    rows, seq = position_ids.shape
    docs = (document_ids(position_ids) - 1).contiguous()  # 0 for each row's first document
    assert int(docs[:, -1].max()) < per_row, "more documents in a row than per_row"
    wanted = torch.arange(per_row, device=docs.device).expand(rows, per_row).contiguous()
    starts = torch.searchsorted(docs, wanted) + torch.arange(rows, device=docs.device).unsqueeze(1) * seq
    return torch.cat([starts.flatten(), starts.new_tensor([rows * seq])]).to(torch.int32)


def to_varlen(t: torch.Tensor) -> torch.Tensor:
    """[b, heads, s, d] -> [b x s, heads, d], the rows' tokens end to end."""
    return t.transpose(1, 2).flatten(0, 1).contiguous()


def from_varlen(t: torch.Tensor, rows: int) -> torch.Tensor:
    """[b x s, heads, d] -> [b, s, heads, d]."""
    return t.unflatten(0, (rows, -1))


KERNEL_OUTPUTS: dict[str, list] = {}
"""What cuDNN's variable-length forward returned beside its output, by name: shape, dtype, device (the JSON's
"cudnn_outputs"). torch has no meta kernel for it, so a compiled path needs a hand-written fake of these."""


class CudnnVarlen(torch.autograd.Function):
    """Causal attention within each document of `offsets` ([total, heads, d] tensors), cuDNN's kernels."""

    @staticmethod
    def forward(ctx, query, key, value, offsets, bound):
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            query, key, value, None, offsets, offsets, bound, bound, True, 0.0, True, False
        )
        for name, t in (("out", out), ("logsumexp", lse), ("philox_seed", seed), ("philox_offset", offset)):
            KERNEL_OUTPUTS[name] = [list(t.shape), str(t.dtype), str(t.device)]
        ctx.save_for_backward(query, key, value, out, lse, seed, offset, offsets)
        ctx.bound = bound
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse, seed, offset, offsets = ctx.saved_tensors
        grads = torch.ops.aten._cudnn_attention_backward(
            grad.contiguous(), query, key, value, out, lse, seed, offset, None, offsets, offsets, ctx.bound,
            ctx.bound, 0.0, True,
        )  # fmt: skip
        return *grads, None, None


def varlen_kernels(position_ids: torch.Tensor, per_row: int) -> dict:
    """The variable-length kernels (see the module's doc): cuDNN's on a GPU, SDPA per document on a CPU; over the
    rows' own documents, and over a static list of `per_row` a row ("static": empty documents at each row's end)."""
    rows, seq = position_ids.shape
    layouts = {"": varlen_layout(position_ids), " static": varlen_layout(position_ids, per_row)}

    def run(kernel, offsets: torch.Tensor, grouped: bool):
        def attend(q, k, v):
            if not grouped:  # the key-value heads repeated to the query heads
                k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            return from_varlen(kernel(to_varlen(q), to_varlen(k), to_varlen(v), offsets), rows)

        return attend

    if position_ids.device.type != "cuda":

        def reference(q, k, v, offsets):  # [total, heads, d], SDPA on each (non-empty) document
            bounds = offsets.tolist()
            parts = [
                torch.nn.functional.scaled_dot_product_attention(
                    *(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True
                ).transpose(0, 1)
                for a, b in zip(bounds, bounds[1:], strict=False)
                if b > a
            ]
            return torch.cat(parts)

        return {f"varlen layout{name}": run(reference, offsets, False) for name, offsets in layouts.items()}

    def cudnn(q, k, v, offsets):
        return CudnnVarlen.apply(q, k, v, offsets, seq)

    chosen = {f"cudnn varlen{name}": run(cudnn, offsets, False) for name, offsets in layouts.items()}
    chosen["cudnn varlen gqa"] = run(cudnn, layouts[""], True)
    return chosen


def kernels(position_ids: torch.Tensor, names: list[str], autotune: bool, varlen: int) -> dict:
    """name -> attention(query, key, value) as [b, s, heads, d], for the kernels this device runs."""
    if position_ids.device.type != "cuda":
        spans = DocumentSpans.of(position_ids)
        chosen = {"as run": lambda q, k, v: spans_attention(q, k, v, spans, None).transpose(1, 2)}
        return chosen | (varlen_kernels(position_ids, varlen) if varlen else {})
    mask = document_block_mask(position_ids)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    def flex(options: dict | None, mode: str | None = None):
        compiled = torch.compile(flex_attention, dynamic=False, mode=mode)
        return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options).transpose(
            1, 2
        )

    chosen = {"as run": flex(None)}
    chosen.update({name: flex(VARIANTS[name]) for name in names})
    if autotune:
        chosen["autotuned"] = flex(None, "max-autotune-no-cudagraphs")
    return chosen | (varlen_kernels(position_ids, varlen) if varlen else {})


def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    names = ("out", "grad_q", "grad_k", "grad_v")
    return {name: float((g.float() - w).norm() / w.norm()) for name, g, w in zip(names, got, want, strict=True)}


def run(kernel, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    for tensor in inputs:
        tensor.grad = None
    out = kernel(*inputs)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in inputs)]


def timed(call, warmup: int, repeats: int, cuda: bool) -> float:
    """Milliseconds of one call (CUDA events around `repeats` calls; wall time on a CPU)."""
    for _ in range(warmup):
        call()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    for _ in range(repeats):
        call()
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
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--autotune", action="store_true", help="also inductor's max-autotune search")
    parser.add_argument("--varlen", action="store_true", help="also cuDNN's variable-length kernel")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    names = [name for name in args.variants.split(",") if name]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    config = load_config(args.config, args.set)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
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
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "rows": rows,
        "seq": seq,
        "heads": [heads, kv_heads, dim],
        "documents_a_row": [len(row) for row in spans.rows],
        "pad_share": 1 - real / (rows * seq),
        "kernels": {},
    }
    per_row = config.data.max_samples_per_row + 1  # the trailing pads a document of their own
    for name, kernel in kernels(position_ids, names, args.autotune, args.varlen and per_row).items():
        began = time.perf_counter()
        try:
            got = run(kernel, inputs, grad)
        except Exception as error:  # an option a torch version refuses: said, the others still measured
            if name == "as run":
                raise
            print(f"{name:20s} failed: {type(error).__name__}: {str(error)[:300]}")
            results["kernels"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            continue
        compile_s = time.perf_counter() - began
        ms = timed(lambda kernel=kernel: run(kernel, inputs, grad), args.warmup, args.repeats, cuda)
        found = errors(got, want)
        results["kernels"][name] = {"ms_a_row": ms / rows, "compile_s": compile_s, "relative_errors": found}
        worst = max(found.values())
        print(f"{name:20s} {ms / rows:8.3f} ms a row  worst relative error {worst:.2e}  first call {compile_s:.0f} s")
    results["cudnn_outputs"] = KERNEL_OUTPUTS
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
