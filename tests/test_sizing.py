"""Worker sizing reads cgroup v2 and v1 limits from real files."""

from __future__ import annotations

from cached import sizing

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


def test_tiny_memory_still_gives_one_worker_and_requested_wins(tmp_path):
    cg = write(tmp_path / "cg", {"memory.max": str(GIB // 4), "memory.current": "0"})
    assert sizing.worker_count(None, GIB, cg) == 1
    assert sizing.worker_count(3, GIB, cg) == 3


def test_cpu_quota_caps_cores(tmp_path):
    cg = write(tmp_path / "cg", {"cpu.max": "100000 100000"})
    assert sizing.usable_cores(cg) == 1
