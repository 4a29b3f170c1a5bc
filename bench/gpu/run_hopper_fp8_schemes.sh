#!/usr/bin/env bash
# Issue 27 on an H200 in two calls, the second while the machine is warm (GPU.md: /tmp
# survives 30 s). vLLM's _C_stable_libtorch.abi3.so (xz, 63.7 MB) does not fit one call
# beside the tree, so its first 45 MB travel alone.
#
#   here:  bench/gpu/run_hopper_fp8_schemes.sh build DIR     (DIR = .dev/fp8-schemes)
#          -> DIR/v1/vllmC.part00, DIR/b/ (kernels, manifest, vllmC.part01, wheel, runtime.xz)
#   there: call 1, carry [DIR/v1]:  bash DIR/b/../run_hopper_fp8_schemes.sh part1 DIR
#          call 2, carry [DIR/b]:   bash DIR/b/run_hopper_fp8_schemes.sh gpu DIR/b [budget_s]
# SCHEMES=a,b (build): only those schemes' kernels (hopper_fp8_schemes.py build --schemes;
# BLOCK_ONLY=1: SCHEMES=block128-exact); PHASES=bcorrect,bbi,bperf (gpu): the block128
# phases only (hopper_fp8_schemes.py --phases)
set -euo pipefail
mode=$1
if [[ $mode == build ]]; then
  D=$2
  cd "$(dirname "$0")/../.."
  CUTE_DSL_ARCH=sm_90a ${PYTHON:-.venv/bin/python} bench/gpu/hopper_fp8_schemes.py build \
    --out "$D/b" --jobs "${JOBS:-2}" ${BLOCK_ONLY:+--schemes block128-exact} \
    ${SCHEMES:+--schemes $SCHEMES}
  so=.venv-vllm/lib/python3.11/site-packages/vllm/_C_stable_libtorch.abi3.so
  if [[ ! -f $D/b/vllmC.part01 ]]; then
    mkdir -p "$D/v1"
    xz -6 -T1 -c "$so" > /tmp/vllmC.so.xz
    (cd /tmp && split -b 45000000 -d vllmC.so.xz vllmC.part)
    mv /tmp/vllmC.part00 "$D/v1/" && mv /tmp/vllmC.part01 "$D/b/"
  fi
  # the digest the run there loads it by (vllm_cutlass.load: a sealed copy, hashed)
  sha256sum < "$so" | cut -d' ' -f1 > "$D/b/vllmC.sha256"
  # the cp312 TVM-FFI wheel of this venv's version (the kernels were built against it)
  py=${PYTHON:-.venv/bin/python}
  source bench/gpu/wheels.sh
  cp312_wheels "$py" "$D/b" apache-tvm-ffi
  cp bench/gpu/run_hopper_fp8_schemes.sh "$D/b/"
  du -sh "$D"/*
  exit 0
fi
if [[ $mode == part1 ]]; then
  cp "$2/v1/vllmC.part00" /tmp/ && ls -la /tmp/vllmC.part00
  exit 0
fi
if [[ $mode == gpu ]]; then
  B=$2
  budget=${3:-200}
  OUT=${OUT:-/tmp/fp8s_out}
  mkdir -p "$OUT"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$B"/apache_tvm_ffi-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  vso=""
  if [[ -f /tmp/vllmC.part00 ]]; then
    cat /tmp/vllmC.part00 "$B/vllmC.part01" | xz -dc > /tmp/vllm_C_stable_libtorch.abi3.so \
      && vso=/tmp/vllm_C_stable_libtorch.abi3.so
  else
    echo "no /tmp/vllmC.part00 (a fresh machine): vLLM's cutlass_scaled_mm is left out"
  fi
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    | tee "$OUT/nvidia-smi.txt" || true
  python3 "$B/hopper_fp8_schemes.py" run --bundle "$B" --out "$OUT" \
    ${vso:+--vllm-so $vso --vllm-sha256 $(cat "$B/vllmC.sha256")} --budget "$budget" ${PHASES:+--phases $PHASES} 2>&1 \
    | tee "$OUT/run.log"
  exit 0
fi
echo "usage: $0 build DIR | part1 DIR | gpu BUNDLE [budget_s]" >&2
exit 2
