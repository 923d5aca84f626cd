"""Writing a file so that a reader sees the old one or the whole new one, and a failure leaves no temporary file."""

from __future__ import annotations

import os
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
