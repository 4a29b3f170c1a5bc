"""The native code of a GPU bench bundle (hopper_fp8_check.py, hopper_fp8_schemes.py), loaded
the way a client loads a daemon's kernels: by digest.

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

import os
import subprocess
import tempfile
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
