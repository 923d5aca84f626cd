"""Checkpoints in one process: a round trip restores everything, markers decide, retention keeps the newest."""

from __future__ import annotations

import csv
import json
import os
import random
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipetune import checkpoint as checkpoint_module
from pipetune.checkpoint import (
    MARKER,
    Checkpoint,
    CheckpointError,
    CheckpointSettings,
    Position,
    TrainState,
    check_compatible,
    checkpoint_dir,
    commit_metadata,
    committed_checkpoints,
    latest_checkpoint,
    layout_change,
    load_checkpoint,
    prune_checkpoints,
    resumed_seed,
    save_checkpoint,
)
from pipetune.metrics import MetricsWriter
from pipetune.model.load import build_model
from pipetune.model.lora import adapter_state, apply_lora
from pipetune.model.split import split_layers
from pipetune.preflight import prepare
from tests.conftest import tiny_config


def _stage(config, layers: range, first: bool, last: bool, seed: int):
    """A tiny LoRA stage, its AdamW and scheduler, and the full-model name of each trainable parameter."""
    base, _ = build_model(prepare(config).model, torch.float32, torch.device("cpu"), layers, first, last, seed=0)
    model = apply_lora(base, config.lora, config.model.name, seed)
    names = {param: name for name, param in model.named_parameters() if param.requires_grad}
    optimizer = torch.optim.AdamW(list(names), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    return model, optimizer, scheduler, names


def _train_a_little(model, optimizer, scheduler, names, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for param in names:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
        scheduler.step()


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory):
    return tiny_config(tmp_path_factory.mktemp("ckpt") / "run", "parallel.pp=1", "train.keep_checkpoints=5")


def test_round_trip_restores_adapter_optimizer_scheduler_rng_and_position(config) -> None:
    layers = range(0, 4)
    model, optimizer, scheduler, names = _stage(config, layers, True, True, seed=1)
    _train_a_little(model, optimizer, scheduler, names)
    random.seed(5)
    torch.manual_seed(5)
    position = Position(step=7, epoch=1, batch=3, skipped_in_row=1)
    path = save_checkpoint(CheckpointSettings.of(config), TrainState.of(model, optimizer, scheduler), position, 0, 1)
    expected_draws = (torch.rand(3), random.random())

    assert (path / MARKER).is_file() and latest_checkpoint(Path(config.output.dir)).step == 7
    saved = load_file(path / "adapter.rank0.safetensors")
    assert sorted(saved) == sorted(adapter_state(model))  # PEFT names, as the final adapter has them
    assert all(".layers." in name and ".default." not in name for name in saved)

    # A fresh model (another init seed), optimizer and scheduler, and disturbed RNGs.
    fresh, fresh_optimizer, fresh_scheduler, fresh_names = _stage(config, layers, True, True, seed=2)
    torch.manual_seed(99)
    random.seed(99)
    fresh_state = TrainState.of(fresh, fresh_optimizer, fresh_scheduler)
    restored = load_checkpoint(latest_checkpoint(Path(config.output.dir)), fresh_state, 0)

    assert restored == position
    for name, tensor in adapter_state(model).items():
        assert torch.equal(adapter_state(fresh)[name], tensor), name
    by_name = {fresh_names[p]: p for p in fresh_names}
    for param, name in names.items():
        old, new = optimizer.state[param], fresh_optimizer.state[by_name[name]]
        assert sorted(old) == sorted(new)
        for field in old:
            assert torch.equal(old[field], new[field]), (name, field)
    assert fresh_scheduler.last_epoch == scheduler.last_epoch == 2
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert torch.equal(torch.rand(3), expected_draws[0]) and random.random() == expected_draws[1]


def test_optimizer_state_follows_parameter_names_into_another_layout(config, tmp_path: Path) -> None:
    """Saved by two stages (layers 0-1 and 2-3), loaded by one process holding all four layers."""
    two_stage = tiny_config(tmp_path / "run", "parallel.pp=2")
    parts = []
    for rank, layers in enumerate(split_layers(4, 2)):
        stage = _stage(two_stage, layers, rank == 0, rank == 1, seed=1)
        _train_a_little(*stage)
        parts.append(stage)
    position = Position(step=2, epoch=0, batch=2)
    for rank, (model, optimizer, scheduler, _) in reversed(list(enumerate(parts))):  # rank 0 commits last
        save_checkpoint(CheckpointSettings.of(two_stage), TrainState.of(model, optimizer, scheduler), position, rank, 2)
    marker = json.loads((checkpoint_dir(tmp_path / "run", 2) / MARKER).read_text())
    assert (marker["world_size"], marker["pp"], marker["model"], marker["lora"]["r"]) == (2, 2, "tiny-qwen3", 16)

    whole, optimizer, scheduler, names = _stage(two_stage, range(0, 4), True, True, seed=3)
    torch.manual_seed(1234)
    expected_draws = torch.rand(3)
    # Under another layout, torch's RNG is seeded as given (resumed_seed), not restored from saved rank 0.
    load_checkpoint(latest_checkpoint(tmp_path / "run"), TrainState.of(whole, optimizer, scheduler), 0, 1234)
    assert torch.equal(torch.rand(3), expected_draws)
    saved = {name: param for _, _, _, stage_names in parts for param, name in stage_names.items()}
    saved_state = {name: opt.state[p] for _, opt, _, stage_names in parts for p, name in stage_names.items()}
    assert sorted(names.values()) == sorted(saved)
    for param, name in names.items():
        assert torch.equal(param, saved[name]), name
        assert torch.equal(optimizer.state[param]["exp_avg_sq"], saved_state[name]["exp_avg_sq"]), name


def _fake_checkpoint(run_dir: Path, step: int, committed: bool) -> Path:
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True)
    (path / "adapter.rank0.safetensors").write_bytes(b"x")
    if committed:
        (path / MARKER).write_text(json.dumps({"step": step, "world_size": 1}))
    return path


def test_retention_keeps_the_newest_and_drops_older_leftovers(tmp_path: Path) -> None:
    for step, committed in [(2, True), (3, False), (4, True), (6, True), (8, False)]:
        _fake_checkpoint(tmp_path, step, committed)
    assert [c.step for c in committed_checkpoints(tmp_path)] == [2, 4, 6]
    assert latest_checkpoint(tmp_path).step == 6  # step-8 has no marker: never loaded

    removed = prune_checkpoints(tmp_path, keep=2)

    assert sorted(p.name for p in removed) == ["step-2", "step-3"]
    remaining = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert remaining == ["step-4", "step-6", "step-8"]  # step-8 may be in progress: newer than the newest commit
    prune_checkpoints(tmp_path, keep=1)
    assert [c.step for c in committed_checkpoints(tmp_path)] == [6]  # the newest committed one always stays


def test_metrics_csv_continues_from_the_checkpoint_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    writer = MetricsWriter(path, n_ranks=2)
    for step in (1, 2, 3, 4):
        writer.write({"strategy": "pp", "epoch": 0, "step": step, "loss": float(step), "peak_gb_rank1": 0.5})
    writer.close()

    writer = MetricsWriter(path, n_ranks=1, keep_until_step=2)  # resumed at step 2, with one stage fewer
    writer.write({"strategy": "pp", "epoch": 0, "step": 3, "loss": 30.0})
    writer.close()

    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["loss"]) for r in rows] == [("1", "1"), ("2", "2"), ("3", "30")]
    assert rows[0]["peak_gb_rank1"] == "0.5" and rows[2]["peak_gb_rank1"] == ""


def test_a_damaged_metrics_tail_does_not_block_a_resume(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """What a full disk or a power cut leaves: a row cut short, NUL bytes, bytes that are not UTF-8."""
    path = tmp_path / "metrics.csv"
    writer = MetricsWriter(path, n_ranks=1)
    for step in (1, 2, 3):
        writer.write({"strategy": "pp", "epoch": 0, "step": step, "loss": float(step)})
    writer.close()
    with open(path, "ab") as f:
        f.write(b"pp,0,4,4.0,12\x00\x00\x00\n\xff\xfe,0,\npp,0,5,5.0")

    writer = MetricsWriter(path, n_ranks=1, keep_until_step=3)
    writer.write({"strategy": "pp", "epoch": 0, "step": 4, "loss": 40.0})
    writer.close()

    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["loss"]) for r in rows] == [("1", "1"), ("2", "2"), ("3", "3"), ("4", "40")]
    assert "3 damaged line(s) dropped" in capsys.readouterr().err


def test_rng_states_are_restored_only_under_the_layout_that_saved_them(tmp_path: Path) -> None:
    """Saved by pp=2 (rank k: stage k), resumed as one tp=2 group: saved ranks 0 and 1 hold two streams, which
    the tp ranks must not take (their dropout masks must agree); each rank is seeded as a fresh run's instead."""
    saved = tiny_config(tmp_path / "run", "parallel.pp=2", "lora.dropout=0.1")
    checkpoint = Checkpoint(checkpoint_dir(tmp_path / "run", 6), commit_metadata(CheckpointSettings.of(saved), 6, 2))
    assert layout_change(checkpoint, CheckpointSettings.of(saved)) is None
    assert layout_change(checkpoint, CheckpointSettings.of(tiny_config(tmp_path / "run", "train.lr=0.1"))) is None
    as_tp = tiny_config(tmp_path / "run", 'parallel.strategy="tp"', "parallel.pp=1", "parallel.tp=2")
    assert layout_change(checkpoint, CheckpointSettings.of(as_tp)) == "parallel.pp 2 -> 1, parallel.tp 1 -> 2"
    interleaved = tiny_config(tmp_path / "run", 'parallel.schedule="interleaved_1f1b"', "parallel.stages_per_rank=2")
    assert layout_change(checkpoint, CheckpointSettings.of(interleaved)) == "parallel.stages_per_rank 1 -> 2"

    # The ranks of a tp group share a replica rank, so a seed; stages and replicas, and steps, differ.
    assert resumed_seed(42, 0, 6) == resumed_seed(42, 0, 6)
    assert len({resumed_seed(42, 0, 6), resumed_seed(42, 1, 6), resumed_seed(42, 0, 7), resumed_seed(7, 0, 6)}) == 4
    assert 0 <= resumed_seed(42, 3, 6) < 2**63


def test_resume_ignores_refused_keys_the_run_never_reads(tmp_path: Path) -> None:
    """data.max_samples_per_row is read only with packing, data.synthetic_* only from synthetic data."""
    run_dir = tmp_path / "run"
    data = tmp_path / "meetings.jsonl"
    data.write_text(json.dumps({"dialogue": "A: hi.", "summary": "They met."}) + "\n")

    def resume(written: list[str], now: list[str]) -> None:
        marker = commit_metadata(CheckpointSettings.of(tiny_config(run_dir, *written)), 2, 2)
        check_compatible(
            Checkpoint(checkpoint_dir(run_dir, 2), marker), CheckpointSettings.of(tiny_config(run_dir, *now))
        )

    from_file = f'data.source="{data}"'
    resume([], ["data.max_samples_per_row=8"])  # packing off
    resume([from_file], [from_file, "data.synthetic_train=5", 'data.synthetic_lengths="whole"'])
    with pytest.raises(CheckpointError, match=r"was written with data.max_samples_per_row 16 \(config: 8\); resume"):
        resume(["data.packing=true"], ["data.packing=true", "data.max_samples_per_row=8"])
    with pytest.raises(CheckpointError, match=r"was written with data.synthetic_train 32 \(config: 5\); resume"):
        resume([], ["data.synthetic_train=5"])


def test_a_commit_is_durable_before_older_checkpoints_are_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file, the marker last, then the step directory's entry in checkpoints/ (fsynced directories), and
    only then the older checkpoint deleted: a power loss in between never leaves no committed checkpoint."""
    config = tiny_config(tmp_path / "run", "parallel.pp=1", "train.keep_checkpoints=1")
    model, optimizer, scheduler, names = _stage(config, range(0, 4), True, True, seed=1)
    _train_a_little(model, optimizer, scheduler, names, steps=1)
    settings, state = CheckpointSettings.of(config), TrainState.of(model, optimizer, scheduler)
    save_checkpoint(settings, state, Position(step=1), 0, 1)

    events: list[str] = []
    step2 = checkpoint_dir(tmp_path / "run", 2)
    directories = {"run": tmp_path / "run", "checkpoints": step2.parent, "step-2": step2}
    fsync, replace, prune = os.fsync, os.replace, checkpoint_module.prune_checkpoints

    def recorded_fsync(fd: int) -> None:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            named = [
                name for name, path in directories.items() if path.exists() and os.path.samestat(info, path.stat())
            ]
            events.append(f"fsync {named[0] if named else '?'}/")
        else:
            events.append("fsync file")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"rename {Path(b).name}"), replace(a, b))[1])
    monkeypatch.setattr(checkpoint_module, "prune_checkpoints", lambda *a: (events.append("prune"), prune(*a))[1])
    save_checkpoint(settings, state, Position(step=2), 0, 1)

    for name in ("adapter.rank0.safetensors", "state.rank0.safetensors", "state.rank0.json", MARKER):
        at = events.index(f"rename {name}")
        assert events[at - 1] == "fsync file" and events[at + 1] == "fsync step-2/", (name, events)
    after_marker = events[events.index(f"rename {MARKER}") :]
    assert after_marker == [f"rename {MARKER}", "fsync step-2/", "fsync checkpoints/", "fsync run/", "prune"], events
    assert [c.step for c in committed_checkpoints(tmp_path / "run")] == [2]
