"""The token cache: built once, found again by content, invalidated by anything the samples depend on."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from pipetune.config import ConfigError, DataConfig
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


def _same_size_other_ids(cache: Path) -> None:
    tokens = cache / "train.tokens"
    tokens.write_bytes(np.full(tokens.stat().st_size // 4, 7, dtype=np.int32).tobytes())


def _cut(name: str, keep: float) -> Callable[[Path], None]:
    def cut(cache: Path) -> None:
        data = (cache / name).read_bytes()
        (cache / name).write_bytes(data[: int(len(data) * keep)])

    return cut


def _one_token_fewer(cache: Path) -> None:
    meta = json.loads((cache / "meta.json").read_text())
    meta["splits"]["train"]["tokens"] -= 1
    (cache / "meta.json").write_text(json.dumps(meta))


DAMAGE = {
    "tokens overwritten, same size": (_same_size_other_ids, "train.tokens's content differs"),
    "tokens cut short": (_cut("train.tokens", 0.5), "train.tokens has"),
    "tokens deleted": (lambda cache: (cache / "train.tokens").unlink(), "train.tokens is missing"),
    "offsets deleted": (lambda cache: (cache / "validation.offsets.npy").unlink(), "offsets.npy is missing"),
    "meta.json cut short": (_cut("meta.json", 0.5), "meta.json cannot be read"),
    "meta.json deleted": (lambda cache: (cache / "meta.json").unlink(), "meta.json is missing"),
    "meta.json's count edited": (_one_token_fewer, "token count of split 'train' disagrees with its file's size"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_cache_is_rebuilt_with_a_note(tmp_path: Path, damage: str, capsys: pytest.CaptureFixture) -> None:
    source = write_jsonl(tmp_path / "meetings.jsonl", GOOD * 2)
    data = DataConfig(source=str(source), validation_fraction=0.3)
    prompts = PromptBuilder(demo_tokenizer(), max_length=64, max_summary_tokens=8)
    first = tokenized_data(data, prompts, seed=1, cache_dir=tmp_path / "cache")
    expected = {name: (np.array(split.tokens), np.array(split.offsets)) for name, split in first.splits.items()}
    damage_cache, problem = DAMAGE[damage]
    damage_cache(first.path)
    capsys.readouterr()

    # A rank that must not build waits for the repair instead of reading the damaged files.
    waiting: list = []
    reader = threading.Thread(
        target=lambda: waiting.append(tokenized_data(data, prompts, 1, wait=True, cache_dir=tmp_path / "cache")),
        daemon=True,
    )
    reader.start()
    again = tokenized_data(data, prompts, seed=1, cache_dir=tmp_path / "cache")
    reader.join(timeout=60)
    assert again.built and again.path == first.path
    note = capsys.readouterr().err.splitlines()[0]
    assert note.startswith(f"pipetune: note: the token cache {first.path} is damaged (") and problem in note
    assert note.endswith("; rebuilding it")
    assert len(waiting) == 1
    for found in (again, waiting[0]):
        assert found.splits.keys() == expected.keys()
        for name, (tokens, offsets) in expected.items():
            assert np.array_equal(found.splits[name].tokens, tokens)
            assert np.array_equal(found.splits[name].offsets, offsets)
    assert not tokenized_data(data, prompts, seed=1, cache_dir=tmp_path / "cache").built  # whole again
    assert [p.name for p in first.path.parent.iterdir()] == [first.path.name]  # nothing left beside it


def test_cache_variables_naming_a_file_are_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = DataConfig(source=str(write_jsonl(tmp_path / "meetings.jsonl", GOOD)))
    prompts = PromptBuilder(demo_tokenizer(), max_length=64, max_summary_tokens=8)
    afile = tmp_path / "notes.txt"
    afile.write_text("a file")
    monkeypatch.setenv("PIPETUNE_CACHE", str(afile))
    with pytest.raises(ConfigError, match=rf"^PIPETUNE_CACHE = '{afile}' is a file, not a directory; point "):
        tokenized_data(data, prompts, seed=0)
    monkeypatch.setenv("PIPETUNE_CACHE", str(afile / "cache"))
    with pytest.raises(ConfigError, match=rf"^PIPETUNE_CACHE = '{afile}/cache': '{afile}' is a file, not a directory"):
        tokenized_data(data, prompts, seed=0)
    monkeypatch.delenv("PIPETUNE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(afile))
    with pytest.raises(ConfigError, match=r"^XDG_CACHE_HOME = .* is a file, not a directory; point XDG_CACHE_HOME"):
        tokenized_data(data, prompts, seed=0)


def test_batches_carry_labels_from_the_prompt_length_whatever_the_pad_id() -> None:
    store = SampleStore(
        np.array([5, 6, 7, 2, 8, 9, 2], dtype=np.int32), np.array([0, 4, 7]), np.array([2, 2], dtype=np.int32)
    )
    ids, labels = store.batch([1, 0], 6, pad_id=2)
    assert ids.tolist() == [[8, 9, 2, 2, 2, 2], [5, 6, 7, 2, 2, 2]]
    assert labels.tolist() == [[-100, 2, -100, -100, -100, -100], [-100, 7, 2, -100, -100, -100]]
    assert store.supervised.tolist() == [2, 1] and store.lengths.tolist() == [4, 3]


def test_an_input_file_is_hashed_once_while_it_stays_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data file or GGUF (file_digest(remember=True)) is read once a process while its inode, size and
    modification time stay; a damage check (remember=False) always reads it; new content is a new digest."""
    import builtins
    import os

    from pipetune.files import file_digest

    path = tmp_path / "meetings.jsonl"
    path.write_text("a" * 100)
    first = file_digest(path, remember=True)
    reads: list[object] = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: reads.append(file) or real_open(file, *a, **k))
    assert file_digest(path, remember=True) == first and reads == []
    assert file_digest(path) == first and reads == [path]
    monkeypatch.undo()
    mtime = path.stat().st_mtime_ns
    path.write_text("b" * 100)  # the same size, other content
    os.utime(path, ns=(mtime + 10**6, mtime + 10**6))  # a later time, as a write at least a clock tick later has
    assert file_digest(path, remember=True) != first


def test_a_failed_rebuild_of_a_damaged_cache_is_raised_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error of the build itself (a full disk) is raised even though the damaged copy still holds meta.json;
    a rebuild that leaves the cache damaged is raised too, never memory-mapped."""
    import errno

    from pipetune.data import cache as cache_module

    source = write_jsonl(tmp_path / "meetings.jsonl", GOOD)
    data = DataConfig(source=str(source))
    prompts = PromptBuilder(demo_tokenizer(), max_length=64, max_summary_tokens=8)
    first = tokenized_data(data, prompts, seed=0, cache_dir=tmp_path / "cache")
    _same_size_other_ids(first.path)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(cache_module, "_write_split", full_disk)
        with pytest.raises(OSError, match="No space left"):
            tokenized_data(data, prompts, seed=0, cache_dir=tmp_path / "cache")
    with monkeypatch.context() as patch:
        patch.setattr(cache_module, "write_atomic_dir", lambda *args, **kwargs: None)  # a build that changes nothing
        with pytest.raises(OSError, match=r"still damaged after rebuilding it \(train.tokens's content differs"):
            tokenized_data(data, prompts, seed=0, cache_dir=tmp_path / "cache")
    assert tokenized_data(data, prompts, seed=0, cache_dir=tmp_path / "cache").built  # repaired when it can be


def test_a_hub_dataset_is_keyed_by_its_splits_fingerprints(monkeypatch: pytest.MonkeyPatch) -> None:
    """`datasets` is stubbed (the hub cannot be reached here): its Dataset objects carry `_fingerprint`."""
    import sys
    import types

    from pipetune.data.cache import source_identity

    class Split(list):
        _fingerprint: str | None = None

    def splits(fingerprint: str | None) -> dict[str, Split]:
        train = Split(GOOD)
        train._fingerprint = fingerprint
        return {"train": train}

    module = types.ModuleType("datasets")
    monkeypatch.setitem(sys.modules, "datasets", module)
    data = DataConfig(source="org/meetings")
    module.load_dataset = lambda name: splits("rev-aaaa")
    assert source_identity(data) == ["hub", "org/meetings", {"train": "rev-aaaa"}]
    module.load_dataset = lambda name: splits("rev-bbbb")
    assert source_identity(data) == ["hub", "org/meetings", {"train": "rev-bbbb"}]
    module.load_dataset = lambda name: splits(None)
    with pytest.raises(ConfigError, match=r"'org/meetings': the hub dataset's split\(s\) train have no fingerprint"):
        source_identity(data)


def test_the_key_covers_every_module_that_decides_the_samples() -> None:
    from pipetune.data.cache import _CODE

    assert {"synthetic.py", "synthetic_whole.py", "synthetic_splits.py", "facts.py", "example.py"} <= set(_CODE)
