"""Long rows: the memory model of offloaded checkpoints and chunked MLPs, the longest row a layout trains, the
checks that refuse or warn about a row before any GPU work, and a training run that offloads and chunks."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipetune.config import ConfigError, apply_override
from pipetune.model.shapes import resolve_model
from pipetune.model.split import run_split
from pipetune.parallel.memory import (
    BACKWARD_INPUTS,
    LAYER_MODES,
    OFFLOAD_STAGING,
    CheckpointPlan,
    RowCosts,
    activation_peak,
    check_row_fits,
    host_bytes,
    long_row_memory,
    longest_rows,
    plan_checkpointing,
    refuse_unfit,
    row_costs,
)
from pipetune.planner.plan import format_plan, make_plan
from pipetune.preflight import check_positions, prepare
from pipetune.switches import mlp_chunk_tokens
from tests.conftest import tiny_config
from tests.parity import adapter, assert_same_training, losses, max_relative


def test_offloaded_layers_hold_nothing_on_the_gpu_but_the_staged_inputs() -> None:
    layers, timeline = [4], [[2]]  # one stage of 4 layers, 2 microbatches in flight
    recomputed = activation_peak(layers, [4], timeline, 10.0, 1.0)[0]
    offloaded = activation_peak(layers, [4], timeline, 10.0, 1.0, offloaded=[4])[0]
    # every input, the layer being recomputed, and the backward's working set
    assert recomputed == 2 * 4 * 1.0 + 10.0 + BACKWARD_INPUTS * 1.0
    assert offloaded == 10.0 + OFFLOAD_STAGING * 1.0 + BACKWARD_INPUTS * 1.0  # no input: the host holds them
    assert host_bytes(timeline, [4], 1.0) == 2 * 4 * 1.0


def test_auto_offloads_within_the_host_budget_and_only_when_it_must_or_it_is_free() -> None:
    # 12 layers of 1 GB (0.1 GB inputs), 4 microbatches in flight, 10 GB fixed: recomputing alone fits 40 GB.
    args = ([12], [[4]], 1e9, 0.1e9, 10e9)
    plain = plan_checkpointing(*args, 40e9)
    assert plan_checkpointing(*args, 40e9, host_budget=1e12).offloaded is None  # fits without: nothing moved
    # 16 GB: even all 12 recomputed (4 x 12 x 0.1 + 1 + 10 = 15.8) is close; 12.5 GB needs the host.
    tight = plan_checkpointing(*args, 12.5e9, host_budget=1e12)
    assert tight.fits and tight.layers == [12] and tight.offloaded and tight.offloaded[0] > 0
    assert tight.host_bytes == 4 * tight.offloaded[0] * 0.1e9
    assert not plan_checkpointing(*args, 12.5e9).fits  # no host budget: no offload, no fit
    small_host = plan_checkpointing(*args, 12.5e9, host_budget=0.8e9)  # two layers' inputs, 4 microbatches each
    assert small_host.offloaded == [2] and small_host.host_bytes <= 0.8e9 and not small_host.fits
    # Offloading first (its copy hides behind compute) recomputes no more layers than recomputing first.
    first = plan_checkpointing(*args, 40e9, host_budget=1e12, offload_first=True)
    assert first.fits and first.layers[0] <= plain.layers[0] and first.offloaded
    assert "offloaded" in first.describe([0], [12]) and "host memory" in first.describe([0], [12])


def test_longest_rows_are_the_lengths_the_memory_model_just_fits() -> None:
    """Each mode's longest row fits the budget by activation_peak's own count, and one more token does not."""
    row = RowCosts(layer=300e3, input=8e3, transient=2e3, fixed=20e9)
    layers, timeline, budget = [3, 3], [[2, 1], [1, 1]], 140e9
    longest = longest_rows(layers, timeline, row, budget, host=float("inf"))
    assert longest["keep"] < longest["recompute"] < longest["offload"]
    modes = {"keep": ([0, 0], None), "recompute": ([3, 3], None), "offload": ([3, 3], [3, 3])}

    def peak(mode: str, tokens: int) -> float:
        k, o = modes[mode]
        held = activation_peak(layers, k, timeline, row.layer * tokens, row.input * tokens, o)[0]
        return row.fixed + held + row.transient * tokens

    for mode in LAYER_MODES:
        assert peak(mode, longest[mode]) <= budget < peak(mode, longest[mode] + 1), mode
    # A host that holds fewer inputs leaves more of them on the GPU: between recompute and offload.
    capped = longest_rows(layers, timeline, row, budget, host=10e9)["offload"]
    assert longest["recompute"] < capped < longest["offload"]


def test_chunked_mlps_lengthen_the_longest_row() -> None:
    config = tiny_config(Path("/tmp/unused"), "parallel.pp=1", "parallel.n_microbatches=1", "train.fused_loss=true")
    resolved = resolve_model(config.model)
    rows = {}
    for chunk in (0, 1024):
        config.train.mlp_chunk = chunk
        measured = long_row_memory(config, resolved)
        row = row_costs(config, resolved.config, measured, 1e9, True, resolved.config.vocab_size)
        rows[chunk] = longest_rows([4], [[1]], row, 2e9, host=0.0)
    assert rows[1024]["keep"] > rows[0]["keep"] and rows[1024]["recompute"] > rows[0]["recompute"]


def test_mlp_chunk_auto_turns_on_at_long_rows_and_bad_values_are_refused(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, 'train.mlp_chunk="auto"')
    assert mlp_chunk_tokens(config.train, 1024) == 0 and mlp_chunk_tokens(config.train, 131072) > 0
    assert mlp_chunk_tokens(config.train, 131072, tp=2) == 0  # a tp rank holds a share of each token
    apply_override(config, "train.mlp_chunk=512")
    assert mlp_chunk_tokens(config.train, 1024) == 512
    # A chunk is 512 positions of every sequence of the microbatch: its workspace grows with the microbatch.
    from pipetune.parallel.memory import mlp_workspace_bytes

    model_config = resolve_model(config.model).config
    apply_override(config, "data.max_length=1024")
    one_row = 3 * model_config.intermediate_size * 512 * 4  # float32
    assert mlp_workspace_bytes(config, model_config, 1, 1024) == one_row
    assert mlp_workspace_bytes(config, model_config, 4, 1024) == 4 * one_row
    assert mlp_workspace_bytes(config, model_config, 4, 256) == 2 * one_row  # rows shorter than the chunk
    from pipetune.config import validate

    config.train.mlp_chunk = -1
    with pytest.raises(ConfigError, match=r'train.mlp_chunk = -1 must be "auto" or a number of tokens >= 0'):
        validate(config, 2)
    offload = tiny_config(tmp_path, 'train.activation_checkpointing="offload"')
    validate(offload, 2)
    apply_override(offload, "train.compile=true")
    apply_override(offload, "train.cuda_graphs=true")
    with pytest.raises(ConfigError, match=r'does not combine with train.activation_checkpointing = "offload"'):
        validate(offload, 2)
    kept = tiny_config(tmp_path, "train.keep_attention=true", "train.activation_checkpointing=false")
    with pytest.raises(ConfigError, match=r"train.keep_attention = true .* set train.activation_checkpointing"):
        validate(kept, 2)
    for setting, fix in (("train.compile=true", "set train.compile = false"), ("data.packing=true", "data.packing")):
        bad = tiny_config(tmp_path, "train.keep_attention=true", "train.activation_checkpointing=true", setting)
        with pytest.raises(ConfigError, match=rf"train.keep_attention = true .*{fix}"):
            validate(bad, 2)


def test_a_row_that_fits_no_layer_mode_is_refused_with_the_longest_that_would(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "parallel.pp=1", "parallel.n_microbatches=1", "train.memory_gb=2")
    resolved = resolve_model(config.model)
    ranges = run_split(config, resolved.config)[1]
    config.data.max_length = 1 << 24
    with pytest.raises(ConfigError, match=r"data.max_length = 16777216 does not fit .* would is (\d+) tokens") as e:
        check_row_fits(config, resolved, ranges)
    longest = int(str(e.value).split("would is ")[1].split(" ")[0])
    assert 0 < longest < 1 << 24
    fitting = dataclasses.replace(config, data=dataclasses.replace(config.data, max_length=longest))
    check_row_fits(fitting, resolved, ranges)


def test_a_run_whose_own_plan_cannot_fit_its_row_stops_before_step_1(tmp_path: Path, monkeypatch, capsys) -> None:
    """Preflight's count on the meta device can let a row through that the run's "auto" plan, from a layer measured
    on its own device, cannot fit (here preflight's check is switched off, and a CPU plan has no host memory to
    offload to): the run stops before step 1 with the longest row that would fit, which then trains. The CPU plan
    counts the process's resident memory: read here as 0.5 GB, whatever this test process holds."""
    from pipetune.cli import main
    from tests.conftest import write_config

    monkeypatch.setattr("pipetune.parallel.memory.check_row_fits", lambda *args: None)
    monkeypatch.setattr("pipetune.parallel.memory.resident_bytes", lambda: 0.5e9)
    budget = ('train.activation_checkpointing="auto"', "train.memory_gb=0.64", "train.max_steps=1")
    config = tiny_config(tmp_path / "run", "parallel.pp=1", "data.max_length=512", *budget)
    with pytest.raises(SystemExit) as stopped:  # a run in one process: its worker's exit, here
        main(["train", "--config", str(write_config(config, tmp_path / "c.toml")), "--quiet"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    said = re.search(
        r"data.max_length = 512 does not fit rank 0's 0.64 GB \(train.memory_gb, else its share of the memory "
        r"available on this machine\): .* predicts a peak resident memory of .* about (\d+) tokens",
        err,
    )
    assert said, err
    assert not (tmp_path / "run" / "metrics.csv").exists() or losses(tmp_path / "run") == []
    longest = int(said.group(1))
    assert 128 <= longest < 512
    fitting = tiny_config(tmp_path / "fits", "parallel.pp=1", f"data.max_length={longest}", *budget)
    assert main(["train", "--config", str(write_config(fitting, tmp_path / "f.toml")), "--quiet"]) == 0
    assert len(losses(tmp_path / "fits")) == 1
    # Not far too short either: the plain loss's logits grow with the row, and are scaled with it (the named row
    # was once a quarter of what fits); a quarter longer does not fit.
    longer = tiny_config(tmp_path / "longer", "parallel.pp=1", f"data.max_length={longest * 5 // 4}", *budget)
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--config", str(write_config(longer, tmp_path / "l.toml")), "--quiet"])
    assert stopped.value.code == 2
    # A plan that fits (a CPU's has no limit) keeps its row.
    assert CheckpointPlan([0], 64e6, float("inf"), fixed_bytes=28e6).longest_row(256) == 256
    # Of several ranks (peak, budget, longest row each), the one with the shortest row that fits is named.
    refuse_unfit([[1e9, 2e9, 512], [2e9, 2e9, 512]], config)  # every rank fits: nothing said
    with pytest.raises(ConfigError, match=r"rank 2's 2 GB .* predicts 5 GB .* about 40 tokens"):
        refuse_unfit([[1e9, 2e9, 512], [3e9, 2e9, 60], [5e9, 2e9, 40]], config)


def test_rows_past_the_trained_positions_warn_and_name_rope_scaling(tmp_path: Path, capsys) -> None:
    config = tiny_config(tmp_path, "data.max_length=8192")  # tiny-qwen3 was built for 4096 positions
    resolved = resolve_model(config.model)
    assert check_positions(tiny_config(tmp_path), resolved.config) is None
    prepare(config)
    err = capsys.readouterr().err
    assert "pipetune: warning: data.max_length = 8192 is beyond the 4096 positions" in err and "rope_scaling" in err
    scaled = SimpleNamespace(max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "factor": 2.0})
    assert check_positions(config, scaled) is None
    # Gemma 3's per-attention-kind parameters: one of them scaled is scaled.
    per_kind = {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "linear", "factor": 8}}
    assert check_positions(config, SimpleNamespace(max_position_embeddings=4096, rope_parameters=per_kind)) is None
    # The factor named reaches the row: 6,100 tokens over 4,096 positions needs 2, not round(1.49) = 1.
    plain = SimpleNamespace(max_position_embeddings=4096, rope_parameters={"rope_type": "default"})
    assert '"factor": 2,' in check_positions(tiny_config(tmp_path, "data.max_length=6100"), plain)
    assert '"factor": 3,' in check_positions(tiny_config(tmp_path, "data.max_length=8193"), plain)


def test_plan_prints_the_longest_row_of_each_layout(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "train.fused_loss=true")
    plan = make_plan(config, 2, budget=4e9, host_memory=64e9)  # the training machine's (pipetune plan --host-memory)
    text = format_plan(plan)
    assert "longest row per layout" in text and "offload: within 50% of 64 GB of host memory" in text
    for prediction in plan.predictions:
        keep, recompute, offload = (prediction.longest[mode] for mode in LAYER_MODES)
        assert 0 < keep <= recompute < offload
    # No host memory: offloading gains nothing, and an offloaded input still needs its staging copies.
    for prediction in make_plan(config, 2, budget=4e9, host_memory=0.0).predictions:
        assert prediction.longest["offload"] <= prediction.longest["recompute"]
    pick = plan.predictions[0]
    lines = text.splitlines()
    rows = lines[next(i for i, line in enumerate(lines) if line.startswith("longest row")) + 1 :]
    line = next(line for line in rows if line.startswith("   1  "))  # the pick, ranked first
    assert pick.layout.describe() in line and line.endswith(" / ".join(f"{pick.longest[m]:,}" for m in LAYER_MODES))


def _train(tmp_path: Path, name: str, *overrides: str) -> Path:
    from tests.conftest import run_cli, write_config

    config = tiny_config(tmp_path / name, "parallel.pp=1", *overrides)
    run_cli("train", "--config", str(write_config(config, tmp_path / f"{name}.toml")), "--quiet")
    return tmp_path / name


@pytest.mark.slow
def test_offloaded_training_is_the_plain_run(reference: Path, tmp_path: Path) -> None:
    """tiny_config in one process with every layer's input offloaded: the same math, step for step."""
    offloaded = _train(tmp_path, "offload", 'train.activation_checkpointing="offload"')
    torch.testing.assert_close(torch.tensor(losses(offloaded)), torch.tensor(losses(reference)), rtol=1e-6, atol=0)
    assert max_relative(adapter(offloaded), adapter(reference)) < 1e-6


@pytest.mark.slow
def test_chunked_mlp_training_matches_the_plain_run(reference: Path, tmp_path: Path) -> None:
    """Offloaded, MLPs in chunks of 32 of 128 tokens and attention kept through the recomputation: the losses to
    1e-6; the adapter to rounding, as a parallel run's (tests/parity.py): the chunks sum each weight gradient over
    the tokens in another order."""
    chunked = _train(
        tmp_path,
        "chunked",
        'train.activation_checkpointing="offload"',
        "train.mlp_chunk=32",
        "train.keep_attention=true",
    )
    torch.testing.assert_close(torch.tensor(losses(chunked)), torch.tensor(losses(reference)), rtol=1e-6, atol=0)
    assert_same_training(chunked, reference)


def test_kept_attention_and_offloaded_inputs_serve_a_second_backward_and_let_go() -> None:
    """A second backward pass through the same graph recomputes the checkpointed layers again: kept attention
    takes its outputs back from the start (its context is entered once per recomputation) and the gradients are
    twice the plain run's. Once the graph is gone no offloaded copy is held (the chain's last link let go)."""
    from pipetune.config import LoraConfig, ModelConfig
    from pipetune.model.attention import DOCUMENT_ATTENTION
    from pipetune.model.load import build_model
    from pipetune.model.lora import apply_lora
    from pipetune.model.stage import StageModule

    def grads(checkpointed: int, offloaded: int) -> tuple[dict, StageModule]:
        resolved = resolve_model(ModelConfig(name="tiny-qwen3", init="random"))
        model, _ = build_model(resolved, torch.float32, torch.device("cpu"), layers=range(2), seed=0)
        stage = StageModule(apply_lora(model, LoraConfig(dropout=0.0), "tiny-qwen3", seed=0)).train()
        stage.layers[0].self_attn.config._attn_implementation = DOCUMENT_ATTENTION
        stage.keep_attention = True
        stage.set_layer_modes(checkpointed, offloaded)
        loss = stage(torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))).pow(2).mean()
        loss.backward(retain_graph=True)
        loss.backward()
        return {n: p.grad for n, p in stage.named_parameters() if p.requires_grad}, stage

    plain, _ = grads(0, 0)
    kept, stage = grads(2, 2)
    assert all(torch.allclose(kept[n], plain[n], rtol=1e-5, atol=1e-7) for n in plain)
    assert stage.offload._last is None and stage.kept.host._last is None
