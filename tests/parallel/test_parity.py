"""Pipeline runs must match the single-process float32 reference: loss at every step, adapter after training."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetune.config import Config, load_config
from tests.conftest import run_cli, tiny_config, write_config
from tests.parity import assert_same_training

pytestmark = pytest.mark.slow  # multi-process end-to-end runs: pytest -m "not slow" leaves them out


def _train(tmp: Path, name: str, *overrides: str) -> Path:
    run_dir = tmp / name
    config = tiny_config(run_dir, *overrides)
    run_cli("train", "--config", str(write_config(config, tmp / f"{name}.toml")), "--quiet")
    return run_dir


# 4 stages of 1F1B run in tests/test_resume.py (resumed from 2 stages, against their continuation); the shared
# 2-stage 1F1B run is tests/conftest.py's, whose validation tests/parallel/test_validation.py checks.
def test_pipeline_matches_single_process(reference: Path, pipeline_run: tuple[Config, Path]) -> None:
    _, run_dir = pipeline_run
    assert_same_training(run_dir, reference, steps=3)


def four_process_configs(tmp: Path) -> dict[str, Config]:
    """pp=2 x tp=2 with tensor parallelism's own switches on: sequence parallelism, the vocabulary-parallel fused
    loss, the fast LoRA path on split adapters."""
    tp = ["parallel.tp=2", "parallel.sequence_parallel=true", "train.fused_loss=true", "lora.fast_path=true"]
    return {"pp2xtp2": tiny_config(tmp / "pp2xtp2", "parallel.pp=2", *tp)}


def test_pipeline_with_tensor_parallel_stages_matches_single_process(reference: Path, four_process_runs: Path) -> None:
    """pp=2 x tp=2 with tensor parallelism's own switches on: sequence parallelism, the vocabulary-parallel fused
    loss, the fast LoRA path on split adapters."""
    assert_same_training(four_process_runs / "pp2xtp2", reference, steps=3)


# Every torch schedule: one stage a rank (gpipe), looped placements (interleaved_1f1b, looped_bfs), looped with
# the backward split in two (interleaved_zero_bubble), V-shaped with the split backward and no forward-only mode
# (dualpipev; zbv, the same placement, runs end to end in tests/parallel/test_quantized.py). The gpipe run also
# checkpoints every layer and keeps attention's output (train.keep_attention: the same math, and torch's stages
# run one forward without a backward to infer their shapes, which must leave no kept output behind).
SCHEDULE_RUNS = [
    ("gpipe", 1),
    ("interleaved_1f1b", 2),
    ("looped_bfs", 2),
    ("interleaved_zero_bubble", 2),
    ("dualpipev", 2),
]
GEMMA = 'model.name="tiny-gemma3"'


def two_process_configs(tmp: Path) -> dict[str, Config]:
    """This file's runs that tests/parallel/conftest.py trains with other files' 2-process runs: each schedule's
    (2 ranks; with 2 stages each, 4 stages of one layer: looped, rank r: r, r + 2, or V-shaped, rank r: r, 3 - r)
    and tiny-gemma3's 2 stages."""
    kept = ["train.activation_checkpointing=true", "train.keep_attention=true"]
    configs = {
        schedule: tiny_config(
            tmp / schedule,
            f'parallel.schedule="{schedule}"',
            f"parallel.stages_per_rank={per_rank}",
            *(kept if schedule == "gpipe" else []),
        )
        for schedule, per_rank in SCHEDULE_RUNS
    }
    return {**configs, "gemma3": tiny_config(tmp / "gemma3", GEMMA)}


@pytest.mark.parametrize("schedule, stages_per_rank", SCHEDULE_RUNS)
def test_schedules_match_single_process(
    reference: Path, two_process_runs: Path, schedule: str, stages_per_rank: int
) -> None:
    run_dir = two_process_runs / schedule
    parallel = load_config(run_dir / "config.toml").parallel  # as trained (the runs share a start of the workers)
    assert (parallel.schedule, parallel.stages_per_rank) == (schedule, stages_per_rank)
    assert_same_training(run_dir, reference, steps=3)


def test_gemma3_pipeline_matches_single_process(two_process_runs: Path, tmp_path: Path) -> None:
    """tiny-gemma3 over 2 stages: what its decoder computes outside its layers (scaled embeddings, a local and a
    global rotary embedding, sliding-window masks over 16 of 128 positions) each stage computes again."""
    reference = _train(tmp_path, "single", GEMMA, "parallel.pp=1")
    assert_same_training(two_process_runs / "gemma3", reference, steps=3)
