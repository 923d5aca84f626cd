"""One-off probe (device call of 2026-12-01 night): what one Qwen3-8B decoder layer keeps, measured on the GPU
against the meta device's measurement, and the real peak of a checkpointed two-layer stage's forward + backward
against the planner's model (inputs + one layer's activations). Run from the repository root on the GPU machine:
    python3 benchmarks/journal/results/2026-12-01-night-4-layer-memory-probe.py nf4:400000 none:131072
As run (before commit 19686ac), `measure_layer_memory` on the GPU and `saved_list` below each left their layer's
saved activations alive (their hooks return each tensor as is: a reference cycle through autograd's graph), so
the two-layer step that followed started with 2 x 36.4 GB already taken, and ran out of memory.
"""

import collections
import dataclasses
import sys

import torch

from pipetune.config import load_config, mlp_chunk_tokens
from pipetune.model.load import DTYPES
from pipetune.model.shapes import resolve_model
from pipetune.model.stage import CudaKernelsOnMeta, layer_call_kwargs
from pipetune.parallel.assemble import Parallelism, StagePart, build_stage_modules
from pipetune.parallel.memory import measure_layer_memory

GB = 1e9


def saved_list(stage, seq, device):
    layer = stage.layers[0]
    h = stage.rotary.config.hidden_size
    hidden = torch.zeros(1, seq, h, dtype=torch.bfloat16, device=device, requires_grad=True)
    weights = {p.untyped_storage()._cdata for p in layer.parameters() if not hasattr(p, "quantized_data")}
    seen = collections.OrderedDict()

    def pack(t):
        try:
            s = t.untyped_storage()
            if s._cdata not in weights and s._cdata not in seen:
                seen[s._cdata] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), s.nbytes())
        except Exception as e:  # subclasses
            seen[id(t)] = (type(t).__name__, str(e)[:40], 0)
        return t

    pos = torch.arange(seq, device=device).unsqueeze(0)
    kwargs = layer_call_kwargs(stage.family, stage.rotary, hidden, pos)[stage.family.layer_kind(layer)]
    kernels = CudaKernelsOnMeta() if device.type == "meta" else torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t
    )
    with kernels, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(hidden, **kwargs)
    del out
    return list(seen.values())


def main() -> None:
    cfg = load_config("configs/bench-qwen3-8b-long.toml")
    cuda = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a rehearsal
    for case in sys.argv[1:]:
        quant, seq = case.split(":")
        seq = int(seq)
        c = dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, quantize=quant),
            data=dataclasses.replace(cfg.data, max_length=seq),
        )
        resolved = resolve_model(c.model)
        chunk = mlp_chunk_tokens(c.train, seq)
        h = resolved.config.hidden_size
        q = torch.empty(1, 32, seq, 128, dtype=torch.bfloat16, device=cuda)
        kv = torch.empty(1, 8, seq, 128, dtype=torch.bfloat16, device=cuda)
        choice = torch._fused_sdp_choice(q, kv, kv, None, 0.0, True, scale=None, enable_gqa=True)
        del q, kv
        print(f"== {quant} {seq}: mlp chunk {chunk}, SDPA fused choice for GQA causal: {choice}", flush=True)
        for dev in (torch.device("meta"), cuda):
            layer, inp = measure_layer_memory(c, resolved, dev, 1, seq)
            print(f"  measure_layer_memory on {dev.type}: layer {layer / GB:.2f} GB = {layer / inp:.2f} x input "
                  f"({inp / GB:.2f} GB)", flush=True)
        for dev in (torch.device("meta"), cuda):
            built = build_stage_modules(
                dataclasses.replace(resolved, weights_dir=None), DTYPES[c.model.dtype], c.lora, [StagePart([0, 1])],
                dev, Parallelism(mlp_chunk=chunk), quantize=quant if dev.type != "meta" else "none",
            )
            stage = built.modules[0]
            rows = saved_list(stage, seq, dev)
            total = sum(r[2] for r in rows)
            print(f"  saved on {dev.type}: {len(rows)} storages, {total / GB:.2f} GB", flush=True)
            for r in rows:
                print(f"    {r[0]} {r[1]} {r[2] / GB:.3f} GB")
            if dev.type == "cuda" and torch.cuda.is_available():
                stage.set_layer_modes(2, 0)
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                hidden = torch.randn(1, seq, h, dtype=torch.bfloat16, device=cuda, requires_grad=True)
                torch.cuda.reset_peak_memory_stats()
                out = stage(hidden)
                torch.cuda.synchronize()
                fwd_peak, held = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
                grad = torch.randn_like(out)
                torch.cuda.reset_peak_memory_stats()
                mark = torch.cuda.memory_allocated() - base
                out.backward(grad)
                torch.cuda.synchronize()
                bwd_peak = torch.cuda.max_memory_allocated() - base
                print(f"  2 checkpointed layers, forward peak {fwd_peak / GB:.2f} GB, held after {held / GB:.2f}, "
                      f"backward peak {bwd_peak / GB:.2f} GB (at its start {mark / GB:.2f}; model: 2 inputs + "
                      f"output + grad + one layer = {(4 * inp + layer) / GB:.2f})", flush=True)
                del out, grad, hidden
            del built, stage
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
