"""``GET /``: one self-contained HTML page for an operator's browser.

Rendered on the server from the object ``/stats`` shows over HTTP, the redacted view of the
daemon's one snapshot (:meth:`cached.view.snapshot.DaemonSnapshot.public`: counts, no
paths or compiler messages), so the page and ``/stats`` cannot disagree: no script,
no stylesheet or font from anywhere else, and a ``<meta http-equiv="refresh">`` so it
refreshes itself.
"""

from __future__ import annotations

import html
import socket

from ..config import size_text
from ..stats import duration_text, time_text
from .snapshot import hit_ratio, mean_compile_s, split_errors

REFRESH_S = 5

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.05em;margin:1.4em 0 .4em}
.sub{color:#666;font-size:.9em}
.tiles{display:flex;flex-wrap:wrap;gap:.8em;margin-top:1em}
.tile{background:#fff;border:1px solid #ddd;border-radius:6px;padding:.6em .9em;min-width:9em}
.tile b{display:block;font-size:1.5em}.tile span{color:#666;font-size:.85em}
.bar{height:6px;background:#eee;border-radius:3px;margin-top:.3em}
.bar i{display:block;height:6px;border-radius:3px;background:#3a7}
.bar i.warn{background:#d80}.bar i.bad{background:#c33}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #ddd;padding:.25em .6em;text-align:right}
th{background:#f0f0f0}td:first-child,th:first-child{text-align:left}
pre{white-space:pre-wrap;margin:0;font-size:.85em;max-width:70em}
.bad{color:#c33}.none{color:#888}tr.idle td{color:#999}
code{font-size:.95em}
.state{border:2px solid;border-radius:6px;padding:.5em .9em;margin:.8em 0;max-width:60em}
.state b{font-size:1.4em;text-transform:uppercase;letter-spacing:.04em}
.state ul{margin:.3em 0 0;padding-left:1.3em}
.state.ok{background:#e3f4e8;border-color:#2a8a4a;color:#14532d}
.state.degraded{background:#ffedc2;border-color:#d98200;color:#6b3b00}
.state.failing{background:#ffd6d6;border-color:#c62828;color:#7f1010}
"""


def _n(count: float, one: str, many: str | None = None) -> str:
    count = int(count)
    return f"{count} {one if count == 1 else many or one + 's'}"


def health(s: dict) -> tuple[str, list[str]]:
    """The state of a daemon from its snapshot as HTTP shows it, and the reasons (counts
    since the start or ``stats --zero``): ``failing`` when workers are configured and none
    runs; ``degraded`` for compile failures, worker restarts, workers not ready, requests
    from an unregistered environment, kernels not stored, client fallbacks, failed
    requests, a store over budget, a fleet tier down or full, or draining; else ``ok``."""
    failing, degraded = [], []
    workers = s.get("workers", 0)
    if workers and not s.get("workers_alive"):
        failing.append(f"no compile worker is running (0 of {workers}): misses cannot be "
                       "compiled")
    elif s.get("workers_ready", 0) < workers:
        degraded.append(f"{workers - s.get('workers_ready', 0)} of {workers} workers not "
                        "ready")
    if s.get("failures"):
        degraded.append(_n(s["failures"], "compile") + " failed")
    if s.get("worker_restarts"):
        degraded.append(_n(s["worker_restarts"], "worker restart"))
    if s.get("unknown_toolchain"):
        degraded.append(_n(s["unknown_toolchain"], "request") + " from an environment no "
                        "toolchain is registered for (cached toolchains)")
    if s.get("persist_failures"):
        degraded.append(_n(s["persist_failures"], "kernel") + " compiled but not stored")
    if s.get("client_fallbacks"):
        degraded.append(_n(s["client_fallbacks"], "client fallback"))
    failed = {k: v for k, v in split_errors(s.get("errors") or {})[0].items()
              if k != "compile_failed"}
    if failed:
        degraded.append(_n(sum(failed.values()), "failed request") + " ("
                        + ", ".join(f"{k} {v}" for k, v in sorted(failed.items())) + ")")
    if s.get("over_budget"):
        degraded.append("store over budget: eviction cannot get under it")
    remote = (s.get("remote") or {}).get("state")
    if remote in ("down", "full"):
        degraded.append(f"fleet tier {remote}: local only")
    if s.get("draining"):
        degraded.append("draining: the daemon is stopping")
    if failing:
        return "failing", failing + degraded
    return ("degraded", degraded) if degraded else ("ok", [])


def _ratio(hits: float, misses: float) -> str:
    ratio = hit_ratio(hits, misses)
    return "n/a" if ratio is None else f"{100 * ratio:.1f}%"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.2f} ms"


def _tile(ident: str, value: str, label: str, extra: str = "") -> str:
    return (f'<div class="tile" id="{ident}"><b>{html.escape(value)}</b>'
            f"<span>{html.escape(label)}</span>{extra}</div>")


def render(s: dict) -> str:
    """The page for one snapshot as HTTP shows it (:meth:`DaemonSnapshot.public`)."""
    e = html.escape
    max_bytes = s.get("max_bytes") or 0
    if max_bytes:
        used = s["bytes"] / max_bytes
        cls = "bad" if used > 1 else "warn" if used > 0.9 else ""
        budget = f"of {size_text(max_bytes)} budget ({100 * used:.0f}%)"
        width = min(100, 100 * used)
        bar = f'<div class="bar"><i class="{cls}" style="width:{width:.0f}%"></i></div>'
    else:
        budget, bar = "no budget set", ""
    tiles = [
        _tile("hit-ratio", _ratio(s["hits"], s["misses"]),
              f"serving hit ratio ({s['hits']} hits, {s['misses']} misses)"),
        _tile("hit-latency", _ms(s.get("hit_seconds_mean")), "mean hit latency"),
        _tile("prewarm", str(s.get("prewarm_hits", 0) + s.get("prewarm_misses", 0)),
              f"pre-warm requests ({s.get('prewarm_hits', 0)} stored, "
              f"{s.get('prewarm_misses', 0)} compiled)"),
        _tile("running", str(s["running"]), "compiling now"),
        _tile("queued", str(s["queued"]), "queued"),
        _tile("workers", f"{s['workers_ready']}/{s['workers']}",
              f"workers ready ({s.get('workers_idle', 0)} idle, {s['workers_alive']} alive, "
              f"{s['worker_restarts']} restarts)"),
        _tile("store-size", size_text(s["bytes"]), budget, bar),
        _tile("entries", str(s["entries"]),
              "entries" + (f" (max {s['max_files'] // 2})" if s.get("max_files") else "")),
        _tile("compiles", str(s["compiles"]), f"compiled, {s['failures']} failed"),
        _tile("evictions", str(s.get("evictions", 0)), "evicted"),
        _tile("fallbacks", str(s.get("client_fallbacks", 0)), "client fallbacks"),
        _tile("outside", str(s.get("client_outside_kernels", 0)),
              "kernels built outside the daemon while serving"),
    ]
    rows = []
    for family, c in sorted(s.get("families", {}).items()):
        compiles = c.get("compiles", 0)
        compile_s = mean_compile_s(c)
        mean = "-" if compile_s is None else f"{compile_s:.2f}"
        idle = not (c.get("hits") or c.get("misses") or c.get("client_fallbacks")
                    or c.get("published"))
        row_class = ' class="idle"' if idle else ""
        rows.append(
            f"<tr{row_class}><td>{e(family)}</td>"
            f"<td>{c.get('hits', 0)}</td><td>{c.get('misses', 0)}</td>"
            f"<td>{_ratio(c.get('hits', 0), c.get('misses', 0))}</td><td>{compiles}</td>"
            f"<td>{c.get('failures', 0)}</td><td>{mean}</td>"
            f"<td>{c.get('published', 0)}</td><td>{c.get('compiles_avoided', 0)}</td>"
            f"<td>{e(size_text(c.get('bytes_served', 0)))}</td>"
            f"<td>{c.get('client_fallbacks', 0)}</td></tr>")
    families = (
        "<table id=\"families\"><tr><th>family</th><th>hits</th><th>misses</th>"
        "<th>hit ratio</th><th>compiled</th><th>failed</th><th>mean compile s</th>"
        "<th>written back</th><th>compiles avoided</th><th>served</th>"
        "<th>client fallbacks</th></tr>" + "".join(rows) + "</table>"
        if rows else '<p class="none" id="families">no families registered</p>')
    toolchains = []
    for t in s.get("toolchains", []):
        w = t.get("workers") or {}
        versions = ", ".join(f"{e(k)} {e(str(v))}" for k, v in (t.get("versions") or {}).items())
        toolchains.append(
            f"<tr><td>{e(str(t.get('name', '')))}{' (default)' if t.get('default') else ''}"
            f"</td><td><code>{e(str(t.get('fingerprint', '')))}</code></td>"
            f"<td>{versions}</td><td>{w.get('ready', 0)} ready, {w.get('busy', 0)} busy</td>"
            "</tr>")
    toolchain_html = (
        "<table id=\"toolchains\"><tr><th>toolchain</th><th>fingerprint</th><th>versions</th>"
        "<th>workers</th></tr>" + "".join(toolchains) + "</table>"
        if toolchains else '<p class="none" id="toolchains">no toolchain registered</p>')
    unknown = []
    for u in s.get("unknown_environments", []):
        versions = ", ".join(f"{e(k)} {e(str(v))}" for k, v in (u.get("versions") or {}).items())
        unknown.append(f"<tr><td><code>{e(str(u.get('fingerprint', '')))}</code></td>"
                       f"<td>{versions}</td><td>{e(', '.join(u.get('families') or []))}</td>"
                       f"<td>{u.get('requests', 0)}</td></tr>")
    unknown_html = (
        "<table id=\"unknown-environments\"><tr><th>fingerprint</th><th>versions</th>"
        "<th>families asked</th><th>requests</th></tr>" + "".join(unknown) + "</table>"
        "<p class=\"sub\">No toolchain of this daemon compiles for these environments: their "
        "processes compile in-process (write-back). The daemon's log "
        "(<code>toolchain.unknown_environment</code>) has the <code>--toolchain</code> line "
        "that registers each.</p>"
        if unknown else '<p class="none" id="unknown-environments">none</p>')
    failures = []
    for f in reversed(s.get("last_failures", [])):
        when = time_text(f.get("time") or 0)
        failures.append(f"<tr><td>{e(when)}</td><td>{e(str(f.get('family', '')))}</td></tr>")
    failure_html = (
        "<table id=\"failures\"><tr><th>time</th><th>family</th></tr>"
        + "".join(failures) + "</table>"
        if failures else '<p class="none" id="failures">no compile failures</p>')
    failures_by_code, client_by_code = split_errors(s.get("errors", {}))
    failed = ", ".join(f"{e(k)}: {v}" for k, v in failures_by_code.items())
    refused = ", ".join(f"{e(k)}: {v}" for k, v in client_by_code.items())
    none = '<span class="none">none</span>'
    state, reasons = health(s)
    why = "".join(f"<li>{e(r)}</li>" for r in reasons)
    banner = (f'<div class="state {state}" id="health"><b>{state}</b>'
              + (f"<ul>{why}</ul>" if why else " &middot; serving, nothing to look at")
              + "</div>")
    versions = " &middot; ".join(f"{e(k)} {e(str(v))}"
                                 for k, v in (s.get("versions") or {}).items())
    host = e(socket.gethostname())
    started = time_text(s.get("started") or 0, seconds=False)
    zeroed = s.get("stats_zeroed_at")
    since = (f"counts since {e(time_text(zeroed))} (zeroed)" if zeroed
             else "counts since start")
    state = "draining" if s.get("draining") else "serve-only" if s.get("serve_only") \
        else "serving"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_S}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>cached on {host}</title><style>{STYLE}</style></head>
<body>
<h1>cached on {host}</h1>
{banner}
<div class="sub" id="about"><span id="state">{state}</span> &middot;
<span id="uptime">up {duration_text(s.get("uptime_s", 0))}</span> (since {e(started)})
&middot; {since} &middot; refreshes every {REFRESH_S} s &middot; <a href="/metrics">metrics</a>
&middot; <a href="/stats">stats (JSON)</a></div>
<div class="sub" id="versions">cached {e(str(s.get("version", "unknown")))} &middot;
{versions} &middot; toolchain digest {e(str(s.get("toolchain", "")))}</div>
<div class="tiles">{"".join(tiles)}</div>
<h2>Families</h2>{families}
<h2>Toolchains</h2>{toolchain_html}
<h2>Errors by code</h2><p id="errors">failures: {failed or none}<br>
client errors (what clients sent): {refused or none}</p>
<h2>Last compile failures</h2>{failure_html}
<h2>Unknown environments</h2>{unknown_html}
<p class="sub" id="redacted">Paths, kernel parameters and compiler messages are not shown
over HTTP: run <code>cached stats</code> on the node (its socket checks who asks).</p>
</body></html>
"""
