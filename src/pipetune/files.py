"""Files that survive crashes: written so that a reader sees the old one or the whole new one (a failure leaves
no temporary file), and metrics.csv read back as a crash may have left it; where pipetune caches what it builds
once, the content digest that keys those caches, and the record of a cache's files that tells a whole cache
from a damaged one."""

from __future__ import annotations

import csv
import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from pipetune.errors import ConfigError


def write_atomic(path: str | Path, data: bytes | str, sync: bool = False) -> None:
    """Write through `.<name>.<pid>.tmp` and a rename. `sync`: durable on return, the file fsynced before the
    rename and its directory after it (the new name survives a power loss too).

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
        if sync:
            fsync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(path: str | Path) -> None:
    """Make the entries of directory `path` durable (files created, renamed or removed in it): a file's own fsync
    leaves its name to the directory's. Skipped where directories cannot be opened (Windows) or the file system
    does not sync them (EINVAL)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def write_atomic_dir(target: Path, build: Callable[[Path], None], complete: str, replace: bool = False) -> None:
    """Make the directory `target` whole or not at all: `build(staging)` fills a private directory beside it,
    which a rename (atomic) then turns into `target`.

    When another process's build got there first the final rename fails; its copy stays if it holds the file
    `complete`, and this one is dropped. Only that rename's error is let go: one from `build` (a full disk, an
    I/O error) is always raised, even where a damaged `target` still holds `complete`. A failed build leaves
    nothing behind. `replace`: a `target` already there (found damaged) is renamed aside once the new copy is
    built, then deleted; readers that opened its files keep reading them.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    aside = target.with_name(f".{target.name}.damaged.{os.getpid()}")
    try:
        staging.chmod(0o755)  # mkdtemp makes it owner-only
        build(staging)
        if replace:
            try:
                os.rename(target, aside)
            except FileNotFoundError:  # another process moved it first
                pass
        try:
            os.rename(staging, target)
        except OSError:  # ENOTEMPTY / EEXIST: another process's build got there first
            if not (target / complete).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)


def record_files(directory: Path, names: list[str], digest: bool = True) -> dict[str, dict]:
    """Each file's size, and its SHA-256 when `digest`: written beside a cache, checked by `files_damage`."""
    records = {name: {"bytes": (directory / name).stat().st_size} for name in names}
    for name in names if digest else ():
        records[name]["sha256"] = file_digest(directory / name)
    return records


def files_damage(directory: Path, recorded: object) -> str | None:
    """What differs between `directory` and its `record_files` record (a file missing, cut short, other
    content), or None when every file is as recorded. A recorded digest costs one read of the file."""
    if not isinstance(recorded, dict) or not recorded:
        return "it has no record of its files"
    for name, want in recorded.items():
        path = directory / name
        if not isinstance(want, dict) or not isinstance(want.get("bytes"), int):
            return f"the record of {name} is malformed"
        if not path.is_file():
            return f"{name} is missing"
        if (size := path.stat().st_size) != want["bytes"]:
            return f"{name} has {size} bytes where {want['bytes']} were written"
        if "sha256" in want and file_digest(path) != want["sha256"]:
            return f"{name}'s content differs from what was written (SHA-256 mismatch)"
    return None


def default_cache_dir() -> Path:
    """``$PIPETUNE_CACHE``, else ``$XDG_CACHE_HOME/pipetune``, else ``~/.cache/pipetune``.

    Raises ConfigError when the variable names a file (or a path below one): no cache could be made there."""
    for variable, below in (("PIPETUNE_CACHE", ""), ("XDG_CACHE_HOME", "pipetune")):
        if os.environ.get(variable):
            value = os.environ[variable]
            _check_cache_dir(Path(value).expanduser(), variable, value)
            return Path(value).expanduser() / below if below else Path(value).expanduser()
    return Path.home() / ".cache" / "pipetune"


def _check_cache_dir(path: Path, variable: str, value: str) -> None:
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                where = "" if existing == path else f": {str(existing)!r}"
                raise ConfigError(
                    f"{variable} = {value!r}{where} is a file, not a directory; point {variable} at a directory "
                    f"for pipetune's cache (or unset it)"
                )
            return


def file_digest(path: Path, remember: bool = False) -> str:
    """SHA-256 of the file's content, read in 16 MiB blocks. `remember`: an input's identity (a data file, which
    the checkpoint settings and the token cache's key both hash; a GGUF, hashed by each resolve: ~3 s a GiB each
    time on 2 cores) is remembered for the process while the file's inode, size and modification time stay the
    same; a check for damage (verify_records) always reads the file."""
    stat = Path(path).stat()
    key = (str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if not remember or key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple[str, int, int, int], str] = {}


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


def rank_columns(columns: Iterable[str], prefix: str) -> list[str]:
    """The per-rank columns `prefix<rank>` ("peak_gb_rank", "reserved_gb_rank") among `columns`, in rank order
    (rank 10 after rank 9)."""
    ranked = {c for c in columns if c.startswith(prefix) and c.removeprefix(prefix).isdigit()}
    return sorted(ranked, key=lambda c: int(c.removeprefix(prefix)))
