"""Offloaded checkpoints and chunked MLPs change where activations live, not what a layer computes."""

from __future__ import annotations

import pytest
import torch

from pipetune.config import LoraConfig, ModelConfig
from pipetune.model.chunked import chunk_mlps
from pipetune.model.load import build_model
from pipetune.model.lora import apply_lora
from pipetune.model.offload import ActivationOffload
from pipetune.model.shapes import resolve_model
from pipetune.model.stage import StageModule

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""On a GPU machine the same tests run the CUDA path: pinned host copies on a side stream, events, prefetch."""


def _stage(dropout: float = 0.0, dtype: torch.dtype = torch.float32) -> StageModule:
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    model, _ = build_model(resolved, dtype, DEVICE, layers=range(4), seed=0)
    return StageModule(apply_lora(model, LoraConfig(dropout=dropout), "tiny-qwen3", seed=0)).train()


def _loss_and_grads(stage: StageModule, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    stage.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout draws for every variant
    loss = stage(tokens).float().pow(2).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in stage.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def test_offload_hooks_move_the_checkpointed_input_and_keep_the_gradients() -> None:
    """A small module under the hooks: its saved input goes to the host copy, gradients are unchanged."""
    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8)).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    plain_in = x.clone().requires_grad_(True)
    torch.utils.checkpoint.checkpoint(layer, plain_in, use_reentrant=False).sum().backward()
    plain = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    offload, unpacked = ActivationOffload(layers=1), []
    unpack = offload.unpack
    offload.unpack = lambda saved: unpacked.append(saved) or unpack(saved)
    offloaded_in = x.clone().requires_grad_(True)
    with offload.saving(0):
        out = torch.utils.checkpoint.checkpoint(layer, offloaded_in, use_reentrant=False)
    assert offload.host_bytes == x.numel() * x.element_size()  # the input, and only it, went to the host
    out.sum().backward()
    assert any(type(saved).__name__ == "_Offloaded" for saved in unpacked)
    for got, want in zip([p.grad for p in layer.parameters()], plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(offloaded_in.grad, plain_in.grad, rtol=0, atol=0)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_offloaded_stage_equals_the_checkpointed_and_the_plain_one(dropout: float) -> None:
    """Every layer checkpointed with its input on the host: loss and adapter gradients as the plain stage's
    (dropout too: the checkpoint restores the RNG for the recomputation)."""
    stage, tokens = _stage(dropout), torch.randint(0, 1000, (2, 32), device=DEVICE)
    plain_loss, plain = _loss_and_grads(stage, tokens)
    stage.checkpoint_layers = len(stage.layers)
    stage.offload = ActivationOffload(layers=len(stage.layers))
    loss, grads = _loss_and_grads(stage, tokens)
    assert stage.offload.host_bytes == len(stage.layers) * 2 * 32 * stage.rotary.config.hidden_size * 4
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-6)


def test_chunked_mlp_equals_the_whole_one_and_keeps_only_its_input() -> None:
    """MLPs in chunks of 8 of 32 positions: the same loss and gradients; a layer keeps less for backward."""
    stage, tokens = _stage(), torch.randint(0, 1000, (2, 32), device=DEVICE)
    plain_loss, plain = _loss_and_grads(stage, tokens)
    whole, _ = stage.layer_memory(2, 32)
    chunk_mlps(list(stage.layers), 8)
    loss, grads = _loss_and_grads(stage, tokens)
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-5, atol=1e-6)
    assert stage.layer_memory(2, 32)[0] < whole
    names = {name for name, _ in stage.named_parameters()}
    chunk_mlps(list(stage.layers), 0)  # back to whole MLPs, parameter names untouched throughout
    assert {name for name, _ in stage.named_parameters()} == names
    assert stage.layer_memory(2, 32)[0] == whole


@pytest.mark.parametrize("offloaded", [False, True])
def test_kept_attention_skips_attention_in_the_recomputation(offloaded: bool, monkeypatch) -> None:
    """train.keep_attention: every layer checkpointed (its input on the host or not), attention computed once
    per layer, its output taken back in the recomputation; loss and adapter gradients as the plain stage's
    (float32 on the CPU; on a GPU bfloat16, the fused kernels' dtype, the same kernels as the plain stage's SDPA)."""
    from pipetune.model import kept_attention
    from pipetune.model.attention import DOCUMENT_ATTENTION

    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    stage, tokens = _stage(dtype=dtype), torch.randint(0, 1000, (2, 32), device=DEVICE)
    plain_loss, plain = _loss_and_grads(stage, tokens)
    stage.layers[0].self_attn.config._attn_implementation = DOCUMENT_ATTENTION  # the layers' shared config
    n = len(stage.layers)
    stage.keep_attention = True
    stage.set_layer_modes(n, n if offloaded else 0)
    computed = []
    forward = kept_attention.sdpa_forward
    monkeypatch.setattr(kept_attention, "sdpa_forward", lambda *a: computed.append(1) or forward(*a))
    with torch.enable_grad():  # a forward whose backward never comes (a pipeline stage's shape inference)
        stage(tokens)
    assert len(computed) == n
    loss, grads = _loss_and_grads(stage, tokens)
    assert len(computed) == 2 * n  # once a layer; the recomputation took the kept outputs back
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(loss, plain_loss, **tolerance)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], **tolerance)
    config, size = stage.rotary.config, dtype.itemsize
    hidden = 2 * 32 * config.hidden_size * size
    attention = 2 * 32 * config.num_attention_heads * (config.head_dim * size + 4)  # output, float32 log-sum-exp
    assert stage.layer_memory(2, 32)[1] == hidden + attention
    stage.keep_attention = False  # a checkpointed layer keeps its input alone
    stage.set_layer_modes(n, 0)
    assert stage.kept is None and stage.layer_memory(2, 32)[1] == hidden
