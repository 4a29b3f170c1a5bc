#!/usr/bin/env bash
# The client's batch-invariant GEMM plans (cached_client.gemm.plan) on the H200, through a
# serve-only daemon holding a store built here.
#
#   here:  BUNDLE=DIR bench/gpu/run_gemm_plan.sh build   -> DIR (git-ignored): store/, the
#          DSL runtime, cp312 wheels of the daemon's pure-Python dependencies and of
#          TVM-FFI, a copy of the code (src/) and this script with gemm_plan_check.py
#   there: bash DIR/run_gemm_plan.sh gpu                   (device tool, carry [DIR])
set -euo pipefail
SHAPES=(4096,4096 2688,4096 4608,2688 14336,4096 2112,7168)
MAX_M=8192
mode=${1:-build}

if [[ $mode == build ]]; then
  cd "$(dirname "$0")/../.."
  BUNDLE=${BUNDLE:-.gpubundle/gemm_plan}
  PY=${PYTHON:-.venv/bin/python}
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/wheels"
  CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/gemm_plan_bundle.py "$BUNDLE/store" "$MAX_M" \
    "${SHAPES[@]}" | tee "$BUNDLE/build.log"
  rm -rf "$BUNDLE/store/tmp" "$BUNDLE/store/index.sqlite-wal" "$BUNDLE/store/index.sqlite-shm"
  cp "$("$PY" -c 'from cached.toolchain.compiler_stack import runtime_library_path as p; print(p())')" "$BUNDLE/"
  source bench/gpu/wheels.sh
  cp312_wheels "$PY" "$BUNDLE/wheels" "${DAEMON_DEPS[@]}"
  mkdir -p "$BUNDLE/src/client"
  cp -r cached "$BUNDLE/src/" && cp -r client/cached_client "$BUNDLE/src/client/"
  cp bench/gpu/run_gemm_plan.sh bench/gpu/gemm_plan_check.py "$BUNDLE/"
  find "$BUNDLE/src" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$BUNDLE"
  exit 0
fi

if [[ $mode == gpu ]]; then
  BUNDLE=$(cd "$(dirname "$0")" && pwd)
  OUT=${OUT:-/tmp/gemm_plan_out}
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$BUNDLE"/wheels/*.whl
  export PYTHONPATH=/tmp/site:$BUNDLE/src/client:$BUNDLE/src PYTHONUNBUFFERED=1
  export CACHED_DSL_RUNTIME=$BUNDLE/libcute_dsl_runtime.so
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    | tee "$OUT/nvidia-smi.txt" || true
  rm -rf /tmp/store && cp -r "$BUNDLE/store" /tmp/store
  cd /tmp  # `python3 -m` puts the working directory first on sys.path: the bundle's code only
  python3 -m cached serve --serve-only --store /tmp/store --socket /tmp/cached.sock --no-http \
    > "$OUT/daemon.log" 2>&1 &
  for _ in $(seq 100); do  # the socket file exists before the daemon listens: ask it
    python3 -c "from cached_client import Client; Client('/tmp/cached.sock', timeout=2,
      fallback=False).hello()" 2>/dev/null && break
    sleep 0.2
  done
  set +e
  python3 "$BUNDLE/gemm_plan_check.py" --socket /tmp/cached.sock --out "$OUT" "${SHAPES[@]}" \
    2>&1 | tee "$OUT/gemm_plan.log"
  rc=${PIPESTATUS[0]}
  tail -5 "$OUT/daemon.log"
  exit "$rc"
fi
echo "usage: $0 build | gpu" >&2
exit 2
