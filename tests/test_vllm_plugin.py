"""The vLLM general plugin, loaded the way vLLM's plugin loader loads it: entry points of
the group ``vllm.general_plugins`` through importlib.metadata, called in several processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import DaemonProcess

LOADER = """
import json, logging, sys
from importlib.metadata import entry_points
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
assert "cached" in plugins, plugins
plugins["cached"].load()()          # what vllm.plugins.load_general_plugins() does
from cached_client import flashinfer
print("RESULT " + json.dumps({"installed": flashinfer.installed(),
                              "flashinfer_imported": "flashinfer" in sys.modules}))
"""


def _run(env: dict) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    logs = [x for x in proc.stderr.splitlines() if x.startswith("cached_client")]
    return json.loads(line[7:]), "\n".join(logs)


@pytest.mark.parametrize("socket", ["", "/nonexistent/cached.sock", "FILE"])
def test_without_a_live_daemon_one_log_line_and_nothing_else(tmp_path, socket):
    if socket == "FILE":
        socket = str(tmp_path / "not-a-socket")
        open(socket, "w").close()
    result, logs = _run({"CACHED_SOCKET": socket})
    assert result == {"installed": False, "flashinfer_imported": False}
    assert len(logs.splitlines()) == 1 and "in-process" in logs


def test_with_a_live_daemon_every_process_installs(tmp_path):
    pytest.importorskip("flashinfer")
    d = DaemonProcess(tmp_path, workers=1)
    try:
        env = {**os.environ, "CACHED_SOCKET": d.socket}
        procs = [subprocess.Popen([sys.executable, "-c", LOADER], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            assert json.loads(line[7:]) == {"installed": True, "flashinfer_imported": True}
            assert "now come from the daemon" in err
    finally:
        d.stop()


def test_vllm_itself_if_installed(tmp_path):
    vllm = pytest.importorskip("vllm.plugins")
    os.environ.pop("CACHED_SOCKET", None)
    vllm.load_general_plugins()
