#!/usr/bin/env bash
# `cached tune` on the H200 through a serve-only daemon holding a store built here, then a
# second process plans from the winners and times the plans before and after
# (bench/gpu/tune_check.py).
#
#   here:  BUNDLE=DIR bench/gpu/run_tune.sh build   -> DIR (git-ignored): store/ (every
#          candidate cached tune times: tune_bundle.py), the DSL runtime (xz), cp312 wheels
#          of the daemon's pure-Python dependencies and of TVM-FFI, a copy of the code
#          (src/) and this script with tune_check.py
#   there: bash DIR/run_tune.sh gpu                   (device tool, carry [DIR])
set -euo pipefail
# SHAPES (N,K N,K ..) and SCHEMES (cached tune's names, comma-separated) from the
# environment, here and there alike; the default: models not in manifests/: Qwen2.5-7B (qkv,
# o, gate_up, down), Gemma-2-9B (qkv, o, gate_up, down), Llama-3.1-405B's qkv_proj at
# tensor parallel 16 (a small N, a large K), per-tensor fast
read -r -a SHAPES <<< "${SHAPES:-4608,3584 3584,3584 37888,3584 3584,18944 8192,3584 3584,4096 28672,3584 3584,14336 1152,16384}"
SCHEMES=${SCHEMES:-tensor-fast}
TOP=${TOP:-3} NEAR=${NEAR:-2} ROUNDS=${ROUNDS:-5} BUDGET=${BUDGET:-60}
# there, optional: REPEAT=1 runs cached tune a second time (a resumed run: nothing to time);
# WIDE=N,K (WIDE_TOP, WIDE_NEAR, WIDE_BUCKETS) a forced wider search on one shape
mode=${1:-build}

if [[ $mode == build ]]; then
  cd "$(dirname "$0")/../.."
  BUNDLE=${BUNDLE:-.gpubundle/tune}
  PY=${PYTHON:-.venv/bin/python}
  if [[ ! -d $BUNDLE/store ]]; then  # the store takes a while: kept when there
    mkdir -p "$BUNDLE"
    CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/tune_bundle.py "$BUNDLE/store" "$TOP" "$NEAR" \
      --schemes "$SCHEMES" "${SHAPES[@]}" | tee "$BUNDLE/build.log"
  fi
  rm -rf "$BUNDLE/store/tmp" "$BUNDLE/store/index.sqlite-wal" "$BUNDLE/store/index.sqlite-shm" \
    "$BUNDLE/wheels" "$BUNDLE/src"
  mkdir -p "$BUNDLE/wheels"
  [[ -f $BUNDLE/libcute_dsl_runtime.so.xz ]] || xz -6 -c \
    "$("$PY" -c 'from cached.compiler_stack import runtime_library_path as p; print(p())')" \
    > "$BUNDLE/libcute_dsl_runtime.so.xz"
  for pkg in apache-tvm-ffi sqlite-utils click click-default-group python-dateutil tzdata \
             pluggy tabulate sqlite-fts4; do
    ver=$("$PY" -c "import importlib.metadata as m; print(m.version('$pkg'))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$BUNDLE/wheels" "$pkg==$ver"
  done
  mkdir -p "$BUNDLE/src/client"
  cp -r cached "$BUNDLE/src/" && cp -r client/cached_client "$BUNDLE/src/client/"
  cp bench/gpu/run_tune.sh bench/gpu/tune_check.py "$BUNDLE/"
  printf 'SHAPES="%s"\nSCHEMES=%s\n' "${SHAPES[*]}" "$SCHEMES" > "$BUNDLE/env.sh"  # what it holds
  find "$BUNDLE/src" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$BUNDLE"
  exit 0
fi

if [[ $mode == gpu ]]; then
  BUNDLE=$(cd "$(dirname "$0")" && pwd)
  # the shapes and schemes the store was built for (env.sh, written by build)
  if [[ -f $BUNDLE/env.sh ]]; then source "$BUNDLE/env.sh"; fi
  read -r -a SHAPES <<< "$SHAPES"
  OUT=${OUT:-/tmp/tune_out}
  mkdir -p "$OUT"
  t0=$(date +%s)
  rm -rf /tmp/tune_site  # a warm machine may hold another run's /tmp/site (other versions)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tune_site \
    "$BUNDLE"/wheels/*.whl
  xz -dc "$BUNDLE/libcute_dsl_runtime.so.xz" > /tmp/libcute_dsl_runtime.so
  export PYTHONPATH=/tmp/tune_site:$BUNDLE/src/client:$BUNDLE/src PYTHONUNBUFFERED=1
  export CACHED_DSL_RUNTIME=/tmp/libcute_dsl_runtime.so
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    | tee "$OUT/nvidia-smi.txt" || true
  rm -rf /tmp/store && cp -r "$BUNDLE/store" /tmp/store
  python3 -c "import tvm_ffi, sys; print('tvm_ffi', tvm_ffi.__version__, tvm_ffi.__file__)"
  cd /tmp  # `python3 -m` puts the working directory first on sys.path: the bundle's code only
  python3 -m cached serve --serve-only --store /tmp/store --socket /tmp/cached.sock --no-http \
    > "$OUT/daemon.log" 2>&1 &
  for _ in $(seq 100); do  # the socket file exists before the daemon listens: ask it
    python3 -c "from cached_client import Client; Client('/tmp/cached.sock', timeout=2,
      fallback=False).hello()" 2>/dev/null && break
    sleep 0.2
  done
  echo "setup $(( $(date +%s) - t0 )) s"
  set +e
  args=()
  for s in "${SHAPES[@]}"; do args+=(--weight "$s"); done
  t1=$(date +%s)
  python3 -m cached tune --socket /tmp/cached.sock "${args[@]}" --top "$TOP" --near "$NEAR" \
    --scheme "$SCHEMES" --rounds "$ROUNDS" --budget "$BUDGET" --json \
    2> >(tee "$OUT/tune.log" >&2) > "$OUT/tune.json"
  echo "cached tune: $(( $(date +%s) - t1 )) s in all"
  if [[ -n ${REPEAT:-} ]]; then  # again: every bucket is published, nothing is timed
    t1=$(date +%s)
    python3 -m cached tune --socket /tmp/cached.sock "${args[@]}" --scheme "$SCHEMES" --json \
      2> >(tee "$OUT/tune_again.log" >&2) > "$OUT/tune_again.json"
    echo "cached tune again: $(( $(date +%s) - t1 )) s in all"
  fi
  if [[ -n ${WIDE:-} ]]; then  # a wider search on one shape, replacing its winners
    python3 -m cached tune --socket /tmp/cached.sock --weight "$WIDE" --force \
      --buckets "${WIDE_BUCKETS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192}" \
      --top "${WIDE_TOP:-16}" --near "${WIDE_NEAR:-3}" --rounds "$ROUNDS" --budget 60 \
      --json 2> >(tee "$OUT/tune_wide.log" >&2) > "$OUT/tune_wide.json"
  fi
  python3 "$BUNDLE/tune_check.py" --socket /tmp/cached.sock --out "$OUT" --rounds "$ROUNDS" \
    --schemes "$SCHEMES" "${SHAPES[@]}" 2>&1 | tee "$OUT/tune_check.log"
  rc=${PIPESTATUS[0]}
  grep -c '"autotune.stored"' "$OUT/daemon.log" || true
  tail -3 "$OUT/daemon.log"
  exit "$rc"
fi
echo "usage: $0 build | gpu" >&2
exit 2
