"""Messages that named the wrong cause or place, and inputs taken without a word (docs/errors.md): each case once
misled a user; here it says what happened and what to do, in one line."""

from __future__ import annotations

import errno
import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipetune.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointSettings,
    Position,
    TrainState,
    find_resume_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from pipetune.cli import main
from pipetune.config import ConfigError, validate
from pipetune.data import tokenizer
from pipetune.data.batching import SampleStore
from pipetune.data.packing import packing_line
from pipetune.data.sources import load_dataset
from pipetune.data.synthetic_splits import synthetic_splits
from pipetune.launch import check_auto_resume
from pipetune.model.gguf import gguf_source
from pipetune.planner.plan import resolve_auto
from pipetune.preflight import prepare
from tests.conftest import tiny_config, write_config


def _state() -> TrainState:
    param = torch.nn.Parameter(torch.full((2, 3), 0.5))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return TrainState({"base_model.model.layers.0.q_proj.lora_A.weight": param}, optimizer, scheduler, {param: "p"})


def _rehash(step: Path, name: str) -> None:
    """Record `name`'s new hash where the checkpoint keeps it (its state JSON, whose own hash the marker keeps)."""
    meta_path = step / "state.rank0.json"
    if name != meta_path.name:
        meta = json.loads(meta_path.read_text())
        meta["files"][name] = hashlib.sha256((step / name).read_bytes()).hexdigest()
        meta_path.write_text(json.dumps(meta))
    marker = json.loads((step / MARKER).read_text())
    marker["files"][meta_path.name] = hashlib.sha256(meta_path.read_bytes()).hexdigest()
    (step / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize("damage", ["position", "moment", "step"])
def test_a_state_file_of_the_right_hash_but_the_wrong_shape_is_named(tmp_path: Path, damage: str) -> None:
    """Once a traceback at the first resumed step on every rank (or a step count of "x" trained on)."""
    config = tiny_config(tmp_path / "run", 'train.resume="auto"')
    state = _state()
    next(iter(state.adapters.values())).grad = torch.ones(2, 3)
    state.optimizer.step()
    save_checkpoint(CheckpointSettings.of(config), state, Position(2, 0, 2), 0, 1)
    step = tmp_path / "run" / "checkpoints" / "step-2"
    if damage == "position":
        meta = json.loads((step / "state.rank0.json").read_text())
        meta["position"]["step"] = "x"
        (step / "state.rank0.json").write_text(json.dumps(meta))
        _rehash(step, "state.rank0.json")
    else:
        tensors = load_file(step / "state.rank0.safetensors")
        tensors["optim/p/exp_avg" if damage == "moment" else "optim/p/step"] = torch.zeros(5)
        save_file(tensors, step / "state.rank0.safetensors")
        _rehash(step, "state.rank0.safetensors")
    checkpoint = find_resume_checkpoint(CheckpointSettings.of(config))  # every hash matches
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(checkpoint, _state(), 0)
    message = str(refused.value)
    assert message.startswith(f"checkpoint {step} is damaged: ") and message.endswith(f"delete {step} to start over")
    assert ("of p is (5,), the model's (2, 3)" in message) == (damage != "position")
    assert message.count("is damaged") == 1


def test_a_full_disk_while_the_demo_tokenizer_is_first_written_names_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Once `no space left on the device; committed checkpoints are kept: ... --resume`, of a run not started."""
    monkeypatch.setenv("PIPETUNE_CACHE", str(tmp_path / "cache"))

    class FullDisk:
        def save_pretrained(self, directory: Path) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")  # as a write to an open file: no file name

    monkeypatch.setattr(tokenizer, "_train", lambda vocab_size: None)
    monkeypatch.setattr(tokenizer, "_wrap", lambda trained: FullDisk())
    config_file = write_config(tiny_config(tmp_path / "run"), tmp_path / "c.toml")
    assert main(["train", "--config", str(config_file), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"pipetune: error: no space left on the device writing {tokenizer.tokenizer_dir()} (the demo tokenizer); "
        "the run had not started: free space there, or set PIPETUNE_CACHE"
    ), err
    assert list((tmp_path / "cache" / "tokenizers").iterdir()) == []  # nothing half-written


def test_a_directory_named_like_a_gguf_file_is_called_a_directory(tmp_path: Path) -> None:
    folder = tmp_path / "model.gguf"
    folder.mkdir()
    with pytest.raises(ConfigError, match=r"is a directory holding no \.gguf file \(nor a config\.json\)"):
        gguf_source(str(folder))
    (folder / "weights.gguf").write_bytes(b"GGUF")
    assert gguf_source(str(folder)) == folder / "weights.gguf"  # a directory holding one: that file


def test_bad_text_in_a_chat_message_is_named_as_the_message(tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "A: hi."}, {"role": "assistant", "content": "They met."}]}
    bad = '{"messages": [{"role": "user", "content": "A: \\ud800"}, {"role": "assistant", "content": "x"}]}'
    data.write_text(json.dumps(good) + "\n" + bad + "\n")
    stats = load_dataset(tiny_config(tmp_path / "run", f'data.source="{data}"').data).stats["train"]
    assert dict(stats.skipped) == {"invalid Unicode in user message": 1}


def test_an_empty_config_name_is_not_called_a_directory(capsys: pytest.CaptureFixture) -> None:
    assert main(["config", "show", "--config", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipetune: error: config file '' is an empty name; pass --config with a TOML file or the ")


def test_memory_gb_nan_is_refused_as_not_finite(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "train.memory_gb=1")
    config.train.memory_gb = math.nan
    with pytest.raises(ConfigError, match=r"^train.memory_gb = nan must be a finite number of GB \(e.g. 80\)$"):
        validate(config, world_size=2)


def test_auto_on_a_process_count_nothing_splits_over_says_why(tmp_path: Path) -> None:
    config = tiny_config(tmp_path / "run", 'parallel.strategy="auto"')  # 4 x 2 = 8 sequences a step
    with pytest.raises(ConfigError) as refused:
        resolve_auto(config, 3, announce=False)
    message = str(refused.value)
    assert "no layout of tiny-qwen3 runs on 3 GPUs (pp=1 tp=1 dp=3: 8 sequences a step do not split over 3" in message
    assert "pp=3 tp=1 dp=1: no multiple of 3 microbatches divides the 8 sequences a step" in message
    assert message.endswith(
        "use another number of processes (--nproc), or a train.batch_size x train.grad_accum that splits over them"
    )


def test_resuming_an_auto_run_on_fewer_processes_names_the_processes(tmp_path: Path) -> None:
    """Once `was written with train.batch_size 4 (config: 8); parallel.dp 2 (config: 1)`: keys "auto" chose."""
    config = tiny_config(tmp_path / "run", 'parallel.strategy="auto"', 'train.resume="auto"')
    on_two = resolve_auto(config, 2, announce=False)
    assert (on_two.parallel.dp, on_two.train.batch_size) == (2, 4)  # ddp: the picks this test is about
    save_checkpoint(CheckpointSettings.of(on_two), _state(), Position(2, 0, 2), 0, 1)
    marker_path = tmp_path / "run" / "checkpoints" / "step-2" / MARKER
    marker = json.loads(marker_path.read_text())
    marker["world_size"] = 2  # as the two processes wrote it
    marker_path.write_text(json.dumps(marker))
    check_auto_resume(on_two, 2)  # on as many processes: resumed
    with pytest.raises(CheckpointError) as refused:
        check_auto_resume(resolve_auto(config, 1, announce=False), 1)
    assert str(refused.value) == (
        f"checkpoint {marker_path.parent} was written on 2 processes, where parallel.strategy = 'auto' chose "
        "train.batch_size 4, train.grad_accum 1, parallel.dp 2; on 1 it chooses train.batch_size 8, train.grad_accum "
        "1, parallel.dp 1, and these set the data position: resume on 2 processes (--nproc 2), or start a new run in "
        "another output.dir"
    )
    other_seed = tiny_config(tmp_path / "run", 'parallel.strategy="auto"', 'train.resume="auto"', "train.seed=7")
    with pytest.raises(CheckpointError, match=r"was written with .*train.seed 42 \(config: 7\)"):  # a key set
        check_auto_resume(resolve_auto(other_seed, 1, announce=False), 1)


def test_whole_meetings_with_short_summary_room_say_the_summaries_are_capped(tmp_path: Path) -> None:
    """The demo config on whole meetings: every summary capped at 96 tokens, once said only as "cut to fit"."""
    config = tiny_config(
        tmp_path, 'data.synthetic_lengths="whole"', "data.max_length=384", "data.max_summary_tokens=96"
    )
    examples = synthetic_splits(seed=0, n_train=4, n_validation=0, lengths="whole")["train"]
    store = SampleStore.from_samples(prepare(config).prompts.build_examples(examples))
    assert store.summaries_capped == 4
    assert store.capped_summaries_note(96).startswith(
        "note: 4 of 4 training summaries are capped at data.max_summary_tokens = 96 (or the room the transcript "
        "leaves): their ends are never trained; raise data.max_summary_tokens"
    )


def test_the_packing_line_compares_the_same_samples() -> None:
    """The rows an epoch trains hold two samples of 60 tokens; the split's others are 100 long. Once "pad share
    40.0% (unpacked: 20.0%)": the split's pad share, not that of the samples the rows hold."""
    lengths = torch.tensor([60, 60, 100, 100])
    one_each = torch.tensor([[[0, -1], [1, -1]]])  # one batch of two rows, one sample each
    assert packing_line(one_each, lengths, 100, 2) == (
        "2 of the 4 samples in 2 rows of 100 tokens (at most 2 a row), pad share 40.0% (the same samples one a row: "
        "40.0%)"
    )
    lengths = torch.tensor([40, 60, 100, 10])
    packed = torch.tensor([[[0, 1], [2, -1]]])
    assert packing_line(packed, lengths, 100, 2).endswith("pad share 0.0% (the same samples one a row: 33.3%)")
