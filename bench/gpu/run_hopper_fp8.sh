#!/usr/bin/env bash
# Hopper FP8 GEMM family: build the GPU bundle here, run the check there.
#
#   here (CPU, venv):   bench/gpu/run_hopper_fp8.sh build [wide|mid|final] [DIR] [build args]
#       -> DIR (default .gpubundle, listed in .git/info/exclude): kernels/*.so, manifest.json,
#          hopper_fp8_check.py, this script, client/cached_client (the launcher),
#          libcute_dsl_runtime.so, the cp312 apache-tvm-ffi wheel.
#   there (H200, via the device tool, carry [DIR]):
#                        bash DIR/run_hopper_fp8.sh gpu [phases] [extra args]
#       -> installs the tvm-ffi wheel into /tmp/site, runs hopper_fp8_check.py run on the
#          bundle the script sits in, retries without a kernel that hung the GPU; logs and
#          JSON under $OUT.
set -euo pipefail
mode=${1:-build}

if [[ $mode == build ]]; then
  cd "$(dirname "$0")/../.."
  set_name=${2:-final}
  BUNDLE=${3:-.gpubundle}
  PY=${PYTHON:-.venv/bin/python}
  if [[ $BUNDLE == .gpubundle ]]; then
    grep -qx '/.gpubundle/' .git/info/exclude 2>/dev/null || echo '/.gpubundle/' >> .git/info/exclude
  fi
  CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/hopper_fp8_check.py build --out "$BUNDLE" \
    --set "$set_name" --jobs "${JOBS:-2}" "${@:4}"
  if ! ls "$BUNDLE"/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
    ver=$("$PY" -c 'import importlib.metadata as m; print(m.version("apache-tvm-ffi"))')
    cache=${TVM_FFI_WHEEL_CACHE:-/tmp/hopper_fp8_wheels}
    mkdir -p "$cache"
    ls "$cache"/apache_tvm_ffi-"$ver"-*cp312*.whl >/dev/null 2>&1 || \
      "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$cache" "apache-tvm-ffi==$ver"
    cp "$cache"/apache_tvm_ffi-"$ver"-*.whl "$BUNDLE"/
  fi
  du -sh "$BUNDLE"
  exit 0
fi

if [[ $mode == gpu ]]; then
  BUNDLE=$(cd "$(dirname "$0")" && pwd)
  phases=${2:-correct,bi,perf}
  shift || true; shift || true
  OUT=${OUT:-/tmp/hopper_fp8_out}
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$BUNDLE"/apache_tvm_ffi-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    | tee "$OUT/nvidia-smi.txt" || true
  exclude=""
  for attempt in 1 2 3; do
    rm -f "$OUT/progress"
    if python3 "$BUNDLE/hopper_fp8_check.py" run --bundle "$BUNDLE" --out "$OUT" \
         --phases "$phases" --exclude "$exclude" "$@"; then
      exit 0
    fi
    hung=$(cat "$OUT/progress" 2>/dev/null || true)
    if [[ -z $hung ]]; then echo "check failed (not a hang); giving up"; exit 1; fi
    echo "kernel $hung hung or crashed; retrying without it"
    exclude=${exclude:+$exclude,}$hung
  done
  exit 1
fi
echo "usage: $0 build [wide|mid|final] [DIR] | gpu [phases] [args]" >&2
exit 2
