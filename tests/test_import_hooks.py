"""cached_client.integrations.import_hooks: a callback right after a module's first import, in fresh
processes (the hooks live in sys.meta_path)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

PROBE = """
import importlib.machinery, json, sys
sys.path.insert(0, sys.argv[1])
from cached_client.integrations.import_hooks import pending, when_imported
seen = []
when_imported("hooked_mod", lambda m: seen.append(("hooked", m.VALUE, "hooked_mod" in sys.modules)))
when_imported("bad_mod", lambda m: 1 / 0)
when_imported("json", lambda m: seen.append(("already", m.__name__)))
before = list(seen)
import hooked_mod
import bad_mod
print("RESULT " + json.dumps({
    "before_import": before, "seen": seen, "pending": pending(),
    "loader_restored": type(hooked_mod.__spec__.loader).__name__,
    "module_loader": type(hooked_mod.__loader__).__name__, "bad_value": bad_mod.VALUE,
    "light": [m for m in ("torch", "vllm", "flashinfer") if m in sys.modules]}))
"""


def test_callbacks_run_after_the_first_import_and_never_break_it(tmp_path):
    (tmp_path / "hooked_mod.py").write_text("VALUE = 41 + 1\n")
    (tmp_path / "bad_mod.py").write_text("VALUE = 'still imported'\n")
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT / "client")}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert out["before_import"] == [["already", "json"]]
    assert out["seen"] == [["already", "json"], ["hooked", 42, True]]
    assert out["pending"] == []
    assert out["loader_restored"] == out["module_loader"] == "SourceFileLoader"
    assert out["bad_value"] == "still imported" and "the hook for bad_mod failed" in proc.stderr
    assert out["light"] == []
