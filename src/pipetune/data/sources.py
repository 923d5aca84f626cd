"""Where meetings come from: the synthetic corpus, local files or directories, a dataset saved with
`datasets`' save_to_disk, or a hub dataset (read from the local HF cache when offline).

A row is either a record with the transcript and summary columns (`data.transcript_column`,
`data.summary_column`) or, when its transcript column is absent or null (None, NaN: what pandas and
Parquet write for the other format's fields in a mixed file) and it has a `messages` list (the chat
format TRL and axolotl read), a conversation: one user message (the transcript) then one assistant
message (the summary); messages after that assistant message are left out. The row's own system message
is its sample's system prompt, unless data.system_prompt is set (differs from the default), which then
replaces it. A conversation of several exchanges is skipped and counted ("multi-turn conversation"):
its earlier turns would be context that no inference prompt carries. How many rows were read each way is
`Dataset.columns`, shown by `pipetune data inspect` and at the start of training.

Every source goes through the same cleaning: a row with a missing, empty or non-string
transcript or summary, text that is not valid Unicode (a lone surrogate), an unparsable JSONL line
(nested too deep, an integer too long to read, ...), or anything that is not a record is skipped
and counted by reason (per split), never raised; the first few skipped rows of each reason are
located (file and line). A transcript or summary too long for any data.max_length budget is cut by
characters (the head and tail of a transcript, the head of a summary) before anything tokenizes it.
`Dataset.summary()` is what a run writes to `data.json`. A source without a validation split can
hold out `data.validation_fraction` of train, chosen by the seed alone.
"""

from __future__ import annotations

import csv
import json
import math
import random
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetune.config import SYSTEM_PROMPT, ConfigError, DataConfig
from pipetune.data.example import Example
from pipetune.data.synthetic_splits import synthetic_splits
from pipetune.files import write_atomic

SYNTHETIC = "synthetic"
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
SPLITS = ("train", "validation", "test")
"""Split names a directory source may hold, as `train.jsonl`, `validation.csv`, `test-00000-of-00002.parquet`, ..."""

UNPARSABLE_LINE = "unparsable JSON line"
NOT_UTF8_LINE = "line not UTF-8"
NOT_A_RECORD = "not a record"
NOT_A_LIST = "JSON file not a list of records"
UNPARSABLE_CSV_ROW = "unparsable CSV row"
CSV_EXTRA_FIELDS = "more fields than the header: quote the text"
UNPARSABLE_JSON_FILE = "unparsable JSON file"
LOCATED_PER_REASON = 5
"""Skipped rows located per reason in data.json: enough to find the pattern, never the whole file."""
CHARS_PER_TOKEN = 64
"""A bound on the characters one token covers: text beyond data.max_length x this is cut before tokenizing."""


@dataclass(frozen=True)
class _Unusable:
    """Stands in for a raw row that could not even be parsed; `reason` is what gets counted."""

    reason: str


@dataclass
class SplitStats:
    """How one split was read: raw rows, rows skipped by reason, rows moved between splits."""

    read: int = 0
    """Raw rows (records, JSONL lines, CSV rows) seen in the source."""
    skipped: Counter = field(default_factory=Counter)
    """Rows dropped, by reason ("missing summary", "unparsable JSON line", ...)."""
    held_out: int = 0
    """Clean train rows moved to validation by data.validation_fraction."""
    from_train: int = 0
    """Validation rows that were taken from train (data.validation_fraction)."""
    skipped_at: dict[str, list[str]] = field(default_factory=dict)
    """Where the first LOCATED_PER_REASON skipped rows of each reason are ("train.jsonl:7", "x.parquet row 3")."""
    shortened: int = 0
    """Kept rows whose text was cut by characters before tokenizing (beyond data.max_length x CHARS_PER_TOKEN)."""


@dataclass
class Dataset:
    """Clean examples per split, and how every split was read."""

    splits: dict[str, list[Example]]
    stats: dict[str, SplitStats] = field(default_factory=dict)
    source: str = ""
    columns: Counter = field(default_factory=Counter)
    """Kept rows by where their transcript and summary came from (`columns_read`), all splits together."""

    @property
    def skipped(self) -> Counter:
        """Skipped rows by reason, all splits together."""
        return sum((s.skipped for s in self.stats.values()), Counter())

    def skipped_line(self) -> str:
        skipped = self.skipped
        if not skipped:
            return "skipped rows: none"
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        return f"skipped rows: {sum(skipped.values())} ({reasons})"

    def summary(self) -> dict[str, Any]:
        """Rows read, kept and skipped by reason, per split: the run directory's `data.json`."""
        splits = {}
        for name, examples in self.splits.items():
            stats = self.stats.get(name, SplitStats(read=len(examples)))
            splits[name] = {
                "read": stats.read,
                "kept": len(examples),
                "skipped": dict(sorted(stats.skipped.items())),
                "held_out": stats.held_out,
                "from_train": stats.from_train,
                "skipped_at": stats.skipped_at,
                "shortened": stats.shortened,
            }
        return {
            "source": self.source,
            "columns": dict(sorted(self.columns.items())),
            "splits": splits,
            "skipped": dict(sorted(self.skipped.items())),
        }

    def write_summary(self, path: str | Path) -> None:
        """`summary()` as JSON, through a temporary file and a rename."""
        write_atomic(path, json.dumps(self.summary(), indent=2) + "\n")


def load_dataset(data: DataConfig, seed: int = 0) -> Dataset:
    """All splits of `data.source` as clean Examples; malformed rows are counted, never raised.

    `seed` chooses the validation hold-out (data.validation_fraction): pass train.seed, so that
    every caller of the same config holds out the same rows.
    """
    if data.source == SYNTHETIC:
        splits = synthetic_splits(
            seed=0, n_train=data.synthetic_train, n_validation=data.synthetic_validation, lengths=data.synthetic_lengths
        )
        dataset = Dataset(
            {name: list(rows) for name, rows in splits.items()},
            {name: SplitStats(read=len(rows)) for name, rows in splits.items()},
            columns=Counter({"synthetic meetings": sum(len(rows) for rows in splits.values())}),
        )
    else:
        dataset = clean_rows(_raw_splits(data.source), data)
        _check_train_usable(dataset, data)
    dataset.source = data.source
    if "validation" not in dataset.splits and data.validation_fraction > 0 and "train" in dataset.splits:
        hold_out_validation(dataset, data.validation_fraction, seed)
    return dataset


def _raw_splits(source: str) -> dict[str, Iterable[tuple[str, Any]]]:
    path = Path(source).expanduser()
    if path.is_dir() and saved_dataset(path):
        return _saved_dataset_rows(path)
    if path.is_dir():
        return {split: _read_files(files) for split, files in split_files(path).items()}
    if path.is_file():
        return {"train": read_local_rows(path)}
    require_local_source(source)
    return _hub_rows(source)


def require_local_source(source: str) -> None:
    """A data.source that names a local file or directory (by its suffix or a leading ".", "/" or "~") must exist;
    anything else is a hub dataset id or "synthetic"."""
    path = Path(source).expanduser()
    looks_local = path.suffix.lower() in LOCAL_SUFFIXES or source.startswith((".", "/", "~"))
    if source != SYNTHETIC and looks_local and not path.exists():
        raise ConfigError(
            f"data.source = {source!r} does not exist; give a JSONL, JSON, CSV or Parquet file, a directory "
            "with train.* (and validation.*, test.*) files, a hub dataset id, or 'synthetic'"
        )


def split_files(directory: Path) -> dict[str, list[Path]]:
    """`{split: files}` of a directory source: `train.jsonl` or shards `train-00000-of-00002.parquet`, ..."""
    found: dict[str, list[Path]] = {}
    for path in sorted(directory.iterdir()):
        suffix = path.suffix.lower()
        if not path.is_file() or suffix not in LOCAL_SUFFIXES:
            continue
        stem = path.name[: -len(suffix)]
        for split in SPLITS:
            shard = re.fullmatch(rf"{split}-\d+-of-\d+(-[0-9a-f]+)?", stem)  # a hub shard's name may end in a hash
            if stem == split or shard:
                found.setdefault(split, []).append(path)
            elif stem.startswith(f"{split}-"):  # a backup or an old copy would silently join the split
                raise ConfigError(
                    f"data.source = {str(directory)!r} holds {path.name!r}, which is neither {split}{suffix} nor a "
                    f"shard named like {split}-00000-of-00002{suffix}; move it out of the directory or rename it"
                )
    for split, files in found.items():
        suffixes = {f.suffix.lower() for f in files}
        if len(suffixes) > 1:
            names = ", ".join(f.name for f in files)
            raise ConfigError(
                f"data.source = {str(directory)!r} holds split {split!r} in several formats ({names}); "
                "keep one format per split"
            )
    if "train" not in found:
        present = ", ".join(sorted(p.name for p in directory.iterdir())[:10]) or "nothing"
        raise ConfigError(
            f"data.source = {str(directory)!r} is a directory without a train file (it holds: {present}); "
            f"name the files train.jsonl, validation.jsonl, test.jsonl (or .json, .csv, .parquet)"
        )
    return {split: found[split] for split in SPLITS if split in found}


def _read_files(files: list[Path]) -> list[tuple[str, Any]]:
    return [row for path in files for row in read_local_rows(path)]


def clean_rows(raw: dict[str, Iterable[tuple[str, Any]]], data: DataConfig) -> Dataset:
    """Keep the rows with a usable transcript and summary (stripped, cut to a length tokenizing can afford); count
    and locate the others by reason. `raw` holds (where, row) pairs."""
    dataset = Dataset({})
    limit = data.max_length * CHARS_PER_TOKEN
    for split, rows in raw.items():
        stats = SplitStats()
        kept = []
        for where, row in rows:
            stats.read += 1
            chat, system = is_chat_row(row, data), None
            if chat:  # its texts under the configured column names (and its system message), or _Unusable
                read = chat_columns(row, data)
                row, system = read if isinstance(read, tuple) else (read, None)
            reason = _problem(row, data)
            if reason:
                stats.skipped[reason] += 1
                located = stats.skipped_at.setdefault(reason, [])
                if len(located) < LOCATED_PER_REASON:
                    located.append(where)
                continue
            transcript, summary = row[data.transcript_column].strip(), row[data.summary_column].strip()
            # Each text is cut only when it is itself too long: a short transcript stays as inference reads it.
            if len(transcript) > limit or len(summary) > limit:
                stats.shortened += 1
            if len(transcript) > limit:
                transcript = transcript[: limit // 2] + "\n" + transcript[-(limit // 2) :]  # the prompt cuts the middle
            summary = summary[:limit]  # a summary keeps its head
            own = system[:limit] if system is not None and uses_own_system(data) else None  # room left: prompt.py
            kept.append(Example(transcript, summary, own))
            dataset.columns[chat_read_as(system, data) if chat else columns_read(data)] += 1
        dataset.splits[split] = kept
        dataset.stats[split] = stats
    return dataset


def _problem(row: Any, data: DataConfig) -> str | None:
    """Why a row cannot be used, or None."""
    if isinstance(row, _Unusable):
        return row.reason
    if not isinstance(row, dict):
        return NOT_A_RECORD
    for column in (data.transcript_column, data.summary_column):
        value = row.get(column)
        if absent(value):
            return f"missing {column}"
        if not isinstance(value, str):
            return f"non-string {column}"
        if not value.strip():
            return f"empty {column}"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return f"invalid Unicode in {column}"  # a lone surrogate: JSON allows it, tokenizers do not
    return None


def _check_train_usable(dataset: Dataset, data: DataConfig) -> None:
    """A train split whose every row was skipped is a config problem (wrong columns, wrong file): say so now."""
    if "train" not in dataset.splits or dataset.splits["train"]:
        return
    stats = dataset.stats["train"]
    reasons = ", ".join(f"{count} {reason}" for reason, count in stats.skipped.most_common())
    raise ConfigError(
        f"data.source = {data.source!r}: none of the {stats.read} train rows is usable ({reasons or 'no rows'}); "
        f"the transcript and summary are read from the columns data.transcript_column = "
        f"{data.transcript_column!r} and data.summary_column = {data.summary_column!r} (or, for chat rows, from a "
        f"{MESSAGES!r} list of role/content messages): set them to the file's column names, or fix the file"
    )


def hold_out_validation(dataset: Dataset, fraction: float, seed: int) -> None:
    """Move `fraction` of the train examples (at least one, never all) to a new validation split, chosen by seed."""
    train = dataset.splits["train"]
    n_held = min(max(1, round(fraction * len(train))), len(train) - 1)
    if n_held <= 0:
        return
    held = set(random.Random(seed).sample(range(len(train)), n_held))
    dataset.splits["validation"] = [e for i, e in enumerate(train) if i in held]
    dataset.splits["train"] = [e for i, e in enumerate(train) if i not in held]
    dataset.stats.setdefault("train", SplitStats(read=len(train))).held_out = n_held
    dataset.stats["validation"] = SplitStats(read=0, from_train=n_held)


# --------------------------------------------------------------------------- local files


def read_local_rows(path: Path) -> list[tuple[str, Any]]:
    """(where, raw row) of a local JSONL/JSON/CSV/Parquet file; rows that cannot be parsed become `_Unusable`."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _json_lines(path.read_bytes(), path)
    if suffix == ".json":
        return _json_rows(path)
    if suffix == ".csv":
        return _csv_rows(path)
    if suffix == ".parquet":
        return [(f"{path} row {i}", row) for i, row in enumerate(_parquet_rows(path), start=1)]
    raise ConfigError(f"data.source = {str(path)!r}: unknown file type {suffix!r}; use .jsonl, .json, .csv or .parquet")


def _parse_json(text: bytes) -> Any:
    """json.loads of UTF-8 bytes (a leading BOM allowed); ValueError for anything it cannot turn into a value:
    invalid UTF-8 or JSON, nesting deeper than Python's recursion, integers longer than int() may read."""
    try:
        return json.loads(text.decode("utf-8-sig"))
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _json_lines(content: bytes, path: Path) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for number, line in enumerate(content.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            rows.append((where, _parse_json(line)))
        except UnicodeDecodeError:
            rows.append((where, _Unusable(NOT_UTF8_LINE)))
        except ValueError:  # JSONDecodeError, too deep, an integer too long
            rows.append((where, _Unusable(UNPARSABLE_LINE)))
    return rows


def _json_rows(path: Path) -> list[tuple[str, Any]]:
    """A list of records, or {"data": [records]}; JSON Lines under a .json name (what `datasets` writes) also work."""
    content = path.read_bytes()
    try:
        loaded = _parse_json(content)
    except ValueError as e:
        if _looks_like_json_lines(content):
            return _json_lines(content, path)
        # One JSON document that does not parse: one unusable file, located where it breaks, not a row per line.
        line, detail = _json_error(content, e)
        return [(f"{path}:{line}" if line else str(path), _Unusable(f"{UNPARSABLE_JSON_FILE}: {detail}"))]
    if isinstance(loaded, dict) and isinstance(loaded.get("data"), list):
        loaded = loaded["data"]
    if not isinstance(loaded, list):
        return [(str(path), _Unusable(NOT_A_LIST))]
    return [(f"{path} record {i}", row) for i, row in enumerate(loaded, start=1)]


def _looks_like_json_lines(content: bytes) -> bool:
    """Whether a .json file that is not one JSON document is JSON Lines: it does not start with `[` or `{`, or one
    of its first two non-blank lines is a record on its own (a pretty-printed document's first lines are not)."""
    text = content.removeprefix(b"\xef\xbb\xbf")
    if not text.lstrip().startswith((b"[", b"{")):
        return True
    if text.lstrip().startswith(b"["):
        return False
    lines = [line for line in text.splitlines() if line.strip()][:2]
    for line in lines:
        try:
            if isinstance(_parse_json(line), dict):
                return True
        except ValueError:
            pass
    return False


def _json_error(content: bytes, error: ValueError) -> tuple[int | None, str]:
    """The line a JSON document stops parsing at (None when unknown) and what went wrong there."""
    if isinstance(error, json.JSONDecodeError):
        return error.lineno, f"{error.msg} at line {error.lineno} column {error.colno}"
    if isinstance(error, UnicodeDecodeError):
        line = content[: error.start].count(b"\n") + 1
        return line, f"not UTF-8 at line {line} (byte {error.start})"
    return None, str(error).split(":")[0][:120]  # nested too deeply, an integer too long, ...


def _csv_rows(path: Path) -> list[tuple[str, Any]]:
    # Meeting transcripts outgrow csv's default 128 KiB field limit.
    csv.field_size_limit(2**31 - 1)
    rows: list[tuple[str, Any]] = []
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            try:
                _ = reader.fieldnames  # reads the header first: line_num + 1 is then the line of the next row
            except csv.Error:
                rows.append((f"{path}:1", _Unusable(UNPARSABLE_CSV_ROW)))
            while True:
                where = f"{path}:{reader.line_num + 1}"
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error:
                    rows.append((where, _Unusable(UNPARSABLE_CSV_ROW)))
                    continue
                # DictReader puts surplus fields under None: an unquoted comma, whose text would shift columns
                rows.append((where, _Unusable(CSV_EXTRA_FIELDS) if None in row else row))
    except UnicodeDecodeError as e:
        raise ConfigError(f"data.source file {str(path)!r} is not UTF-8 text ({e}); re-save it as UTF-8") from None
    return rows


def _parquet_rows(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"data.source file {str(path)!r} is Parquet, which needs pyarrow (pip install pyarrow); "
            "or export it to JSONL"
        ) from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for damaged files
        raise ConfigError(f"data.source file {str(path)!r} is not readable Parquet ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- chat rows

MESSAGES = "messages"
"""The column of chat rows: a list of {"role": ..., "content": ...} messages."""
CHAT_COLUMNS = f"{MESSAGES}: user message -> transcript, assistant message -> summary"
OWN_SYSTEM = "the row's system message -> system prompt"
REPLACED_SYSTEM = "the row's system message replaced by data.system_prompt"
MULTI_TURN = "multi-turn conversation"


def columns_read(data: DataConfig) -> str:
    """How a column row's fields are read, as `data inspect` shows it."""
    return f"{data.transcript_column} -> transcript, {data.summary_column} -> summary"


def chat_lines(columns: dict[str, int]) -> list[str]:
    """`read as: <how> (N rows)` for each way rows were read, where chat rows were among them (what the start of
    training says: whether their system messages were kept); none otherwise."""
    if not any(how.startswith(CHAT_COLUMNS) for how in columns):
        return []
    return [f"read as: {how} ({count} rows)" for how, count in columns.items()]


def chat_read_as(own_system: str | None, data: DataConfig) -> str:
    """How a kept chat row was read: with its own system message, with that message replaced, or without one."""
    if own_system is None:
        return CHAT_COLUMNS
    return f"{CHAT_COLUMNS}, {OWN_SYSTEM if uses_own_system(data) else REPLACED_SYSTEM}"


def absent(value: Any) -> bool:
    """None or NaN: how pandas and Parquet write a field a row does not have."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def is_chat_row(row: Any, data: DataConfig) -> bool:
    """A record whose transcript column is absent or null, with a `messages` field, is read as a conversation."""
    return isinstance(row, dict) and absent(row.get(data.transcript_column)) and not absent(row.get(MESSAGES))


def uses_own_system(data: DataConfig) -> bool:
    """Chat rows keep their own system message unless data.system_prompt was changed from the default."""
    return data.system_prompt == SYSTEM_PROMPT


def chat_columns(row: dict, data: DataConfig) -> tuple[dict[str, str], str | None] | _Unusable:
    """The user message and the assistant message answering it, as a column row, and the row's own system
    message (several: joined by a blank line), or None."""
    messages = row[MESSAGES]
    if not isinstance(messages, list):
        return _Unusable(f"{MESSAGES} not a list")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        return _Unusable("message without a role")
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        return _Unusable("no assistant message")
    turns = [m for m in messages[: answers[-1] + 1] if m["role"] != "system"]
    if not any(m["role"] == "user" for m in turns):
        return _Unusable("no user message before the last assistant message")
    if len(turns) > 2 or turns[0]["role"] != "user":
        return _Unusable(MULTI_TURN)
    texts = {}
    for column, message in ((data.transcript_column, turns[0]), (data.summary_column, turns[1])):
        content = message.get("content")
        if not isinstance(content, str):
            return _Unusable(f"non-string {message['role']} message")
        if not content.strip():
            return _Unusable(f"empty {message['role']} message")
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            return _Unusable(f"invalid Unicode in {message['role']} message")  # as in _problem
        texts[column] = content
    systems = [m.get("content") for m in messages[: answers[-1] + 1] if m["role"] == "system"]  # later: left out
    if not all(isinstance(content, str) for content in systems):
        return _Unusable("non-string system message")
    try:
        "".join(systems).encode("utf-8")
    except UnicodeEncodeError:
        return _Unusable("invalid Unicode in system message")  # a lone surrogate, as in _problem
    return texts, "\n\n".join(content.strip() for content in systems) if systems else None


# --------------------------------------------------------------------------- datasets saved with save_to_disk


def saved_dataset(path: Path) -> bool:
    """A directory written by `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _saved_dataset_rows(path: Path) -> dict[str, Iterable[Any]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.source = {str(path)!r} is a dataset saved with save_to_disk, which needs the `datasets` "
            "package (pip install 'pipetune[data]'); or export it to JSONL"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # damaged or partial files: datasets raises many kinds
        raise ConfigError(
            f"data.source = {str(path)!r} looks like a dataset saved with save_to_disk but cannot be read "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''})"
        ) from None
    if isinstance(loaded, datasets.Dataset):  # one split: train
        return {"train": _located_rows(f"{path} row", loaded)}
    return {split: _located_rows(f"{path} {split} row", loaded[split]) for split in loaded}


# --------------------------------------------------------------------------- hub


def _hub_rows(name: str) -> dict[str, Iterable[Any]]:
    loaded = hub_dataset(name)
    return {split: _located_rows(f"{name} {split} row", loaded[split]) for split in loaded}


def hub_dataset(name: str) -> Any:
    """`datasets.load_dataset(name)` (from the local HF cache when offline), or a ConfigError with the way out."""
    offline = (
        f"Export it to a local file where the hub is reachable (e.g. datasets.load_dataset({name!r})['train']"
        ".to_json('ami/train.jsonl'), likewise validation and test) and set data.source to that file or "
        "directory, or use data.source = 'synthetic'"
    )
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.source = {name!r} is neither a local file nor directory, and as a hub dataset it needs the "
            f"`datasets` package (pip install 'pipetune[data]'). {offline}"
        ) from None
    try:
        loaded = datasets.load_dataset(name)
    except Exception as e:  # offline, missing, auth: the hub raises many kinds
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ConfigError(
            f"data.source = {name!r} is neither a local file nor directory, and could not be loaded from the hub "
            f"({type(e).__name__}{': ' + detail if detail else ''}). {offline}"
        ) from None
    return loaded


def _located_rows(prefix: str, rows: Iterable[Any]) -> Iterable[tuple[str, Any]]:
    return ((f"{prefix} {i}", row) for i, row in enumerate(rows, start=1))
