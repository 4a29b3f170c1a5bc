"""The HTTP endpoint for operators: /metrics (checked by promtool) and the page at /
(loaded in headless Chromium), against one live daemon with real compiles."""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request

import pytest
from cached_client import CompileFailed
from conftest import DaemonProcess, fault


@pytest.fixture(scope="module")
def busy_daemon(tmp_path_factory, mm_fp4_requests):
    """Two compiles, one hit, one failed compile, fallbacks reported by a client."""
    d = DaemonProcess(tmp_path_factory.mktemp("http"), extra_args=["--max-bytes", "10M"])
    client = d.client(timeout=120)
    for request in mm_fp4_requests[:2]:
        assert client.get(request).origin == "compiled"
    assert client.get(mm_fp4_requests[0]).origin == "hit"
    with pytest.raises(CompileFailed):
        client.get(fault("fail", tag="<b>page-check</b>"))
    client._fallbacks = {"flashinfer.mm_fp4": 3}  # as Client.load counts them
    client._report_fallbacks()  # what load() does on its next answered get
    assert client._fallbacks == {}
    yield d
    d.stop()


def _get(d: DaemonProcess, path: str) -> tuple[str, str]:
    with urllib.request.urlopen(f"http://{d.stats()['http']}{path}", timeout=10) as r:
        return r.headers["Content-Type"], r.read().decode()


def _sample(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def test_metrics_pass_promtool_and_count_what_happened(busy_daemon):
    content_type, text = _get(busy_daemon, "/metrics")
    assert content_type.startswith("text/plain")
    result = subprocess.run([shutil.which("promtool") or "promtool", "check", "metrics"],
                            input=text, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    fam = '{family="flashinfer.mm_fp4"}'
    assert _sample(text, f"cached_hits_total{fam}") == 1
    assert _sample(text, f"cached_misses_total{fam}") == 2
    assert _sample(text, f"cached_compilations_total{fam}") == 2
    assert _sample(text, f"cached_client_fallbacks_total{fam}") == 3
    assert _sample(text, f"cached_compile_duration_seconds_count{fam}") == 2
    assert _sample(text, 'cached_compile_failures_total{family="cached.test.fault"}') == 1
    assert _sample(text, 'cached_errors_total{code="compile_failed"}') == 1
    assert _sample(text, 'cached_workers{state="alive"}') == 2
    assert _sample(text, "cached_store_entries") == 2
    assert _sample(text, "cached_store_bytes") == busy_daemon.stats()["bytes"] > 0
    assert _sample(text, "cached_store_max_bytes") == 10 << 20
    for name in ("cached_queue_depth", "cached_in_flight", "cached_worker_restarts_total",
                 "cached_store_evictions_total"):
        assert _sample(text, name) == 0


def test_operator_page_in_headless_chromium(busy_daemon, tmp_path):
    content_type, html = _get(busy_daemon, "/")
    assert content_type.startswith("text/html")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing from outside
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed (make setup installs it)"
    url = f"http://{busy_daemon.stats()['http']}/"
    result = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", url],
        capture_output=True, text=True, timeout=120)
    dom = result.stdout
    assert "<title>cached on" in dom, result.stderr[-2000:]
    assert 'http-equiv="refresh"' in dom
    text = re.sub(r"<[^>]+>", " ", dom)
    text = re.sub(r"\s+", " ", text)
    assert "25.0% hit ratio (1 hits, 3 misses)" in text  # the fault request is a miss too
    assert "2/2 workers ready" in text
    assert "of 10.0 MiB budget" in text
    assert re.search(r"flashinfer\.mm_fp4 1 2 33\.3% 2 0 \d+\.\d\d 3", text), text
    assert "cached.test.fault RuntimeError: injected failure" in text
    assert "&lt;b&gt;page-check&lt;/b&gt;" in dom  # escaped, not markup
