"""Tokenized data cached on disk, memory-mapped, so that a start after the first skips reading and tokenizing.

Every split is stored as one flat int32 file of all samples' token ids, with each sample's offset and
prompt length beside it; batches are then read from it by index (`SampleStore.batch`), so a rank holds
on its device only the batch it runs, and in memory only the pages it touches.

The cache directory is named by a digest of everything the samples depend on: the data files' content
(or the synthetic corpus' settings, or a hub dataset's fingerprints), the column and hold-out settings,
the tokenizer, the prompt (chat template, system prompt, lengths) and the code that reads and cuts rows.
Change any of them and the next run tokenizes afresh into a new directory. A build writes into a private
directory and renames it into place, so concurrent builders never leave a half-written cache.

meta.json records every file's size and SHA-256; each start checks them (one read of the cache, which also
brings it into the page cache) and rebuilds a cache that was cut short, half deleted or changed since.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipetune.config import ConfigError, DataConfig
from pipetune.data.batching import SampleStore
from pipetune.data.prompt import PromptBuilder
from pipetune.files import default_cache_dir, file_digest, files_damage, record_files, write_atomic, write_atomic_dir

CACHE_VERSION = 2
"""Part of the digest; bump it when the stored layout changes."""
CHUNK = 8192
"""Examples tokenized per batch call while building."""
_CODE = (
    "sources.py",
    "prompt.py",
    "synthetic_splits.py",
    "example.py",
    "synthetic.py",
    "synthetic_whole.py",
    "facts.py",
    "batching.py",
    "cache.py",
)
"""Modules whose code decides the stored samples: their source text is part of the digest."""


@dataclass
class TokenizedData:
    """Every split's samples, memory-mapped from the cache, and how the rows were read (data.json)."""

    splits: dict[str, SampleStore]
    summary: dict[str, Any]
    """`Dataset.summary()` of the build: rows read, kept and skipped by reason per split."""
    path: Path
    built: bool
    """True when this call tokenized the data, False when it found the cache."""

    def skipped_line(self) -> str:
        skipped = self.summary["skipped"]
        if not skipped:
            return "skipped rows: none"
        reasons = ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items()))
        return f"skipped rows: {sum(skipped.values())} ({reasons})"

    def write_summary(self, path: str | Path) -> None:
        """The summary as JSON (a run's data.json), through a temporary file and a rename."""
        write_atomic(path, json.dumps(self.summary, indent=2) + "\n")


def tokenized_data(
    data: DataConfig, prompts: PromptBuilder, seed: int, wait: bool = False, cache_dir: Path | None = None
) -> TokenizedData:
    """The config's data tokenized by `prompts`: from the cache, else built into it.

    `wait`: never build, wait for another process to finish the build or the repair (the other ranks of a
    node, while its local rank 0 builds). A damaged cache is rebuilt in place, with a note.
    """
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "data"
    target = root / data_digest(data, prompts, seed)
    damage = cache_damage(target)
    while wait and damage is not None:
        time.sleep(0.5)
        damage = cache_damage(target)
    built = damage is not None
    if built:
        if target.exists():
            print(f"pipetune: note: the token cache {target} is damaged ({damage}); rebuilding it", file=sys.stderr)
        _build_into(target, data, prompts, seed, replace=target.exists())
        damage = cache_damage(target)  # what this build (or a concurrent one) left must be whole before it is read
        if damage is not None:
            raise OSError(
                f"the token cache {target} is still damaged after rebuilding it ({damage}); delete that directory "
                "and run again, or set PIPETUNE_CACHE to another directory"
            )
    meta = json.loads((target / "meta.json").read_text())
    splits = {name: _open_split(target, name, info) for name, info in meta["splits"].items()}
    return TokenizedData(splits, meta["summary"], target, built)


def cache_damage(target: Path) -> str | None:
    """What is wrong with the cache directory `target` (not built, meta.json unreadable, a file missing, cut short
    or changed), or None when it is whole."""
    if not target.is_dir():
        return "not built"
    try:
        meta = json.loads((target / "meta.json").read_text())
    except FileNotFoundError:
        return "meta.json is missing"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"meta.json cannot be read: {e}"
    if not isinstance(meta, dict) or not isinstance(meta.get("splits"), dict) or "summary" not in meta:
        return "meta.json lacks its splits"
    files = meta.get("files")
    for name, info in meta["splits"].items():
        if not all(isinstance(files, dict) and f in files for f in _split_files(name)):
            return f"meta.json has no record of split {name!r}'s files"
        counts = [info.get(key) if isinstance(info, dict) else None for key in ("samples", "tokens", "truncated")]
        recorded = files[f"{name}.tokens"]
        if not all(isinstance(n, int) for n in counts) or not isinstance(recorded, dict):
            return f"meta.json's record of split {name!r} is malformed"
        if recorded.get("bytes") != 4 * counts[1]:
            return f"meta.json's token count of split {name!r} disagrees with its file's size"
    return files_damage(target, files)


def data_digest(data: DataConfig, prompts: PromptBuilder, seed: int) -> str:
    """The cache key: a digest of everything the tokenized samples depend on."""
    tokenizer = prompts.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    here = Path(__file__).parent
    parts = {
        "version": CACHE_VERSION,
        "source": source_identity(data),
        "columns": [data.transcript_column, data.summary_column],
        "hold_out": [data.validation_fraction, seed if data.validation_fraction > 0 else None],
        "tokenizer": hashlib.sha256(vocabulary.encode()).hexdigest(),
        "prompt": [prompts.head_ids, prompts.middle_ids, prompts.end_ids, prompts.elision_ids],
        "lengths": [prompts.max_length, prompts.max_summary_tokens],
        "code": hashlib.sha256(b"".join((here / name).read_bytes() for name in _CODE)).hexdigest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def source_identity(data: DataConfig) -> Any:
    """What the rows are, without reading them: file digests, synthetic settings, or a hub dataset's fingerprints."""
    from pipetune.data import sources

    if data.source == sources.SYNTHETIC:
        lengths = [] if data.synthetic_lengths == "short" else [data.synthetic_lengths]  # short: the key as before
        return ["synthetic", data.synthetic_train, data.synthetic_validation, *lengths]
    path = Path(data.source).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir() and sources.saved_dataset(path):
        files = sorted(p for p in path.rglob("*") if p.is_file())
    elif path.is_dir():
        files = [f for split_files in sources.split_files(path).values() for f in split_files]
    else:  # a hub dataset, or a path that does not exist: _raw_splits raises the clear error
        sources.require_local_source(data.source)  # a local path that does not exist: its clear error
        loaded = sources.hub_dataset(data.source)
        fingerprints = {name: getattr(loaded[name], "_fingerprint", None) for name in loaded}
        missing = sorted(name for name, fingerprint in fingerprints.items() if not isinstance(fingerprint, str))
        if missing:  # without them the key would not change with the data: a new revision would reuse stale tokens
            raise ConfigError(
                f"data.source = {data.source!r}: the hub dataset's split(s) {', '.join(missing)} have no fingerprint "
                "to key the token cache by; export the dataset to local files (e.g. "
                f"datasets.load_dataset({data.source!r})['train'].to_json('data/train.jsonl')) and set data.source "
                "to that directory"
            )
        return ["hub", data.source, fingerprints]
    return [[str(f.relative_to(path)) if f != path else f.name, file_digest(f, remember=True)] for f in files]


def _split_files(name: str) -> tuple[str, str, str]:
    return f"{name}.tokens", f"{name}.offsets.npy", f"{name}.n_prompt.npy"


def _build_into(target: Path, data: DataConfig, prompts: PromptBuilder, seed: int, replace: bool = False) -> None:
    """Read, clean and tokenize every split into a private directory, then rename it to `target` (replacing a
    damaged one when `replace`)."""
    from pipetune.data.sources import load_dataset

    started = time.perf_counter()
    dataset = load_dataset(data, seed=seed)

    def build(staging: Path) -> None:
        splits = {name: _write_split(staging, name, examples, prompts) for name, examples in dataset.splits.items()}
        files = record_files(staging, [f for name in splits for f in _split_files(name)])
        meta = {
            "summary": dataset.summary(),
            "splits": splits,
            "files": files,
            "seconds": round(time.perf_counter() - started, 1),
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")  # last: marks the build complete

    write_atomic_dir(target, build, complete="meta.json", replace=replace)
    n = sum(len(examples) for examples in dataset.splits.values())
    print(f"pipetune: tokenized {n} samples in {time.perf_counter() - started:.1f} s -> {target}", file=sys.stderr)


def _write_split(directory: Path, name: str, examples: list, prompts: PromptBuilder) -> dict[str, int]:
    """Tokenize one split a chunk at a time, appending its ids to `<name>.tokens`; offsets and prompt lengths beside."""
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    n_prompt = np.zeros(len(examples), dtype=np.int32)
    truncated = capped = 0
    with open(directory / f"{name}.tokens", "wb") as tokens:
        for start in range(0, len(examples), CHUNK):
            chunk = examples[start : start + CHUNK]
            samples = prompts.build_examples(chunk)
            for i, sample in enumerate(samples, start=start):
                offsets[i + 1] = offsets[i] + len(sample.input_ids)
                n_prompt[i] = sample.n_prompt
                truncated += bool(sample.transcript_tokens_cut or sample.summary_tokens_cut)
                capped += bool(sample.summary_tokens_cut)
            ids = np.fromiter((t for s in samples for t in s.input_ids), dtype=np.int32)
            tokens.write(ids.tobytes())
    np.save(directory / f"{name}.offsets.npy", offsets)
    np.save(directory / f"{name}.n_prompt.npy", n_prompt)
    return {"samples": len(examples), "tokens": int(offsets[-1]), "truncated": truncated, "summaries_capped": capped}


def _open_split(directory: Path, name: str, info: dict[str, int]) -> SampleStore:
    tokens = (
        np.memmap(directory / f"{name}.tokens", dtype=np.int32, mode="r", shape=(info["tokens"],))
        if info["tokens"]
        else np.zeros(0, dtype=np.int32)  # mmap refuses an empty file
    )
    offsets = np.load(directory / f"{name}.offsets.npy", mmap_mode="r")
    n_prompt = np.load(directory / f"{name}.n_prompt.npy", mmap_mode="r")
    return SampleStore(tokens, offsets, n_prompt, info["truncated"], info.get("summaries_capped", 0))
