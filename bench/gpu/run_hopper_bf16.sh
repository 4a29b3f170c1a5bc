#!/usr/bin/env bash
# cached.hopper_bf16 on a lent Hopper GPU in one call (issue 36).
#
#   here:  bench/gpu/run_hopper_bf16.sh build DIR       (DIR = /work/main/.dev/bf16-bench)
#          -> DIR: kernels, manifest, client, DSL runtime (xz), tvm-ffi wheel, this script
#   there: carry [DIR relative to the repo]:  bash DIR/run_hopper_bf16.sh gpu DIR [budget_s]
set -euo pipefail
mode=$1
if [[ $mode == build ]]; then
  D=$2
  cd "$(dirname "$0")/../.."
  py=${PYTHON:-.venv/bin/python}
  CUTE_DSL_ARCH=sm_90a "$py" bench/gpu/hopper_bf16.py build --out "$D" --jobs "${JOBS:-2}"
  # the cp312 TVM-FFI wheel of this venv's version (the kernels were built against it)
  source bench/gpu/wheels.sh
  cp312_wheels "$py" "$D" apache-tvm-ffi
  cp bench/gpu/run_hopper_bf16.sh "$D/"
  du -sh "$D"
  exit 0
fi
if [[ $mode == gpu ]]; then
  B=$2
  budget=${3:-190}
  OUT=${OUT:-/tmp/bf16_out}
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$B"/apache_tvm_ffi-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  { date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv; } | tee "$OUT/nvidia-smi.txt" || true
  python3 "$B/hopper_bf16.py" run --bundle "$B" --out "$OUT" --budget "$budget" \
    ${PHASES:+--phases $PHASES} 2>&1 | tee "$OUT/run.log"
  # cuBLAS under vLLM's batch-invariant settings, in a process of its own (read at start)
  CUBLASLT_WORKSPACE_SIZE=1 CUBLAS_WORKSPACE_CONFIG=:16:8 python3 "$B/hopper_bf16.py" \
    cublas_bi --out "$OUT" --budget "${CUBLAS_BI_BUDGET:-35}" 2>&1 | tee -a "$OUT/run.log"
  exit 0
fi
echo "usage: $0 build DIR | gpu BUNDLE [budget_s]" >&2
exit 2
