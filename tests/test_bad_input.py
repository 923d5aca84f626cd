"""Bad input fails once, before training, with a message naming the value and the fix (docs/errors.md).

Covered elsewhere, not repeated here: every other config value (tests/test_config.py) and every
malformed data row class (tests/data/test_sources.py). Here: the reliability keys, checkpoints that
are damaged, missing their marker or written for another model, and data that makes no step.
Committed checkpoints are never lost on the way.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from pipetune.bench import strategy_config
from pipetune.checkpoint import (
    MARKER,
    CheckpointError,
    CheckpointSettings,
    Position,
    TrainState,
    committed_checkpoints,
    find_resume_checkpoint,
    save_checkpoint,
)
from pipetune.cli import main
from pipetune.config import ConfigError, validate
from pipetune.model.load import build_model
from pipetune.model.lora import apply_lora
from pipetune.preflight import prepare
from tests.conftest import tiny_config, write_config


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with committed checkpoints step-1 and step-2, written by one process."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    config = tiny_config(run_dir, "parallel.pp=1")
    base, _ = build_model(prepare(config).model, torch.float32, torch.device("cpu"), range(4), True, True)
    model = apply_lora(base, config.lora, config.model.name, seed=0)
    names = {param: name for name, param in model.named_parameters() if param.requires_grad}
    optimizer = torch.optim.AdamW(list(names), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    checkpoints = CheckpointSettings.of(config)
    for step in (1, 2):
        for param in names:
            param.grad = torch.ones_like(param)
        optimizer.step()
        scheduler.step()
        save_checkpoint(checkpoints, TrainState.of(model, optimizer, scheduler), Position(step, 0, step), 0, 1)
    return run_dir


@pytest.fixture
def run_dir(saved_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    return copy


def _train(run_dir: Path, *args: str) -> int:
    """`pipetune train` in this process: every case here must fail before a worker starts."""
    config_file = write_config(tiny_config(run_dir), run_dir.parent / "c.toml")
    return main(["train", "--config", str(config_file), "--quiet", *args])


def _files(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "override, message",
    [
        ('train.resume="sometimes"', r"train.resume = 'sometimes' is unknown; use one of never, auto"),
        ("train.keep_checkpoints=0", r"train.keep_checkpoints = 0 must be at least 1"),
        ("train.max_skipped_steps=0", r"train.max_skipped_steps = 0 must be at least 1"),
        ("train.save_every=-1", r"train.save_every = -1 must be >= 0"),
        ("parallel.timeout_s=0", r"parallel.timeout_s = 0.0 must be positive"),
    ],
)
def test_reliability_keys_are_validated(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(tiny_config(tmp_path, override), world_size=2)


def test_negative_max_restarts_is_refused(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert _train(run_dir, "--resume", "--max-restarts", "-1") == 2
    assert "--max-restarts -1 must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", r"state.rank0.safetensors does not match the hash recorded when it was written"),
        ("truncate", r"adapter.rank0.safetensors does not match the hash recorded"),
        ("delete", r"adapter.rank0.safetensors is missing"),
        ("json", r"state.rank0.json does not match the hash recorded"),  # the marker holds the JSON files' hashes
    ],
)
def test_damaged_checkpoint_is_named_with_the_older_one_to_fall_back_to(
    run_dir: Path, capsys: pytest.CaptureFixture, damage: str, message: str
) -> None:
    newest = run_dir / "checkpoints" / "step-2"
    if damage == "flip":
        data = bytearray((newest / "state.rank0.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (newest / "state.rank0.safetensors").write_bytes(bytes(data))
    elif damage == "truncate":
        data = (newest / "adapter.rank0.safetensors").read_bytes()
        (newest / "adapter.rank0.safetensors").write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        (newest / "adapter.rank0.safetensors").unlink()
    else:
        (newest / "state.rank0.json").write_text("{not json")
    before = _files(run_dir)

    assert _train(run_dir, "--resume") == 2
    err = capsys.readouterr().err
    assert f"checkpoint {newest} is damaged: " in err and message.replace("\\", "") in err
    assert f"delete {newest} to resume from step-1" in err
    assert _files(run_dir) == before  # nothing was deleted or rewritten


def test_damaged_marker_is_named(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (run_dir / "checkpoints" / "step-2" / MARKER).write_text('{"step": 2,')
    assert _train(run_dir, "--resume") == 2
    assert f"checkpoint marker {run_dir / 'checkpoints' / 'step-2' / MARKER} is damaged" in capsys.readouterr().err


@pytest.mark.parametrize("marker", ["[]", '{"step": "2", "world_size": 1}', '{"step": 2, "world_size": 0}'])
def test_a_marker_of_the_wrong_shape_is_named_with_the_fallback(
    run_dir: Path, capsys: pytest.CaptureFixture, marker: str
) -> None:
    newest = run_dir / "checkpoints" / "step-2"
    (newest / MARKER).write_text(marker)
    assert _train(run_dir, "--resume") == 2
    err = capsys.readouterr().err
    assert (
        f"checkpoint marker {newest / MARKER} is damaged (" in err and f"delete {newest} to resume from step-1" in err
    )


def test_a_damaged_older_marker_leaves_the_newest_checkpoint_usable(run_dir: Path) -> None:
    (run_dir / "checkpoints" / "step-1" / MARKER).write_bytes(b"\xff\x00")
    assert find_resume_checkpoint(CheckpointSettings.of(tiny_config(run_dir, 'train.resume="auto"'))).step == 2


def test_file_names_in_a_checkpoint_stay_inside_it(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """A crafted checkpoint, its hashes recomputed, that names a file outside itself is refused, never read."""
    newest = run_dir / "checkpoints" / "step-2"
    meta = json.loads((newest / "state.rank0.json").read_text())
    meta["files"]["../../../outside.safetensors"] = "0" * 64
    (newest / "state.rank0.json").write_text(json.dumps(meta))
    marker = json.loads((newest / MARKER).read_text())
    marker["files"]["state.rank0.json"] = hashlib.sha256((newest / "state.rank0.json").read_bytes()).hexdigest()
    (newest / MARKER).write_text(json.dumps(marker))
    assert _train(run_dir, "--resume") == 2
    assert "lists a file '../../../outside.safetensors' that is not one of its parts" in capsys.readouterr().err


def test_checkpoint_without_marker_is_never_loaded(run_dir: Path) -> None:
    (run_dir / "checkpoints" / "step-2" / MARKER).unlink()
    config = tiny_config(run_dir, 'train.resume="auto"')
    assert find_resume_checkpoint(CheckpointSettings.of(config)).step == 1


@pytest.mark.parametrize(
    "override, message",
    [
        ("lora.r=8", r"lora.r 16 (config: 8)"),
        ("lora.alpha=16", r"lora.alpha 32.0 (config: 16.0)"),
        ('lora.target_modules=["q_proj","v_proj"]', r"lora.target_modules ['down_proj', "),
        ('model.name="qwen3-0.6b"', r"model.name 'tiny-qwen3' (config: 'qwen3-0.6b')"),
        ("train.seed=7", r"train.seed 42 (config: 7)"),  # builds a random-init base, orders the data
        ("train.batch_size=8", r"train.batch_size 4 (config: 8)"),  # batch_size, grad_accum, dp: the data position
        ("train.grad_accum=1", r"train.grad_accum 2 (config: 1)"),
        ("data.max_length=256", r"data.max_length 128 (config: 256)"),
    ],
)
def test_incompatible_resume_fails_before_training_and_keeps_the_checkpoints(
    run_dir: Path, capsys: pytest.CaptureFixture, override: str, message: str
) -> None:
    before = _files(run_dir)
    assert _train(run_dir, "--resume", "--set", override) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {run_dir / 'checkpoints' / 'step-2'} was written with" in err and message in err
    assert "resume with the settings it was written with, or start a new run in another output.dir" in err
    assert _files(run_dir) == before


def test_fresh_start_refuses_to_overwrite_an_earlier_run(run_dir: Path, capsys: pytest.CaptureFixture) -> None:
    before = _files(run_dir)
    assert _train(run_dir) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints of an earlier run (newest: step-2); pass --resume" in err
    assert _files(run_dir) == before
    assert [c.step for c in committed_checkpoints(run_dir)] == [1, 2]


def test_data_that_makes_no_optimizer_step_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = tmp_path / "meetings.jsonl"
    rows = [{"dialogue": "A: hi.", "summary": "They met."}, {"dialogue": "A: hi."}, {"summary": ""}]
    data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    config = tiny_config(tmp_path / "run", f'data.source="{data}"')  # pp = 2: the launcher says it, once
    assert main(["train", "--config", str(write_config(config, tmp_path / "c.toml")), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "1 training samples (skipped rows: 2" in err
    assert "make no optimizer step of train.batch_size 4 x train.grad_accum 2; lower them or add data" in err


def test_bench_arguments_are_refused_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`bench --rows N`: a metrics row every N steps (strategy_config's log_every), refused before any run when N
    does not divide the warm-up and timed steps."""
    config = tiny_config(tmp_path / "run")
    assert strategy_config(config, "single", steps=10, warmup=5, out_dir=tmp_path, rows=5).train.log_every == 5
    path = str(write_config(config, tmp_path / "c.toml"))
    assert main(["bench", "--config", path, "--rows", "3", "--steps", "20", "--warmup", "5"]) == 2
    assert "--rows 3 must be >= 1 and divide --steps 20 and --warmup 5" in capsys.readouterr().err
    for option, value, message in (
        ("--timeout", "nan", "--timeout nan must be >= 0 seconds (0: no limit)"),
        ("--peak-tflops", "nan", "--peak-tflops nan must be a positive, finite TFLOP/s per GPU (e.g. 790)"),
        ("--peak-tflops", "0", "--peak-tflops 0.0 must be a positive, finite TFLOP/s per GPU (e.g. 790)"),
        ("--steps", "0", "--steps 0 must be >= 1 and --warmup 5 >= 0 (timed steps after the warm-up ones, e.g. "),
        ("--warmup", "-1", "--steps 20 must be >= 1 and --warmup -1 >= 0 (timed steps after the warm-up ones, e.g. "),
    ):
        assert main(["bench", "--config", path, option, value]) == 2
        assert capsys.readouterr().err.startswith(f"pipetune: error: {message}")


def _save_plain(config, step: int, value: float = 0.5) -> None:
    """A committed one-process checkpoint of `config`'s run at `step` whose one adapter tensor holds `value`."""
    param = torch.nn.Parameter(torch.full((2, 3), value))
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = TrainState({"base_model.model.layers.0.q_proj.lora_A.weight": param}, optimizer, scheduler, {param: "p"})
    save_checkpoint(CheckpointSettings.of(config), state, Position(step, 0, step), 0, 1)


def test_resume_refuses_data_whose_content_changed_under_the_same_name(tmp_path: Path) -> None:
    data = tmp_path / "meetings.jsonl"
    data.write_text(json.dumps({"dialogue": "A: hi.", "summary": "They met."}) + "\n")
    run_dir = tmp_path / "run"
    _save_plain(tiny_config(run_dir, f'data.source="{data}"'), step=2)
    resume = CheckpointSettings.of(tiny_config(run_dir, f'data.source="{data}"', 'train.resume="auto"'))
    assert find_resume_checkpoint(resume).step == 2  # the same content: resumed

    data.write_text(json.dumps({"dialogue": "B: other.", "summary": "Others met."}) + "\n")
    with pytest.raises(CheckpointError) as refused:  # a restarted group checks it too
        find_resume_checkpoint(CheckpointSettings.of(tiny_config(run_dir, f'data.source="{data}"')), restarted=True)
    message = str(refused.value)
    assert f"checkpoint {run_dir / 'checkpoints' / 'step-2'} was trained on other data: the content of '{data}'" in (
        message
    )
    assert "Restore the data it was trained on, or start a new run in another output.dir" in message

    # A checkpoint of an older version recorded no data content, quantization or system prompt: it resumes.
    marker_path = run_dir / "checkpoints" / "step-2" / MARKER
    marker = json.loads(marker_path.read_text())
    del marker["data_content"], marker["config"]["model"]["quantize"], marker["config"]["data"]["system_prompt"]
    marker_path.write_text(json.dumps(marker))
    assert find_resume_checkpoint(CheckpointSettings.of(tiny_config(run_dir, f'data.source="{data}"')), True).step == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ('data.system_prompt="Answer in French."', "data.system_prompt 'You are "),
        ('model.dtype="bfloat16"', "model.dtype 'float32' (config: 'bfloat16')"),
        ('model.quantize="nf4"', "model.quantize 'none' (config: 'nf4')"),
        ("data.synthetic_validation=5", "data.synthetic_validation 8 (config: 5)"),  # the val_loss column's meetings
    ],
)
def test_resume_refuses_another_prompt_dtype_or_quantization(run_dir: Path, override: str, message: str) -> None:
    """The system turn is part of every sample; dtype and quantization are the base weights the adapter learned
    against: a resume under others would train the rest of the run on another model."""
    with pytest.raises(CheckpointError) as refused:
        find_resume_checkpoint(CheckpointSettings.of(tiny_config(run_dir, 'train.resume="auto"', override)))
    assert f"checkpoint {run_dir / 'checkpoints' / 'step-2'} was written with {message}" in str(refused.value)


def test_resume_of_a_run_directory_that_does_not_exist_or_is_empty_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    missing = tmp_path / "typo"
    assert _train(missing, "--resume") == 2
    err = capsys.readouterr().err
    assert f"--resume: output.dir = '{missing}' does not exist, so there is no run to continue" in err
    assert "point output.dir at the run to continue, or drop --resume to start a new run there" in err
    assert not missing.exists()
    missing.mkdir()
    assert _train(missing, "--resume") == 2
    assert f"output.dir = '{missing}' is empty, so there is no run to continue" in capsys.readouterr().err
    # A run that stopped before its first checkpoint: --resume starts it over, and says so.
    data = tmp_path / "meetings.jsonl"
    data.write_text(json.dumps({"dialogue": "A: hi.", "summary": "They met."}) + "\n")  # no optimizer step: stops
    config_file = write_config(tiny_config(missing, f'data.source="{data}"'), missing / "config.toml")
    assert main(["train", "--config", str(config_file), "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"pipetune: note: {missing} holds no committed checkpoint to continue from: training starts at step 0" in err


def test_a_missing_data_file_is_named_before_any_model_work(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """data.source names a file that is not there: said before the model is resolved (a download, a conversion),
    here shown by a model.name that would fail too, and would be named first if the model came first."""
    missing = tmp_path / "no" / "meetings.jsonl"
    config = tiny_config(tmp_path / "run", f'data.source="{missing}"', 'model.name="./no/such/model"')
    path = str(write_config(config, tmp_path / "c.toml"))
    for command in (["train", "--config", path, "--quiet"], ["data", "inspect", "--config", path]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pipetune: error: data.source = '{missing}' does not exist; give a JSONL"), err
    config.parallel.strategy = "auto"  # the plan of "auto" resolves the model too: the data comes first there too
    assert main(["train", "--config", str(write_config(config, tmp_path / "auto.toml")), "--quiet"]) == 2
    assert f"data.source = '{missing}' does not exist" in capsys.readouterr().err
