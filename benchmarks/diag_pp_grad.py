"""Where a pipeline stage's output loses requires_grad (diagnosis of `pp` with CUDA graphs failing on 2x H200 with
"[5] for chunk 0 has gradients None"): each stage forward's first calls with grad print, per rank, the grad mode, whether the
input, each layer's output and the stage output require grad, and whether the loss does; then train as usual.

    torchrun --nproc-per-node 2 benchmarks/diag_pp_grad.py train --config configs/bench-qwen3-4b.toml --set ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from pipetune.cli import main  # noqa: E402
from pipetune.model import stage as stage_module  # noqa: E402
from pipetune.parallel import pipeline  # noqa: E402

RANK = os.environ.get("RANK", "0")
CALLS = {"forward": 0, "loss": 0}


def flag(tensor: torch.Tensor) -> str:
    return f"rg={int(tensor.requires_grad)} fn={type(tensor.grad_fn).__name__ if tensor.grad_fn else None}"


def traced_forward(self, x):
    if not torch.is_grad_enabled():  # validation, torch's shape inference
        return original_forward(self, x)
    CALLS["forward"] += 1
    if CALLS["forward"] > 16:
        return original_forward(self, x)
    outs = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o: outs.append(o[0] if isinstance(o, tuple) else o))
        for layer in self.layers
    ]
    try:
        out = original_forward(self, x)
    finally:
        for hook in hooks:
            hook.remove()
    layers = " ".join(flag(o).split()[0] for o in outs)
    print(
        f"diag rank {RANK} forward {CALLS['forward']}: grad mode {int(torch.is_grad_enabled())}, "
        f"input {flag(x) if x.is_floating_point() else 'ids'}, layers [{layers}], output {flag(out)}",
        flush=True,
    )
    return out


def traced_loss(self, output, labels):
    loss = original_loss(self, output, labels)
    CALLS["loss"] += torch.is_grad_enabled()
    if torch.is_grad_enabled() and CALLS["loss"] <= 6:
        print(f"diag rank {RANK} loss {CALLS['loss']}: output {flag(output)}, loss {flag(loss)}", flush=True)
    return loss


original_forward = stage_module.StageModule.forward
stage_module.StageModule.forward = traced_forward
original_loss = pipeline.TokenLoss.__call__
pipeline.TokenLoss.__call__ = traced_loss

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
