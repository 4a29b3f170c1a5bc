"""Every JIT kernel a vLLM worker builds, compiled once per node (issue 15), with real compiles:
Triton's vector add (``triton.compile`` for sm_90), Humming's ``pack_weight_kernel<4>``
(NVRTC, sm_90a, through Humming's own runtime class) and FlashInfer's ``silu_and_mul`` nvcc
module (sm_90a), each in real processes of two real environments against a real daemon
(tests/jit_harness.py says what stands in for the GPU and driver these machines lack).

For each library: four processes miss the same kernel at once, one compiles and the others
load its artifact; a fifth process after a daemon restart compiles nothing; a tampered
artifact is refused and rebuilt; a process of another environment (toolchain) never
receives it."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import DaemonProcess
from jit_harness import JIT, VLLM, run_together

from cached.config import size_text

pytestmark = pytest.mark.skipif(not (JIT / "triton").is_dir() or not Path(VLLM).exists(),
                                reason="make setup-jit and setup-vllm install the JIT libraries")

BARE = ["--toolchain", f"bare={sys._base_executable}"]  # write-back needs no compiler
MAIN_FILE = {"triton": "add_kernel.cubin", "humming": "kernel_tmp.cubin",
             "flashinfer.nvcc": "silu_and_mul.so"}


def _files(store: Path, key: str) -> dict[str, dict]:
    """A stored bundle's manifest, as the index on disk holds it."""
    db = sqlite3.connect(f"file:{store / 'index.sqlite'}?mode=ro", uri=True)
    try:
        (files,) = db.execute("SELECT files FROM entries WHERE key = ?", [key]).fetchone()
    finally:
        db.close()
    return json.loads(files)


def _tamper(store: Path, key: str, name: str) -> Path:
    """Flip one byte of a stored bundle file (as a disk fault or an intruder would)."""
    f = _files(store, key)[name]
    path = store / "blobs" / f["sha256"][:2] / (f["sha256"] + os.path.splitext(name)[1])
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def _entries(d: DaemonProcess, family: str) -> list[dict]:
    return [e for e in d.client(timeout=30).list() if e["family"] == family]


def _shown_as_its_own_family(d: DaemonProcess, family: str, fam: dict) -> None:
    """/metrics, the status page and ``cached stats`` each show the family's row."""
    http = d.stats()["http"]
    with urllib.request.urlopen(f"http://{http}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    for metric, value in (("cached_hits_total", 3), ("cached_misses_total", 1),
                          ("cached_compiles_avoided_total", 3), ("cached_published_total", 1),
                          ("cached_served_bytes_total", fam["bytes_served"])):
        assert f'{metric}{{family="{family}"}} {float(value)}' in metrics, metric
    with urllib.request.urlopen(f"http://{http}/", timeout=10) as r:
        page = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", r.read().decode()))
    served = size_text(fam["bytes_served"])
    assert f"{family} 3 1 75.0% 0 0 - 1 3 {served} 0" in page
    text = subprocess.run([sys.executable, "-m", "cached", "stats", "--socket", d.socket],
                          capture_output=True, text=True, check=True).stdout
    assert re.search(rf"^{re.escape(family)} +3 +1 +75\.00% +0 +0 +- +1 +3 +{served} +0$",
                     text, re.M), text


def scenario(family: str, tmp_path: Path) -> dict[str, list[dict]]:
    """The four steps for one library; returns each step's process results for the
    library-specific checks. The daemon's counters are checked here."""
    store = tmp_path / "store"
    d = DaemonProcess(tmp_path, workers=1, extra_args=BARE)
    try:
        four = run_together(family, d.socket, [tmp_path / f"p{i}" for i in range(4)])
        assert sorted(json.dumps(r["stats"]) for r in four) == [
            '{"compiled": 1}', '{"hit": 1}', '{"hit": 1}', '{"hit": 1}'], four
        fam = d.stats()["families"][family]
        assert (fam["misses"], fam["hits"], fam["compiles_avoided"], fam["published"]) == \
            (1, 3, 3, 1), fam
        assert fam["bytes_served"] == 3 * fam["bytes_published"] > 0
        _shown_as_its_own_family(d, family, fam)
        (entry,) = _entries(d, family)
        assert entry["kind"] == "bundle" and entry["arch"] == "sm_90a"
    finally:
        d.stop()
    d = DaemonProcess(tmp_path, workers=1, extra_args=BARE)  # a restart, the same store
    try:
        fifth = run_together(family, d.socket, [tmp_path / "p5"])
        assert fifth[0]["stats"] == {"hit": 1}, fifth

        tampered = _tamper(store, entry["key"], MAIN_FILE[family])
        sixth = run_together(family, d.socket, [tmp_path / "p6"])
        assert sixth[0]["stats"] == {"compiled": 1}, sixth  # refused by the daemon, rebuilt
        assert '"event": "store.entry_dropped"' in d.log() and entry["key"][:16] in d.log()
        rebuilt = _files(store, entry["key"])[MAIN_FILE[family]]  # stored again, whole
        path = store / "blobs" / rebuilt["sha256"][:2] / (rebuilt["sha256"] + tampered.suffix)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == rebuilt["sha256"]

        other = run_together(family, d.socket, [tmp_path / "p7"], python=VLLM)
        assert other[0]["stats"] == {"compiled": 1}, other  # never the first environment's
        rows = _entries(d, family)
        assert len(rows) == 2 and len({r["toolchain"] for r in rows}) == 2
        fam = d.stats()["families"][family]
        assert (fam["hits"], fam["misses"], fam["published"]) == (1, 2, 2), fam
    finally:
        d.stop()
    return {"four": four, "fifth": fifth, "sixth": sixth, "other": other, "rows": rows}


def test_triton_kernels_compile_once_per_node(tmp_path):
    out = scenario("triton", tmp_path)
    # Triton's own listener: a cache miss in the one process that compiled, hits elsewhere
    assert sorted(r["triton_cache_hit"] for r in out["four"]) == [[False], [True], [True],
                                                                  [True]]
    assert out["fifth"][0]["triton_cache_hit"] == [True]
    assert len({r["hash"] for r in out["four"] + out["fifth"] + out["other"]}) == 1
    # the same Triton, the same kernel: only the toolchain keeps the environments apart
    a, b = out["rows"]
    assert a["params"] == b["params"] and a["toolchain"] != b["toolchain"]


def test_humming_cubins_compile_once_per_node(tmp_path):
    out = scenario("humming", tmp_path)
    results = out["four"] + out["fifth"] + out["sixth"] + out["other"]
    assert {r["names"][0] for r in results} == {"_Z18pack_weight_kernelILj4EEvPKjPjx"}
    # Humming post-processed and named the cubin itself, in every process
    assert len({r["cubin_sha256"] for r in results}) == 1
    assert all(r["cubin"].endswith("/kernel.cubin") for r in results)
    a, b = out["rows"]
    assert a["params"] == b["params"] and a["toolchain"] != b["toolchain"]


def test_flashinfer_nvcc_modules_compile_once_per_node_and_aot_wins(tmp_path):
    out = scenario("flashinfer.nvcc", tmp_path)
    results = out["four"] + out["fifth"] + out["sixth"] + out["other"]
    assert all(r["has_fn"] for r in results)  # TVM-FFI loaded the module: its function is there
    built = [r["built_here"] for r in out["four"]]
    assert sorted(built) == [False, False, False, True]  # only the compiler has a build of its own
    assert out["fifth"][0]["built_here"] is False and out["sixth"][0]["built_here"] is True

    # FlashInfer's prebuilt (AOT) module wins: the daemon is not asked
    aot = tmp_path / "aot" / "silu_and_mul"
    aot.mkdir(parents=True)
    shutil.copy(out["sixth"][0]["so"], aot / "silu_and_mul.so")
    d = DaemonProcess(tmp_path, workers=1, extra_args=BARE)
    try:
        before = d.stats()["families"]["flashinfer.nvcc"]
        (r,) = run_together("flashinfer.nvcc", d.socket, [tmp_path / "p8"],
                            AOT_DIR=str(aot.parent))
        assert r["stats"] == {"aot": 1} and r["has_fn"] and not r["built_here"]
        assert d.stats()["families"]["flashinfer.nvcc"] == before
    finally:
        d.stop()


PLUGIN = """
import json, logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
from importlib.metadata import entry_points
plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
plugins["cached"].load()()          # what vllm.plugins.load_general_plugins() does
out = {k: os.environ.get(k) for k in ("TRITON_CACHE_MANAGER", "TRITON_REMOTE_CACHE_BACKEND")}
from cached_client.integrations.jit import humming as ch
out["humming_before"] = ch.HummingHook.current() is not None
if sys.argv[1:] == ["compile"]:     # a worker's first Triton kernel, and Humming imported
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def scale(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

    triton.compile(ASTSource(fn=scale, signature={"x_ptr": "*fp32", "n": "i32",
                             "BLOCK": "constexpr"}, constexprs={"BLOCK": 256}),
                   target=GPUTarget("cuda", 90, 32))
    from cached_client.integrations.jit import triton as ct
    out["triton"] = ct.stats()
    import humming.jit.compiler     # the hook attaches now
    out["humming_after"] = ch.HummingHook.current() is not None
print("RESULT " + json.dumps(out))
"""


def test_the_vllm_plugin_routes_triton_and_humming_when_a_daemon_is_live(tmp_path):
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN)
    ours = {"TRITON_CACHE_MANAGER": "triton.runtime.cache:RemoteCacheManager",
            "TRITON_REMOTE_CACHE_BACKEND": "cached_client.integrations.jit.triton:DaemonBackend"}

    def run(sock: str, *args: str, **extra: str) -> dict:
        from jit_harness import environment

        env = environment("plain", sock, tmp_path / "w", **extra)
        env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton-{len(os.listdir(tmp_path))}")
        if not sock:
            env.pop("CACHED_SOCKET")
        proc = subprocess.run([sys.executable, str(script), *args], capture_output=True,
                              text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line[7:]) | {"log": proc.stderr}

    d = DaemonProcess(tmp_path, workers=1, extra_args=BARE)
    try:
        first, second = run(d.socket, "compile"), run(d.socket, "compile")
        mine = run(d.socket, TRITON_REMOTE_CACHE_BACKEND="mypkg:MyBackend")
    finally:
        d.stop()
    for r in (first, second):
        assert {k: r[k] for k in ours} == ours
        assert r["humming_before"] is False and r["humming_after"] is True
        assert "Triton kernels from the daemon (TRITON_REMOTE_CACHE_BACKEND set)" in r["log"]
    assert (first["triton"], second["triton"]) == ({"compiled": 1}, {"hit": 1})
    # a backend the user chose stays, and the line says so
    assert mine["TRITON_REMOTE_CACHE_BACKEND"] == "mypkg:MyBackend"
    assert mine["TRITON_CACHE_MANAGER"] is None
    assert "Triton keeps the cache chosen in its environment" in mine["log"]
    # no daemon: nothing selected
    alone = run("")
    assert {k: alone[k] for k in ours} == dict.fromkeys(ours)
