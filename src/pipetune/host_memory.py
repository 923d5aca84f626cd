"""The host memory this process may use, and what of it is free now: the machine's, bounded by its cgroup's limit.

/proc/meminfo is the machine's even inside a container: a container's MemAvailable counts memory that its cgroup's
limit does not let it have, and the kernel's OOM killer ends a process whose cgroup passes its limit, whatever
MemAvailable says. So the total is the smaller of MemTotal and the cgroup's limit, and what is available now the
smaller of MemAvailable and what the limit leaves: the limit less the cgroup's working set (its usage less the
inactive file cache, which the kernel reclaims before it kills: the figure kubelet's eviction watches). Both cgroup
hierarchies are read, v2 (memory.max, memory.current) and v1 (memory.limit_in_bytes, memory.usage_in_bytes), at
this process's own cgroup (/proc/self/cgroup) and each above it up to the mount: a limit set on a parent binds its
children. In a container without a cgroup namespace, /proc/self/cgroup names the host's path, which the container's
mount does not have: then its root, the container's cgroup, is read. Every reader takes a root ("/") under which
/proc and /sys are found.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

V1_UNLIMITED = 2**60
"""cgroup v1 writes "no limit" as the largest page-aligned 64-bit number (9223372036854771712): a limit from here up
is none."""
V2_FILES = ("memory.max", "memory.current", "inactive_file")
V1_FILES = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
"""A hierarchy's limit file, usage file and memory.stat's line of inactive file cache (v1's total_: its subtree's)."""


@dataclass(frozen=True)
class HostMemory:
    """This process's host memory, in bytes: the machine's (/proc/meminfo) and its cgroup's, where a limit is set."""

    meminfo_total: float
    """MemTotal: the machine's physical memory less what the kernel reserves (sysconf's figure where there is no
    /proc)."""
    meminfo_available: float
    """MemAvailable: what the machine can give processes now without swapping (MemTotal where unreadable)."""
    cgroup_limit: float | None = None
    """The smallest limit of this process's cgroup and those above it; None where none is set."""
    cgroup_left: float | None = None
    """What those limits leave now: the least, over the limited cgroups, of the limit less the working set."""

    @property
    def total(self) -> float:
        """The memory this process may use: the machine's, or its cgroup's limit where that is less."""
        return self.meminfo_total if self.cgroup_limit is None else min(self.meminfo_total, self.cgroup_limit)

    @property
    def available(self) -> float:
        """The memory processes here may still take: MemAvailable, or what the cgroup leaves where that is less."""
        return self.meminfo_available if self.cgroup_left is None else min(self.meminfo_available, self.cgroup_left)

    @property
    def cgroup_bound(self) -> bool:
        """Whether the cgroup, not the machine, sets `available`."""
        return self.cgroup_left is not None and self.cgroup_left < self.meminfo_available


def read_host_memory(root: str | Path = "/") -> HostMemory:
    """This process's host memory now, read under `root`."""
    root = Path(root)
    total, available = _meminfo(root)
    limit, left = _cgroup_room(root)
    return HostMemory(total, available, limit, left)


def total_host_memory(root: str | Path = "/") -> float:
    """The memory this process may use, in bytes: the machine's, or its cgroup's limit where less (0: unknown)."""
    return read_host_memory(root).total


def oom_kills(root: str | Path = "/") -> int | None:
    """The processes the kernel's OOM killer has ended in this process's cgroup and those below it (the `oom_kill`
    line of v2's memory.events, or of v1's memory.oom_control), at the nearest of its cgroups that counts them; None
    where none does. A launcher reads it before and after a worker dies: a rise means the kernel killed it."""
    for (mount, own), name in zip(_hierarchies(Path(root)), ("memory.events", "memory.oom_control"), strict=True):
        for directory in _levels(mount, own):
            if (count := _keyed(directory / name, "oom_kill")) is not None:
                return int(count)
    return None


def _meminfo(root: Path) -> tuple[float, float]:
    fields: dict[str, float] = {}
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = float(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    total = fields.get("MemTotal") or _sysconf_memory()
    return total, fields.get("MemAvailable", total)


def _sysconf_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def _cgroup_room(root: Path) -> tuple[float | None, float | None]:
    """The smallest cgroup limit over this process's cgroups and those above them, in both hierarchies, and the
    least that any of them leaves; (None, None) where none sets a limit."""
    rooms = [
        room
        for (mount, own), files in zip(_hierarchies(root), (V2_FILES, V1_FILES), strict=True)
        for directory in _levels(mount, own)
        if (room := _room(directory, *files))
    ]
    if not rooms:
        return None, None
    return min(limit for limit, _ in rooms), max(0.0, min(left for _, left in rooms))


def _hierarchies(root: Path) -> tuple[tuple[Path, str], tuple[Path, str]]:
    """(mount, this process's cgroup in it) for cgroup v2's hierarchy, then v1's memory hierarchy."""
    v2, v1 = _own_cgroups(root)
    return (root / "sys/fs/cgroup", v2), (root / "sys/fs/cgroup/memory", v1)


def _own_cgroups(root: Path) -> tuple[str, str]:
    """This process's cgroup in the v2 hierarchy and in v1's memory hierarchy ("/" where not said)."""
    v2 = v1 = "/"
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        parts = line.split(":", 2)  # hierarchy-ID:controllers:path; v2's controllers are empty
        if len(parts) == 3 and parts[1] == "":
            v2 = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _levels(mount: Path, own: str) -> list[Path]:
    """The directories under `mount` of cgroup `own` and of each cgroup above it, those that exist."""
    parts = PurePosixPath(own).parts[1:]
    if ".." in parts:  # a cgroup outside this namespace's root: only the root is ours to read
        parts = ()
    directories = (mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1))
    return [directory for directory in directories if directory.is_dir()]


def _room(directory: Path, limit_file: str, usage_file: str, inactive_line: str) -> tuple[float, float] | None:
    """A cgroup's limit and what it leaves (the limit less the usage less the inactive file cache), or None where
    it sets no limit."""
    limit = _read_bytes(directory / limit_file)
    if limit is None or limit >= V1_UNLIMITED:
        return None
    usage = _read_bytes(directory / usage_file) or 0.0
    inactive = _keyed(directory / "memory.stat", inactive_line) or 0.0
    return limit, limit - max(0.0, usage - inactive)


def _keyed(path: Path, key: str) -> float | None:
    """The number on `path`'s line "KEY N" (memory.stat, memory.events, memory.oom_control); None where absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return float(value)
    return None


def _read_bytes(path: Path) -> float | None:
    """A cgroup file's number of bytes; None where it is absent or says "max" (v2's no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return float(text) if text.isdigit() else None
