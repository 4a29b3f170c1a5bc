"""How many compile workers this machine can hold: cores, memory, cgroup limits.

Limits are read from this process's own cgroup (``/proc/self/cgroup``: v2's ``0::/path``,
v1's ``N:memory:/path`` and ``N:cpu,...:/path``) and every cgroup above it up to the mount
root, so ``MemoryMax=`` on the systemd service that runs the daemon is seen; the tightest
level wins.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cached.log import event

log = logging.getLogger("cached.sizing")

WORKER_BYTES = 1 << 30
"""Resident memory budgeted per worker (measured ~0.55 GiB after an mm_fp4 compile; see
docs/benchmarks.md), rounded up for compiler peaks."""

PROC_CGROUP = "/proc/self/cgroup"


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def own_cgroups(proc_cgroup: str = PROC_CGROUP) -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``""`` for v2, else each v1 controller
    (``memory``, ``cpu``, ...); paths start with ``/``."""
    out: dict[str, str] = {}
    for line in (_read(proc_cgroup) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
        for name in controllers.split(","):
            if name:
                out[name] = path
    return out


def _levels(base: Path, path: str) -> list[Path]:
    """``base/path`` and each directory above it up to ``base`` (deepest first)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    return [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def cgroup_memory_headroom(root: str = "/sys/fs/cgroup",
                           proc_cgroup: str = PROC_CGROUP) -> int | None:
    """Bytes left under the tightest memory limit of this process's cgroup or any cgroup
    above it (v2 ``memory.max``/``memory.current``, then v1 ``memory.limit_in_bytes``/
    ``memory.usage_in_bytes``); None if no level is limited."""
    own = own_cgroups(proc_cgroup)
    headrooms = []
    for level in _levels(Path(root), own.get("", "")):
        limit, current = _read(level / "memory.max"), _read(level / "memory.current")
        if limit and limit != "max" and current:
            headrooms.append(max(0, int(limit) - int(current)))
    v1 = Path(root) / "memory"
    for level in _levels(v1, own.get("memory", "")):
        limit = _read(level / "memory.limit_in_bytes")
        usage = _read(level / "memory.usage_in_bytes")
        if limit and usage and int(limit) < 1 << 60:
            headrooms.append(max(0, int(limit) - int(usage)))
    return min(headrooms) if headrooms else None


def available_memory(meminfo_path: str = "/proc/meminfo",
                     cgroup_root: str = "/sys/fs/cgroup",
                     proc_cgroup: str = PROC_CGROUP) -> int | None:
    """The tighter of MemAvailable and the cgroup headroom, in bytes."""
    candidates = []
    meminfo = _read(meminfo_path) or ""
    for line in meminfo.splitlines():
        if line.startswith("MemAvailable:"):
            candidates.append(int(line.split()[1]) * 1024)
    headroom = cgroup_memory_headroom(cgroup_root, proc_cgroup)
    if headroom is not None:
        candidates.append(headroom)
    return min(candidates) if candidates else None


def usable_cores(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = PROC_CGROUP) -> int:
    """CPUs this process may run on, reduced by the tightest CPU quota of its cgroup or any
    above it (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``)."""
    cores = len(os.sched_getaffinity(0))
    own = own_cgroups(proc_cgroup)
    for level in _levels(Path(cgroup_root), own.get("", "")):
        quota = _read(level / "cpu.max")
        if quota and not quota.startswith("max"):
            q, period = quota.split()
            cores = min(cores, max(1, int(q) // int(period)))
    for base in ("cpu", "cpu,cpuacct"):
        for level in _levels(Path(cgroup_root) / base, own.get("cpu", "")):
            q, period = _read(level / "cpu.cfs_quota_us"), _read(level / "cpu.cfs_period_us")
            if q and period and int(q) > 0 and int(period) > 0:
                cores = min(cores, max(1, int(q) // int(period)))
    return cores


def worker_count(requested: int | None = None, worker_bytes: int = WORKER_BYTES,
                 cgroup_root: str = "/sys/fs/cgroup", meminfo_path: str = "/proc/meminfo",
                 proc_cgroup: str = PROC_CGROUP) -> int:
    """One worker per usable core, or ``requested``; either way capped by memory
    (``worker_bytes`` each; an explicit count over the cap is lowered, with a warning);
    at least 1."""
    memory = available_memory(meminfo_path, cgroup_root, proc_cgroup)
    cap = None if memory is None else max(1, memory // worker_bytes)
    if requested:
        if cap is not None and requested > cap:
            event(log, logging.WARNING, "sizing.workers_capped", requested=requested,
                  workers=cap, memory_bytes=memory, worker_bytes=worker_bytes,
                  reason="each worker is budgeted this much memory and the cgroup or "
                  "machine has only that much available")
            return cap
        return requested
    count = usable_cores(cgroup_root, proc_cgroup)
    return max(1, count if cap is None else min(count, cap))
