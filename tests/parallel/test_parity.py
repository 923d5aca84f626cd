"""Pipeline runs must match the single-process float32 reference: loss at every step, adapter after training."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipetune.config import Config
from tests.conftest import run_cli, tiny_config, write_config

pytestmark = pytest.mark.slow  # multi-process end-to-end runs: pytest -m "not slow" leaves them out


def _losses(run_dir: Path) -> list[float]:
    with open(run_dir / "metrics.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f) if row["loss"]]  # step 0: val_loss only


def _adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


def assert_rounding_apart(
    adapter: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], lr: float = 1e-3
) -> None:
    """Adapters that differ from the reference only as float32 rounding does under Adam (tensor parallelism sums
    row-wise products in parts): each tensor within 1e-5 relative L2, or apart in at most one element in a
    thousand (at least one) by more than 1e-6, each within 2 x lr a step. Adam divides each gradient element by its
    own magnitude, so an element whose gradient is rounding-sized follows the sign of the last bits of a sum done
    in another order (tests/parallel/test_tensor_parallel.py says what was measured); a wrong gradient moves many
    elements."""
    assert sorted(adapter) == sorted(reference)
    steps = 3
    for name, expected in reference.items():
        off = (adapter[name] - expected).abs()
        if float(off.norm() / expected.norm()) < 1e-5:
            continue
        outliers = int((off > 1e-6).sum())
        assert outliers <= max(1, expected.numel() // 1000), (name, outliers, float(off.max()))
        assert float(off.max()) <= 2 * lr * steps, (name, float(off.max()))


def _max_relative(adapter: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest relative L2 difference of an adapter's tensors from the reference's (same names)."""
    assert sorted(adapter) == sorted(reference)
    return max(float((adapter[k] - v).norm() / v.norm()) for k, v in reference.items())


def _train(tmp: Path, name: str, *overrides: str) -> Path:
    run_dir = tmp / name
    config = tiny_config(run_dir, *overrides)
    run_cli("train", "--config", str(write_config(config, tmp / f"{name}.toml")), "--quiet")
    return run_dir


# 4 stages of 1F1B run in tests/test_resume.py (resumed from 2 stages, against their continuation); the shared
# 2-stage 1F1B run is tests/conftest.py's, whose validation tests/parallel/test_validation.py checks.
def test_pipeline_matches_single_process(reference: Path, pipeline_run: tuple[Config, Path]) -> None:
    _, run_dir = pipeline_run
    expected, got = _losses(reference), _losses(run_dir)
    assert len(expected) == len(got) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    # each tensor within 1e-5 relative L2: Adam's near-zero-gradient noise is ~1e-6 absolute, far below a norm
    adapter = _adapter(run_dir)
    assert _max_relative(adapter, _adapter(reference)) < 1e-5
    # The adapters really trained: lora_B started at zero.
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)


def test_pipeline_with_tensor_parallel_stages_matches_single_process(reference: Path, tmp_path: Path) -> None:
    """pp=2 x tp=2 with tensor parallelism's own switches on: sequence parallelism, the vocabulary-parallel fused
    loss, the fast LoRA path on split adapters (adapters: `assert_rounding_apart`)."""
    overrides = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.fused_loss=true", "lora.fast_path=true"]
    run_dir = _train(tmp_path, "run", "parallel.pp=2", *overrides)
    expected, got = _losses(reference), _losses(run_dir)
    assert len(expected) == len(got) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    assert_rounding_apart(_adapter(run_dir), _adapter(reference))


# Every torch schedule: one stage a rank (gpipe), looped placements (interleaved_1f1b, looped_bfs), looped with
# the backward split in two (interleaved_zero_bubble), V-shaped with the split backward and no forward-only mode
# (dualpipev; zbv, the same placement, runs end to end in tests/parallel/test_quantized.py).
@pytest.mark.parametrize(
    "schedule, stages_per_rank",
    [("gpipe", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2), ("interleaved_zero_bubble", 2), ("dualpipev", 2)],
)
def test_schedules_match_single_process(reference: Path, tmp_path: Path, schedule: str, stages_per_rank: int) -> None:
    # 2 ranks; with 2 stages each, 4 stages of one layer: looped (rank r: r, r + 2) or V-shaped (rank r: r, 3 - r).
    run_dir = tmp_path / schedule
    config = tiny_config(run_dir, f'parallel.schedule="{schedule}"', f"parallel.stages_per_rank={stages_per_rank}")
    run_cli("train", "--config", str(write_config(config, tmp_path / f"{schedule}.toml")), "--quiet")
    torch.testing.assert_close(torch.tensor(_losses(run_dir)), torch.tensor(_losses(reference)), rtol=1e-5, atol=0)
    assert _max_relative(_adapter(run_dir), _adapter(reference)) < 1e-5


def test_gemma3_pipeline_matches_single_process(tmp_path: Path) -> None:
    """tiny-gemma3 over 2 stages: what its decoder computes outside its layers (scaled embeddings, a local and a
    global rotary embedding, sliding-window masks over 16 of 128 positions) each stage computes again."""
    gemma = 'model.name="tiny-gemma3"'
    reference = _train(tmp_path, "single", gemma, "parallel.pp=1")
    run_dir = _train(tmp_path, "pp2", gemma)
    expected, got = _losses(reference), _losses(run_dir)
    assert len(expected) == len(got) == 3
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    assert _max_relative(_adapter(run_dir), _adapter(reference)) < 1e-5
