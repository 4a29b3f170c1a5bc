"""Worker sizing reads cgroup v2 and v1 limits from real files."""

from __future__ import annotations

import os

from cached.node import sizing

GIB = 1 << 30


def write(root, files: dict) -> str:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_cgroup_v2_limit_caps_workers(tmp_path):
    cg = write(tmp_path / "cg", {"memory.max": str(3 * GIB), "memory.current": str(GIB // 2)})
    meminfo = write(tmp_path, {"meminfo": f"MemAvailable: {64 * GIB // 1024} kB\n"}) + "/meminfo"
    assert sizing.cgroup_memory_headroom(cg) == 3 * GIB - GIB // 2
    assert sizing.worker_count(None, GIB, cg, meminfo) == min(2, sizing.usable_cores(cg))


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    cg = write(tmp_path / "v1", {"memory/memory.limit_in_bytes": str(GIB),
                                 "memory/memory.usage_in_bytes": str(GIB // 4)})
    assert sizing.cgroup_memory_headroom(cg) == GIB - GIB // 4
    unlimited = write(tmp_path / "u", {"memory.max": "max", "memory.current": "5"})
    assert sizing.cgroup_memory_headroom(unlimited) is None


def test_tiny_memory_still_gives_one_worker_and_an_explicit_count_is_capped(tmp_path):
    cg = write(tmp_path / "cg", {"memory.max": str(GIB // 4), "memory.current": "0"})
    assert sizing.worker_count(None, GIB, cg) == 1
    assert sizing.worker_count(3, GIB, cg) == 1  # issue 16 item 17: memory caps it too
    roomy = write(tmp_path / "roomy", {"memory.max": str(8 * GIB), "memory.current": "0"})
    assert sizing.worker_count(3, GIB, roomy) == 3


def test_the_services_own_cgroup_and_its_parents_are_read(tmp_path):
    """Issue 16 item 17: under systemd the daemon runs in /system.slice/cached.service, not
    at the mount root; MemoryMax=10G there (and a tighter slice above) must be seen."""
    root = write(tmp_path / "v2", {
        "system.slice/cached.service/memory.max": str(10 * GIB),
        "system.slice/cached.service/memory.current": str(GIB),
        "system.slice/memory.max": "max", "system.slice/memory.current": str(5 * GIB),
        "system.slice/cached.service/cpu.max": "200000 100000",
    })
    proc = write(tmp_path, {"cgroup": "0::/system.slice/cached.service\n"}) + "/cgroup"
    assert sizing.own_cgroups(proc) == {"": "/system.slice/cached.service"}
    assert sizing.cgroup_memory_headroom(root, proc) == 9 * GIB
    assert sizing.usable_cores(root, proc) == min(2, len(os.sched_getaffinity(0)))
    write(tmp_path / "v2", {"system.slice/memory.max": str(7 * GIB)})  # the slice is tighter
    assert sizing.cgroup_memory_headroom(root, proc) == 2 * GIB
    assert sizing.worker_count(8, GIB, root, proc_cgroup=proc) == 2
    # cgroup v1: the memory controller's own line
    v1 = write(tmp_path / "v1", {"memory/svc/memory.limit_in_bytes": str(3 * GIB),
                                 "memory/svc/memory.usage_in_bytes": str(GIB)})
    proc1 = write(tmp_path / "p1", {"cgroup": "4:memory:/svc\n1:cpu,cpuacct:/svc\n"})
    assert sizing.cgroup_memory_headroom(v1, proc1 + "/cgroup") == 2 * GIB


def test_cpu_quota_caps_cores(tmp_path):
    cg = write(tmp_path / "cg", {"cpu.max": "100000 100000"})
    assert sizing.usable_cores(cg) == 1
