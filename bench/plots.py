"""Pictures for docs/benchmarks.md from bench/out/{cold,warm}.json (matplotlib, no display).
Usage: python bench/plots.py"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from common import OUT, ROOT  # noqa: E402

IMG = ROOT / "docs" / "img"


def cold() -> None:
    r = json.loads((OUT / "cold.json").read_text())
    paths = [("FlashInfer serial\n(build_and_load)", r["flashinfer_serial"]["wall_s"]),
             (f"FlashInfer spawn pool\n({r['flashinfer_pool']['workers']} workers)",
              r["flashinfer_pool"]["wall_s"]),
             (f"FlashInfer spawn pool\n(default, {r['flashinfer_pool_default']['workers']})",
              r["flashinfer_pool_default"]["wall_s"]),
             (f"cached daemon\n({r['daemon']['workers']} workers)", r["daemon"]["wall_s"])]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.barh([p[0] for p in paths], [p[1] for p in paths],
                   color=["#999", "#bbb", "#bbb", "#2a7"])
    ax.bar_label(bars, fmt="%.0f s", padding=3)
    ax.set_xlabel("wall seconds, cold, empty caches (lower is better)")
    ax.set_title(f"(a) {r['kernels']} NVFP4 mm_fp4 tactics, m=256 n=1024 k=7168, sm_100a")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(IMG / "cold.png", dpi=110)


def warm() -> None:
    r = json.loads((OUT / "warm.json").read_text())
    series = [("client, path", r["client_path"]), ("client, bytes", r["client_bytes"]),
              ("FlashInfer try_load", r["flashinfer_try_load"])]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.boxplot([[v * 1000 for v in s["latencies_s"]] for _, s in series],
               tick_labels=[f"{n}\np50 {s['p50_ms']:.2f} ms" for n, s in series],
               orientation="horizontal", showfliers=True)
    ax.set_xscale("log")
    ax.set_xlabel("ms per kernel: first load in a fresh process (lower is better)")
    ax.set_title(f"(b) warm get+load of {r['kernels']} kernels")
    fig.tight_layout()
    fig.savefig(IMG / "warm.png", dpi=110)


if __name__ == "__main__":
    IMG.mkdir(parents=True, exist_ok=True)
    cold()
    warm()
