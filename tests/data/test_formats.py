"""Formats users bring: chat rows (`messages`), datasets saved with save_to_disk, hub datasets in the local cache."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest

from pipetune.config import ConfigError, DataConfig, validate
from pipetune.data.example import Example
from pipetune.data.inspect import format_report, inspect_data
from pipetune.data.sources import CHAT_COLUMNS, load_dataset
from pipetune.preflight import prepare
from tests.conftest import tiny_config
from tests.data.test_sources import GOOD, write_jsonl


def chat(*turns: tuple[str, object]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


CHATS = [
    chat(("system", "Summarize."), ("user", " A: we ship Friday. "), ("assistant", "They ship Friday.")),
    chat(("user", "A: first."), ("assistant", "First."), ("user", "B: second."), ("assistant", " Second. ")),
    chat(("user", "C: a meeting."), ("assistant", "A summary."), ("user", "a follow-up left unanswered")),
]


def test_chat_rows_give_the_last_assistant_message_and_the_user_message_before_it(tmp_path: Path) -> None:
    bad = [
        {"messages": "not a list"},
        chat(("user", "A: hi.")),
        chat(("assistant", "An answer with no question.")),
        chat(("user", "A: hi."), ("assistant", "   ")),
        chat(("user", 3), ("assistant", "x")),
        {"messages": [{"content": "no role"}]},
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS + bad + GOOD[:2])  # chat and column rows side by side
    dataset = load_dataset(DataConfig(source=str(path)))

    assert dataset.splits["train"] == [
        Example("A: we ship Friday.", "They ship Friday."),
        Example("B: second.", "Second."),
        Example("C: a meeting.", "A summary."),
    ] + [Example(r["dialogue"], r["summary"]) for r in GOOD[:2]]
    assert dataset.stats["train"].skipped == Counter(
        {
            "messages not a list": 1,
            "no assistant message": 1,
            "no user message before the last assistant message": 1,
            "empty assistant message": 1,
            "non-string user message": 1,
            "message without a role": 1,
        }
    )
    assert dataset.summary()["columns"] == {CHAT_COLUMNS: 3, "dialogue -> transcript, summary -> summary": 2}


def test_all_chat_rows_unusable_is_a_config_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", [chat(("user", "A: hi."))] * 3)
    with pytest.raises(ConfigError, match=r"none of the 3 train rows is usable \(3 no assistant message\).*'messages'"):
        load_dataset(DataConfig(source=str(path)))


def test_datasets_saved_to_disk(tmp_path: Path) -> None:
    import datasets

    rows = [{"dialogue": r["dialogue"], "summary": r["summary"]} for r in GOOD]
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:4]), "validation": datasets.Dataset.from_list(CHATS[:1])}
    )
    splits.save_to_disk(tmp_path / "dict")
    dataset = load_dataset(DataConfig(source=str(tmp_path / "dict")))
    assert dataset.splits["train"] == [Example(r["dialogue"], r["summary"]) for r in rows[:4]]
    assert dataset.splits["validation"] == [Example("A: we ship Friday.", "They ship Friday.")]

    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "one")  # a single Dataset is the train split
    assert len(load_dataset(DataConfig(source=str(tmp_path / "one"))).splits["train"]) == 5

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "state.json").write_text("{}")
    with pytest.raises(ConfigError, match="looks like a dataset saved with save_to_disk but cannot be read"):
        load_dataset(DataConfig(source=str(tmp_path / "broken")))


def test_hub_dataset_is_read_from_the_local_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub dataset loaded once before (here: a cache laid out as the hub's would be) loads with the hub offline."""
    import datasets

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    source = write_jsonl(tmp_path / "train.jsonl", GOOD)
    built = tmp_path / "built"
    datasets.load_dataset("json", data_files={"train": str(source)}, cache_dir=str(built))
    (arrow,) = built.glob("json/*/0.0.0/*/json-train.arrow")
    cache = tmp_path / "hf-datasets"
    cached = cache / "alice___meetings" / "default" / "0.0.0" / arrow.parent.name
    shutil.copytree(arrow.parent, cached)
    (cached / "json-train.arrow").rename(cached / "meetings-train.arrow")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)

    dataset = load_dataset(DataConfig(source="alice/meetings"))
    assert dataset.splits["train"] == [Example(r["dialogue"], r["summary"]) for r in GOOD]


def test_inspect_says_which_columns_it_read(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS * 4 + [chat(("user", "x"))])
    config = tiny_config(tmp_path / "run", f'data.source="{path}"', "data.max_length=256")
    validate(config, config.parallel.world_size)
    report = inspect_data(config, prepare(config).prompts)
    text = format_report(report)
    assert f"read as: {CHAT_COLUMNS} (12 rows)" in text
    assert f"1  no assistant message  (train 1; first: {path}:13)" in text
    assert json.loads(report.to_json())["rows"]["columns"] == {CHAT_COLUMNS: 12}
