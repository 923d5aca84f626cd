"""Formats users bring: chat rows (`messages`), datasets saved with save_to_disk, hub datasets in the local cache."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from pipetune.config import ConfigError, DataConfig, validate
from pipetune.data.example import Example
from pipetune.data.inspect import format_report, inspect_data
from pipetune.data.sources import CHAT_COLUMNS, MULTI_TURN, OWN_SYSTEM, REPLACED_SYSTEM, chat_lines, load_dataset
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


def test_chat_rows_give_one_exchange_with_the_rows_own_system_message(tmp_path: Path) -> None:
    bad = [
        {"messages": "not a list"},
        chat(("user", "A: hi.")),
        chat(("assistant", "An answer with no question.")),
        chat(("user", "A: hi."), ("assistant", "   ")),
        chat(("user", 3), ("assistant", "x")),
        {"messages": [{"content": "no role"}]},
        chat(("system", 7), ("user", "A: hi."), ("assistant", "Hi.")),
        chat(("system", "\ud800"), ("user", "A: hi."), ("assistant", "Hi.")),  # a lone surrogate
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS + bad + GOOD[:2])  # chat and column rows side by side
    dataset = load_dataset(DataConfig(source=str(path)))

    assert (
        dataset.splits["train"]
        == [
            Example("A: we ship Friday.", "They ship Friday.", system="Summarize."),  # the row's own system message
            Example("C: a meeting.", "A summary."),  # the unanswered message after the exchange is left out
        ]
        + [Example(r["dialogue"], r["summary"]) for r in GOOD[:2]]
    )
    assert dataset.stats["train"].skipped == Counter(
        {
            MULTI_TURN: 1,  # two exchanges: its first would be context no inference prompt has
            "messages not a list": 1,
            "no assistant message": 1,
            "no user message before the last assistant message": 1,
            "empty assistant message": 1,
            "non-string user message": 1,
            "message without a role": 1,
            "non-string system message": 1,
            "invalid Unicode in system message": 1,
        }
    )
    assert dataset.summary()["columns"] == {
        CHAT_COLUMNS: 1,
        f"{CHAT_COLUMNS}, {OWN_SYSTEM}": 1,
        "dialogue -> transcript, summary -> summary": 2,
    }

    # data.system_prompt set: it replaces the row's system message, and the count says so
    replaced = load_dataset(DataConfig(source=str(path), system_prompt="Summarize in one line."))
    assert replaced.splits["train"][0] == Example("A: we ship Friday.", "They ship Friday.")
    assert replaced.summary()["columns"][f"{CHAT_COLUMNS}, {REPLACED_SYSTEM}"] == 1
    assert chat_lines(replaced.summary()["columns"]) == [
        "read as: dialogue -> transcript, summary -> summary (2 rows)",
        f"read as: {CHAT_COLUMNS} (1 rows)",
        f"read as: {CHAT_COLUMNS}, {REPLACED_SYSTEM} (1 rows)",
    ]
    assert chat_lines({"dialogue -> transcript, summary -> summary": 2}) == []  # nothing to say without chat rows


MIXED = [
    {"dialogue": "A: we ship Friday.", "summary": "They ship Friday.", "messages": None},
    {"dialogue": None, "summary": None, "messages": CHATS[0]["messages"]},
    {"dialogue": "B: budget is fine.", "summary": "Budget fine.", "messages": None},
    {"dialogue": None, "summary": None, "messages": CHATS[2]["messages"]},
]
MIXED_EXAMPLES = [
    Example("A: we ship Friday.", "They ship Friday."),
    Example("A: we ship Friday.", "They ship Friday.", system="Summarize."),
    Example("B: budget is fine.", "Budget fine."),
    Example("C: a meeting.", "A summary."),
]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_a_file_mixing_column_and_chat_rows_reads_each_row_by_its_own_format(tmp_path: Path, suffix: str) -> None:
    """pandas and Parquet write the other format's fields as null (pandas' JSON, a float NaN too): a row is chat
    when its transcript column is absent or null and it has messages, whatever the rows around it hold."""
    path = tmp_path / f"mixed.{suffix}"
    if suffix == "jsonl":
        nan_rows = [  # json.dumps writes a float NaN as NaN, which json.loads reads back as one
            {"dialogue": float("nan"), "summary": float("nan"), "messages": CHATS[2]["messages"]},
            {"dialogue": "D: lunch at noon.", "summary": float("nan"), "messages": None},
        ]
        write_jsonl(path, MIXED + nan_rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(MIXED), path)  # messages: list<struct<role, content>>, nulls between
    dataset = load_dataset(DataConfig(source=str(path)))
    if suffix == "jsonl":
        assert dataset.splits["train"] == MIXED_EXAMPLES + [MIXED_EXAMPLES[3]]
        assert dataset.stats["train"].skipped == Counter({"missing summary": 1})
    else:
        assert dataset.splits["train"] == MIXED_EXAMPLES
        assert not dataset.stats["train"].skipped


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
    assert dataset.splits["validation"] == [Example("A: we ship Friday.", "They ship Friday.", "Summarize.")]

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
    assert f"read as: {CHAT_COLUMNS} (4 rows)" in text
    assert f"read as: {CHAT_COLUMNS}, {OWN_SYSTEM} (4 rows)" in text
    assert f"4  {MULTI_TURN}  (train 4; first: {path}:2)" in text
    assert f"1  no assistant message  (train 1; first: {path}:13)" in text
    assert json.loads(report.to_json())["rows"]["columns"] == {CHAT_COLUMNS: 4, f"{CHAT_COLUMNS}, {OWN_SYSTEM}": 4}


def test_training_reads_chat_rows_with_their_own_system_message_and_says_so(tmp_path: Path) -> None:
    """The start of training says how chat rows were read, and the token cache holds each row's own system prompt."""
    from pipetune.parallel.process_group import DistEnv
    from pipetune.train import build_data

    path = write_jsonl(tmp_path / "chats.jsonl", CHATS[:1] * 8 + [CHATS[2]] * 8)
    config = tiny_config(tmp_path / "run", f'data.source="{path}"', "data.max_length=256", "parallel.pp=1")
    validate(config, config.parallel.world_size)
    prepared = prepare(config)
    said: list[str] = []
    (tmp_path / "run").mkdir()
    data = build_data(config, DistEnv(0, 1, 0, torch.device("cpu")), prepared, tmp_path / "run", said.append)

    assert f"data read as: {CHAT_COLUMNS}, {OWN_SYSTEM} (8 rows)" in said
    assert f"data read as: {CHAT_COLUMNS} (8 rows)" in said
    prompts = []
    for i in range(len(data.split)):
        ids, labels = data.split.batch([i], 256, prepared.pad_id)
        n = int((ids[0] != prepared.pad_id).sum())
        prompts.append(prepared.tokenizer.decode(ids[0, :n]))
    assert sum(p.startswith("<|im_start|>system\nSummarize.<|im_end|>") for p in prompts) == 8
    assert sum(p.startswith(f"<|im_start|>system\n{config.data.system_prompt}<|im_end|>") for p in prompts) == 8
