"""Data sources: local files and directories, the hub, skipped rows counted by reason, the validation hold-out."""

from __future__ import annotations

import csv
import json
import sys
import types
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipetune.config import Config, ConfigError, DataConfig, validate
from pipetune.data.example import Example
from pipetune.data.sources import load_dataset

GOOD = [{"dialogue": f"A: point {i}. B: agreed.", "summary": f"They agreed on point {i}."} for i in range(5)]


def write_jsonl(path: Path, rows: list, extra_lines: list[str] = ()) -> Path:
    lines = [json.dumps(row) for row in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_skips_every_kind_of_bad_row_and_counts_it(tmp_path: Path) -> None:
    bad = [
        {"dialogue": "A: hi.", "summary": None},
        {"dialogue": "A: hi."},
        {"dialogue": "   \n", "summary": "x"},
        {"dialogue": "A: hi.", "summary": 3},
        ["A: hi.", "a list, not a record"],
    ]
    path = write_jsonl(tmp_path / "ami.jsonl", GOOD[:2] + bad + GOOD[2:], ["{not json", "", '"a string"'])
    dataset = load_dataset(DataConfig(source=str(path)))

    assert dataset.splits["train"] == [Example(r["dialogue"], r["summary"]) for r in GOOD]
    assert dataset.stats["train"].skipped == Counter(
        {
            "missing summary": 2,
            "empty dialogue": 1,
            "non-string summary": 1,
            "not a record": 2,
            "unparsable JSON line": 1,
        }
    )
    assert dataset.summary()["splits"]["train"]["read"] == 5 + 5 + 2  # the blank line is not a row
    assert dataset.skipped_line() == (
        "skipped rows: 7 (1 empty dialogue, 2 missing summary, 1 non-string summary, 2 not a record, "
        "1 unparsable JSON line)"
    )


def test_csv_with_configured_columns_long_fields_and_short_rows(tmp_path: Path) -> None:
    path = tmp_path / "meetings.csv"
    long_transcript = "A: " + "word " * 40_000  # 200 kB: beyond csv's default field limit
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "text", "abstract"])
        writer.writerow([1, long_transcript, "Long meeting."])
        writer.writerow([2, "A: short.", "Short meeting."])
        writer.writerow([3, "A: no summary.", ""])
        writer.writerow([4, "A: cut short"])  # fewer fields than the header
        f.write("5,A: hello, B: we ship Friday,Ship Friday.\n")  # an unquoted comma: the text would shift columns
    data = DataConfig(source=str(path), transcript_column="text", summary_column="abstract", max_length=8192)
    dataset = load_dataset(data)  # 8192 tokens: room for the whole transcript, which is not cut by characters

    assert [e.summary for e in dataset.splits["train"]] == ["Long meeting.", "Short meeting."]
    assert dataset.splits["train"][0].transcript == long_transcript.strip()
    extra = "more fields than the header: quote the text"
    assert dataset.stats["train"].skipped == Counter({"empty abstract": 1, "missing abstract": 1, extra: 1})
    assert dataset.stats["train"].skipped_at == {
        "empty abstract": [f"{path}:4"],
        "missing abstract": [f"{path}:5"],
        extra: [f"{path}:6"],
    }

    first_bad = tmp_path / "first.csv"
    first_bad.write_text("dialogue,summary\n,S.\nA: x.,X.\n")
    assert load_dataset(DataConfig(source=str(first_bad))).stats["train"].skipped_at == {
        "empty dialogue": [f"{first_bad}:2"]  # the first data row is line 2, after the header
    }


def test_parquet_nulls_and_non_strings_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "ami.parquet"
    table = pa.table(
        {
            "dialogue": ["A: one.", "A: two.", None, "A: four."],
            "summary": ["One.", None, "Three.", "Four."],
            "length": [1, 2, 3, 4],
        }
    )
    pq.write_table(table, path)
    dataset = load_dataset(DataConfig(source=str(path)))
    assert [e.summary for e in dataset.splits["train"]] == ["One.", "Four."]
    assert dataset.stats["train"].skipped == Counter({"missing summary": 1, "missing dialogue": 1})

    with pytest.raises(ConfigError, match="4 non-string length"):  # every row unusable: a config problem
        load_dataset(DataConfig(source=str(path), transcript_column="length"))


def test_json_list_records_and_json_lines_under_a_json_name(tmp_path: Path) -> None:
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(GOOD + ["not a record", {"dialogue": "A: x."}]))
    dataset = load_dataset(DataConfig(source=str(listed)))
    assert len(dataset.splits["train"]) == len(GOOD)
    assert dataset.stats["train"].skipped == Counter({"not a record": 1, "missing summary": 1})

    lines = write_jsonl(tmp_path / "lines.json", GOOD, ["[1, 2"])  # what datasets' to_json writes
    dataset = load_dataset(DataConfig(source=str(lines)))
    assert len(dataset.splits["train"]) == len(GOOD)
    assert dataset.stats["train"].skipped == Counter({"unparsable JSON line": 1})

    # One document that does not parse is one unusable file, located where it breaks, not a row per line.
    broken = tmp_path / "split"
    broken.mkdir()
    write_jsonl(broken / "train.jsonl", GOOD)
    (broken / "validation.json").write_text(json.dumps(GOOD[:3], indent=2).replace('"summary"', '"summary" 1', 1))
    stats = load_dataset(DataConfig(source=str(broken))).stats["validation"]
    assert (stats.read, stats.skipped) == (
        1,
        Counter({"unparsable JSON file: Expecting ':' delimiter at line 4 column 15": 1}),
    )
    assert stats.skipped_at == {next(iter(stats.skipped)): [f"{broken / 'validation.json'}:4"]}
    latin1 = json.dumps(GOOD[:3], indent=2).encode().replace(b"point 1", b"caf\xe9 1")
    (broken / "validation.json").write_bytes(latin1)
    stats = load_dataset(DataConfig(source=str(broken))).stats["validation"]
    byte = latin1.index(b"\xe9")
    assert stats.read == 1 and list(stats.skipped) == [f"unparsable JSON file: not UTF-8 at line 7 (byte {byte})"]
    with pytest.raises(ConfigError, match=r"1 unparsable JSON file: not UTF-8 at line 7"):  # train: every row unusable
        load_dataset(DataConfig(source=str(broken / "validation.json")))
    first_line_bad = write_jsonl(tmp_path / "first.json", GOOD, [])
    first_line_bad.write_text("{broken\n" + first_line_bad.read_text())  # JSON Lines with a bad first line
    dataset = load_dataset(DataConfig(source=str(first_line_bad)))
    assert len(dataset.splits["train"]) == len(GOOD) and dataset.skipped == Counter({"unparsable JSON line": 1})

    not_a_list = tmp_path / "dict.json"
    not_a_list.write_text(json.dumps({"dialogue": ["A: x."], "summary": ["X."]}))
    with pytest.raises(ConfigError, match="1 JSON file not a list of records"):
        load_dataset(DataConfig(source=str(not_a_list)))


def test_wrong_column_names_fail_with_the_columns_to_set(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "ami.jsonl", [{"transcript": "A: x.", "abstract": "X."}] * 3)
    with pytest.raises(ConfigError, match=r"none of the 3 train rows is usable \(3 missing dialogue\).*transcript_col"):
        load_dataset(DataConfig(source=str(path)))


def test_directory_of_split_files_in_any_format(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "train.jsonl", GOOD + [{"dialogue": "A: x."}])
    with open(tmp_path / "validation.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["dialogue", "summary"])
        writer.writeheader()
        writer.writerows(GOOD[:2])
    pq.write_table(pa.Table.from_pylist(GOOD[:1]), tmp_path / "test-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(GOOD[1:3]), tmp_path / "test-00001-of-00002.parquet")
    (tmp_path / "README.md").write_text("not data")

    dataset = load_dataset(DataConfig(source=str(tmp_path), validation_fraction=0.5))
    assert list(dataset.splits) == ["train", "validation", "test"]
    assert dataset.splits["validation"] == [Example(r["dialogue"], r["summary"]) for r in GOOD[:2]]  # no hold-out
    assert dataset.splits["test"] == [Example(r["dialogue"], r["summary"]) for r in GOOD[:3]]
    summary = dataset.summary()
    assert summary["splits"]["train"] == {
        "read": 6,
        "kept": 5,
        "skipped": {"missing summary": 1},
        "held_out": 0,
        "from_train": 0,
        "skipped_at": {"missing summary": [f"{tmp_path / 'train.jsonl'}:6"]},
        "shortened": 0,
    }
    assert summary["splits"]["test"]["read"] == 3 and summary["skipped"] == {"missing summary": 1}

    (tmp_path / "train.csv").write_text("dialogue,summary\nA: x.,X.\n")
    with pytest.raises(ConfigError, match="several formats"):
        load_dataset(DataConfig(source=str(tmp_path)))
    (tmp_path / "train.csv").unlink()

    for backup in ("train-old.jsonl", "validation-backup.csv"):  # not a split file nor a shard: never read as one
        (tmp_path / backup).write_text("")
        with pytest.raises(ConfigError, match=rf"holds '{backup}', which is neither .* move it out"):
            load_dataset(DataConfig(source=str(tmp_path)))
        (tmp_path / backup).unlink()
    from pipetune.data.sources import split_files

    hashed = tmp_path / "train-00000-of-00001-5d8b5b2e.jsonl"  # a hub shard's name, its hash included
    hashed.write_text("")
    assert hashed in split_files(tmp_path)["train"]
    hashed.unlink()


def test_directory_without_a_train_file_names_what_it_holds(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "val.jsonl", GOOD)
    with pytest.raises(ConfigError, match=r"without a train file \(it holds: val.jsonl\)"):
        load_dataset(DataConfig(source=str(tmp_path)))


def test_missing_local_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_dataset(DataConfig(source=str(tmp_path / "nope.jsonl")))


def test_validation_fraction_holds_out_a_deterministic_disjoint_share(tmp_path: Path) -> None:
    rows = [{"dialogue": f"A: meeting {i}.", "summary": f"Meeting {i}."} for i in range(40)]
    path = write_jsonl(tmp_path / "ami.jsonl", rows)
    data = DataConfig(source=str(path), validation_fraction=0.25)

    first, again, other = load_dataset(data, seed=7), load_dataset(data, seed=7), load_dataset(data, seed=8)
    assert first.splits == again.splits
    train, validation = set(first.splits["train"]), set(first.splits["validation"])
    assert len(validation) == 10 and len(train) == 30
    assert not train & validation
    assert train | validation == {Example(r["dialogue"], r["summary"]) for r in rows}
    assert set(other.splits["validation"]) != validation
    assert first.summary()["splits"]["train"]["held_out"] == 10
    assert first.summary()["splits"]["validation"]["from_train"] == 10

    assert "validation" not in load_dataset(DataConfig(source=str(path))).splits  # 0: no hold-out


def test_validation_fraction_is_validated() -> None:
    config = Config()
    config.data.validation_fraction = 1.0
    with pytest.raises(ConfigError, match=r"data.validation_fraction = 1.0 must be within \[0, 1\)"):
        validate(config, config.parallel.pp)


def _fake_datasets(monkeypatch: pytest.MonkeyPatch, load) -> None:
    module = types.ModuleType("datasets")
    module.load_dataset = load
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_unreachable_hub_names_the_offline_alternatives(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(name: str):
        raise ConnectionError("Couldn't reach 'knkarthick/AMI' on the Hub (LocalEntryNotFoundError)")

    _fake_datasets(monkeypatch, offline)
    with pytest.raises(ConfigError) as error:
        load_dataset(DataConfig(source="knkarthick/AMI"))
    message = str(error.value)
    assert "'knkarthick/AMI'" in message and "ConnectionError" in message
    assert "set data.source to that file or directory" in message and "'synthetic'" in message

    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(ConfigError, match=r"needs the `datasets` package.*'synthetic'"):
        load_dataset(DataConfig(source="knkarthick/AMI"))


def test_hub_dataset_goes_through_the_same_cleaning(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load(name: str):
        calls.append(name)
        return {"train": GOOD + [{"dialogue": "", "summary": "X."}], "validation": GOOD[:2], "test": GOOD[:1]}

    _fake_datasets(monkeypatch, load)
    dataset = load_dataset(DataConfig(source="knkarthick/AMI"))
    assert calls == ["knkarthick/AMI"]
    assert {name: len(rows) for name, rows in dataset.splits.items()} == {"train": 5, "validation": 2, "test": 1}
    assert dataset.skipped == Counter({"empty dialogue": 1})


def test_a_system_message_after_the_answer_is_left_out(tmp_path: Path) -> None:
    """Only messages up to the last assistant message count, as summarize reads the row."""
    messages = [
        {"role": "system", "content": "Summarize briefly."},
        {"role": "user", "content": "A: we ship Friday."},
        {"role": "assistant", "content": "Ship Friday."},
        {"role": "system", "content": "Trailing note after the answer."},
    ]
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": messages}])
    (example,) = load_dataset(DataConfig(source=str(path))).splits["train"]
    assert example == Example("A: we ship Friday.", "Ship Friday.", "Summarize briefly.")


def test_synthetic_summary_and_data_json(tmp_path: Path) -> None:
    dataset = load_dataset(DataConfig(source="synthetic", synthetic_train=6, synthetic_validation=2))
    dataset.write_summary(tmp_path / "data.json")
    written = json.loads((tmp_path / "data.json").read_text())
    assert written == dataset.summary()
    assert written["source"] == "synthetic"
    assert {name: (s["read"], s["kept"]) for name, s in written["splits"].items()} == {
        "train": (6, 6),
        "validation": (2, 2),
    }


def test_rows_that_would_crash_a_reader_are_skipped_counted_and_located(tmp_path: Path) -> None:
    """Nesting deeper than Python's recursion, an integer too long for int(), a lone surrogate; a BOM is no
    problem; a transcript far beyond any token budget is cut by characters before anything tokenizes it."""
    path = tmp_path / "rows.jsonl"
    huge = "A: " + "word " * 400_000  # 2 MB
    lines = [
        "\ufeff" + json.dumps(GOOD[0]),  # UTF-8 BOM
        '{"dialogue": ' + "[" * 100_000 + "]" * 100_000 + ', "summary": "s"}',
        '{"dialogue": "A: hi.", "summary": "S.", "n": ' + "9" * 5000 + "}",
        '{"dialogue": "A: \\ud800 hi.", "summary": "S."}',
        json.dumps({"dialogue": huge, "summary": "Long."}),
        json.dumps({"dialogue": "A: short meeting.", "summary": "S" * 9000}),  # only the summary is too long
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    dataset = load_dataset(DataConfig(source=str(path), max_length=128))

    stats = dataset.stats["train"]
    assert stats.skipped == Counter({"unparsable JSON line": 2, "invalid Unicode in dialogue": 1})
    assert stats.skipped_at == {
        "unparsable JSON line": [f"{path}:2", f"{path}:3"],
        "invalid Unicode in dialogue": [f"{path}:4"],
    }
    first, long, long_summary = dataset.splits["train"]
    assert first == Example(GOOD[0]["dialogue"], GOOD[0]["summary"])
    assert stats.shortened == 2 and len(long.transcript) <= 128 * 64 + 1 and long.summary == "Long."
    assert long_summary == Example("A: short meeting.", "S" * 128 * 64)  # the transcript as inference reads it
    assert long.transcript.startswith(huge[:1000]) and long.transcript.endswith(huge.strip()[-1000:])

    (tmp_path / "rows.json").write_text("\ufeff" + json.dumps(GOOD[:2]), encoding="utf-8")  # a JSON list with a BOM
    assert len(load_dataset(DataConfig(source=str(tmp_path / "rows.json"))).splits["train"]) == 2
