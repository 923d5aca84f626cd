"""Packed rows (data.packing) compute what their samples compute alone: per-sample logits and gradients against
transformers' own model, the block mask against the dense document mask, and whole runs against unpacked runs
over the same samples in the same steps."""

from __future__ import annotations

import csv
import json
import random
import statistics
import threading
from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from pipetune.config import Config, LoraConfig, ModelConfig
from pipetune.data.batching import IGNORE
from pipetune.data.packing import batches_of_rows, epoch_rows
from pipetune.model import attention
from pipetune.model.attention import (
    document_attention,
    document_block_mask,
    document_ids,
    document_mask,
    padded_length,
    use_document_attention,
)
from pipetune.model.forward_thread import start_forward_thread, stop_forward_thread
from pipetune.model.load import build_model
from pipetune.model.lora import apply_lora
from pipetune.model.shapes import resolve_model
from pipetune.model.stage import StageModule
from pipetune.parallel.pipeline import TokenLoss
from pipetune.planner.plan import attention_share
from tests.conftest import run_cli, tiny_config, write_config
from tests.parity import assert_same_training

WORDS = "we should ship the remote by friday agreed budget design buttons colour rubber case logo".split()


def write_short_meetings(path: Path, n: int, seed: int = 0) -> Path:
    """n short meetings as JSONL (transcripts of 2-12 words, summaries of 2-5): with data.system_prompt = "Sum."
    every sample takes 30-64 tokens of the tiny tokenizer."""
    rng = random.Random(seed)
    rows = [
        {
            "dialogue": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))),
            "summary": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))),
        }
        for _ in range(n)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def positions_of(lengths: list[int], row: int) -> torch.Tensor:
    """[row] position ids of samples of `lengths` packed one after another, then the pads (a document of theirs)."""
    used = sum(lengths)
    return torch.cat([torch.arange(n) for n in [*lengths, row - used] if n > 0])


# --------------------------------------------------------------------------- unit level: one process


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the CPU's reference kernel
def test_block_mask_is_the_document_mask() -> None:
    """The tile tables built from position ids list exactly the tiles the dense causal document mask touches, and
    flex attention under them (forward: torch has no flex backward on the CPU) equals causal SDPA on each sample."""
    row, block = 300, 64  # the last tile is partial
    position_ids = torch.stack(
        [positions_of([100, 50, 129], row), positions_of([300], row), positions_of([1, 1, 130, 20], row)]
    )
    docs = document_ids(position_ids)
    q = torch.arange(row)

    def mask_mod(b, h, q_idx, kv_idx):
        return (docs[b, q_idx] == docs[b, kv_idx]) & (q_idx >= kv_idx)

    reference = create_block_mask(mask_mod, 3, None, row, row, device="cpu", BLOCK_SIZE=block)
    mask = document_block_mask(position_ids, block)
    assert torch.equal(mask.to_dense(), reference.to_dense())
    full_tiles = torch.zeros_like(mask.to_dense())  # tiles that need no mask inside: wholly in one document, below
    for b in range(3):
        for i in range(mask.full_kv_num_blocks.shape[-1]):
            full_tiles[b, 0, i, mask.full_kv_indices[b, 0, i, : mask.full_kv_num_blocks[b, 0, i]]] = 1
    dense = (docs[:, :, None] == docs[:, None, :]) & (q[:, None] >= q[None, :])
    n_tiles = -(-row // block)
    extra = n_tiles * block - row
    tiles = torch.nn.functional.pad(dense, (0, extra, 0, extra)).view(3, n_tiles, block, n_tiles, block)
    assert torch.equal(full_tiles[:, 0].bool(), tiles.all(dim=4).all(dim=2))

    torch.manual_seed(0)
    query, key, value = torch.randn(3, 4, row, 16), torch.randn(3, 2, row, 16), torch.randn(3, 2, row, 16)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=dense.unsqueeze(1)
    )
    torch.testing.assert_close(flex_attention(query, key, value, block_mask=mask, enable_gqa=True), expected)


def test_documents_kernel_is_the_document_mask_compiled_or_not(monkeypatch) -> None:
    """train.packed_attention = "documents" (and every CPU run): SDPA's fused kernel on each span of a static span
    table (rows with fewer documents end in empty spans), each document run over a window of its padded length,
    gives causal SDPA under the dense document mask, output and gradients, eagerly and traced whole by
    torch.compile (one graph: the table is a graph input, the kernel an operator of its own); where no fused kernel
    runs (float32 off the CPU) it refuses, naming the fix. The plans built ahead for a run's lengths (cuDNN's only;
    here the CPU's kernel through the same calls) run each padded length once per attention shape."""
    row = 300
    tail = torch.cat([torch.arange(120), torch.arange(80), -torch.arange(100)])  # a pad tail as packing makes it
    position_ids = torch.stack(
        [positions_of([100, 50, 129], row), positions_of([300], row), positions_of([1, 1, 130, 20], row), tail]
    )
    mask = document_mask(position_ids, "documents", per_row=6)
    assert mask.spans.shape == (4, 6, 2) and mask.spans.dtype == torch.int64
    assert mask.spans[2].tolist() == [[0, 1], [1, 2], [2, 132], [132, 152], [152, 300], [300, 300]]
    assert mask.spans[3, :3].tolist() == [[0, 120], [120, 200], [300, 300]]  # the pad tail left out
    with pytest.raises(ValueError, match="5 documents, over the bound of 4"):
        document_mask(position_ids, "documents", per_row=4)
    docs, q = document_ids(position_ids), torch.arange(row)
    dense = (docs[:, :, None] == docs[:, None, :]) & (q[:, None] >= q[None, :])
    torch.manual_seed(0)
    inputs = [torch.randn(4, n, row, 16, requires_grad=True) for n in (4, 2, 2)]  # grouped key-value heads
    grad = torch.randn(4, row, 4, 16)
    query, key, value = inputs
    kept = torch.ones(4, row, 1, 1)
    kept[3, 200:] = 0  # the pad tail: zeros out, no gradient to or through it
    expected = (
        torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), attn_mask=dense.unsqueeze(1)
        ).transpose(1, 2)
        * kept
    )
    expected_grads = torch.autograd.grad(expected, inputs, grad)

    def attend(query, key, value, mask):
        return document_attention(torch.nn.Module(), query, key, value, mask)[0]

    meta = [torch.empty(1, n, 8, 16, device="meta") for n in (4, 2, 2)]  # float32: no fused kernel off the CPU
    with pytest.raises(ValueError, match='set model.dtype = "bfloat16", or train.packed_attention = "flex"'):
        attention._documents_backend(*meta)
    fresh = (("_SEEN_LENGTHS", []), ("_PLAN_LENGTHS", []))
    for name, value_ in (*fresh, ("_BUILT", threading.local()), ("PLAN_BUILDS", [])):
        monkeypatch.setattr(attention, name, value_)
    padded = [padded_length(n) for n in range(1, 16385)]  # no lengths named: the octave rule's
    assert all(0 <= p - n < max(64, n / 32) for n, p in enumerate(padded, 1)) and len(set(padded)) <= 130
    assert all(padded_length(p) == p for p in set(padded))
    attention.expect_document_lengths(torch.tensor([0, 30, 100, 128, 129, 300]))
    # the octave rule's 64, 128, 192 and 320 cost as many 128-token tiles as 128, 192 and 320; 320: past the row
    # of 300, a copy
    assert attention._PLAN_LENGTHS == [128, 192, 320]
    assert [padded_length(n) for n in (1, 128, 129, 193, 320, 321)] == [128, 128, 192, 320, 320, 384]

    def build(backward: bool) -> None:
        attention._build_plans(query.detach(), key.detach(), value.detach(), 0.25, attention.CUDNN, backward)

    forwards = []
    forward = attention._document_forward
    monkeypatch.setattr(attention, "_document_forward", lambda *a: forwards.append(a[-3]) or forward(*a))
    for backward in (False, False, True, True):  # once per pass and thread: torch keeps cuDNN's plans per thread
        build(backward)
    thread = threading.Thread(target=build, args=(True,))  # autograd's backward thread, for one
    thread.start()
    thread.join()
    # A backward of zeros through _BackwardPlans builds the backward's plans where autograd runs it (on a GPU, its
    # device thread: `prebuild_plans` starts one before the model compiles); no forward runs there, the
    # log-sum-exp's shape of a length no forward has met inferred from one that has.
    recorded = dict(attention._LSE_SHAPES)
    monkeypatch.setattr(attention, "_LSE_SHAPES", {k: v for k, v in recorded.items() if k[-1] == 128})
    rows = [t.detach()[:1] for t in (query, key, value)]
    zero = torch.zeros(1, requires_grad=True)
    prebuilt = threading.Thread(
        target=lambda: attention._BackwardPlans.apply(zero, *rows, 0.25, attention.CUDNN).sum().backward()
    )
    prebuilt.start()
    prebuilt.join()
    assert zero.grad is not None and attention._LSE_SHAPES.keys() == {k for k in recorded if k[-1] == 128}
    assert all(attention._lse_shape(*k) == v for k, v in recorded.items())
    # no backward build ran a forward: each length's log-sum-exp shape was known (or inferred)
    assert sorted(forwards) == attention._PLAN_LENGTHS
    assert [(count, passes) for count, _, passes in attention.PLAN_BUILDS] == [
        (3, "forward"),
        (3, "backward"),
        (3, "backward"),
        (3, "backward"),
    ]
    for call in (attend, torch.compile(attend, backend="aot_eager", fullgraph=True)):
        out = call(query, key, value, mask)
        torch.testing.assert_close(out, expected)
        for got, want in zip(torch.autograd.grad(out, inputs, grad), expected_grads, strict=True):
            torch.testing.assert_close(got, want)
    # With a forward thread started (a GPU run's, model/forward_thread.py), the forwards run there: the same values
    ran_in = []
    inner = attention._document_sdpa
    monkeypatch.setattr(attention, "_document_sdpa", lambda *a: ran_in.append(threading.current_thread()) or inner(*a))
    started = start_forward_thread(query.device)
    try:
        out = attend(query, key, value, mask)
        grads = torch.autograd.grad(out, inputs, grad)
    finally:
        stop_forward_thread(query.device)
    assert ran_in == [started.thread]
    torch.testing.assert_close(out, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    # A value handed over as a view of a wider output (q, k and v from one matmul): its tokens 64 apart, taken in the
    # projections' layout (`projection_layout`: the plans built ahead are for that layout).
    wide = torch.zeros(4, row, 64)
    wide[..., 32:] = value.detach().transpose(1, 2).reshape(4, row, 32)
    wide.requires_grad_(True)
    strided = wide[..., 32:].view(4, row, 2, 16).transpose(1, 2)
    assert attention.projection_layout(strided) is not strided
    rows_layout = query.detach().transpose(1, 2).contiguous().transpose(1, 2)
    assert attention.projection_layout(rows_layout) is rows_layout
    out = attend(query, key, strided, mask)
    torch.testing.assert_close(out, expected)
    (got,) = torch.autograd.grad(out, [wide], grad)
    assert not got[..., :32].any()
    torch.testing.assert_close(got[..., 32:].view(4, row, 2, 16).transpose(1, 2), expected_grads[2])


def test_packed_row_matches_each_sample_alone(monkeypatch) -> None:
    """A packed row through two pipeline stages (each building its mask from the position ids) gives every sample
    the logits transformers' model gives it alone, and the row's loss the summed per-sample losses, with the same
    adapter gradients. The documents kernel gets its query, key and value in the layout of the rows the backward's
    plans are built with ahead (`attention.plan_rows`), so those plans are the steps'."""
    resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
    model, _ = build_model(resolved, torch.float32, torch.device("cpu"), seed=0)
    peft_model = apply_lora(model, LoraConfig(dropout=0.0), "tiny-qwen3", seed=0)
    for name, param in peft_model.named_parameters():  # lora_B starts at 0: give the adapters some effect
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    torch.manual_seed(0)
    lengths, row = [40, 1, 57, 17], 128
    samples = [torch.randint(0, 1000, (n,)) for n in lengths]
    targets = [torch.randint(0, 1000, (n,)) for n in lengths]
    for target in targets:
        target[: len(target) // 3] = IGNORE  # a prompt: no loss
    params = [p for p in peft_model.parameters() if p.requires_grad]

    expected_logits, loss_fn = [], TokenLoss()
    expected_loss = torch.zeros(())
    for ids, target in zip(samples, targets, strict=True):
        logits = peft_model(input_ids=ids[None]).logits  # transformers' own forward, SDPA, one sample
        expected_logits.append(logits[0].detach())
        expected_loss = expected_loss + loss_fn(logits, target[None])
    expected_loss.backward()
    expected_grads = [p.grad.clone() for p in params]
    peft_model.zero_grad()

    use_document_attention(peft_model)
    layouts, kernel = [], attention.document_sdpa
    monkeypatch.setattr(
        attention, "document_sdpa", lambda *a: layouts.append(tuple(t.stride() for t in a[:3])) or kernel(*a)
    )
    first = StageModule(peft_model, layer_ids=[0, 1], first=True, last=False)
    last = StageModule(peft_model, layer_ids=[2, 3], first=False, last=True)
    pad = row - sum(lengths)
    input_ids = torch.cat([*samples, torch.zeros(pad, dtype=torch.long)])[None]
    labels = torch.cat([*targets, torch.full((pad,), IGNORE)])[None]
    position_ids = positions_of(lengths, row)[None]
    logits = last(first(input_ids, position_ids=position_ids), position_ids=position_ids)
    loss = loss_fn(logits, labels)
    loss.backward()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for expected, start, end in zip(expected_logits, starts, starts[1:], strict=False):
        torch.testing.assert_close(logits[0, start:end].detach(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.detach(), expected_loss.detach(), rtol=1e-6, atol=0)
    hf = model.config
    rows = attention.plan_rows(
        torch.device("cpu"), torch.float32, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, row
    )
    assert len(layouts) == hf.num_hidden_layers and set(layouts) == {tuple(t.stride() for t in rows)}
    for param, expected in zip(params, expected_grads, strict=True):  # float32 sums in another order
        assert float((param.grad - expected).norm() / expected.norm()) < 1e-5


# --------------------------------------------------------------------------- whole runs: several processes


PACKED = ["data.packing=true", "data.max_samples_per_row=2", "train.batch_size=4"]
MEETINGS = "meetings.jsonl"


def _config(tmp: Path, name: str, data: Path, *overrides: str) -> Config:
    """A run of `data` into tmp / name."""
    return tiny_config(
        tmp / name,
        f'data.source="{data}"',
        'data.system_prompt="Sum."',
        "data.validation_fraction=0.25",
        "train.max_steps=-1",
        *overrides,
    )


def _on_the_packed_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpacked runs in this process take, at each step, the samples the packed runs' step holds (the epoch's rows
    of 2 samples, PACKED's 4 a step, flattened): the unpacked run on the same samples in the same steps. A reference
    run that left this process would not see it, and its losses would differ."""
    from pipetune.train import TrainData

    def plan(self: TrainData, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = epoch_rows(self.real_tokens, self.max_length, 2, self.seed, epoch)
        batches = batches_of_rows(rows, 4).flatten(1)
        assert batches.shape[1] == self.global_batch and bool((batches >= 0).all())  # two samples every row
        return batches, torch.full((len(batches),), self.max_length, dtype=torch.long)

    monkeypatch.setattr(TrainData, "epoch_plan", plan)


def _run(tmp: Path, name: str, data: Path, *overrides: str) -> Path:
    config_file = write_config(_config(tmp, name, data, *overrides), tmp / f"{name}.toml")
    run_cli("train", "--config", str(config_file), "--quiet")
    return tmp / name


def two_process_configs(tmp: Path) -> dict[str, Config]:
    """This file's runs that tests/parallel/conftest.py trains with other files' 2-process runs: packed rows of
    short meetings (written to tmp / MEETINGS) through a 1F1B pipeline of 2 stages, an interleaved one of 4, two
    data-parallel replicas of 2 rows each, and two tensor-parallel ranks."""
    data = write_short_meetings(tmp / MEETINGS, 43)  # 32 training samples after the hold-out
    looped = ['parallel.schedule="interleaved_1f1b"', "parallel.stages_per_rank=2"]
    ddp = [
        'parallel.strategy="ddp"',
        "parallel.pp=1",
        "parallel.dp=2",
        "parallel.n_microbatches=1",
        "train.batch_size=2",
    ]
    tp = ['parallel.strategy="tp"', "parallel.pp=1", "parallel.tp=2"]
    return {
        "packed-pp2": _config(tmp, "packed-pp2", data, *PACKED),
        "packed-looped": _config(tmp, "packed-looped", data, *PACKED, *looped),
        "packed-ddp": _config(tmp, "packed-ddp", data, *PACKED, *ddp),  # 2 replicas x 2 rows: the same 4 rows
        "packed-tp": _config(tmp, "packed-tp", data, *PACKED, *tp),
    }


@pytest.mark.slow
def test_packed_runs_match_the_unpacked_run_on_the_same_samples(
    two_process_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every sample takes at most half a row, so every packed row holds two: 4 rows a schedule step hold 8
    samples, which the unpacked reference takes as its step of 8 rows (_on_the_packed_steps). The losses of each
    step (normalized over its supervised tokens) and the adapter must match, in one process, through a 1F1B
    pipeline of 2 stages and through an interleaved one of 4 (torch's multi-stage runtime hands the position ids
    to each stage of a rank), over 2 data-parallel replicas (each of 2 of the step's 4 rows) and over 2
    tensor-parallel ranks. The adapters differ from the unpacked one only as rounding does under Adam (attention
    runs per sample instead of over the row: other float32 sums), and from each other likewise."""
    data = two_process_runs / MEETINGS  # the meetings the 2-process runs read
    single = _run(tmp_path, "single", data, "parallel.pp=1", *PACKED)
    _on_the_packed_steps(monkeypatch)
    reference = _run(tmp_path, "unpacked", data, "parallel.pp=1", "train.batch_size=8")
    runs = [single, *(two_process_runs / f"packed-{name}" for name in ("pp2", "looped", "ddp", "tp"))]
    for run_dir in runs:  # losses, gradient norms, adapters (tests/parity.py)
        assert_same_training(run_dir, reference, steps=2)
    for run_dir in runs[1:]:
        assert_same_training(run_dir, runs[0], steps=2)
    # The metrics count the same supervised and real tokens, in half the rows: twice the real share of them.
    unpacked, packed_rows = _steps(reference), _steps(runs[1])
    # Each packed step records its rows' attention share; over the epoch's steps, the epoch's (data inspect's).
    epoch_share = attention_share(_config(tmp_path, "single", data, "parallel.pp=1", *PACKED))
    assert statistics.fmean(float(r["attention_share"]) for r in _steps(single)) == pytest.approx(epoch_share)
    assert len({r["attention_share"] for r in _steps(single)}) > 1 and not any(r["attention_share"] for r in unpacked)
    assert [r["supervised_tokens"] for r in packed_rows] == [r["supervised_tokens"] for r in unpacked]
    for got, want in zip(packed_rows, unpacked, strict=True):
        share = float(got["real_tokens_per_sec"]) / float(got["tokens_per_sec"])
        assert share == pytest.approx(2 * float(want["real_tokens_per_sec"]) / float(want["tokens_per_sec"]), rel=1e-5)


def _steps(run_dir: Path) -> list[dict[str, str]]:
    with open(run_dir / "metrics.csv") as f:
        return [row for row in csv.DictReader(f) if row["loss"]]


@pytest.mark.slow
def test_packed_rows_with_an_nf4_base_fused_loss_and_checkpointing(
    two_process_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The switches a long-row run sets, on packed rows in one process: an NF4 base, the fused loss and every layer
    checkpointed (what "auto" turns on where memory is short) give the unpacked run's training with the same
    switches (tests/parity.py), the pair of packed and unpacked as above."""
    data = two_process_runs / MEETINGS
    switches = ['model.quantize="nf4"', "train.fused_loss=true", "train.activation_checkpointing=true", "parallel.pp=1"]
    packed = _run(tmp_path, "packed-switches", data, *switches, *PACKED)
    _on_the_packed_steps(monkeypatch)
    reference = _run(tmp_path, "unpacked-switches", data, *switches, "train.batch_size=8")
    assert_same_training(packed, reference, steps=2)


def test_documents_kernel_speaks_up_on_short_samples() -> None:
    """ "documents" loses to flex on short samples (6-7x a layer at ~550 tokens on an H200): a run says so."""
    advice = attention.documents_advice(torch.tensor([500, 600, 550]))
    assert advice is not None and "550 tokens on average" in advice and '"flex"' in advice
    assert attention.documents_advice(torch.tensor([7000, 8000])) is None
    # on a CPU both kernels take each sample alone: no advice to prefer one
    assert attention.documents_advice(torch.tensor([500, 600, 550]), gpu=False) is None
