"""The fast LoRA path's grouped down-projections: PEFT's math without dropout, one mask per input with
lora.shared_dropout, and the same under torch.compile and activation checkpointing."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from peft.tuners.lora import Linear as LoraLinear

from pipetune.config import LoraConfig, ModelConfig
from pipetune.model.load import build_model
from pipetune.model.lora import SharedInput, apply_lora, use_fast_path
from pipetune.model.shapes import resolve_model
from pipetune.model.stage import StageModule

TINY = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))


def _stage(lora: LoraConfig, fast: bool, layers: range = range(2), **fast_path: bool | int) -> StageModule:
    """A float32 stage of tiny-qwen3 with LoRA; lora_B random (at its initial zeros lora_A would get no gradient)."""
    model, _ = build_model(TINY, torch.float32, torch.device("cpu"), layers=layers, seed=0)
    peft_model = apply_lora(model, lora, "tiny-qwen3", seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1, generator=generator)
    if fast:
        use_fast_path(peft_model, **fast_path)
    return StageModule(peft_model).train()


def _loss_and_gradients(stage: StageModule, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, 2000, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(seed)
    loss = stage(ids).pow(2).mean()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in stage.named_parameters() if p.requires_grad}


def _groups(stage: StageModule) -> list[list[str]]:
    """Each SharedInput of the stage's first layer as its members' names."""
    names = {module: name for name, module in stage.layers[0].named_modules()}
    groups = {id(m.shared_input): m.shared_input for m in stage.layers[0].modules() if hasattr(m, "shared_input")}
    return sorted([names[member].rsplit(".", 1)[-1] for member in group.members] for group in groups.values())


@pytest.mark.parametrize(
    "targets, groups",
    [
        (LoraConfig().target_modules, [["gate_proj", "up_proj"], ["q_proj", "k_proj", "v_proj"]]),
        (["v_proj", "q_proj", "up_proj", "o_proj"], [["q_proj", "v_proj"]]),  # up alone, o and down never
    ],
)
def test_grouped_down_projections_are_pefts_math(targets: list[str], groups: list[list[str]]) -> None:
    lora = LoraConfig(dropout=0.0, target_modules=targets)
    grouped = _stage(lora, fast=True)
    assert _groups(grouped) == groups
    expected_loss, expected = _loss_and_gradients(_stage(lora, fast=False))
    loss, gradients = _loss_and_gradients(grouped)
    # float32 sums in another order: the CPU's matmul kernels vary with their operands' alignment from run to run
    # (1.1e-6 relative seen in the loss once in eight runs), so to parity's 1e-5 (tests/parity.py)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert sorted(gradients) == sorted(expected) and len(expected) == 2 * 2 * len(targets)
    for name, gradient in expected.items():
        assert gradient.abs().max() > 0, name
        assert float((gradients[name] - gradient).norm() / gradient.norm()) < 1e-5, name
    # Nothing is held past the call: no tensor outlives a layer (CUDA graphs).
    group = grouped.layers[0].self_attn.q_proj.shared_input
    assert group.source is None and group.held == [None] * len(group.members)
    # With dropout, PEFT's independent masks: no group unless lora.shared_dropout.
    assert _groups(_stage(LoraConfig(dropout=0.1), fast=True)) == []
    assert _groups(_stage(LoraConfig(dropout=0.0), fast=True, tp=2)) == []  # its plans hook each lora_A


def test_shared_dropout_draws_one_mask_for_the_projections_of_one_input() -> None:
    """q, k and v (called in another order than the model's) against one mask drawn by hand from the same random
    stream, in the proportion of dropout's expectation: each element kept with 1 - p, scaled by 1 / (1 - p)."""
    p = 0.5
    stage = _stage(LoraConfig(dropout=p), fast=True, layers=range(1), shared_dropout=True)
    attention = stage.layers[0].self_attn
    assert not hasattr(attention.o_proj, "shared_input")  # o and down keep masks of their own
    x = torch.randn(2, 16, TINY.config.hidden_size)
    torch.manual_seed(3)
    got = {name: getattr(attention, name)(x) for name in ("v_proj", "q_proj", "k_proj")}
    torch.manual_seed(3)
    mask = torch.empty_like(x).bernoulli_(1 - p) / (1 - p)  # CPU dropout's own draw
    assert 0.45 < (mask > 0).float().mean() < 0.55
    for name, out in got.items():
        linear: LoraLinear = getattr(attention, name)
        a, b = linear.lora_A["default"].weight, linear.lora_B["default"].weight
        expected = linear.base_layer(x) + (x * mask) @ a.T @ b.T * linear.scaling["default"]
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_shared_masks_are_the_same_compiled_and_recomputed() -> None:
    """A layer traced whole by torch.compile (no graph break) and a checkpointed layer (recomputed in backward, the
    random stream restored) draw the eager layer's masks: the same loss and gradients."""
    lora = LoraConfig(dropout=0.3)
    expected_loss, expected = _loss_and_gradients(_stage(lora, fast=True, shared_dropout=True))
    for variant in ("compiled", "checkpointed"):
        stage = _stage(lora, fast=True, shared_dropout=True)
        if variant == "compiled":
            torch._dynamo.reset()
            for layer in stage.layers:
                layer.compile(backend="eager", fullgraph=True)  # dynamo's trace run eagerly: the same random ops
        else:
            stage.checkpoint_layers = len(stage.layers)
        loss, gradients = _loss_and_gradients(stage)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0, msg=variant)
        for name, gradient in expected.items():
            torch.testing.assert_close(gradients[name], gradient, rtol=1e-5, atol=1e-7, msg=f"{variant}: {name}")
        group: SharedInput = stage.layers[0].mlp.gate_proj.shared_input
        assert group.source is None and group.held == [None, None], variant


@pytest.mark.parametrize(
    "lora, fast_path",
    [
        (LoraConfig(dropout=0.0), {}),  # one down-projection matmul per input
        (LoraConfig(dropout=0.2), {}),  # a mask per adapter, drawn in the fast path's order
        (LoraConfig(dropout=0.2), {"shared_dropout": True}),
    ],
    ids=["no dropout", "dropout", "shared dropout"],
)
def test_adapter_in_matmul_is_the_fast_paths_math(lora: LoraConfig, fast_path: dict) -> None:
    """lora.adapter_in_matmul (each LoRA term inside its base matmul, [x | down-projections] @ [W | lora_B]^T) gives
    the fast path's loss and gradients, eagerly, with every layer recomputed, and without dropout compiled by
    inductor as a GPU run compiles it (its graphs dropped after, so that none outlives the test holding tensors
    that tests/model/test_stage.py counts). After a write to lora_B, an optimizer's or any other, the next forward
    sees it (the stage copies lora_B into the extended weights before each forward), and the base weights are
    views of the extended ones."""
    from pipetune.model import lora as lora_module
    from pipetune.model.lora import extend_base_weights

    expected_loss, expected = _loss_and_gradients(_stage(lora, fast=True, **fast_path))
    compiled = ("compiled",) if lora.dropout == 0 else ()
    for variant in ("eager", "checkpointed", "groups only", *compiled):
        with mock.patch.object(lora_module, "IN_MATMUL_ALONE", variant != "groups only"):
            stage = _stage(lora, fast=True, in_matmul=True, **fast_path)
        # 7 adapted linears in each of the 2 layers; groups only: o and down on the fast path
        assert len(extend_base_weights(stage)) == (10 if variant == "groups only" else 14)
        q_proj = stage.layers[0].self_attn.q_proj
        assert (
            q_proj.base_layer.weight.untyped_storage().data_ptr() == q_proj.extended_weight.untyped_storage().data_ptr()
        )
        # [W | q's | k's | v's B | zeros to a multiple of 64 columns]
        assert q_proj.extended_weight.shape[1] == TINY.config.hidden_size + 64 >= TINY.config.hidden_size + 3 * lora.r
        if variant == "checkpointed":
            stage.checkpoint_layers = len(stage.layers)
        if variant == "compiled":
            torch._dynamo.reset()
            for layer in stage.layers:
                layer.compile(fullgraph=True)
        loss, gradients = _loss_and_gradients(stage)
        if variant == "compiled":
            torch._dynamo.reset()
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0, msg=variant)
        assert sorted(gradients) == sorted(expected)
        for name, gradient in expected.items():  # float32 sums in another order
            error = float((gradients[name] - gradient).norm() / gradient.norm())
            assert error < 1e-5, (variant, name, error)
        group = q_proj.shared_input
        assert group.source is None and group.held == [None] * 3, variant  # nothing held past the layer's call
    with torch.no_grad():  # a write to lora_B: the next forward computes with it
        for name, param in stage.named_parameters():
            if ".lora_B." in name:
                param.mul_(-2.0)
    # and a fused AdamW step's, which moves no tensor's version
    torch.optim.AdamW([p for p in stage.parameters() if p.requires_grad], lr=0.05, fused=True).step()
    reference = _stage(lora, fast=True, **fast_path)
    with torch.no_grad():
        for param, theirs in zip(reference.parameters(), stage.parameters(), strict=True):
            param.copy_(theirs)
    loss, _ = _loss_and_gradients(stage, seed=1)
    expected_loss, _ = _loss_and_gradients(reference, seed=1)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_adapter_in_matmul_keeps_what_the_fast_path_keeps(dropout: float) -> None:
    """What "auto" checkpointing plans with, a bfloat16 layer's kept bytes as an eager forward keeps them (on the
    meta device, as the planner measures), is the fast path's with the adapters in the matmuls too: a view that kept
    a wider output alive there once planned 3 needless recomputed layers and cost 9.5% of a step
    (benchmarks/journal/2026-12-07-stacked-adapters-one-h100.md)."""
    from pipetune.parallel.assemble import Parallelism, StagePart, build_stage_modules

    kept = {}
    for in_matmul in (False, True):
        lora = LoraConfig(dropout=dropout, fast_path=True, adapter_in_matmul=in_matmul)
        parts = [StagePart([0, 1])]
        built = build_stage_modules(TINY, torch.bfloat16, lora, parts, torch.device("meta"), Parallelism())
        kept[in_matmul] = built.modules[0].layer_memory(1, 256)[0]
    assert kept[False] > 0 and kept[True] <= 1.02 * kept[False], kept
