"""One run at a time per output.dir: a lock held by the launcher and its workers.

`<output.dir>/.pipetune.lock` is locked with flock(2) by the process that starts a run: the launcher
(`pipetune train` outside torchrun, which also runs a one-process run itself), or rank 0 under torchrun.
The kernel releases an flock when its process ends, however it ends, so a lock file left by a process
that was killed is taken over with a note. Workers started by a pipetune launcher find the lock's token
in their environment and in the file: they run inside their launcher's lock. The file records who
holds it (pid, host, start time) for the message that refuses a second run.

`<output.dir>/.pipetune.launch` records the launch whose worker group passed the start checks there, where the
group may be restarted (`pipetune train --max-restarts`, torchrun's): a restarted attempt continues only what
its own launch started, and checks anything else as a fresh start does.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from pipetune.config import ConfigError
from pipetune.files import write_atomic
from pipetune.parallel.process_group import restart_count

LOCK_FILE = ".pipetune.lock"
LAUNCH_FILE = ".pipetune.launch"
TOKEN_ENV = "PIPETUNE_RUN_LOCK"
"""The token of the lock this process runs inside, set by its holder for itself and its workers."""


class RunLock:
    """An flock on <run_dir>/.pipetune.lock; `release()` (or leaving the `with` block) removes the file and unlocks."""

    def __init__(self, path: Path, fd: int | None, token: str) -> None:
        self.path, self._fd, self.token = path, fd, token

    def release(self) -> None:
        if self._fd is None:
            return
        if os.environ.get(TOKEN_ENV) == self.token:
            del os.environ[TOKEN_ENV]
        self.path.unlink(missing_ok=True)  # before unlocking: a waiting process re-checks the path (see acquire)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_run_dir(run_dir: str | Path) -> RunLock:
    """Lock `run_dir` (created if missing) for this process and the workers it starts; refuse if a live run holds it."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"output.dir = {str(run_dir)!r} is a file, not a directory; choose another output.dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    token = uuid.uuid4().hex
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a directory where the lock file goes, or a directory this user cannot write
            if path.is_dir():
                raise ConfigError(
                    f"{path} is a directory, not pipetune's lock file; remove it (pipetune keeps nothing there), "
                    "or choose another output.dir"
                ) from None
            raise ConfigError(
                f"the lock file {path} cannot be opened ({e.strerror}); make output.dir writable, or choose "
                "another output.dir"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ConfigError(
                    f"output.dir = {str(run_dir)!r} is in use by another run ({_describe(holder)}); wait for it to "
                    "end, or choose another output.dir"
                ) from None
            print(
                f"pipetune: warning: output.dir = {str(run_dir)!r} cannot be locked ({e.strerror}); "
                "make sure no other run uses it",
                file=sys.stderr,
                flush=True,
            )
            return RunLock(path, None, token)
        # The holder may have removed the file between our open and our lock: then ours is a lock on nothing.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    stale = _read(fd)
    if stale:
        print(
            f"pipetune: note: taking over the lock of {str(run_dir)!r} left by {_describe(stale)}, which ended "
            "without releasing it",
            file=sys.stderr,
            flush=True,
        )
    record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "token": token}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    os.environ[TOKEN_ENV] = token
    return RunLock(path, fd, token)


def lock_for_worker(run_dir: str | Path, rank: int) -> RunLock | None:
    """In a worker: nothing when its pipetune launcher holds the lock; rank 0 takes it under torchrun."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        try:
            holder = json.loads((Path(run_dir) / LOCK_FILE).read_text())
        except (OSError, ValueError):
            holder = {}
        if isinstance(holder, dict) and holder.get("token") == token:
            return None
        raise ConfigError(
            f"output.dir = {str(run_dir)!r} is no longer locked by this worker's launcher (it ended, or another "
            "run took the directory over); this worker stops"
        )
    return lock_run_dir(run_dir) if rank == 0 else None


def launch_id() -> str | None:
    """What names this process's launch across the restarts of its worker group: the rendezvous id (a new uuid
    for each `pipetune train` and one-node torchrun; a multi-node job's --rdzv-id), else, with torchrun's
    default "none", the agent that starts the workers (host, pid, start time); None outside an elastic agent."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    if run_id not in ("", "none"):
        return f"run {run_id}"
    agent = os.getppid()
    try:  # the start time tells a new agent from an old one whose pid the system reused
        started = Path(f"/proc/{agent}/stat").read_text().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"agent {agent} on {socket.gethostname()} started at {started}"


def restarted_launch(run_dir: str | Path) -> bool:
    """Whether this is a restarted attempt of the launch whose first passing attempt `record_launch` recorded in
    run_dir: what is there is its own, to continue. Any other attempt (a first one, or a restart of a launch that
    was refused: another run's files) must pass the start checks of a fresh start."""
    if restart_count() == 0:
        return False
    try:
        recorded = json.loads((Path(run_dir) / LAUNCH_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and recorded.get("launch") is not None and recorded["launch"] == launch_id()


def record_launch(run_dir: str | Path) -> None:
    """Rank 0, once this attempt passed the start checks and before it writes anything else: record its launch,
    for `restarted_launch`. Only where the group may be restarted (torchrun's or the launcher's max_restarts > 0)."""
    launch = launch_id()
    if launch is None or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(run_dir) / LAUNCH_FILE, json.dumps({"launch": launch}).encode(), sync=True)


def _read(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {"pid": "?"}
    return data if isinstance(data, dict) else {"pid": "?"}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "a process that has not yet written its name"
    started = holder.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, float) else ""
    return f"process {holder.get('pid', '?')} on {holder.get('host', '?')}{when}"
