"""Issue 26 item 3: the serving monitor. A serving process counts every kernel it builds
outside the daemon, warns once naming the first, and reports the count, which the daemon
shows in stats, /metrics and its page; with a warm daemon the count is 0. Real processes
with the plugin loaded (entry point), real Triton compiles for sm_90 (tests/jit_harness.py),
a real daemon (the vLLM hook that starts the monitor: test_vllm_plugin.py)."""

from __future__ import annotations

import re
import sys
import urllib.request

import pytest
from conftest import DaemonProcess
from jit_harness import JIT
from test_recovery import Steps, _metric

pytestmark = pytest.mark.skipif(not (JIT / "triton").is_dir(),
                                reason="make setup-jit installs Triton")

BARE = ["--toolchain", f"bare={sys._base_executable}"]


def _run(tmp, sock: str, plan: str) -> tuple[list[dict], str]:
    tmp.mkdir()
    steps = Steps(tmp, sock, plan)
    try:
        out = [steps.next() for _ in plan.split(",")]
        steps.next()
        return out, steps.log()
    finally:
        steps.close()


def test_serving_processes_report_kernels_built_outside_the_daemon(tmp_path):
    d = DaemonProcess(tmp_path, workers=1, extra_args=BARE)
    try:
        # model load: a cold daemon's kernel compiled here before serving is not counted
        (loading, settled), log = _run(tmp_path / "load", d.socket, "compile,settle")
        assert loading["stats"] == {"compiled": 1} and settled["outside"] == {}, settled
        assert "while serving" not in log
        # serving: k2 again, from the daemon: not counted
        (_, again, settled), log = _run(tmp_path / "again", d.socket, "serve,compile,settle")
        assert again["stats"] == {"hit": 1} and settled["outside"] == {}, settled
        # serving: a new kernel compiled here (the daemon had none): counted, warned, reported
        (_, _, new, settled), log = _run(tmp_path / "new", d.socket,
                                         "serve,compile,compile,settle")
        assert new["stats"] == {"hit": 1, "compiled": 1}, new   # k3: not in the daemon
        assert settled["outside"] == {"triton": 1}, settled
        warnings = [x for x in log.splitlines() if "while serving, outside the daemon" in x]
        assert len(warnings) == 1 and "kernel k3 (triton) was compiled" in warnings[0], log
        stats = d.stats()
        assert stats["client_outside_kernels"] == 1, stats
        assert stats["families"]["triton"]["client_outside_kernels"] == 1
        assert stats["outside_kernels"][0]["kernel"] == "triton:k3"
        assert _metric(d, 'cached_client_outside_kernels_total{family="triton"}') == 1.0
        assert '"event": "client.outside_kernels_reported"' in d.log()
        with urllib.request.urlopen(f"http://{stats['http']}/", timeout=10) as r:
            page = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", r.read().decode()))
        assert "1 kernels built outside the daemon while serving" in page
        # the daemon warm with both: a serving process builds nothing outside it
        (_, a, b, settled), log = _run(tmp_path / "warm", d.socket,
                                       "serve,compile,compile,settle")
        assert (a["stats"], b["stats"]) == ({"hit": 1}, {"hit": 2}), (a, b)
        assert settled["outside"] == {} and d.stats()["client_outside_kernels"] == 1
    finally:
        d.stop()
