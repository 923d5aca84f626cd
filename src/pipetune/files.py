"""Files that survive crashes: written so that a reader sees the old one or the whole new one (a failure leaves
no temporary file), and metrics.csv read back as a crash may have left it; where pipetune caches what it builds
once, and the content digest that keys those caches."""

from __future__ import annotations

import csv
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str, sync: bool = False) -> None:
    """Write through `.<name>.<pid>.tmp` and a rename (after an fsync when `sync`).

    On any failure, a full disk or a stop signal included, the temporary file is removed and the error
    re-raised naming `path`.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic_dir(target: Path, build: Callable[[Path], None], complete: str) -> None:
    """Make the directory `target` whole or not at all: `build(staging)` fills a private directory beside it,
    which a rename (atomic) then turns into `target`.

    When another process's build got there first the rename fails; its copy stays if it holds the file
    `complete`, and this one is dropped. A failed build leaves nothing behind.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it owner-only
        build(staging)
        os.rename(staging, target)
    except OSError:
        if not (target / complete).is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def default_cache_dir() -> Path:
    """``$PIPETUNE_CACHE``, else ``$XDG_CACHE_HOME/pipetune``, else ``~/.cache/pipetune``."""
    if os.environ.get("PIPETUNE_CACHE"):
        return Path(os.environ["PIPETUNE_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "pipetune"
    return Path.home() / ".cache" / "pipetune"


def file_digest(path: Path) -> str:
    """SHA-256 of the file's content, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def read_metrics_rows(path: Path) -> tuple[list[dict], list[str], int]:
    """metrics.csv's complete rows (those with a step), its columns, and how many lines were damaged (cut short,
    NUL bytes, not UTF-8: what a full disk or a killed run leaves)."""
    text = path.read_bytes().decode("utf-8", errors="replace").replace("\0", "")
    lines = text.splitlines()
    if not lines:
        return [], [], 0
    fieldnames = next(csv.reader(lines[:1]), [])
    rows, damaged = [], 0
    for line in lines[1:]:
        try:
            values = next(csv.reader([line]), [])
        except csv.Error:
            values = []
        row = dict(zip(fieldnames, values, strict=False))
        if len(values) != len(fieldnames) or "\ufffd" in line or not row.get("step", "").isdigit():
            damaged += bool(line.strip())
            continue
        rows.append(row)
    return rows, fieldnames, damaged
