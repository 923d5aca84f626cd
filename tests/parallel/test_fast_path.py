"""The speed switches must not change the math: fast LoRA path, fused loss and torch.compile against the plain
float32 run."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.conftest import run_cli, tiny_config, write_config
from tests.parallel.test_parity import _adapter, _losses, _max_relative


def _train(tmp: Path, name: str, *overrides: str) -> Path:
    """Train a tiny config; the run directory holds its metrics, its adapter, and train.log (stdout + stderr)."""
    config = tiny_config(tmp / name, *overrides)
    result = run_cli("train", "--config", str(write_config(config, tmp / f"{name}.toml")), "--quiet", timeout=300)
    (tmp / name / "train.log").write_text(result.stdout + result.stderr)
    return tmp / name


def _val_loss(run_dir: Path) -> float:
    with open(run_dir / "metrics.csv") as f:
        return float(list(csv.DictReader(f))[-1]["val_loss"])


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("plain"), "plain", "parallel.pp=1")


def test_fast_path_pipeline_matches_plain_single_process(plain: Path, tmp_path: Path) -> None:
    fast = _train(tmp_path, "fast", "lora.fast_path=true", "parallel.pp=2")
    torch.testing.assert_close(torch.tensor(_losses(fast)), torch.tensor(_losses(plain)), rtol=1e-5, atol=0)
    assert _max_relative(_adapter(fast), _adapter(plain)) < 1e-5


def test_fused_loss_pipeline_matches_plain_single_process(plain: Path, tmp_path: Path) -> None:
    # loss_chunk 7: chunk boundaries fall inside sequences and microbatches
    fused = _train(tmp_path, "fused", "train.fused_loss=true", "train.loss_chunk=7", "parallel.pp=2")
    torch.testing.assert_close(torch.tensor(_losses(fused)), torch.tensor(_losses(plain)), rtol=1e-5, atol=0)
    # Gradients agree to ~1e-6 (float32 sums in another order: tests/model/test_loss.py); Adam's first steps
    # divide by each gradient's own magnitude, which turns that into ~1e-4 on the smallest ones.
    assert _max_relative(_adapter(fused), _adapter(plain)) < 5e-4


def test_compiled_fast_path_matches_plain(plain: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_LOGS", "recompiles")
    compiled = _train(tmp_path, "compiled", "lora.fast_path=true", "train.compile=true", "parallel.pp=1")
    torch.testing.assert_close(torch.tensor(_losses(compiled)), torch.tensor(_losses(plain)), rtol=1e-5, atol=0)
    # Inductor reassociates float sums; Adam's first steps turn that into ~1e-4 relative weight differences.
    assert _max_relative(_adapter(compiled), _adapter(plain)) < 2e-3
    # Validation runs the compiled layers eagerly: the same loss, and no second compilation for no_grad.
    assert _val_loss(compiled) == pytest.approx(_val_loss(plain), rel=1e-4)
    assert "grad_mode" not in (compiled / "train.log").read_text()


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path: Path) -> None:
    # With dropout on: the recomputation must draw the same masks as the first forward.
    plain = _train(tmp_path, "plain", "parallel.pp=2", "lora.dropout=0.1")
    recomputed = _train(tmp_path, "ckpt", "parallel.pp=2", "lora.dropout=0.1", "train.activation_checkpointing=true")
    torch.testing.assert_close(torch.tensor(_losses(recomputed)), torch.tensor(_losses(plain)), rtol=1e-6, atol=0)
    assert _max_relative(_adapter(recomputed), _adapter(plain)) < 1e-6
