"""The last layer on the loss's rows (model/head_rows.py): there, the whole layer's output, loss and gradients."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import LlamaConfig, LlamaForCausalLM

from pipetune.config import LoraConfig, ModelConfig
from pipetune.data.batching import IGNORE
from pipetune.model import attention
from pipetune.model.attention import document_mask, use_document_attention
from pipetune.model.head_rows import (
    RUNS_STEP,
    HeadRows,
    HeadRowsLayer,
    head_rows_layer,
    head_rows_sdpa,
    mark_dynamic,
)
from pipetune.model.load import build_model
from pipetune.model.lora import apply_lora, extend_base_weights, use_fast_path
from pipetune.model.shapes import resolve_model
from pipetune.model.stage import StageModule, layer_call_kwargs
from pipetune.parallel.pipeline import SingleRunner, TokenLoss

ROW = 96


def _model(kind: str, in_matmul: bool) -> torch.nn.Module:
    """A tiny float32 model of the family, LoRA on every projection with lora_B drawn (it starts at 0)."""
    torch.manual_seed(0)
    if kind == "qwen3":
        model, _ = build_model(
            resolve_model(ModelConfig(name="tiny-qwen3", init="random")), torch.float32, torch.device("cpu"), seed=0
        )
    else:  # Llama's layers: no q/k norms, rotary embedding as Qwen3's
        shape = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        model = LlamaForCausalLM(shape).float()
    lora = LoraConfig(
        dropout=0.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    )
    peft_model = apply_lora(model, lora, kind, seed=0)
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    if in_matmul:  # the adapters inside the base matmuls: q/k/v share one extended input
        use_fast_path(peft_model, in_matmul=True)
        extend_base_weights(peft_model)
    use_document_attention(peft_model)
    return peft_model


def _batch(vocab: int, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Two rows: packed, documents of several lengths and a pad tail (position ids restarting with each), or
    one sample a row; each sample's last third supervised, as a summary is."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (2, ROW), generator=generator)
    labels = torch.full((2, ROW), IGNORE)
    positions = []
    for row, lengths in enumerate([[30, 1, 41, 13], [55, 33]] if packed else [[ROW], [70]]):
        start = 0
        for n in lengths:
            labels[row, start + n - n // 3 : start + n] = torch.randint(0, vocab, (n // 3,), generator=generator)
            start += n
        positions.append(torch.cat([torch.arange(n) for n in lengths] + [-torch.arange(ROW - start)]))
    return ids, labels, torch.stack(positions) if packed else None


def _train_step(stage: StageModule, ids, labels, positions, head_rows: bool):
    stage.zero_grad()
    stage.head_rows = head_rows
    loss_fn = TokenLoss(head=stage.lm_head, chunk=16)
    hidden = stage(ids, **({} if positions is None else dict(position_ids=positions)), head_rows=labels != IGNORE)
    loss = loss_fn(hidden, labels)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in stage.named_parameters() if p.grad is not None}
    return hidden.detach(), loss.detach(), grads


@pytest.mark.parametrize(
    "kind, packed, in_matmul", [("qwen3", True, True), ("qwen3", False, False), ("llama", True, False)]
)
def test_the_last_layer_on_the_loss_rows_trains_as_the_whole_layer(
    kind: str, packed: bool, in_matmul: bool, monkeypatch
) -> None:
    """On the rows the loss reads the last layer's output is the whole layer's, and so are the loss and every
    adapter's gradient (the last layer's, and the earlier ones' through its keys and values), packed rows (the
    documents kernel on the CPU, each query masked to its own document) or one sample a row; the other rows keep
    the layer's input. The documents kernel gets q, k and v in the projections' layout, the one its plans are
    built ahead for: it copies none (`projection_layout`)."""
    seen, copied = [], []
    layout = attention.projection_layout

    def recorded(t: torch.Tensor) -> torch.Tensor:
        kept = layout(t)
        seen.append(tuple(t.shape))
        if kept is not t:
            copied.append(tuple(t.shape))
        return kept

    monkeypatch.setattr(attention, "projection_layout", recorded)
    stage = StageModule(_model(kind, in_matmul))
    stage.head_in_loss = True
    ids, labels, positions = _batch(stage.embed.num_embeddings, packed)
    whole, whole_loss, whole_grads = _train_step(stage, ids, labels, positions, head_rows=False)
    rows, rows_loss, rows_grads = _train_step(stage, ids, labels, positions, head_rows=True)
    chosen = labels != IGNORE
    torch.testing.assert_close(rows[chosen], whole[chosen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rows_loss, whole_loss, rtol=1e-6, atol=0)
    assert set(rows_grads) == set(whole_grads) and any(".1." in name for name in rows_grads)
    for name, grad in whole_grads.items():  # float32 sums in another order
        assert float((rows_grads[name] - grad).norm() / grad.norm()) < 1e-5, name
    assert not torch.equal(rows[~chosen], whole[~chosen])  # elsewhere the layer's input, normed: not computed
    assert bool(seen) == packed and copied == []


def test_the_runner_names_the_loss_rows_and_validation_takes_the_whole_layer(monkeypatch) -> None:
    """A training step hands the stage the rows its labels supervise; a forward without them (validation, the
    eval step) runs the whole layer."""
    stage = StageModule(_model("qwen3", in_matmul=False))
    stage.head_in_loss = stage.head_rows = True
    ids, labels, positions = _batch(stage.embed.num_embeddings, packed=False)
    seen = []
    forward = StageModule.forward
    monkeypatch.setattr(
        StageModule, "forward", lambda self, *a, **k: seen.append(k.get("head_rows")) or forward(self, *a, **k)
    )
    runner = SingleRunner(stage, n_microbatches=2, loss_fn=TokenLoss(head=stage.lm_head))
    runner.step(ids, labels)
    assert [bool(torch.equal(got, want != IGNORE)) for got, want in zip(seen, labels.chunk(2), strict=True)] == [
        True,
        True,
    ]
    seen.clear()
    runner.eval_step(ids, labels)
    assert seen == [None, None]


def test_compiled_groups_leave_the_last_layer_a_graph_of_its_own() -> None:
    """Compiled, the last layer is a graph of its own (`HeadRowsLayer`); checkpointed, it stays among the
    checkpointed layers (the whole layer: a checkpoint recomputes what it ran)."""
    stage = StageModule(_model("qwen3", in_matmul=False))
    stage.head_rows = True
    stage.compile_layers(per_graph=2)  # tiny-qwen3's 4 layers: the first 3 grouped, short group first; the last alone
    layers = list(stage.layers)
    assert [list(run.layers) for run in stage.runs[:-1]] == [layers[:1], layers[1:3]]
    assert isinstance(stage.runs[-1], HeadRowsLayer) and stage.runs[-1].layer is layers[3]
    assert stage.runs[-1]._compiled_call_impl is not None
    stage.head_rows = False
    stage.compile_layers(per_graph=2)
    assert [list(run.layers) for run in stage.runs] == [layers[:2], layers[2:]]
    stage.head_rows = True
    stage.set_layer_modes(4, 0)  # every layer checkpointed: each its own run, compiled
    stage.compile_layers(per_graph=2)
    assert stage.runs == layers and layers[3]._compiled_call_impl is not None


def test_one_compiled_graph_serves_every_count_of_chosen_rows() -> None:
    """The compiled last layer takes the chosen rows' count as dynamic: microbatches with other counts (and runs
    within one step of RUNS_STEP) reuse its one graph (no graph break either), with the eager layer's output and
    gradients."""
    stage = StageModule(_model("qwen3", in_matmul=True))
    ids, labels, positions = _batch(stage.embed.num_embeddings, packed=True)
    layer = stage.layers[-1]
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(HeadRowsLayer(layer), backend=counter, fullgraph=True)
    hidden = torch.randn(2, ROW, layer.self_attn.config.hidden_size, requires_grad=True)
    inputs = layer_call_kwargs(stage.family, stage.rotary, hidden, positions, document_mask(positions))
    kwargs = inputs[stage.family.layer_kind(layer)]
    trained = [hidden, *(p for p in layer.parameters() if p.requires_grad)]
    for keep in (ROW, 70, 45):  # fewer and fewer chosen rows (and runs)
        chosen = (labels != IGNORE) & (torch.arange(ROW) < keep)
        rows = HeadRows.of(chosen, positions, hidden.device, step=1)  # as many rows as chosen
        mark_dynamic(rows)
        grad = torch.randn_like(hidden)
        expected = head_rows_layer(layer, hidden, rows, kwargs)
        want = torch.autograd.grad(expected, trained, grad)
        got = compiled(hidden, rows=rows, **kwargs)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        have = torch.autograd.grad(got, trained, grad)
        for a, b in zip(have, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    del got, expected, have, want, compiled
    torch._dynamo.reset()  # what the compiled graph holds goes (a later test counts the tensors with history)
    gc.collect()


def test_runs_are_the_consecutive_chosen_rows_of_one_document() -> None:
    """`HeadRows.of`: a run breaks where the chosen positions skip or a new document starts; its keys start at its
    document's first position (a row's first one where rows are not packed)."""
    chosen = torch.zeros(2, 12, dtype=torch.bool)
    chosen[0, [2, 3, 4, 5, 7, 8]] = True  # documents [0, 4), [4, 10), pad tail [10, 12)
    chosen[1, [5, 6]] = True
    positions = torch.stack([torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, -1]), torch.arange(12)])
    rows = HeadRows.of(chosen, positions, torch.device("cpu"), step=1)
    empty = [[0, 0, 0, 0]] * (RUNS_STEP - 4)  # a multiple of RUNS_STEP runs: a few shapes for the compiled layer
    assert rows.runs.tolist() == [[0, 0, 2, 4], [0, 4, 4, 6], [0, 4, 7, 9], [1, 0, 5, 7], *empty]
    assert rows.flat.tolist() == [2, 3, 4, 5, 7, 8, 17, 18]
    unpacked = HeadRows.of(chosen, None, torch.device("cpu"), step=1).runs.tolist()
    assert unpacked == [[0, 0, 2, 6], [0, 0, 7, 9], [1, 0, 5, 7], *empty, [0, 0, 0, 0]]
    assert HeadRows.of(torch.zeros(2, 12, dtype=torch.bool), None, torch.device("cpu")) is None
    # to a multiple of `step` rows: runs start earlier in their documents, never before a document's start or into
    # the row's run before them; where the documents leave no more room, fewer
    padded = HeadRows.of(chosen, positions, torch.device("cpu"), step=5)
    assert padded.runs.tolist() == [[0, 0, 0, 4], [0, 4, 4, 6], [0, 4, 7, 9], [1, 0, 5, 7], *empty]
    assert padded.flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 17, 18]
    full = HeadRows.of(chosen, positions, torch.device("cpu"), step=64)
    assert full.runs.tolist() == [[0, 0, 0, 4], [0, 4, 4, 6], [0, 4, 6, 9], [1, 0, 0, 7], *empty]


def test_the_runs_attention_is_each_documents_causal_attention_at_the_chosen_rows() -> None:
    """`head_rows_sdpa`, against SDPA's causal attention of each whole document (another kernel, every row): the
    same output at the chosen rows (zeros elsewhere) and the same query, key and value gradients for an output
    gradient at the chosen rows alone, with two runs of one document sharing its keys and grouped key-value
    heads."""
    torch.manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 4, 2, 12, 8
    chosen = torch.zeros(batch, seq, dtype=torch.bool)
    chosen[0, [2, 3, 4, 5, 7, 8]] = True
    chosen[1, [5, 6]] = True
    positions = torch.stack([torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, -1]), torch.arange(12)])
    documents = [[(0, 0, 4), (0, 4, 10)], [(1, 0, 12)]]
    query = torch.randn(batch, seq, heads, dim).transpose(1, 2).requires_grad_(True)
    key, value = (torch.randn(batch, seq, kv_heads, dim).transpose(1, 2).requires_grad_(True) for _ in range(2))
    rows = HeadRows.of(chosen, positions, torch.device("cpu"), step=1)
    out, _ = head_rows_sdpa(query, key, value, rows.runs, dim**-0.5)
    expected = torch.zeros_like(out)
    for row, start, end in (span for spans in documents for span in spans):
        part = (t[row : row + 1, :, start:end] for t in (query, key, value))
        expected[row : row + 1, :, start:end] = F.scaled_dot_product_attention(*part, is_causal=True, enable_gqa=True)
    mask = chosen[:, None, :, None]
    torch.testing.assert_close(out, expected * mask, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out) * mask
    got = torch.autograd.grad(out, (query, key, value), grad)
    want = torch.autograd.grad(expected, (query, key, value), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
