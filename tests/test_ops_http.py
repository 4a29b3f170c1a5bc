"""The HTTP endpoint for operators: /metrics (checked by promtool), /stats as HTTP shows it
(counts, no paths or compiler messages) and the page at / (loaded in headless Chromium,
and photographed for docs/operations.md), against one live daemon with real compiles."""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import re
import shutil
import struct
import subprocess
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from cached_client import CompileFailed, KernelRequest, UnknownFamily, identity
from conftest import ROOT, DaemonProcess, fault, raw_call, run_cli, wait_for
from PIL import Image
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from cached.config import size_text
from cached.toolchain import compiler_stack
from cached.view.page import health, render
from cached.view.snapshot import public_stats

SCREENSHOT = ROOT / "docs" / "img" / "status.png"
DEGRADED_RGB, OK_RGB = (0xFF, 0xED, 0xC2), (0xE3, 0xF4, 0xE8)  # the state box's background
WINDOW = (1280, 1000)


@pytest.fixture(scope="module")
def busy_daemon(tmp_path_factory, mm_fp4_requests):
    """Two compiles, one hit, one failed compile, fallbacks reported by a client; then
    pre-warm: ``cached warm`` of the two stored kernels, a pre-warm get that compiles and a
    prefetch of it; and a client's typo (an unknown family)."""
    tmp = tmp_path_factory.mktemp("http")
    d = DaemonProcess(tmp, extra_args=["--max-bytes", "10MB"])
    client = d.client(timeout=120)
    for request in mm_fp4_requests[:2]:
        assert client.get(request).origin == "compiled"
    assert client.get(mm_fp4_requests[0]).origin == "hit"
    with pytest.raises(CompileFailed):
        client.get(fault("fail", tag="<b>page-check</b>"))
    client._fallbacks = {"flashinfer.mm_fp4": 3}  # as Client.load counts them
    client._report_fallbacks()  # what load() does on its next answered get
    assert client._fallbacks == {}
    wanted = tmp / "requests.json"
    wanted.write_text(json.dumps([r.to_wire() for r in mm_fp4_requests[:2]]))
    warmed = run_cli("warm", "--socket", d.socket, "--requests", str(wanted), "--json")
    assert json.loads(warmed.stdout)["cached"] == 2
    assert client.get(PREWARM, priority="prewarm").origin == "compiled"
    assert client.prefetch([PREWARM]).cached == 1
    with pytest.raises(UnknownFamily):
        client.get(KernelRequest("no.such.family", {}, "sm_100a", 148, 148))
    yield d
    d.stop()


PREWARM = fault("build", tag="prewarm")


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
    for state, count in (("idle", 2), ("busy", 0), ("starting", 0), ("down", 0)):
        assert _sample(text, f'cached_workers{{state="{state}"}}') == count, state
    assert _sample(text, "cached_workers_configured") == 2
    assert _sample(text, "cached_store_entries") == 3  # two mm_fp4, the pre-warm build
    assert _sample(text, "cached_store_bytes") == busy_daemon.stats()["bytes"] > 0
    assert _sample(text, "cached_store_max_bytes") == 10**7  # 10MB: decimal
    for name in ("cached_queue_depth", "cached_in_flight", "cached_worker_restarts_total",
                 "cached_store_evictions_total"):
        assert _sample(text, name) == 0


def test_prewarm_is_counted_apart_from_serving(busy_daemon):
    """A warm-up (cached warm, a pre-warm get, a prefetch) leaves the serving hit ratio,
    its latency histograms and CachedLowHitRatio's inputs alone."""
    _, text = _get(busy_daemon, "/metrics")
    fam, fault_fam = '{family="flashinfer.mm_fp4"}', '{family="cached.test.fault"}'
    assert _sample(text, f"cached_hits_total{fam}") == 1
    assert _sample(text, f"cached_misses_total{fam}") == 2
    assert _sample(text, f"cached_prewarm_hits_total{fam}") == 2  # cached warm
    assert _sample(text, f"cached_prewarm_misses_total{fam}") == 0
    assert _sample(text, f"cached_misses_total{fault_fam}") == 1  # the failed compile
    assert _sample(text, f"cached_prewarm_misses_total{fault_fam}") == 1  # pre-warm get
    assert _sample(text, f"cached_prewarm_hits_total{fault_fam}") == 1  # the prefetch
    assert _sample(text, f"cached_hit_duration_seconds_count{fam}") == 1
    assert _sample(text, f"cached_miss_duration_seconds_count{fault_fam}") == 0
    stats = busy_daemon.stats()
    assert (stats["hits"], stats["misses"]) == (1, 3)
    assert (stats["prewarm_hits"], stats["prewarm_misses"]) == (3, 1)


def test_errors_are_failures_or_client_errors_never_both(busy_daemon):
    _, text = _get(busy_daemon, "/metrics")
    assert _sample(text, 'cached_errors_total{code="compile_failed"}') == 1
    assert _sample(text, 'cached_client_errors_total{code="unknown_family"}') == 1
    assert 'cached_errors_total{code="unknown_family"}' not in text
    assert 'cached_client_errors_total{code="compile_failed"}' not in text


def test_metrics_speak_openmetrics_to_a_scraper_that_asks(busy_daemon):
    url = f"http://{busy_daemon.stats()['http']}/metrics"
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as r:
        content_type, text = r.headers["Content-Type"], r.read().decode()
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert text.endswith("# EOF\n")
    parsed = {m.name: m for m in text_string_to_metric_families(text)}  # a strict parser
    hits = [x for x in parsed["cached_hits"].samples if x.name == "cached_hits_total"
            and x.labels == {"family": "flashinfer.mm_fp4"}]
    assert parsed["cached_hits"].type == "counter" and hits[0].value == 1
    assert parsed["cached_hit_duration_seconds"].type == "histogram"
    plain, _ = _get(busy_daemon, "/metrics")
    assert plain.startswith("text/plain; version=0.0.4")  # what Accept-less scrapers get


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
    infos = re.findall(r"^cached_build_info\{(.*)\} 1\.0$", text, re.M)
    assert len(infos) == len(busy_daemon.stats()["toolchains"]) == 1, text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', infos[0]))
    assert labels["version"] == importlib.metadata.version(compiler_stack.DAEMON_DIST)
    assert labels["toolchain"] == busy_daemon.stats()["toolchain"]
    assert labels["default"] == "true" and labels["name"]
    for name, version in compiler_stack.versions().items():
        assert labels[name.replace("-", "_")] == version
    assert "cached_toolchain_info" not in text  # one info metric, one set of label keys
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
    assert "25.0% serving hit ratio (1 hits, 3 misses)" in text  # the failed one too
    assert "4 pre-warm requests (3 stored, 1 compiled)" in text
    assert re.search(r"\d+\.\d\d ms mean hit latency", text), text
    # the state, with its reasons, first on the page
    assert re.search(r"cached on \S+ degraded 1 compile failed 3 client fallbacks ", text), text
    assert "2/2 workers ready (2 idle, 2 alive, 0 restarts)" in text
    assert "of 10 MB budget" in text
    # hits misses ratio compiled failed mean, written back, avoided (the hit and the two
    # warmed), served, fallbacks
    served = size_text(stats["families"]["flashinfer.mm_fp4"]["bytes_served"])
    assert stats["families"]["flashinfer.mm_fp4"]["bytes_served"] > 0
    assert re.search(rf"flashinfer\.mm_fp4 1 2 33\.3% 2 0 \d+\.\d\d 0 3 {served} 3", text), text
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
    zone = time.strftime("%Z")
    assert re.search(r"up (\d+\.\ds|\d+s|\d+m\d\ds) \(since \d{4}-\d\d-\d\d \d\d:\d\d "
                     rf"{zone}\)", text), text
    assert f"cached {importlib.metadata.version(compiler_stack.DAEMON_DIST)}" in text
    for name, version in compiler_stack.versions().items():
        assert f"{name} {version}" in text
    assert f"toolchain digest {stats['toolchain']}" in text
    assert re.search(rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d {zone} cached\.test\.fault",
                     text)  # a failure, its time with its zone
    assert "failures: compile_failed: 1 client errors (what clients sent): unknown_family: 1" \
        in text
    for secret in (stats["store"], stats["socket"], "injected failure", "page-check",
                   t["python"]):
        assert secret not in dom, secret  # over the socket only
    shot = tmp_path / "status.png"
    result = subprocess.run([*browser, f"--screenshot={shot}", url], capture_output=True,
                            text=True, timeout=120)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n", result.stderr[-2000:]
    assert struct.unpack(">II", png[16:24]) == WINDOW
    with Image.open(io.BytesIO(png)) as image:  # the state is seen, not only in the DOM
        colours = Counter(image.convert("RGB").getdata())
    assert colours[DEGRADED_RGB] > 20_000, colours.most_common(8)
    assert colours[OK_RGB] == 0
    if os.environ.get("CACHED_DOC_IMAGES") == "1":  # refresh docs/operations.md's picture
        Path(SCREENSHOT).write_bytes(png)


def test_page_escapes_what_it_shows(busy_daemon):
    snapshot = busy_daemon.stats()
    snapshot["families"]["<b>x</b>"] = dict(snapshot["families"]["flashinfer.mm_fp4"])
    snapshot["versions"] = {**snapshot["versions"], "<i>lib</i>": "<script>1</script>"}
    page = render(public_stats(snapshot))
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
    assert "&lt;script&gt;1&lt;/script&gt;" in page and "<script>" not in page


def test_page_state_is_ok_then_names_a_worker_restart_and_an_unknown_environment(
        tmp_path, mm_fp4_requests):
    """A fresh daemon's page says ok; a worker that dies and a request from an environment
    no toolchain is registered for turn it degraded, each named; no running worker is
    failing. ``stats --zero`` (an operator who has looked) brings it back to ok."""
    d = DaemonProcess(tmp_path, workers=1)
    try:
        _, page = _get(d, "/")
        assert '<div class="state ok" id="health"><b>ok</b>' in page, page
        with pytest.raises(CompileFailed):
            d.client(timeout=60).get(fault("crash", tag="state"))
        elsewhere = {**identity.for_families(["flashinfer.mm_fp4"]), "toolchain": "another"}
        reply = raw_call(d.socket, {"v": 1, "op": "get", "request": mm_fp4_requests[0].to_wire(),
                                    "identity": elsewhere})
        assert reply["error"]["code"] == "unknown_toolchain", reply
        wait_for(lambda: d.stats()["workers_ready"] == 1)
        _, page = _get(d, "/")
        assert '<div class="state degraded" id="health"><b>degraded</b>' in page, page
        for reason in ("1 compile failed", "1 worker restart",
                       "1 request from an environment no toolchain is registered for"):
            assert f"<li>{reason}" in page, reason
        dead = {**public_stats(d.stats()), "workers_alive": 0, "workers_ready": 0}
        assert health(dead)[0] == "failing"
        assert health(dead)[1][0].startswith("no compile worker is running (0 of 1)")
        run_cli("stats", "--socket", d.socket, "--zero")
        _, page = _get(d, "/")
        assert '<div class="state ok" id="health">' in page, page
    finally:
        d.stop()


WIRE_KEYS = {
    "entries", "bytes", "hits", "misses", "prewarm_hits", "prewarm_misses",
    "hit_seconds_mean", "miss_seconds_mean", "compiles", "failures", "persist_failures",
    "remote_hits", "remote", "compile_seconds", "in_flight", "queued", "running", "workers",
    "workers_alive", "workers_ready", "workers_idle", "worker_restarts", "connections",
    "errors", "families", "last_failures", "uptime_s", "started", "stats_zeroed_at",
    "version", "versions", "toolchain", "toolchains", "serve_only", "store", "socket", "http",
    "max_bytes", "max_files", "evictions", "evicted_bytes", "over_budget",
    "client_fallbacks", "unknown_toolchain", "unknown_environments",
    "client_outside_kernels", "outside_kernels", "draining", "settings",
}
"""Every key of the socket's ``stats`` object (cached stats --json), as operators know it."""


def test_every_view_renders_the_same_snapshot(tmp_path):
    """After real gets, ``cached stats`` (--json and its text), ``GET /stats``, the page and
    ``/metrics`` agree on the stored entries and the serving hits and misses; after
    ``stats --zero`` the socket's and HTTP's counts start again while /metrics' go on."""
    d = DaemonProcess(tmp_path, workers=1)
    fam = '{family="cached.test.fault"}'

    def views() -> tuple[dict, str, dict, str, str]:
        wire = json.loads(run_cli("stats", "--socket", d.socket, "--json").stdout)
        text = run_cli("stats", "--socket", d.socket).stdout
        over_http = json.loads(_get(d, "/stats")[1])
        return wire, text, over_http, _get(d, "/")[1], _get(d, "/metrics")[1]

    try:
        client = d.client(timeout=60)
        for tag in ("agree-a", "agree-b"):
            assert client.get(fault("build", tag=tag)).origin == "compiled"
        for _ in range(3):
            assert client.get(fault("build", tag="agree-a")).origin == "hit"
        wire, text, over_http, page, metrics = views()
        assert set(wire) == WIRE_KEYS
        assert (wire["entries"], wire["hits"], wire["misses"], wire["compiles"]) == (2, 3, 2, 2)
        assert wire["families"]["cached.test.fault"]["hits"] == 3
        for key in ("entries", "bytes", "hits", "misses", "compiles", "failures", "workers",
                    "workers_ready", "families", "toolchain", "version"):
            assert over_http[key] == wire[key], key
        assert _sample(metrics, "cached_store_entries") == 2
        assert _sample(metrics, "cached_store_bytes") == wire["bytes"] > 0
        assert _sample(metrics, f"cached_hits_total{fam}") == 3
        assert _sample(metrics, f"cached_misses_total{fam}") == 2
        assert _sample(metrics, f"cached_compilations_total{fam}") == 2
        assert _sample(metrics, "cached_workers_configured") == wire["workers"] == 1
        assert '<div class="tile" id="entries"><b>2</b>' in page, page
        assert "serving hit ratio (3 hits, 2 misses)" in page, page
        assert re.search(r"^  Hits:\s+3 / 5 \(60\.00%\)$", text, re.M), text
        assert re.search(r"^  Entries:\s+2$", text, re.M), text

        run_cli("stats", "--socket", d.socket, "--zero")
        wire, text, over_http, page, metrics = views()
        assert (wire["entries"], wire["hits"], wire["misses"]) == (2, 0, 0)
        assert (over_http["entries"], over_http["hits"], over_http["misses"]) == (2, 0, 0)
        assert over_http["stats_zeroed_at"] == wire["stats_zeroed_at"] is not None
        assert "serving hit ratio (0 hits, 0 misses)" in page, page
        assert re.search(r"^  Hits:\s+0 / 0$", text, re.M), text
        assert _sample(metrics, f"cached_hits_total{fam}") == 3  # monotonic
        assert _sample(metrics, "cached_store_entries") == 2
    finally:
        d.stop()


def test_idle_http_connections_are_closed_and_capped_and_health_still_answers(tmp_path):
    """Issue 37 case 9: 20,000 idle HTTP connections from one local user were never
    closed, took the daemon's descriptors and wrote 333 MB of log. Now at most
    httpguard.MAX_CONNECTIONS (64) are open (each new one closes the longest idle), /healthz
    answers amid them, every idle one (no request, half a request, or idle after a response)
    is closed within IDLE_S (10 s), and the log holds a line or two about it."""
    import socket

    d = DaemonProcess(tmp_path, workers=1)
    try:
        host, port = d.stats()["http"].rsplit(":", 1)
        conns = []
        for i in range(400):
            s = socket.create_connection((host, int(port)), timeout=5)
            if i % 3 == 1:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHo")  # half a request
            conns.append(s)
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=10) as r:
            assert r.status == 200

        def closed(s: socket.socket) -> bool:
            s.setblocking(False)
            try:
                return s.recv(1 << 16) == b""
            except BlockingIOError:
                return False
            except OSError:
                return True

        wait_for(lambda: sum(not closed(s) for s in conns) <= 64, 10)
        wait_for(lambda: all(closed(s) for s in conns), 30)
        for s in conns:
            s.close()
        assert len(re.findall("http.over_limit", d.log_path.read_text())) <= 3
        assert d.stats()["workers_alive"] == 1
    finally:
        d.stop()
