"""One daemon, every inference environment of the node (issue 11), with real environments:
``.venv`` (FlashInfer 0.7.4, DSL 4.8.1, TVM-FFI 0.1.15) and ``.venv-vllm`` (vLLM 0.33.0's
pins: FlashInfer 0.7.2.post1, DSL 4.8.0, TVM-FFI 0.1.11; ``make setup-vllm``), real
compiles (CUTE_DSL_ARCH=sm_100a), real processes of each environment.

The client states its identity (cached_client.identity), the daemon compiles a miss with
the registered toolchain that matches it, and serves an artifact only to requests whose key
(built from the identity) matches."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cached_client import KernelRequest
from conftest import ROOT, DaemonProcess, fault, raw_call, run_cli, wait_for

pytest.importorskip("flashinfer")

MAIN = sys.executable
VLLM = str(ROOT / ".venv-vllm" / "bin" / "python")
ENV = {"CUTE_DSL_ARCH": "sm_100a", "CACHED_SM_COUNT": "148"}


def _mm_fp4(tile: list, swap_ab: bool, l2: str | None) -> KernelRequest:
    return KernelRequest("flashinfer.mm_fp4", {
        "sf_vec_size": 16, "mma_tiler_mn": tile, "cluster_shape_mn": [1, 1],
        "swap_ab": swap_ab, "use_prefetch": False, "kernel_type": "sm100",
        "use_tma_store": None, "enable_pdl": True, "out_dtype": "bfloat16",
        "per_token_alpha": None, "l2_policy": l2}, "sm_100a", 148, 148)


# A is the tactic the FlashInfer scripts below compile through FlashInfer's own path
TACTICS = [_mm_fp4([128, 64], False, "b_ef"), _mm_fp4([128, 32], True, None)]

# a process of one environment: asks for kernels with this environment's identity
GET = """
import json, sys
from cached_client import Client, KernelRequest, identity
client = Client(sys.argv[1], timeout=600, fallback=False)
out = []
for wire in json.loads(sys.argv[2]):
    try:
        a = client.get(KernelRequest.from_wire(wire))
        out.append({"key": a.key, "origin": a.origin, "toolchain": a.toolchain,
                    "source_sha256": a.source_sha256})
    except Exception as exc:  # the typed error, for the test to check
        out.append({"error": getattr(exc, "code", type(exc).__name__), "message": str(exc)})
print("RESULT " + json.dumps({"toolchain": identity.toolchain(), "python": sys.executable,
                              "results": out}))
"""

# FlashInfer's own build_and_load_cute_dsl_kernel for tactic A (works on 0.7.2.post1 and 0.7.4);
# compile_fn is counted so "compiled nothing here" is observable
MM_FP4 = """
import json, os, sys
import cutlass, torch
from flashinfer.gemm.gemm_mm_fp4_cute_dsl import (
    _blockscaled_gemm_cache_key_files, _blockscaled_kernel_disk_name,
    _make_blockscaled_gemm_compile_fn, _mm_fp4_cache_key)
from flashinfer.gemm.kernels.dense_blockscaled_gemm_sm100 import (
    Sm100BlockScaledPersistentDenseGemmKernel)
from flashinfer.jit.cute_dsl_core import (JitSpecCuteDsl, _hash_source_files,
                                          build_and_load_cute_dsl_kernel)
MODE = sys.argv[1]
if MODE == "client":
    from cached_client.integrations.flashinfer import cute_dsl as cf
    cf.install(os.environ["CACHED_SOCKET"])
tactic = ((128, 64), (1, 1), False, False, "sm100", None)
name = _blockscaled_kernel_disk_name(
    _mm_fp4_cache_key(16, tactic, True, torch.bfloat16, None, "b_ef"), 1, 148)
gemm = Sm100BlockScaledPersistentDenseGemmKernel(16, (128, 64), (1, 1), False, True, None,
                                                 b_l2_evict_first=True)
inner = _make_blockscaled_gemm_compile_fn(
    gemm, ab_cutlass_dtype=cutlass.Uint8, sf_dtype=cutlass.Float8E4M3FN,
    c_cutlass_dtype=cutlass.BFloat16, ab_assumed_align=32, swap_ab=False,
    sf_m=2, sf_n=8, sf_k=112, batch_size=1, max_active_clusters=148)
calls = []
def compile_fn():
    calls.append(1)
    return inner()
out = {"name": name}
if MODE == "plain":
    spec = JitSpecCuteDsl("mm_fp4", name, compile_fn,
                          _hash_source_files(_blockscaled_gemm_cache_key_files()))
    out["is_compiled"] = spec.is_compiled
    fn = spec.try_load()
    out["try_load"] = type(fn).__name__ if fn is not None else None
else:
    fn = build_and_load_cute_dsl_kernel("mm_fp4", name, compile_fn,
                                        extra_key_files=_blockscaled_gemm_cache_key_files())
    out["fn"] = type(fn).__name__
    out["stats"] = cf.stats()
out["compiles_here"] = len(calls)
print("RESULT " + json.dumps(out))
"""

# a FlashInfer kernel the daemon has no recipe for (written back), in either version
NORM = """
import importlib, json, os
from cached_client.integrations.flashinfer import cute_dsl as cf
cf.install(os.environ["CACHED_SOCKET"])
r = importlib.import_module("flashinfer.norm.kernels.rmsnorm_sigmoid_gate")
fn = r._get_compiled(8, 8 * r.HEAD_DIM, 8 * r.HEAD_DIM, 32, 4, 1)
print("RESULT " + json.dumps({"fn": type(fn).__name__, "stats": cf.stats()}), flush=True)
"""


def _env(python: str, sock: str, fi_base: Path | None = None, **extra: str) -> dict:
    """A process of the environment of ``python``: the client package only (an inference
    environment has no daemon package), FlashInfer's cache where the test says."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ENV, PYTHONPATH=str(ROOT / "client"), CACHED_SOCKET=sock, **extra)
    if fi_base is not None:
        env["FLASHINFER_WORKSPACE_BASE"] = str(fi_base)
    return env


def _result(proc: subprocess.CompletedProcess) -> dict:
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"no result: rc={proc.returncode}\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")


def _run(python: str, script: str, *args: str, env: dict) -> dict:
    return _result(subprocess.run([python, "-c", script, *args], capture_output=True, text=True,
                                  env=env, timeout=600))


def _spawn(python: str, script: str, *args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([python, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    return _result(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))


def _wires(requests: list[KernelRequest]) -> str:
    return json.dumps([r.to_wire() for r in requests])


def _rows(d: DaemonProcess) -> dict[str, dict]:
    return {a["key"]: a for a in d.client(timeout=30).flashinfer_artifacts().artifacts}


@pytest.fixture(scope="module")
def vllm_env() -> str:
    assert os.access(VLLM, os.X_OK), f"{VLLM} is missing: make setup-vllm builds it"
    return VLLM


@pytest.fixture(scope="module")
def two(tmp_path_factory, vllm_env):
    """One daemon, both environments registered (main is the default), a worker each."""
    d = DaemonProcess(tmp_path_factory.mktemp("two"), workers=2, extra_env=ENV,
                      extra_args=["--toolchain", f"main={MAIN}", "--toolchain",
                                  f"vllm={vllm_env}"])
    yield d
    d.stop()


def _toolchains(d: DaemonProcess) -> dict[str, dict]:
    return {t["name"]: t for t in d.client(timeout=30).hello().toolchains}


def test_fingerprint_ignores_install_paths_and_how_pip_was_called(vllm_env):
    """torch 2.13.0+cpu, one wheel installed into both environments by two pip runs at two
    paths: FlashInfer 0.7.4's RECORD hash differs (console-script shebangs, REQUESTED),
    ours is equal; the stacks that do differ (DSL 4.8.0/4.8.1, TVM-FFI) differ."""
    script = """
import hashlib, json, importlib.metadata as md
from cached_client import identity
d = md.distribution("torch")
fi = hashlib.sha256(json.dumps([d.read_text("RECORD"), d.read_text("direct_url.json")])
                    .encode()).hexdigest()
print("RESULT " + json.dumps({"ours": identity.dist_component(identity.distributions()["torch"]),
                              "flashinfer_rule": fi, "toolchain": identity.toolchain()}))
"""
    main = _run(MAIN, script, env=_env(MAIN, "/nonexistent"))
    vllm = _run(vllm_env, script, env=_env(vllm_env, "/nonexistent"))
    assert main["ours"] == vllm["ours"] and main["ours"].startswith("torch==2.13.0+cpu:")
    assert main["flashinfer_rule"] != vllm["flashinfer_rule"]
    assert main["toolchain"] != vllm["toolchain"]


def test_a_carried_runtime_library_has_the_identity_of_the_installed_one(tmp_path):
    """A GPU node's process without the DSL carries libcute_dsl_runtime.so and names it in
    $CACHED_DSL_RUNTIME: its runtime identity hashes that file, and equals the installed
    library's (read from RECORD without hashing the file) when the bytes are the same."""
    from cached_client.loader import installed_runtime_libraries

    installed = installed_runtime_libraries("libcute_dsl_runtime.so")[0]
    carried = tmp_path / "bare" / "libcute_dsl_runtime.so"
    carried.parent.mkdir()
    carried.write_bytes(Path(installed).read_bytes())
    script = ("import json; from cached_client import identity; "
              "print('RESULT ' + json.dumps(identity.runtime()))")
    own = _run(MAIN, script, env=_env(MAIN, "/x"))
    bare = _run(MAIN, script, env=_env(MAIN, "/x", CACHED_DSL_RUNTIME=str(carried)))
    assert own == bare
    assert own["dsl_runtime_sha256"] == hashlib.sha256(carried.read_bytes()).hexdigest()
    carried.write_bytes(carried.read_bytes() + b"\0")  # another build of the library
    other = _run(MAIN, script, env=_env(MAIN, "/x", CACHED_DSL_RUNTIME=str(carried)))
    assert other["dsl_runtime_sha256"] != own["dsl_runtime_sha256"]


def test_each_environment_compiles_with_its_own_interpreter_and_never_gets_the_others(two,
                                                                                     vllm_env):
    """Four processes of each environment at once ask for the same two mm_fp4 tactics: each
    kernel is compiled once per environment, by that environment's interpreter (its worker),
    and the same request from the two environments never returns the same artifact."""
    tcs = _toolchains(two)
    assert tcs["vllm"]["versions"]["flashinfer-python"] == "0.7.2.post1"
    assert tcs["main"]["versions"]["flashinfer-python"] == "0.7.4"
    procs = [(py, _spawn(py, GET, two.socket, _wires(TACTICS), env=_env(py, two.socket)))
             for _ in range(4) for py in (MAIN, vllm_env)]
    results = [(py, _finish(p)) for py, p in procs]
    by_env: dict[str, set] = {MAIN: set(), vllm_env: set()}
    for py, res in results:
        name = "main" if py == MAIN else "vllm"
        assert res["toolchain"] == tcs[name]["fingerprint"]  # the probe is the client's code
        assert all("key" in r for r in res["results"]), res
        by_env[py].add(tuple(r["key"] for r in res["results"]))
    assert len(by_env[MAIN]) == len(by_env[vllm_env]) == 1  # 4 processes, one artifact each
    main_keys, vllm_keys = by_env[MAIN].pop(), by_env[vllm_env].pop()
    assert not set(main_keys) & set(vllm_keys)
    stats = two.stats()
    assert stats["compiles"] == 4 and stats["failures"] == 0
    rows = _rows(two)
    for keys, name, python in ((main_keys, "main", MAIN), (vllm_keys, "vllm", vllm_env)):
        for key in keys:
            assert rows[key]["toolchain"] == tcs[name]["fingerprint"]
            assert rows[key]["source_sha256"] == tcs[name]["sources"]["flashinfer.mm_fp4"]
            assert rows[key]["meta"]["compiled_by"] == {"toolchain": name, "python": python}


def test_a_workers_interpreter_is_its_environments_and_imports_none_of_the_daemons_deps(
        two, vllm_env):
    """The project's own families are routed by the client's toolchain, else its runtime
    (TVM-FFI and DSL runtime library); no match is toolchain_mismatch naming both."""
    tcs = _toolchains(two)

    def introspect(identity: dict | None, tag: str) -> dict:
        message = {"op": "get", "request": fault("introspect", tag).to_wire()}
        if identity is not None:
            message["identity"] = identity
        return raw_call(two.socket, message, timeout=120)

    for name, python in (("main", MAIN), ("vllm", vllm_env)):
        t = tcs[name]
        reply = introspect({"toolchain": t["fingerprint"], "runtime": t["runtime"]}, name)
        assert reply["error"]["code"] == "compile_failed"
        text = reply["error"]["message"]
        seen, _ = json.JSONDecoder().raw_decode(text[text.index("introspect {") + 11:])
        assert seen == {"python": python, "daemon_modules": []}
    # another environment whose runtime is vllm's (TVM-FFI 0.1.11, same DSL runtime bytes)
    reply = introspect({"toolchain": "elsewhere", "runtime": tcs["vllm"]["runtime"]}, "rt")
    assert vllm_env in reply["error"]["message"]
    alien = {"tvm_ffi": "0.0.1", "dsl_runtime_sha256": "0" * 64, "dsl": "9.9"}
    reply = introspect({"toolchain": "elsewhere", "runtime": alien}, "alien")
    assert reply["error"]["code"] == "toolchain_mismatch"
    assert "TVM-FFI 0.0.1" in reply["error"]["message"]
    assert "TVM-FFI 0.1.15" in reply["error"]["message"]
    assert "TVM-FFI 0.1.11" in reply["error"]["message"]
    # the vLLM environment has none of the daemon's own store dependency to import (uvicorn
    # is there as vLLM's own: `vllm serve` needs it)
    missing = subprocess.run([vllm_env, "-c", "import importlib.util as u; print([m for m in "
                              "('sqlite_utils',) if u.find_spec(m)])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert missing == "[]"


def test_one_worker_budget_is_shared_by_the_toolchains(tmp_path, vllm_env):
    """With one worker for two toolchains, the worker goes where the work is: an idle
    worker of a toolchain nobody waits for is retired for the one that has a job."""
    d = DaemonProcess(tmp_path, workers=1, extra_env=ENV,
                      extra_args=["--toolchain", f"main={MAIN}", "--toolchain",
                                  f"vllm={vllm_env}"])
    try:
        tcs = _toolchains(d)
        for name, python in (("vllm", vllm_env), ("main", MAIN), ("vllm", vllm_env)):
            t = tcs[name]
            reply = raw_call(d.socket, {"op": "get", "request": fault("introspect", name).to_wire(),
                                        "identity": {"toolchain": t["fingerprint"],
                                                     "runtime": t["runtime"]}}, timeout=300)
            assert f'"python": "{python}"' in reply["error"]["message"]
            workers = {t["name"]: t["workers"] for t in d.stats()["toolchains"]}
            assert sum(w["alive"] for w in workers.values()) == 1
            assert workers[name]["alive"] == 1
        # the vLLM environment's worker dies with the daemon, as every worker does
        pids = d.worker_pids()
        argv = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
        assert len(pids) == 1 and argv[0].decode() == vllm_env
        d.kill9()
        wait_for(lambda: not os.path.exists(f"/proc/{pids[0]}"), 30)
    finally:
        d.stop()


def test_flashinfer_0_7_2_hook_gets_its_kernel_and_export_writes_meta_it_accepts(two, vllm_env,
                                                                                 tmp_path):
    """vLLM 0.33.0's FlashInfer (no batch-invariant modules, no TVM-FFI export switch): the
    hook installs, its mm_fp4 kernel comes from the daemon; ``cached export --python`` writes
    the meta this FlashInfer accepts (its own cute_dsl_version rule and source hash), and a
    process of it without the client loads the kernel from its own disk cache."""
    got = _run(vllm_env, MM_FP4, "client", env=_env(vllm_env, two.socket, tmp_path / "fi"))
    assert got["fn"] == "Function" and got["compiles_here"] == 0
    assert got["stats"] == {"daemon": 1}
    _run(MAIN, GET, two.socket, _wires(TACTICS[:1]), env=_env(MAIN, two.socket))  # main's too
    base = tmp_path / "plain"
    out = subprocess.run(
        [MAIN, "-m", "cached", "export", "--socket", two.socket, "--python", vllm_env,
         "--family", "flashinfer.mm_fp4", "--json"], capture_output=True, text=True,
        env={**os.environ, "FLASHINFER_WORKSPACE_BASE": str(base)}, timeout=600)
    report = json.loads(out.stdout)
    assert report["written"] >= 1 and report["python"] == vllm_env
    assert any("another toolchain" in r for r in report["reasons"])  # main's, not exported
    assert ".venv-vllm" not in report["target"] and "0.7.2.post1" in report["target"]
    plain = _run(vllm_env, MM_FP4, "plain", env=_env(vllm_env, "/nonexistent", base))
    assert plain == {"name": got["name"], "is_compiled": True, "try_load": "Function",
                     "compiles_here": 0}
    meta = json.loads((Path(report["target"]) / "mm_fp4_sm100a_cute_dsl" / "meta.json")
                      .read_text())
    assert meta["cute_dsl_version"].startswith("nvidia-cutlass-dsl")  # 0.7.2's own rule


def test_vllm_0_33_loads_the_plugin_and_the_hook_installs_on_its_flashinfer(two, vllm_env):
    """vLLM 0.33.0's own plugin loader in its environment installs the FlashInfer hook (when
    FlashInfer is first imported); what
    FlashInfer 0.7.2.post1 lacks (batch-invariant GEMMs) is skipped with one log line."""
    script = """
import json, logging
logging.basicConfig(level=logging.INFO)
from vllm.plugins import load_general_plugins
load_general_plugins()
from cached_client.integrations.flashinfer import cute_dsl as cf
before = cf.installed()
import flashinfer  # noqa: F401 -- the plugin's hooks attach at FlashInfer's first import
print("RESULT " + json.dumps({"before": before, "installed": cf.installed()}))
"""
    proc = subprocess.run([vllm_env, "-c", script], capture_output=True, text=True,
                          env=_env(vllm_env, two.socket), timeout=600)
    assert _result(proc) == {"before": False, "installed": True}
    assert proc.stderr.count("has no batch-invariant GEMMs") == 1
    assert "plugin not installed" not in proc.stderr


def test_warm_for_a_registered_toolchain_compiles_with_its_interpreter(two, vllm_env):
    """``cached warm --toolchain vllm`` plans with the vLLM environment's FlashInfer and
    compiles under its identity (what its processes then hit)."""
    out = run_cli("warm", "--socket", two.socket, "--toolchain", "vllm", "--family",
                  "flashinfer.mm_fp4", "--arch", "sm_100a", "--shape", "8,4096,4096",
                  "--limit", "1", "--json")
    counts = json.loads(out.stdout)
    assert counts["failed"] == 0 and counts["compiled"] + counts["cached"] == 1
    from cached_client import protocol as p

    t = _toolchains(two)["vllm"]
    as_vllm = p.Identity(toolchain=t["fingerprint"], sources=t["sources"], runtime=t["runtime"])
    planned = two.client(timeout=120, identity=as_vllm).plan(
        "flashinfer.mm_fp4", (8, 4096, 4096), "sm_100a")[0]
    res = _run(vllm_env, GET, two.socket, _wires([planned]), env=_env(vllm_env, two.socket))
    assert res["results"][0]["origin"] == "hit"
    assert _rows(two)[res["results"][0]["key"]]["meta"]["compiled_by"]["toolchain"] == "vllm"
    bad = run_cli("warm", "--socket", two.socket, "--toolchain", "nope", "--family",
                  "flashinfer.mm_fp4", "--arch", "sm_100a", "--shape", "8,4096,4096",
                  check=False)
    assert bad.returncode == 2 and "no toolchain 'nope'" in bad.stderr


def test_a_kernel_written_back_by_one_environment_is_never_served_to_the_other(two, vllm_env,
                                                                              tmp_path):
    """A FlashInfer kernel the daemon has no recipe for, compiled and published by a process
    of the vLLM environment, is stored under that environment's identity: a process of the
    main environment compiles and publishes its own."""
    first = _run(vllm_env, NORM, env=_env(vllm_env, two.socket, tmp_path / "a"))
    assert first["fn"] == "Function" and first["stats"] == {"write_back_compiled": 1}
    other = _run(MAIN, NORM, env=_env(MAIN, two.socket, tmp_path / "b"))
    assert other["fn"] == "Function" and other["stats"] == {"write_back_compiled": 1}
    tcs = _toolchains(two)
    rows = [a for a in _rows(two).values() if a["family"] == "flashinfer.jit"]
    assert sorted(r["toolchain"] for r in rows) == sorted(
        tcs[n]["fingerprint"] for n in ("main", "vllm"))
    assert all(r["params"]["key_files"] == ["norm/kernels/rmsnorm_sigmoid_gate.py"]
               for r in rows)


def test_two_virtualenvs_with_the_same_stack_at_different_paths_share_every_artifact(
        two, vllm_env, tmp_path):
    """A copy of the vLLM environment's packages at another path (hard links: the same files,
    as an image's environment copied to another prefix) states the same identity, so every
    artifact built for one is a hit for the other; FlashInfer's own source hash, which
    includes the path, differs."""
    copy = tmp_path / "elsewhere" / "venv"
    home = next(line.split("=", 1)[1].strip() for line in
                (ROOT / ".venv-vllm" / "pyvenv.cfg").read_text().splitlines()
                if line.startswith("home"))
    subprocess.run([str(Path(home) / "python3"), "-m", "venv", "--without-pip", str(copy)],
                   check=True)
    site = copy / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run(["rm", "-rf", str(site / "site-packages")], check=True)
    subprocess.run(["cp", "-al", str(Path(VLLM).parents[1] / site.relative_to(copy) /
                                     "site-packages"), str(site)], check=True)
    python = str(copy / "bin" / "python")
    # everything the first environment has (both tactics were compiled for it above, or now)
    original = _run(vllm_env, GET, two.socket, _wires(TACTICS), env=_env(vllm_env, two.socket))
    compiles = two.stats()["compiles"]
    moved = _run(python, GET, two.socket, _wires(TACTICS), env=_env(python, two.socket))
    assert moved["python"] == python and moved["toolchain"] == original["toolchain"]
    assert [r["key"] for r in moved["results"]] == [r["key"] for r in original["results"]]
    assert {r["origin"] for r in moved["results"]} == {"hit"}
    assert two.stats()["compiles"] == compiles
    fi_hash = ("from flashinfer.jit.cute_dsl_core import _hash_source_files; import json; "
               "from flashinfer.gemm.gemm_mm_fp4_cute_dsl import "
               "_blockscaled_gemm_cache_key_files as f; "
               "print('RESULT ' + json.dumps(_hash_source_files(f())))")
    assert _run(python, fi_hash, env=_env(python, "/x")) != _run(vllm_env, fi_hash,
                                                                 env=_env(vllm_env, "/x"))


def test_an_unregistered_environment_writes_back_its_kernels_once_and_a_later_toolchain_serves_them(  # noqa: E501
        tmp_path, vllm_env):
    """A daemon that knows only the main environment: a vLLM-environment process gets
    unknown_toolchain at once (nothing compiled), compiles in-process and publishes under its
    own identity; its other processes then hit; the project's own kernels, which it would load
    with TVM-FFI 0.1.11, are toolchain_mismatch. Restarted with the vLLM toolchain, the daemon
    serves what that environment wrote back (same key), compiling nothing."""
    store = tmp_path / "store"
    d = DaemonProcess(tmp_path, workers=1, store=store, extra_env=ENV,
                      extra_args=["--toolchain", f"main={MAIN}"])
    try:
        first = _run(vllm_env, MM_FP4, "client", env=_env(vllm_env, d.socket, tmp_path / "1"))
        assert first["stats"] == {"unknown_toolchain": 1, "write_back_compiled": 1}
        assert first["compiles_here"] == 1 and first["fn"] == "Function"
        others = [_spawn(vllm_env, MM_FP4, "client",
                         env=_env(vllm_env, d.socket, tmp_path / f"o{i}")) for i in range(2)]
        for proc in others:
            res = _finish(proc)
            assert res["stats"] == {"daemon": 1} and res["compiles_here"] == 0
        hopper = d.client(timeout=60).plan("cached.hopper_fp8", (128, 256, 512), "sm_90a")[0]
        light = _run(vllm_env, GET, d.socket, _wires([hopper]), env=_env(vllm_env, d.socket))
        error = light["results"][0]
        assert error["error"] == "toolchain_mismatch"
        assert "TVM-FFI 0.1.11" in error["message"] and "TVM-FFI 0.1.15" in error["message"]
        stats = d.stats()
        assert stats["compiles"] == 0 and stats["entries"] == 1
    finally:
        d.stop()
    d = DaemonProcess(tmp_path, workers=2, store=store, extra_env=ENV,
                      extra_args=["--toolchain", f"main={MAIN}", "--toolchain",
                                  f"vllm={vllm_env}"])
    try:
        later = _run(vllm_env, MM_FP4, "client", env=_env(vllm_env, d.socket, tmp_path / "3"))
        assert later["stats"] == {"daemon": 1} and later["compiles_here"] == 0
        assert d.stats()["compiles"] == 0
    finally:
        d.stop()


def test_toolchains_come_from_flags_the_environment_or_the_file(tmp_path):
    toml = tmp_path / "cached.toml"
    toml.write_text('toolchain = ["main=/opt/a/bin/python", "vllm=/opt/b/bin/python"]\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHED_")}

    def effective(*args: str, **extra: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "cached", "config", "--json", *args],
                             capture_output=True, text=True, check=True, env={**env, **extra})
        return next(o for o in json.loads(out.stdout)["options"] if o["name"] == "toolchain")

    from_file = effective("--config", str(toml))
    assert from_file["value"] == [["main", "/opt/a/bin/python"], ["vllm", "/opt/b/bin/python"]]
    assert from_file["source"] == f"file {toml}"
    from_env = effective(CACHED_TOOLCHAIN="x=/opt/x/bin/python,y=/opt/y/bin/python")
    assert from_env["value"] == [["x", "/opt/x/bin/python"], ["y", "/opt/y/bin/python"]]
    from_flags = effective("--config", str(toml), "--toolchain", "z=/opt/z/bin/python")
    assert from_flags["value"] == [["z", "/opt/z/bin/python"]]
    assert from_flags["source"] == "flag --toolchain"


@pytest.mark.parametrize("value, message", [
    ("vllm", "NAME=/absolute/path"), ("a b=/x", "NAME=/absolute/path"),
    ("vllm=relative/python", "NAME=/absolute/path"),
])
def test_a_malformed_toolchain_option_is_refused_with_the_option_named(value, message):
    out = run_cli("config", "--toolchain", value, check=False)
    assert out.returncode == 2 and "toolchain" in out.stderr and message in out.stderr


def test_a_toolchain_that_cannot_be_probed_stops_the_daemon_with_the_reason(tmp_path):
    missing = str(tmp_path / "nope" / "python")
    out = run_cli("serve", "--store", str(tmp_path / "s"), "--socket", str(tmp_path / "x.sock"),
                  "--http", "off", "--toolchain", f"ghost={missing}", check=False)
    assert out.returncode == 2
    assert f"toolchain ghost: {missing} is not an executable interpreter" in out.stderr
    assert not (tmp_path / "s" / "identity.json").exists()


def test_identity_is_stated_with_every_request_that_can_return_an_artifact():
    from cached_client import protocol as p

    stated = {name for name, op in p.OPS.items() if "identity" in
              {f for f in op.request.__dataclass_fields__}}
    assert stated == {"get", "prefetch", "plan", "lease", "lease_renew", "lease_release",
                      "publish_bundle",
                      "publish", "plan_shape", "get_batch"}
    digest = hashlib.sha256(b"x").hexdigest()
    with pytest.raises(Exception, match="64 lowercase hex"):
        p.Identity.from_wire({"toolchain": "t", "sources": {"f": digest.upper()}})


THREADS_AT_ONCE = """
import threading
from cached_client import identity
out, barrier = [], threading.Barrier(8)
def ask():
    barrier.wait()
    out.append(identity.toolchain())
threads = [threading.Thread(target=ask) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(len(set(out)), out[0].split(";")[1])
"""


def test_the_fingerprint_is_the_same_in_threads_asking_at_once():
    """bench/load.py found it: 8 threads of a fresh process asking for the fingerprint at
    once got two answers (Python 3.11's sysconfig gave some of them SOABI None), so their
    first requests were unknown_toolchain. Every fresh process here gives one answer."""
    import sysconfig

    for _ in range(12):
        out = subprocess.run([sys.executable, "-c", THREADS_AT_ONCE], capture_output=True,
                             text=True, check=True, timeout=60).stdout.split()
        assert out == ["1", sysconfig.get_config_var("SOABI")], out


IDENTITY_SCRIPT = ("import json; from cached_client import identity; "
                   "print('RESULT ' + json.dumps(identity.toolchain()))")


def _toolchain_of(site: Path, cache: str) -> str:
    """The toolchain fingerprint a fresh process states with ``site`` first on its path and
    $CACHED_IDENTITY_CACHE set to ``cache`` ("" turns the cache off)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), os.environ.get("PYTHONPATH", "")]), "CACHED_IDENTITY_CACHE": cache}
    out = subprocess.run([MAIN, "-c", IDENTITY_SCRIPT], capture_output=True, text=True,
                         check=True, env=env).stdout
    return json.loads(out.split("RESULT ", 1)[1])


def test_the_identity_cache_is_used_only_while_a_record_is_unchanged_and_private(tmp_path):
    """A stack distribution's component comes from this user's identity cache while its
    RECORD's stamp is unchanged; a rewritten RECORD, a malformed cache file and a cache in a
    directory others can write are all recomputed, never an error."""
    site = tmp_path / "site"
    dist = site / "apache_tvm_ffi-9.9.dist-info"  # first on the path: the one identity reads
    dist.mkdir(parents=True)
    record = dist / "RECORD"
    record.write_text("tvm_ffi/__init__.py,sha256=AAAA,10\n")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    cache = private / "stack-digests.json"
    uncached = _toolchain_of(site, "")
    assert "apache-tvm-ffi==9.9:" in uncached
    assert _toolchain_of(site, str(cache)) == uncached
    entries = json.loads(cache.read_text())["components"]
    stamp, component = entries[str(record)]
    assert component in uncached
    # the cache is consulted: an entry for the unchanged stamp is what the process states
    entries[str(record)] = [stamp, "apache-tvm-ffi==9.9:" + "0" * 64]
    cache.write_text(json.dumps({"version": 1, "components": entries}))
    assert "apache-tvm-ffi==9.9:" + "0" * 64 in _toolchain_of(site, str(cache))
    # a rewritten RECORD (another size, so another stamp) is hashed again
    record.write_text("tvm_ffi/__init__.py,sha256=BBBB,10\ntvm_ffi/x.py,sha256=CCCC,1\n")
    changed = _toolchain_of(site, "")
    assert changed != uncached and _toolchain_of(site, str(cache)) == changed
    for garbage in ("{not json", json.dumps({"version": 1, "components": {str(record): 5}}),
                    json.dumps([1, 2])):
        cache.write_text(garbage)
        assert _toolchain_of(site, str(cache)) == changed
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    planted = shared / "stack-digests.json"
    planted.write_text(json.dumps({"version": 1, "components": {
        str(record): [_stamp_of(record), "apache-tvm-ffi==9.9:" + "1" * 64]}}))
    assert _toolchain_of(site, str(planted)) == changed  # not ours alone: not read
    assert json.loads(planted.read_text())["components"][str(record)][1].endswith("1" * 64)


def _stamp_of(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


ADOPT_SCRIPT = """
import json, os, sys
from cached_client import Client, identity
hello = Client(sys.argv[1], timeout=30).hello()
stack = identity.toolchain()
runtime = identity.runtime()
hashed = identity.dist_files.cache_info().currsize
records = hello.toolchains[0]["records"]
record, (stamp, component) = next(iter(records.items()))
forged = [stamp[0], stamp[1], stamp[2] + 1, stamp[3]]
garbage = [None, [1, 2], {record: "x"}, {record: [[1, 2, 3], component]}, {5: [stamp, "x"]},
           {record: [forged, "torch==0:" + "0" * 64]}, {"/nowhere/RECORD": [stamp, "x"]}]
print("RESULT " + json.dumps({"stack": stack, "runtime": runtime, "hashed": hashed,
                              "records": len(records),
                              "again": identity.adopt(records),
                              "garbage": [identity.adopt(g) for g in garbage],
                              "after": identity.toolchain.__wrapped__()}))
"""


def test_a_client_on_the_node_adopts_the_components_the_daemon_hashed(tmp_path):
    """The daemon's hello states the components its probe hashed (RECORD path, stamp,
    component; the DSL runtime library's path, stamp and sha256); a fresh client with no
    identity cache of its own states the same toolchain and runtime as one that hashes
    everything, without parsing a RECORD. A stated component is adopted
    only for a RECORD whose stamp here is the stated one; malformed records adopt nothing
    and raise nothing."""
    daemon = DaemonProcess(tmp_path, workers=1)
    try:
        env = {**os.environ, "CACHED_IDENTITY_CACHE": ""}
        out = subprocess.run([MAIN, "-c", ADOPT_SCRIPT, daemon.socket], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        got = json.loads(out.stdout.split("RESULT ", 1)[1])
    finally:
        daemon.stop()
    computed = subprocess.run([MAIN, "-c", IDENTITY_SCRIPT], capture_output=True, text=True,
                              check=True, env=env).stdout
    assert got["stack"] == json.loads(computed.split("RESULT ", 1)[1])
    runtime = subprocess.run([MAIN, "-c", "import json; from cached_client import identity; "
                              "print('RESULT ' + json.dumps(identity.runtime()))"],
                             capture_output=True, text=True, check=True, env=env).stdout
    assert got["runtime"] == json.loads(runtime.split("RESULT ", 1)[1])
    assert got["runtime"]["dsl_runtime_sha256"]  # this environment has a DSL runtime
    assert got["records"] >= 4 and got["hashed"] == 0  # torch, TVM-FFI, the DSL, its runtime
    assert got["again"] == 0  # a later hello's records are already held: nothing redone
    assert got["garbage"] == [0] * 7
    assert got["after"] == got["stack"]  # the forged stamp replaced nothing
