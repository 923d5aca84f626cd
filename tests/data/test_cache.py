"""The token cache: built once, found again by content, invalidated by anything the samples depend on."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from pipetune.config import DataConfig
from pipetune.data.batching import SampleStore, tokenize_split
from pipetune.data.cache import tokenized_data
from pipetune.data.prompt import PromptBuilder
from pipetune.data.sources import load_dataset
from pipetune.data.tokenizer import demo_tokenizer
from tests.data.test_sources import GOOD, write_jsonl


def test_built_once_then_memory_mapped_and_equal_to_direct_tokenization(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "meetings.jsonl", GOOD * 3, ["{broken"])
    data = DataConfig(source=str(source), validation_fraction=0.2)
    prompts = PromptBuilder(demo_tokenizer(), max_length=64, max_summary_tokens=8)
    cache = tmp_path / "cache"

    first = tokenized_data(data, prompts, seed=1, cache_dir=cache)
    again = tokenized_data(data, prompts, seed=1, cache_dir=cache)
    assert first.built and not again.built and again.path == first.path
    assert isinstance(again.splits["train"].tokens, np.memmap)

    dataset = load_dataset(data, seed=1)
    assert again.summary == json.loads(json.dumps(dataset.summary()))  # data.json is the same on a cache hit
    assert again.skipped_line() == dataset.skipped_line() == "skipped rows: 1 (1 unparsable JSON line)"
    for name, examples in dataset.splits.items():
        direct = tokenize_split(examples, prompts, pad_id=0)
        cached = again.splits[name]
        assert len(cached) == len(examples) and cached.truncated == direct.truncated
        order = torch.tensor([2, 0, 1][: len(examples)])
        ids, labels = cached.batch(order, 64, pad_id=0)
        assert torch.equal(ids, direct.input_ids[order]) and torch.equal(labels, direct.labels[order])
        assert torch.equal(cached.lengths, direct.real_tokens)


def test_a_change_to_data_prompt_or_hold_out_is_a_new_cache(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "meetings.jsonl", GOOD)
    prompts = PromptBuilder(demo_tokenizer(), max_length=64, max_summary_tokens=8)
    cache = tmp_path / "cache"

    def path(data: DataConfig, builder: PromptBuilder = prompts, seed: int = 0) -> Path:
        return tokenized_data(data, builder, seed, cache_dir=cache).path

    base = path(DataConfig(source=str(source)))
    assert path(DataConfig(source=str(source)), seed=5) == base  # no hold-out: the seed changes nothing
    assert path(DataConfig(source=str(source), validation_fraction=0.4), seed=5) != path(
        DataConfig(source=str(source), validation_fraction=0.4), seed=6
    )
    assert path(DataConfig(source=str(source)), PromptBuilder(demo_tokenizer(), 80, 8)) != base
    assert path(DataConfig(source=str(source), summary_column="dialogue")) != base
    write_jsonl(source, GOOD[:4])  # same file name, other content
    changed = tokenized_data(DataConfig(source=str(source)), prompts, 0, cache_dir=cache)
    assert changed.path != base and len(changed.splits["train"]) == 4


def test_batches_carry_labels_from_the_prompt_length_whatever_the_pad_id() -> None:
    store = SampleStore(
        np.array([5, 6, 7, 2, 8, 9, 2], dtype=np.int32), np.array([0, 4, 7]), np.array([2, 2], dtype=np.int32)
    )
    ids, labels = store.batch([1, 0], 6, pad_id=2)
    assert ids.tolist() == [[8, 9, 2, 2, 2, 2], [5, 6, 7, 2, 2, 2]]
    assert labels.tolist() == [[-100, 2, -100, -100, -100, -100], [-100, 7, 2, -100, -100, -100]]
    assert store.supervised.tolist() == [2, 1] and store.lengths.tolist() == [4, 3]
