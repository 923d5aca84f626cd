"""Length buckets: fewer pads, one static shape per bucket, and still the single-process result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipetune.config import Config, ConfigError, validate
from pipetune.data.batching import bucket_lengths, bucketed_epoch_batches, tokenize_split
from pipetune.data.sources import load_dataset
from pipetune.preflight import prepare
from tests.conftest import run_cli, tiny_config, write_config
from tests.parity import assert_same_training

BUCKETS = ["data.max_length=1024", "data.max_summary_tokens=128", "data.buckets=[512, 640, 768, 1024]"]


def test_buckets_cut_padding_and_batches_hold_one_bucket(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, *BUCKETS)
    prepared = prepare(config)
    split = tokenize_split(load_dataset(config.data).splits["train"], prepared.prompts, prepared.pad_id)
    lengths = bucket_lengths(split.real_tokens, config.data.buckets)
    assert (lengths >= split.real_tokens).all()
    assert len(set(lengths.tolist())) >= 2  # the corpus really spreads over several buckets
    assert int(lengths.sum()) < 0.8 * len(split) * 1024  # far less padding than one length for all

    batches, batch_lengths = bucketed_epoch_batches(lengths, batch_size=4, seed=1, epoch=0)
    for index, length in zip(batches, batch_lengths, strict=True):
        assert (lengths[index] == length).all()
    again, _ = bucketed_epoch_batches(lengths, batch_size=4, seed=1, epoch=0)
    assert torch.equal(batches, again)
    other, _ = bucketed_epoch_batches(lengths, batch_size=4, seed=1, epoch=1)
    assert not torch.equal(batches, other)


def test_bad_buckets_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.buckets = \[256, 192\] must be distinct ascending"):
        validate(tiny_config(tmp_path, "data.max_length=256", "data.buckets=[256, 192]"), 2)
    with pytest.raises(ConfigError, match="ending at data.max_length = 384"):
        validate(tiny_config(tmp_path, "data.max_length=384", "data.buckets=[128, 256]"), 2)


def two_process_configs(tmp: Path) -> dict[str, Config]:
    """This file's runs that tests/parallel/conftest.py trains with other files' 2-process runs."""
    return {"buckets-pp2": tiny_config(tmp / "buckets-pp2", *BUCKETS, "parallel.pp=2")}


@pytest.mark.slow
def test_bucketed_pipeline_matches_bucketed_single_process(two_process_runs: Path, tmp_path: Path) -> None:
    config = tiny_config(tmp_path / "pp1", *BUCKETS, "parallel.pp=1")
    run_cli("train", "--config", str(write_config(config, tmp_path / "pp1.toml")), "--quiet")
    assert_same_training(two_process_runs / "buckets-pp2", tmp_path / "pp1")
