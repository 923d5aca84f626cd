"""StageModule options: activation checkpointing recomputes each layer in backward."""

from __future__ import annotations

import pytest
import torch

from pipetune.config import LoraConfig, ModelConfig
from pipetune.model.load import build_model
from pipetune.model.lora import apply_lora
from pipetune.model.shapes import resolve_model
from pipetune.model.stage import StageModule


@pytest.mark.parametrize("checkpointed, calls", [(False, 1), (True, 2)])
def test_checkpointed_layers_run_again_in_backward(checkpointed: bool, calls: int) -> None:
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    model, _ = build_model(resolved, torch.float32, torch.device("cpu"), layers=range(4), seed=0)
    stage = StageModule(apply_lora(model, LoraConfig(dropout=0.1), "tiny-qwen3", seed=0)).train()
    stage.checkpoint_layers = checkpointed
    seen = []
    # A pre-hook: the recomputation may stop early (torch stops once it has the tensors backward needs).
    stage.layers[1].register_forward_pre_hook(lambda *_: seen.append(1))
    torch.manual_seed(0)
    logits = stage(torch.randint(0, 1000, (2, 32)))
    assert len(seen) == 1
    logits.float().pow(2).mean().backward()
    assert len(seen) == calls  # the recomputation is a second forward of the layer
