"""StageModule options: activation checkpointing recomputes each layer in backward."""

from __future__ import annotations

import gc

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
    stage.checkpoint_layers = len(stage.layers) if checkpointed else 0
    seen = []
    # A pre-hook: the recomputation may stop early (torch stops once it has the tensors backward needs).
    stage.layers[1].register_forward_pre_hook(lambda *_: seen.append(1))
    torch.manual_seed(0)
    logits = stage(torch.randint(0, 1000, (2, 32)))
    assert len(seen) == 1
    logits.float().pow(2).mean().backward()
    assert len(seen) == calls  # the recomputation is a second forward of the layer


def test_own_boundary_memory_copies_what_is_sent_and_changes_no_value() -> None:
    """A middle stage with `own_boundary_memory` (set under CUDA graphs) returns its output in fresh storage,
    and its output and its input's gradient have the plain stage's values."""
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    model, _ = build_model(resolved, torch.float32, torch.device("cpu"), layers=range(4), seed=0)
    peft_model = apply_lora(model, LoraConfig(dropout=0.0), "tiny-qwen3", seed=0)
    stage = StageModule(peft_model, layer_ids=[1, 2], first=False, last=False).train()
    last_outputs: list[torch.Tensor] = []
    stage.layers[-1].register_forward_hook(lambda _m, _i, out: last_outputs.append(out))
    hidden = torch.randn(2, 16, resolved.config.hidden_size)
    results = []
    for own in (False, True):
        stage.own_boundary_memory = own
        x = hidden.clone().requires_grad_(True)
        out = stage(x)
        out.pow(2).sum().backward()
        results.append((out.detach(), x.grad))
        shares = out.untyped_storage().data_ptr() == last_outputs[-1].untyped_storage().data_ptr()
        assert shares is not own
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-gemma3"])  # gemma3's first layer: a sliding-window mask
def test_layer_memory_counts_activations_not_weights(name: str) -> None:
    """What a layer keeps for backward grows with the tokens; the weights its matmuls save are not counted; and
    the measurement leaves nothing behind (its graph once outlived it, holding a layer's activations)."""
    resolved = resolve_model(ModelConfig(name=name, init="random"))
    model, _ = build_model(resolved, torch.float32, torch.device("cpu"), layers=range(1), first=False, last=False)
    stage = StageModule(apply_lora(model, LoraConfig(dropout=0.1), name, seed=0)).train()
    state = torch.get_rng_state()
    gc.collect()
    graphs = _tensors_with_history()
    short, short_input = stage.layer_memory(1, 64)
    gc.collect()
    # none more (fewer may be: what an earlier test's compilation left in a cycle through autograd's C++ graph
    # can go while this one runs)
    assert _tensors_with_history() <= graphs
    long, long_input = stage.layer_memory(2, 64)
    assert torch.equal(torch.get_rng_state(), state)  # the run's dropout stream is untouched
    assert short_input == 64 * 256 * 4 and long_input == 2 * short_input
    weights = sum(p.numel() * p.element_size() for p in stage.layers[0].parameters())
    assert long == pytest.approx(2 * short, rel=0.02), (short, long, weights)


def _tensors_with_history() -> int:
    """Python tensors alive with an autograd history (a graph whose backward may still run)."""
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


@pytest.mark.parametrize(
    "model_name, per_graph, checkpointed, sizes",
    [
        ("tiny-qwen3", 3, 0, [1, 3]),  # the short group first
        ("tiny-qwen3", 0, 1, [1, 3]),
        ("tiny-qwen3", 2, 1, [1, 1, 2]),  # a checkpointed layer, then the short group
        ("tiny-qwen3", 1, 0, [1, 1, 1, 1]),
        ("tiny-gemma3", 3, 0, [1, 3]),  # groups of sliding-window and full-attention layers, each with its inputs
    ],
)
def test_compiled_layers_run_in_groups_of_layers_per_graph(
    model_name: str, per_graph: int, checkpointed: int, sizes: list
) -> None:
    """train.layers_per_graph: consecutive layers called as one compiled module (0: all of the stage's), the
    checkpointed ones one each; the stage computes the same, and its parameters keep their names."""
    resolved = resolve_model(ModelConfig(name=model_name, init="random"))
    model, _ = build_model(resolved, torch.float32, torch.device("cpu"), layers=range(4), seed=0)
    stage = StageModule(apply_lora(model, LoraConfig(dropout=0.0), model_name, seed=0)).train()
    names = [name for name, _ in stage.named_parameters()]
    ids = torch.randint(0, 1000, (2, 40))  # beyond tiny-gemma3's 16-position window
    expected = stage(ids)
    stage.checkpoint_layers = checkpointed
    stage.compile_layers(per_graph=per_graph)
    assert [len(getattr(run, "layers", [run])) for run in stage.runs] == sizes
    assert [name for name, _ in stage.named_parameters()] == names
    with torch.compiler.set_stance("force_eager"):
        torch.testing.assert_close(stage(ids), expected, rtol=0, atol=0)


def test_the_short_group_comes_first_so_each_size_is_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first stage's first run takes the embeddings' output, which needs no gradient: dynamo traces it apart
    from the runs after it. Five layers in groups of 2 run as [1, 2, 2], two graphs (that first run's and the
    groups of 2'), where [2, 2, 1] was three (a group of 2 twice, and the group of 1)."""
    from torch._dynamo.testing import CompileCounter

    from pipetune.model.shapes import BUILTIN_SHAPES

    monkeypatch.setitem(BUILTIN_SHAPES, "tiny-qwen3", {**BUILTIN_SHAPES["tiny-qwen3"], "num_hidden_layers": 5})
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    model, _ = build_model(resolved, torch.float32, torch.device("cpu"), layers=range(5), seed=0)
    stage = StageModule(apply_lora(model, LoraConfig(dropout=0.0), "tiny-qwen3", seed=0)).train()
    stage.compile_layers(per_graph=2)
    assert [len(run.layers) for run in stage.runs] == [1, 2, 2]
    counter = CompileCounter()
    torch._dynamo.reset()
    for run in stage.runs:  # dynamo's traces counted, none compiled
        run.compile(backend=counter)
    stage(torch.randint(0, 1000, (2, 24))).float().pow(2).mean().backward()
    torch._dynamo.reset()
    assert counter.frame_count == 2


def test_a_sliding_window_layer_on_meta_saves_no_attention_scores() -> None:
    """On the meta device (`pipetune plan`) a sliding-window layer's masked attention runs as CUDA runs it,
    memory-efficient attention: it saves the mask as a [seq, seq] bias, not [heads, seq, seq] scores."""
    from pipetune.model.load import build_meta

    resolved = resolve_model(ModelConfig(name="tiny-gemma3", init="random"))
    seq, saved = 1024, {}
    for layer in (0, 1):  # sliding-window, full attention
        model = build_meta(resolved, torch.float32, [layer], first=False, last=False)
        stage = StageModule(apply_lora(model, LoraConfig(dropout=0.0), "tiny-gemma3", seed=0)).train()
        assert stage.family.layer_kind(stage.layers[0]) == resolved.config.layer_types[layer]
        saved[layer] = stage.layer_memory(1, seq)[0]
    # The sliding layer's extra: a float32 [seq, seq] bias and its key / value heads repeated for the mask
    # (transformers' sdpa path); the attention probabilities alone would be heads x [seq, seq].
    heads = resolved.config.num_attention_heads
    assert 0 < saved[0] - saved[1] < heads * seq * seq * 4
