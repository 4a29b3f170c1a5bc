"""The native code of a GPU bench bundle (hopper_fp8_check.py, hopper_fp8_schemes.py,
hopper_bf16.py): built here (:func:`compile_kernels`, :func:`finish`: one builder for every
bench that carries kernels rather than a store) and loaded there the way a client loads a
daemon's kernels: by digest.

A bundle is built here and carried to a lent GPU machine by the device tool; no daemon
serves it. What is checked before anything in it is loaded:

* the DSL runtime (``libcute_dsl_runtime.so``, or its ``.xz`` unpacked into a directory
  this process creates with mkdtemp, 0700) must have the sha256 the manifest recorded at
  build time (``runtime_sha256``); only then is it named in $CACHED_DSL_RUNTIME, the one
  runtime the client's loader opens;
* each kernel library goes through ``cached_client.loader.load_library`` with the sha256
  the manifest recorded for it (``sha256``), which refuses changed bytes before dlopen.

Refused forgeries: tests/test_hopper_fp8_bench.py
(``test_a_bundle_whose_runtime_or_kernel_changed_is_refused_before_loading``).
The manifest itself travels with the bundle: these digests catch a file changed or
swapped on the machine (a planted /tmp file, a stale unpack), not a forged bundle.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUNTIME = "libcute_dsl_runtime.so"
RUNTIME_ENV = "CACHED_DSL_RUNTIME"  # cached_client.loader.RUNTIME_LIBRARY_ENV


def record(out: str, entries: list[dict], runtime: str) -> dict:
    """The manifest fields of a bundle built in ``out``: each entry gets the sha256 of its
    ``so``; returns {"runtime_sha256": the digest of ``runtime``, the library the bundle
    carries}."""
    from cached_client.loader import sha256_file as sha256_of

    for e in entries:
        e["sha256"] = sha256_of(os.path.join(out, e["so"]))
    return {"runtime_sha256": sha256_of(runtime)}


def use_runtime(bundle: str, manifest: dict) -> str:
    """The bundle's DSL runtime, checked against the manifest, set as $CACHED_DSL_RUNTIME;
    its path. SystemExit naming both digests when they differ (nothing is set)."""
    from cached_client.loader import sha256_file as sha256_of

    want = manifest.get("runtime_sha256")
    if not want:
        raise SystemExit(f"{bundle}/manifest.json records no runtime_sha256: rebuild the bundle")
    so = os.path.join(bundle, RUNTIME)
    if not os.path.exists(so):
        so = os.path.join(tempfile.mkdtemp(prefix="dslrt-"), RUNTIME)
        with open(so, "wb") as f:
            subprocess.run(["xz", "-dc", os.path.join(bundle, RUNTIME + ".xz")], stdout=f,
                           check=True)
    got = sha256_of(so)
    if got != want:
        raise SystemExit(f"{so} has sha256 {got}, the bundle's manifest says {want}; "
                         "not loading it")
    os.environ[RUNTIME_ENV] = so
    return so


def load_kernels(bundle: str, manifest: dict) -> dict[str, Any]:
    """{name: TVM-FFI function} of every kernel of the manifest, each library's digest
    checked by the client's loader before it is opened (call use_runtime first). The
client (``cached_client``) must be importable: the bundle carries it."""
    from cached_client.loader import load_library

    fns = {}
    for e in manifest["kernels"]:
        if not e.get("sha256"):
            raise SystemExit(f"{bundle}/manifest.json records no sha256 for {e['name']}: "
                             "rebuild the bundle")
        fns[e["name"]] = load_library(os.path.join(bundle, e["so"]), e["symbol"], e["sha256"])
    return fns


# -- building a bundle (here) ----------------------------------------------------------------


def _dsl_libs() -> tuple[str, str]:
    """(the DSL runtime's lib directory, TVM-FFI's lib directory) of this environment."""
    import tvm_ffi

    site = os.path.dirname(os.path.dirname(tvm_ffi.__file__))
    return (os.path.join(site, "nvidia_cutlass_dsl", "cu13", "lib"),
            os.path.join(site, "tvm_ffi", "lib"))


def compile_kernels(out: str, tactics: Sequence[tuple[str, Any]], prefix: str, jobs: int,
                    repo: str, num_sms: int = 132) -> tuple[list[dict], int, float]:
    """Compile each (name, tactic) of the Hopper families (sm_90a, ``jobs`` at a time, one
    ``cached.families.hopper_fp8.compile`` process each, the code of ``repo``) and link it
    against the DSL runtime and TVM-FFI into ``out/kernels/{prefix}_{i:03d}.so``; a kernel
    an earlier build into ``out`` made from the same params (its ``.ok`` file) is kept.
    Returns (manifest entries: name, params, symbol, so, class, mac; compiled now; seconds).
    SystemExit naming the kernel whose compile failed."""
    os.makedirs(os.path.join(out, "kernels"), exist_ok=True)
    entries = []
    for i, (nm, t) in enumerate(tactics):
        sym = f"{prefix}_{i:03d}"
        entries.append({"name": nm, "params": t.to_params(), "symbol": sym,
                        "so": f"kernels/{sym}.so", "class": t.reduction_class,
                        "mac": num_sms // t.cluster_size})
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a",
               PYTHONPATH=f"{repo}:{os.path.join(repo, 'client')}")
    tmp = os.path.join(out, "obj")
    os.makedirs(tmp, exist_ok=True)
    t0 = time.perf_counter()
    rt, ffi = _dsl_libs()

    def built(e: dict) -> bool:
        ok = Path(out, e["so"] + ".ok")
        return ok.exists() and ok.read_text() == json.dumps(e["params"], sort_keys=True)

    def finish_one(proc: subprocess.Popen, e: dict) -> None:
        if proc.wait():
            raise SystemExit(f"compile of {e['name']} failed")
        obj = os.path.join(tmp, e["symbol"] + ".o")
        subprocess.check_call(["gcc", "-shared", "-o", os.path.join(out, e["so"]), obj,
                               f"-L{rt}", "-lcute_dsl_runtime", f"-L{ffi}", "-ltvm_ffi"])
        Path(out, e["so"] + ".ok").write_text(json.dumps(e["params"], sort_keys=True))

    todo = [e for e in entries if not built(e)]
    running: list = []
    for e in todo:
        while len(running) >= jobs:
            finish_one(*running.pop(0))
        running.append((subprocess.Popen(
            [sys.executable, "-m", "cached.families.hopper_fp8.compile", "--params",
             json.dumps(e["params"]), "--max-active-clusters", str(e["mac"]), "--out",
             os.path.join(tmp, e["symbol"] + ".o"), "--symbol", e["symbol"]],
            env=env, stdout=subprocess.DEVNULL), e))
    for proc, e in running:
        finish_one(proc, e)
    shutil.rmtree(tmp)
    return entries, len(todo), time.perf_counter() - t0


def finish(out: str, entries: list[dict], scripts: Sequence[str], repo: str) -> dict:
    """What every kernel bundle carries besides its kernels: the DSL runtime (xz, made
    once), ``scripts`` and this module copied beside it, the client (``client/``, fresh);
    returns the manifest's digest fields (:func:`record`)."""
    rt, _ = _dsl_libs()
    if not os.path.exists(os.path.join(out, RUNTIME + ".xz")):
        subprocess.check_call(f"xz -6 -T2 -c {rt}/{RUNTIME} > {out}/{RUNTIME}.xz", shell=True)
    digests = record(out, entries, os.path.join(rt, RUNTIME))
    for script in (*scripts, os.path.abspath(__file__)):
        shutil.copy2(script, os.path.join(out, os.path.basename(script)))
    cdst = os.path.join(out, "client", "cached_client")
    shutil.rmtree(cdst, ignore_errors=True)
    shutil.copytree(os.path.join(repo, "client", "cached_client"), cdst,
                    ignore=shutil.ignore_patterns("__pycache__"))
    return digests
