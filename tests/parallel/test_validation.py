"""Validation loss through the pipeline (forward only) equals the saved adapter's loss computed in one process."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from pipetune.config import Config
from pipetune.data.batching import tokenize_split
from pipetune.data.sources import load_dataset
from pipetune.generate import load_finetuned, mean_token_loss

pytestmark = pytest.mark.slow  # multi-process end-to-end runs: pytest -m "not slow" leaves them out


def test_pipeline_validation_loss_matches_one_process(pipeline_run: tuple[Config, Path]) -> None:
    # The shared 2-stage run (tests/conftest.py): 6 validation meetings with batch 4, so the last validation batch
    # is filled with ignored rows. The same check for one stage (split over tensor-parallel ranks) is in
    # tests/parallel/test_tensor_parallel.py.
    config, run_dir = pipeline_run
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = {int(r["step"]): float(r["val_loss"]) for r in rows if r["val_loss"]}
    assert sorted(logged) == [0, 2, 3]  # before the first step, every 2 steps, and at the end
    assert [int(r["step"]) for r in rows if r["val_time_sec"]] == [0, 2, 3]  # timed in its own column
    assert all(float(r["val_time_sec"]) > 0 for r in rows if r["val_time_sec"])
    assert logged[3] < logged[2] < logged[0]

    model, prepared = load_finetuned(config, run_dir / "adapter", torch.device("cpu"))
    dataset = load_dataset(config.data, seed=config.train.seed)
    split = tokenize_split(dataset.splits["validation"], prepared.prompts, prepared.pad_id)
    assert len(split) == 6
    expected = mean_token_loss(model, split)
    assert logged[3] == pytest.approx(expected, rel=1e-5)
    with model.disable_adapter():  # step 0: the adapters are still zero, so the base model's loss
        assert logged[0] == pytest.approx(mean_token_loss(model, split), rel=1e-5)
