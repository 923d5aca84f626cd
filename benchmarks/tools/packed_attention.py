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
- "documents": SDPA's fused kernel on each document alone (`attention.document_sdpa`, a run's
  train.packed_attention = "documents"; cuDNN's on an H200), over a static table of data.max_samples_per_row + 1
  spans a row (the rows with fewer end in empty spans). On whole meetings in rows of 16,384, flex's attention
  cost ~1.4x Unsloth's per token pair (~407 against ~575 TFLOP/s: journal/2026-12-02-flex-and-best-fit-one-h200.md).
  cuDNN builds a plan for each new shape, so `--new-lengths N` also times N calls on rows whose first two documents
  run at (padded) lengths it has not seen (`moved`, by multiples of NEW_LENGTH_SHIFT): what a run pays the first
  time it meets a length. "documents, one stream": the same with its documents on the current stream alone
  (attention.DOCUMENT_STREAMS = 1),
- "kernels alone" (timed, not checked): the fused kernel's forward and backward operators on each document at its
  exact length, on contiguous tensors made beforehand: what the documents kernel's calls would cost with nothing
  around them, and `--sweep L1,L2,...` the same on one document of each length, with the fit ms = a L^2 + b L + c
  (c: a document's cost whatever its length),
- `--head-rows N`: the last layer's attention on the loss's rows (model/head_rows.py, `head_rows_sdpa`) with each
  document's last N tokens chosen, as a summary's are: checked at those rows and timed,
- `--layouts L1,L2,...` (`--only-layouts`: nothing else): one document of each length through the fused kernel's
  operators as run, on contiguous tensors, with the key-value heads repeated, and through flash attention's,
  forward and backward timed apart (LAYOUTS; 2026-12-06-fast-by-default-seventh-round-one-h100.md).

Each is checked against causal SDPA on each sample alone in float32 (output and the query / key / value gradients:
the error's norm over the reference's) and timed (CUDA events around `--repeats` calls after `--warmup`;
milliseconds a row, forward + backward; the variants change the forward's kernel or the backward's, so the name
says which moved).

    python3 benchmarks/tools/packed_attention.py --config configs/bench-qwen3-4b.toml \
        --set data.packing=true --set data.max_length=4096 --rows 4 --autotune --out packed-attention.json

On a CPU (no flex backward there, no cuDNN) "as run" is what a CPU run takes, the documents kernel (the CPU's
flash attention on each document): a check that the tool starts and packs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from pipetune.config import load_config  # noqa: E402
from pipetune.data.cache import tokenized_data  # noqa: E402
from pipetune.data.packing import epoch_rows  # noqa: E402
from pipetune.model import attention  # noqa: E402
from pipetune.model.attention import document_block_mask, document_sdpa, span_table  # noqa: E402
from pipetune.model.head_rows import HeadRows, head_rows_sdpa  # noqa: E402
from pipetune.model.kept_attention import FLASH, sdpa_backend, sdpa_backward, sdpa_forward  # noqa: E402
from pipetune.model.shapes import head_dim as head_size  # noqa: E402
from pipetune.planner.calibrate import Mark  # noqa: E402
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


def reference(position_ids: torch.Tensor):
    """Causal SDPA on each document alone ([b, heads, s, d] in, [b, s, heads, d] out): what every kernel must give
    (zeros on a row's pad tail, which the documents kernel leaves out and `errors` does not compare)."""
    table = span_table(position_ids)

    def attend(q, k, v):
        out = torch.zeros_like(q)
        for row, spans in enumerate(table.tolist()):
            for start, end in spans:
                part = (slice(row, row + 1), slice(None), slice(start, end))
                out[part] = F.scaled_dot_product_attention(q[part], k[part], v[part], is_causal=True, enable_gqa=True)
        return out.transpose(1, 2)

    return attend


def documents(position_ids: torch.Tensor, per_row: int):
    """The documents kernel as a run calls it (`attention.document_sdpa` over the rows' `span_table`, static at
    `per_row` spans a row): [b, heads, s, d] in, [b, s, heads, d] out."""
    table = span_table(position_ids, per_row)
    return lambda q, k, v: document_sdpa(q, k, v, table, q.shape[-1] ** -0.5)[0].transpose(1, 2)


STREAMS = {"documents, one stream": 1}
"""The kernels run with other than attention.DOCUMENT_STREAMS streams (set around their forward and backward)."""


def kernels_alone(position_ids: torch.Tensor, heads: tuple[int, int, int], dtype):
    """A call that runs the fused kernel's forward and backward operators (kept_attention's) on each document of
    the rows at its exact length (but those of one token), on contiguous tensors made beforehand: the kernels' own
    time, with nothing of `document_sdpa` around them (no windows, padding, copies into the row or streams)."""
    device = position_ids.device
    docs = []
    for spans in span_table(position_ids).tolist():
        for start, end in spans:
            if end - start > 1:  # cuDNN refuses a one-token document alone (document_sdpa pads it to 64)
                q, k, v, g = (
                    torch.randn(1, n, end - start, heads[2], device=device, dtype=dtype)
                    for n in (heads[0], heads[1], heads[1], heads[0])
                )
                docs.append((q, k, v, g))
    backend = sdpa_backend(*docs[0][:3])
    scale = heads[2] ** -0.5

    def call():
        for q, k, v, g in docs:
            kept = sdpa_forward(q, k, v, scale, backend)
            sdpa_backward(g, q, k, v, kept.out, kept.logsumexp, kept, scale)

    return call


def sweep(lengths: list[int], heads: tuple[int, int, int], device, dtype, warmup: int, repeats: int) -> dict:
    """Milliseconds of the fused kernel's forward + backward on one document of each length (`kernels_alone`), and
    the least-squares fit ms = a (L / 1000)^2 + b (L / 1000) + c over them: c is what a document costs whatever
    its length (a launch, a last part-empty wave)."""
    found = {}
    for length in lengths:
        position_ids = torch.arange(length, device=device)[None]
        found[length] = timed(kernels_alone(position_ids, heads, dtype), warmup, repeats, device.type == "cuda")
        print(f"one document of {length:6d} tokens {found[length]:8.3f} ms forward + backward")
    x = torch.tensor([[(n / 1e3) ** 2, n / 1e3, 1.0] for n in found], dtype=torch.float64)
    fit = torch.linalg.lstsq(x, torch.tensor(list(found.values()), dtype=torch.float64)[:, None]).solution.flatten()
    print(f"fit: {fit[0]:.4f} ms (L/1000)^2 + {fit[1]:.4f} ms (L/1000) + {fit[2]:.4f} ms")
    return {"ms": {str(n): ms for n, ms in found.items()}, "fit_a_b_c": fit.tolist()}


LAYOUTS = ("as run", "contiguous", "expanded", "flash")
"""`--layouts`: one document through the fused kernel's operators as the documents kernel calls them ("as run":
[1, heads, L, d] views of [1, L, heads, d], grouped key-value heads as they are), on contiguous [1, heads, L, d]
tensors ("contiguous"), with the key-value heads repeated to the query's and their gradients summed back
("expanded", the repeat and the sum timed with it), and through flash attention's operators ("flash"; the
CPU's flash attention on a CPU, where all four run one kernel)."""


def layouts(lengths: list[int], heads: tuple[int, int, int], device, dtype, warmup: int, repeats: int) -> dict:
    """Each of LAYOUTS on one document of each length: forward and backward milliseconds apart, their TFLOP/s
    (causal: 2 L^2 heads d a forward, 2.5x that a backward) and the worst relative difference of the output and
    the gradients from "as run"'s (a layout that changes the math is not a speed-up)."""
    n_heads, n_kv, dim = heads
    scale = dim**-0.5
    cuda = device.type == "cuda"
    found: dict = {}
    for length in lengths:
        torch.manual_seed(0)
        made = [torch.randn(1, length, n, dim, device=device, dtype=dtype) for n in (n_heads, n_kv, n_kv, n_heads)]
        bshd = [t.transpose(1, 2) for t in made]  # [1, heads, L, d] views, as a layer's projections give them
        flops = 2 * length * length * n_heads * dim
        results, reference = {}, None
        for name in LAYOUTS:
            q, k, v, g = [t.contiguous() for t in bshd] if name == "contiguous" else bshd
            group = n_heads // n_kv
            expand = name == "expanded"
            backend = FLASH if name == "flash" else sdpa_backend(q, k, v)
            if name == "flash" and cuda and sdpa_backend(q, k, v) == FLASH:
                continue  # "as run" is flash attention already
            try:
                got, fwd_ms, bwd_ms = _time_layout(q, k, v, g, group if expand else 1, backend, scale, warmup, repeats)
            except Exception as error:  # a kernel this torch or GPU refuses: said, the others still measured
                print(f"one document of {length:6d} tokens {name:10s} failed: {type(error).__name__}: {error}"[:300])
                results[name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
                continue
            reference = reference or got
            diff = max(
                float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(got, reference, strict=True)
            )
            results[name] = {
                "forward_ms": fwd_ms,
                "backward_ms": bwd_ms,
                "forward_tflops": flops / fwd_ms / 1e9,
                "backward_tflops": 2.5 * flops / bwd_ms / 1e9,
                "difference": diff,
            }
            print(
                f"one document of {length:6d} tokens {name:10s} forward {fwd_ms:7.3f} ms ({flops / fwd_ms / 1e9:4.0f} "
                f"TFLOP/s)  backward {bwd_ms:7.3f} ms ({2.5 * flops / bwd_ms / 1e9:4.0f})  difference {diff:.1e}"
            )
        found[str(length)] = results
    return found


def _time_layout(q, k, v, g, group: int, backend: int, scale: float, warmup: int, repeats: int):
    """`layouts`' one kernel on one document: ([output, dq, dk, dv], forward ms, backward ms), the key-value heads
    repeated `group` times for the kernel and their gradients summed back (1: as they are)."""

    def forward():
        kk, vv = (t.repeat_interleave(group, dim=1) for t in (k, v)) if group > 1 else (k, v)
        return sdpa_forward(q, kk, vv, scale, backend), kk, vv

    kept, kk, vv = forward()

    def backward():
        dq, dk, dv = sdpa_backward(g, q, kk, vv, kept.out, kept.logsumexp, kept, scale)[:3]
        if group > 1:
            dk, dv = (t.unflatten(1, (t.shape[1] // group, group)).sum(2) for t in (dk, dv))
        return dq, dk, dv

    got = [kept.out, *backward()]
    cuda = q.device.type == "cuda"
    return got, timed(forward, warmup, repeats, cuda), timed(backward, warmup, repeats, cuda)


NEW_LENGTH_SHIFT = 1031
"""Tokens `--new-lengths` moves a row's first document boundary by, per call: more than the padding's step
(`attention.padded_length` with no lengths named: `plan_lengths.octave_length`, up to 1,024 below 32,768
tokens), so each call's documents run at lengths not seen."""


def moved(position_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """The rows with each row's first document `shift` tokens shorter and its second as much longer: lengths a
    kernel that builds a plan per shape has not seen (the rows keep their documents' count; a row of one
    document stays as it is)."""
    moved = position_ids.clone()
    for row in moved:
        starts = [*torch.nonzero(row == 0).flatten().tolist(), row.numel()]
        if len(starts) > 2 and starts[1] > shift:
            start, end = starts[1] - shift, starts[2]
            row[start:end] = torch.arange(end - start, device=row.device)
    return moved


def head_rows(position_ids: torch.Tensor, inputs, grad: torch.Tensor, want, tail: int, warmup: int, repeats: int):
    """The last layer's attention on the loss's rows (model/head_rows.py) with each document's last `tail` tokens
    chosen (a summary's): `head_rows_sdpa` against the reference on those rows, for an output gradient there
    alone (the reference's gradients for the same: `want` is for the whole gradient, so it is run again), and its
    milliseconds a row, forward + backward (flash attention's kernel on a GPU, run by run)."""
    chosen = torch.zeros_like(position_ids, dtype=torch.bool)
    for row, spans in enumerate(span_table(position_ids).tolist()):
        for start, end in spans:
            chosen[row, max(start, end - tail) : end] = True
    rows = HeadRows.of(chosen, position_ids, position_ids.device)
    mask = chosen[:, :, None, None]  # [b, s, heads, d]
    grad = grad * mask
    scale = inputs[0].shape[-1] ** -0.5

    def kernel(q, k, v):
        return head_rows_sdpa(q, k, v, rows.runs, scale)[0].transpose(1, 2)

    got = run(kernel, inputs, grad)
    want = run(reference(position_ids), [t.detach().clone().requires_grad_(True) for t in want], grad.float())
    got[0], want[0] = got[0] * mask, want[0] * mask  # outputs compared at the chosen rows
    found = errors(got, want, position_ids)
    ms = timed(lambda: run(kernel, inputs, grad), warmup, repeats, position_ids.device.type == "cuda")
    rows_count = position_ids.shape[0]
    print(
        f"{'head rows':20s} {ms / rows_count:8.3f} ms a row  worst relative error {max(found.values()):.2e}  "
        f"({int(chosen.sum()) / rows_count:,.0f} chosen rows a row, {len(rows.runs)} runs)"
    )
    return {"ms_a_row": ms / rows_count, "relative_errors": found, "chosen_a_row": int(chosen.sum()) / rows_count}


def kernels(position_ids: torch.Tensor, names: list[str], autotune: bool, per_row: int) -> dict:
    """name -> attention(query, key, value) as [b, s, heads, d], for the kernels this device runs."""
    chosen = {"documents": documents(position_ids, per_row)}
    if position_ids.device.type != "cuda":  # what a CPU run takes
        return {"as run": chosen["documents"]}
    chosen["documents, one stream"] = chosen["documents"]
    mask = document_block_mask(position_ids)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    def flex(options: dict | None, mode: str | None = None):
        compiled = torch.compile(flex_attention, dynamic=False, mode=mode)
        return lambda q, k, v: compiled(q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options).transpose(
            1, 2
        )

    chosen = {"as run": flex(None)} | chosen
    chosen.update({name: flex(VARIANTS[name]) for name in names})
    if autotune:
        chosen["autotuned"] = flex(None, "max-autotune-no-cudagraphs")
    return chosen


def errors(got: list[torch.Tensor], want: list[torch.Tensor], position_ids: torch.Tensor) -> dict:
    """Each tensor's error's norm over the reference's, on the samples' tokens (a pad tail, positions 0, -1, ...,
    is flex's document and the documents kernel's zeros: neither is compared)."""
    real = torch.ones_like(position_ids, dtype=torch.bool)
    for row, spans in enumerate(span_table(position_ids).tolist()):
        real[row, max((e for s, e in spans if e > s), default=0) :] = False
    names = ("out", "grad_q", "grad_k", "grad_v")
    found = {}
    for name, g, w in zip(names, got, want, strict=True):
        keep = real[:, :, None, None] if name == "out" else real[:, None, :, None]  # [b, s, h, d] / [b, h, s, d]
        found[name] = float(((g.float() - w) * keep).norm() / (w * keep).norm())
    return found


def run(kernel, inputs: list[torch.Tensor], grad: torch.Tensor) -> list[torch.Tensor]:
    for tensor in inputs:
        tensor.grad = None
    out = kernel(*inputs)
    out.backward(grad)
    return [out.detach(), *(t.grad for t in inputs)]


def timed(call, warmup: int, repeats: int, cuda: bool) -> float:
    """Milliseconds of one call (the planner's marks around `repeats` calls: CUDA events; wall time on a CPU)."""
    for _ in range(warmup):
        call()
    device = torch.device("cuda" if cuda else "cpu")
    start = Mark(device)
    for _ in range(repeats):
        call()
    return start.seconds_to(Mark(device)) * 1e3 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rows", type=int, default=2, help="packed rows (one microbatch)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    parser.add_argument("--autotune", action="store_true", help="also inductor's max-autotune search")
    parser.add_argument("--new-lengths", type=int, default=0, help="time the documents kernel on N unseen lengths")
    parser.add_argument("--sweep", default="", help="comma-separated lengths: `sweep` one document of each")
    parser.add_argument("--layouts", default="", help="comma-separated lengths: `layouts` of one document of each")
    parser.add_argument("--only-layouts", action="store_true", help="run `--layouts` alone (no packing, no kernels)")
    parser.add_argument(
        "--head-rows",
        type=int,
        default=0,
        help="check and time the last layer's attention on each document's last N tokens (model/head_rows.py)",
    )
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
    dim = head_size(hf)
    if args.only_layouts:
        lengths = [int(n) for n in args.layouts.split(",") if n]
        found = layouts(lengths, (heads, kv_heads, dim), device, dtype, args.warmup, args.repeats)
        device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
        results = {"config": args.config, "device": device_name, "torch": torch.__version__, "layouts": found}
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
        return
    position_ids, real = packed_positions(config, args.rows)
    position_ids = position_ids.to(device)
    rows, seq = position_ids.shape
    torch.manual_seed(0)
    # laid out [rows, seq, heads, d] as a layer's projections leave them (what the documents kernel's windows see)
    inputs = [torch.randn(rows, seq, n, dim, device=device, dtype=dtype) for n in (heads, kv_heads, kv_heads)]
    inputs = [t.transpose(1, 2).requires_grad_(True) for t in inputs]
    grad = torch.randn(rows, seq, heads, dim, device=device, dtype=dtype)
    reference_inputs = [t.detach().float().requires_grad_(True) for t in inputs]
    want = run(reference(position_ids), reference_inputs, grad.float())

    results = {
        "config": args.config,
        "overrides": args.set,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "rows": rows,
        "seq": seq,
        "heads": [heads, kv_heads, dim],
        "documents_a_row": [int((row == 0).sum()) for row in position_ids],
        "pad_share": 1 - real / (rows * seq),
        "kernels": {},
    }
    per_row = config.data.max_samples_per_row + 1  # as a run's bound (assemble.Parallelism.documents_per_row)
    streams = attention.DOCUMENT_STREAMS
    for name, kernel in kernels(position_ids, names, args.autotune, per_row).items():
        attention.DOCUMENT_STREAMS = STREAMS.get(name, streams)
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
        found = errors(got, want, position_ids)
        results["kernels"][name] = {"ms_a_row": ms / rows, "compile_s": compile_s, "relative_errors": found}
        worst = max(found.values())
        print(f"{name:20s} {ms / rows:8.3f} ms a row  worst relative error {worst:.2e}  first call {compile_s:.0f} s")
    attention.DOCUMENT_STREAMS = streams
    alone = timed(kernels_alone(position_ids, (heads, kv_heads, dim), dtype), args.warmup, args.repeats, cuda)
    results["kernels_alone_ms_a_row"] = alone / rows
    print(f"{'kernels alone':20s} {alone / rows:8.3f} ms a row  (each document's operators, exact lengths)")
    if args.head_rows:
        results["head_rows"] = head_rows(
            position_ids, inputs, grad, reference_inputs, args.head_rows, args.warmup, args.repeats
        )
    if args.sweep:
        lengths = [int(n) for n in args.sweep.split(",")]
        results["sweep"] = sweep(lengths, (heads, kv_heads, dim), device, dtype, args.warmup, args.repeats)
    if args.layouts:
        lengths = [int(n) for n in args.layouts.split(",")]
        results["layouts"] = layouts(lengths, (heads, kv_heads, dim), device, dtype, args.warmup, args.repeats)
    if args.new_lengths:  # each call its own new lengths: wall time, plan building included
        calls = []
        for shift in range(1, args.new_lengths + 1):
            kernel = documents(moved(position_ids, shift * NEW_LENGTH_SHIFT), per_row)
            began = time.perf_counter()
            run(kernel, inputs, grad)
            if cuda:
                torch.cuda.synchronize()
            calls.append((time.perf_counter() - began) * 1e3 / rows)
        results["new_lengths_ms_a_row"] = calls
        print(f"documents, new lengths {statistics.median(calls):8.3f} ms a row (median of {len(calls)} calls)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
