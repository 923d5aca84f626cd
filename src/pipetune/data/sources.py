"""Where meetings come from: the synthetic corpus, local files, or a hub dataset; bad rows are skipped and counted."""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipetune.config import ConfigError, DataConfig

SYNTHETIC = "synthetic"
LOCAL_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


@dataclass(frozen=True)
class Example:
    transcript: str
    summary: str


@dataclass
class Dataset:
    """Clean examples per split, and how many rows were skipped for which reason."""

    splits: dict[str, list[Example]]
    skipped: Counter = field(default_factory=Counter)

    def skipped_line(self) -> str:
        if not self.skipped:
            return "skipped rows: none"
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(self.skipped.items()))
        return f"skipped rows: {sum(self.skipped.values())} ({reasons})"


def load_dataset(data: DataConfig) -> Dataset:
    """All splits of `data.source` as Examples; malformed rows are counted, never raised."""
    if data.source == SYNTHETIC:
        from pipetune.data.synthetic import synthetic_splits

        splits = synthetic_splits(seed=0, n_train=data.synthetic_train, n_validation=data.synthetic_validation)
        return Dataset({name: [Example(m.transcript, m.summary) for m in rows] for name, rows in splits.items()})
    path = Path(data.source).expanduser()
    if path.suffix in LOCAL_SUFFIXES or path.exists():
        if not path.is_file():
            raise ConfigError(f"data.source = {data.source!r} does not exist; give a JSONL, JSON, CSV or Parquet file")
        return clean_rows({"train": read_local_rows(path)}, data)
    return clean_rows(_hub_rows(data.source), data)


def clean_rows(raw: dict[str, Iterable[dict[str, Any]]], data: DataConfig) -> Dataset:
    dataset = Dataset({})
    for split, rows in raw.items():
        kept = []
        for row in rows:
            reason = _problem(row, data)
            if reason:
                dataset.skipped[reason] += 1
            else:
                kept.append(Example(row[data.transcript_column].strip(), row[data.summary_column].strip()))
        dataset.splits[split] = kept
    return dataset


def _problem(row: Any, data: DataConfig) -> str | None:
    """Why a row cannot be used, or None."""
    if not isinstance(row, dict):
        return "not a record"
    for column in (data.transcript_column, data.summary_column):
        value = row.get(column)
        if value is None:
            return f"missing {column}"
        if not isinstance(value, str):
            return f"non-string {column}"
        if not value.strip():
            return f"empty {column}"
    return None


def read_local_rows(path: Path) -> list[Any]:
    """Rows of a local JSONL/JSON/CSV/Parquet file; unparsable JSONL lines become None (counted later)."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows: list[Any] = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    rows.append(None)
        return rows
    if suffix == ".json":
        content = json.loads(path.read_text(encoding="utf-8"))
        return content if isinstance(content, list) else content.get("data", [])
    if suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ConfigError(f"data.source = {str(path)!r}: unknown file type {suffix!r}; use .jsonl, .json, .csv or .parquet")


def _hub_rows(name: str) -> dict[str, Iterable[dict[str, Any]]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.source = {name!r} is a hub dataset, which needs the `datasets` package "
            "(pip install 'pipetune[data]'), or give a local JSONL/CSV/Parquet file"
        ) from None
    try:
        loaded = datasets.load_dataset(name)
    except Exception as e:  # offline, missing, auth: the hub raises many kinds
        raise ConfigError(
            f"data.source = {name!r} could not be loaded from the hub ({type(e).__name__}). Export it to a "
            f"local file where the hub is reachable (e.g. load_dataset({name!r})['train'].to_json('train.jsonl')) "
            "and set data.source to that file, or use data.source = 'synthetic'"
        ) from None
    return {split: loaded[split] for split in loaded}
