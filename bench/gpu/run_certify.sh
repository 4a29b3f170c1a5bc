#!/usr/bin/env bash
# `cached certify` on the H200, the whole path: daemon-built store (here, CPU) served by a
# serve-only daemon there, kernels loaded by the client, counts recorded in the daemon.
#
#   here:  bench/gpu/run_certify.sh build [LIMIT]   -> .gpubundle/certify (git-ignored),
#          with a copy of the code (src/) so the run uses the code the store was built by
#   there: bash bench/gpu/run_certify.sh gpu        (device tool, carry [".gpubundle"])
set -euo pipefail
cd "$(dirname "$0")/../.."
BUNDLE=${BUNDLE:-.gpubundle/certify}
SHAPES=(4096,4096 2688,4096 4608,2688 14336,4096)
mode=${1:-build}

if [[ $mode == build ]]; then
  PY=${PYTHON:-.venv/bin/python}
  git_dir=$(git rev-parse --git-common-dir)
  grep -qx '/.gpubundle/' "$git_dir/info/exclude" 2>/dev/null || echo '/.gpubundle/' >> "$git_dir/info/exclude"
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/wheels"
  "$PY" bench/gpu/certify_bundle.py "$BUNDLE/store" "${2:-6}" "${SHAPES[@]}"
  rm -rf "$BUNDLE/store/tmp" "$BUNDLE/store/index.sqlite-wal" "$BUNDLE/store/index.sqlite-shm"
  cp "$("$PY" -c 'from cached.toolchain.compiler_stack import runtime_library_path as p; print(p())')" "$BUNDLE/"
  source bench/gpu/wheels.sh
  cp312_wheels "$PY" "$BUNDLE/wheels" "${DAEMON_DEPS[@]}"
  mkdir -p "$BUNDLE/src/client"
  cp -r cached "$BUNDLE/src/" && cp -r client/cached_client "$BUNDLE/src/client/"
  find "$BUNDLE/src" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$BUNDLE"
  exit 0
fi

if [[ $mode == gpu ]]; then
  OUT=${OUT:-/tmp/certify_out}
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$BUNDLE"/wheels/*.whl
  export PYTHONPATH=/tmp/site:$PWD/$BUNDLE/src/client:$PWD/$BUNDLE/src PYTHONUNBUFFERED=1
  export CACHED_DSL_RUNTIME=$PWD/$BUNDLE/libcute_dsl_runtime.so
  rm -rf /tmp/store && cp -r "$BUNDLE/store" /tmp/store
  python3 -m cached serve --serve-only --store /tmp/store --socket /tmp/cached.sock --no-http \
    > "$OUT/daemon.log" 2>&1 &
  for _ in $(seq 100); do  # the socket file exists before the daemon listens: ask it
    python3 -c "from cached_client import Client; Client('/tmp/cached.sock', timeout=2,
      fallback=False).hello()" 2>/dev/null && break
    sleep 0.2
  done
  args=()
  for s in "${SHAPES[@]}"; do args+=(--weight "$s"); done
  set +e
  python3 -m cached certify --socket /tmp/cached.sock --family cached.hopper_fp8 \
    "${args[@]}" --limit "${LIMIT:-6}" --json | tee "$OUT/certify.jsonl"
  rc=$?
  python3 -m cached stats --socket /tmp/cached.sock --json > "$OUT/stats.json"
  python3 - <<'PY' | tee "$OUT/summary.txt"
import json
from cached_client import Client
c = Client("/tmp/cached.sock")
rows = c.call({"op": "certifications", "family": "cached.hopper_fp8"})[0]["certifications"]
s = c.stats()
print(f"daemon: serve_only={s['serve_only']} entries={s['entries']} hits={s['hits']} "
      f"misses={s['misses']} compiles={s['compiles']}")
print(f"{'N x K':<12} {'device':<22} {'tactics':>7} {'per-tactic':>10} {'mix':>5} {'cross':>6}")
for r in rows:
    d = r["rows_differing"]
    per = sum(v for k, v in d.items() if k not in ("mix", "cross_tactic"))
    print(f"{r['n']}x{r['k']:<7} {r['device']:<22} {len(r['tactics']):>7} {per:>10} "
          f"{d['mix']:>5} {d['cross_tactic']:>6}")
PY
  tail -5 "$OUT/daemon.log"
  exit $rc
fi
echo "usage: $0 build [LIMIT] | gpu" >&2
exit 2
