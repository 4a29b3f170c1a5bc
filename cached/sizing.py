"""How many compile workers this machine can hold: cores, memory, cgroup limits."""

from __future__ import annotations

import os
from pathlib import Path

WORKER_BYTES = 1 << 30
"""Resident memory budgeted per worker (measured ~0.55 GiB after an mm_fp4 compile; see
docs/benchmarks.md), rounded up for compiler peaks."""


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cgroup_memory_headroom(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under this process's cgroup memory limit (v2, then v1); None if unlimited."""
    limit, current = _read(f"{root}/memory.max"), _read(f"{root}/memory.current")
    if limit and limit != "max" and current:
        return max(0, int(limit) - int(current))
    limit = _read(f"{root}/memory/memory.limit_in_bytes")
    usage = _read(f"{root}/memory/memory.usage_in_bytes")
    if limit and usage and int(limit) < 1 << 60:
        return max(0, int(limit) - int(usage))
    return None


def available_memory(meminfo_path: str = "/proc/meminfo",
                     cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The tighter of MemAvailable and the cgroup headroom, in bytes."""
    candidates = []
    meminfo = _read(meminfo_path) or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            candidates.append(int(line.split()[1]) * 1024)
    headroom = cgroup_memory_headroom(cgroup_root)
    if headroom is not None:
        candidates.append(headroom)
    return min(candidates) if candidates else None


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may run on, reduced by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0))
    quota = _read(f"{cgroup_root}/cpu.max")
    if quota and not quota.startswith("max"):
        q, period = quota.split()
        cores = min(cores, max(1, int(q) // int(period)))
    return cores


def worker_count(requested: int | None = None, worker_bytes: int = WORKER_BYTES,
                 cgroup_root: str = "/sys/fs/cgroup", meminfo_path: str = "/proc/meminfo") -> int:
    """``requested`` if given, else one per usable core, capped by memory; at least 1."""
    if requested:
        return requested
    count = usable_cores(cgroup_root)
    memory = available_memory(meminfo_path, cgroup_root)
    if memory is not None:
        count = min(count, memory // worker_bytes)
    return max(1, count)
