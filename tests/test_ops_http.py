"""The HTTP endpoint for operators: /metrics (checked by promtool), /stats as HTTP shows it
(counts, no paths or compiler messages) and the page at / (loaded in headless Chromium,
and photographed for docs/operations.md), against one live daemon with real compiles."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import struct
import subprocess
import urllib.request
from pathlib import Path

import pytest
from cached_client import CompileFailed
from conftest import ROOT, DaemonProcess, fault

from cached import toolchain
from cached.config import size_text
from cached.httpapp import public_stats
from cached.page import render

SCREENSHOT = ROOT / "docs" / "img" / "status.png"
WINDOW = (1280, 1000)


@pytest.fixture(scope="module")
def busy_daemon(tmp_path_factory, mm_fp4_requests):
    """Two compiles, one hit, one failed compile, fallbacks reported by a client."""
    d = DaemonProcess(tmp_path_factory.mktemp("http"), extra_args=["--max-bytes", "10MB"])
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
    assert result.returncode == 0, result.stdout + result.stderr  # names, types, units
    fam = '{family="flashinfer.mm_fp4"}'
    assert _sample(text, f"cached_hits_total{fam}") == 1
    assert _sample(text, f"cached_misses_total{fam}") == 2
    assert _sample(text, f"cached_compilations_total{fam}") == 2
    assert _sample(text, f"cached_client_fallbacks_total{fam}") == 3
    assert _sample(text, f"cached_compile_duration_seconds_count{fam}") == 2
    assert _sample(text, 'cached_compile_failures_total{family="cached.test.fault"}') == 1
    assert _sample(text, 'cached_errors_total{code="compile_failed"}') == 1
    assert _sample(text, 'cached_workers{state="alive"}') == 2
    assert _sample(text, 'cached_workers{state="idle"}') == 2  # none is compiling now
    assert _sample(text, "cached_store_entries") == 2
    assert _sample(text, "cached_store_bytes") == busy_daemon.stats()["bytes"] > 0
    assert _sample(text, "cached_store_max_bytes") == 10**7  # 10MB: decimal
    for name in ("cached_queue_depth", "cached_in_flight", "cached_worker_restarts_total",
                 "cached_store_evictions_total"):
        assert _sample(text, name) == 0


def test_metrics_have_latency_histograms_process_metrics_and_idle_families(busy_daemon):
    _, text = _get(busy_daemon, "/metrics")
    fam = '{family="flashinfer.mm_fp4"}'
    # one hit, two gets served after a compile; the failed get was never served
    assert _sample(text, f"cached_hit_duration_seconds_count{fam}") == 1
    assert _sample(text, f"cached_miss_duration_seconds_count{fam}") == 2
    assert 0 < _sample(text, f"cached_hit_duration_seconds_sum{fam}") < 5
    assert _sample(text, f"cached_miss_duration_seconds_sum{fam}") >= _sample(
        text, f"cached_compile_duration_seconds_sum{fam}")  # waiting includes compiling
    assert _sample(text, 'cached_miss_duration_seconds_count{family="cached.test.fault"}') == 0
    assert _sample(text, 'cached_hit_duration_seconds_bucket{family="flashinfer.mm_fp4",'
                         'le="+Inf"}') == 1
    for idle in ("cached.hopper_fp8", "flashinfer.bi.bmm_fp8"):  # no traffic yet: zeros
        for name in ("cached_hits_total", "cached_misses_total", "cached_compilations_total",
                     "cached_hit_duration_seconds_count", "cached_miss_duration_seconds_count",
                     "cached_compile_duration_seconds_count"):
            assert _sample(text, f'{name}{{family="{idle}"}}') == 0, (name, idle)
    info = re.search(r"^cached_build_info\{(.*)\} 1\.0$", text, re.M)
    assert info, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1)))
    assert labels["version"] == importlib.metadata.version("cached")
    assert labels["toolchain"] == busy_daemon.stats()["toolchain"]
    for name, version in toolchain.versions().items():
        assert labels[name.replace("-", "_")] == version
    assert _sample(text, "process_resident_memory_bytes") > 10 << 20
    assert _sample(text, "process_cpu_seconds_total") > 0
    assert _sample(text, "process_open_fds") > 0
    assert abs(_sample(text, "process_start_time_seconds")
               - _sample(text, "cached_start_time_seconds")) < 60


def test_http_stats_show_counts_but_no_paths_or_compiler_messages(busy_daemon):
    over_socket = busy_daemon.stats()
    _, body = _get(busy_daemon, "/stats")
    over_http = json.loads(body)
    for key in ("entries", "bytes", "hits", "misses", "compiles", "failures", "families",
                "version", "versions", "toolchain", "uptime_s", "workers_idle"):
        assert key in over_http, key
    for key in ("entries", "bytes", "hits", "misses", "compiles", "failures"):
        assert over_http[key] == over_socket[key]
    assert "store" not in over_http and "socket" not in over_http
    for secret in (over_socket["store"], over_socket["socket"], "injected failure",
                   "page-check", over_socket["last_failures"][0]["key"]):
        assert secret not in body, secret
    assert over_http["last_failures"] == [{"time": f["time"], "family": f["family"]}
                                          for f in over_socket["last_failures"]]
    assert "cached stats" in over_http["redacted"]


def test_operator_page_in_headless_chromium(busy_daemon, tmp_path):
    content_type, html = _get(busy_daemon, "/")
    assert content_type.startswith("text/html")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html)  # nothing from outside
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is not installed (make setup installs it)"
    url = f"http://{busy_daemon.stats()['http']}/"
    browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu",
               "--disable-dev-shm-usage", "--disable-background-networking",
               "--disable-component-update", "--no-first-run", "--hide-scrollbars",
               f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WINDOW[0]},"
               f"{WINDOW[1]}"]
    result = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True,
                            timeout=120)
    dom = result.stdout
    assert "<title>cached on" in dom, result.stderr[-2000:]
    assert 'http-equiv="refresh"' in dom
    text = re.sub(r"<[^>]+>", " ", dom)
    text = re.sub(r"\s+", " ", text)
    stats = busy_daemon.stats()
    assert "25.0% hit ratio (1 hits, 3 misses)" in text  # the fault request is a miss too
    assert "2/2 workers ready (2 idle, 2 alive, 0 restarts)" in text
    assert "of 10 MB budget" in text
    # hits misses ratio compiled failed mean, written back, avoided (the hit), served, fallbacks
    served = size_text(stats["families"]["flashinfer.mm_fp4"]["bytes_served"])
    assert stats["families"]["flashinfer.mm_fp4"]["bytes_served"] > 0
    assert re.search(rf"flashinfer\.mm_fp4 1 2 33\.3% 2 0 \d+\.\d\d 0 1 {served} 3", text), text
    for idle in ("cached.hopper_fp8", "flashinfer.bi.bmm_fp8", "flashinfer.jit", "triton",
                 "humming", "flashinfer.nvcc"):
        assert f"{idle} 0 0 n/a 0 0 - 0 0 0 B 0" in text, idle  # every family has its row
    # every registered toolchain: name, fingerprint digest, versions, workers; no path
    (t,) = stats["toolchains"]
    section = text[text.index("Toolchains toolchain fingerprint versions workers"):
                   text.index("Errors by code")]
    assert f"{t['name']} (default) {t['fingerprint']} " in section, section
    assert all(f"{k} {v}" in section for k, v in t["versions"].items()), section
    assert section.rstrip().endswith("2 ready, 0 busy"), section
    assert re.search(r"up (\d+\.\ds|\d+s|\d+m\d\ds) \(since \d{4}-\d\d-\d\d \d\d:\d\d\)", text)
    assert f"cached {importlib.metadata.version('cached')}" in text
    for name, version in toolchain.versions().items():
        assert f"{name} {version}" in text
    assert f"toolchain digest {stats['toolchain']}" in text
    assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d cached\.test\.fault", text)  # a failure
    for secret in (stats["store"], stats["socket"], "injected failure", "page-check",
                   t["python"]):
        assert secret not in dom, secret  # over the socket only
    shot = tmp_path / "status.png"
    result = subprocess.run([*browser, f"--screenshot={shot}", url], capture_output=True,
                            text=True, timeout=120)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n", result.stderr[-2000:]
    assert struct.unpack(">II", png[16:24]) == WINDOW
    if os.environ.get("CACHED_DOC_IMAGES") == "1":  # refresh docs/operations.md's picture
        Path(SCREENSHOT).write_bytes(png)


def test_page_escapes_what_it_shows(busy_daemon):
    snapshot = busy_daemon.stats()
    snapshot["families"]["<b>x</b>"] = dict(snapshot["families"]["flashinfer.mm_fp4"])
    snapshot["versions"] = {**snapshot["versions"], "<i>lib</i>": "<script>1</script>"}
    page = render(public_stats(snapshot))
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
    assert "&lt;script&gt;1&lt;/script&gt;" in page and "<script>" not in page
