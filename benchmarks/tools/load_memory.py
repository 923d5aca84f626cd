"""Host and GPU memory of one pipeline rank at load: pipetune's per-stage loading vs the full model per rank.

    python benchmarks/tools/load_memory.py write DIR --shape qwen3-4b          # random-weight sharded checkpoint
    python benchmarks/tools/load_memory.py measure DIR --pp 2 --out load.json   # one fresh process per (mode, rank)

`per-stage` is pipetune's path (meta init, only the stage's tensors read from safetensors, straight
to the GPU); `full-model` is the original script's (from_pretrained of the whole model in host
memory on every rank, then the stage moved to the GPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def write_checkpoint(out: Path, shape: str) -> None:
    from pipetune.config import ModelConfig
    from pipetune.data.tokenizer import demo_tokenizer
    from pipetune.model.load import build_model
    from pipetune.model.shapes import resolve_model

    resolved = resolve_model(ModelConfig(name=shape, init="random"))
    model, _ = build_model(resolved, torch.bfloat16, torch.device("cpu"), seed=0)
    model.save_pretrained(out, max_shard_size="2GB")
    demo_tokenizer().save_pretrained(out)


def measure_one(checkpoint: Path, mode: str, pp: int, stage: int) -> dict:
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    start = time.perf_counter()
    if mode == "per-stage":
        from pipetune.config import ModelConfig
        from pipetune.model.load import build_model
        from pipetune.model.shapes import resolve_model
        from pipetune.model.split import split_layers

        resolved = resolve_model(ModelConfig(name=str(checkpoint)))
        layers = split_layers(resolved.config.num_hidden_layers, pp)[stage]
        _, stats = build_model(resolved, torch.bfloat16, device, layers=layers, first=stage == 0, last=stage == pp - 1)
        read = {"tensors_read": stats.tensors, "gb_read": stats.bytes / 1e9}
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, low_cpu_mem_usage=True)
        n = model.config.num_hidden_layers
        per = n // pp
        keep = list(model.model.layers[stage * per : (stage + 1) * per if stage < pp - 1 else n])
        parts = (
            keep
            + ([model.model.embed_tokens] if stage == 0 else [])
            + ([model.model.norm, model.lm_head] if stage == pp - 1 else [])
        )
        for part in parts:
            part.to(device)
        read = {"tensors_read": len(model.state_dict()), "gb_read": None}
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {
        "mode": mode,
        "stage": stage,
        "seconds": round(time.perf_counter() - start, 2),
        "peak_host_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9, 2),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.type == "cuda" else None,
        **read,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["write", "measure", "one"])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--shape", default="qwen3-4b")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--mode", default="per-stage")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.action == "write":
        write_checkpoint(args.checkpoint, args.shape)
    elif args.action == "one":
        print(json.dumps(measure_one(args.checkpoint, args.mode, args.pp, args.stage)))
    else:
        rows = []
        for mode in ("per-stage", "full-model"):
            for stage in range(args.pp):
                cmd = [sys.executable, __file__, "one", str(args.checkpoint), "--mode", mode]
                cmd += ["--pp", str(args.pp), "--stage", str(stage)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                rows.append(json.loads(out.strip().splitlines()[-1]))
                print(rows[-1], flush=True)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
