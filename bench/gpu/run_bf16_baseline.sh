#!/usr/bin/env bash
# vLLM 0.33.0's own BF16 GEMM paths on the GPU (issue 36's baseline): torch.mm (cuBLAS
# default), cuBLASLt under vLLM's batch-invariant settings, vLLM's Triton matmul_persistent.
#
#   here:  bench/gpu/run_bf16_baseline.sh build   -> .dev/vllmbf16-baseline (git-ignored): this
#          script, bf16_baseline.py, vllm_bi_shim.py and vLLM's two batch_invariant files
#   there: bash .dev/vllmbf16-baseline/run_bf16_baseline.sh gpu (carry [".dev/vllmbf16-baseline"])
#          -> $OUT/{torch,lt,triton}.jsonl, run.log, card.txt, table.md (printed last)
set -euo pipefail
mode=${1:-build}

if [[ $mode == build ]]; then
  cd "$(dirname "$0")/../.."
  main=$(git rev-parse --path-format=absolute --git-common-dir)/..
  D=${BUNDLE:-$main/.dev/vllmbf16-baseline}
  SITE=${VLLM_SITE:-$main/.venv-vllm/lib/python3.11/site-packages}
  exclude=$(git rev-parse --path-format=absolute --git-common-dir)/info/exclude
  grep -qx '/.dev/' "$exclude" 2>/dev/null || echo '/.dev/' >> "$exclude"  # never committed
  rm -rf "$D" && mkdir -p "$D/vllm_bi"
  grep -q '^Version: 0.33.0$' "$SITE"/vllm-0.33.0.dist-info/METADATA
  cp "$SITE"/vllm/model_executor/determinism/batch_invariant{,_configs}.py "$D/vllm_bi/"
  cp bench/gpu/bf16_baseline.py bench/gpu/vllm_bi_shim.py bench/gpu/run_bf16_baseline.sh "$D/"
  du -sh "$D"
  exit 0
fi

if [[ $mode == gpu ]]; then
  D=$(cd "$(dirname "$0")" && pwd)
  OUT=${OUT:-/tmp/bf16_baseline_out}
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1
  nvidia-smi -L | tee "$OUT/card.txt"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv | tee -a "$OUT/card.txt" || true
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
    | tee -a "$OUT/card.txt"
  # Triton compiles each (config, M specialization) once: in parallel, before any timing
  t0=$(date +%s)
  W=/tmp/bf16_warm && mkdir -p $W
  pids=()
  for s in 6144,4096 4096,4096 28672,4096 4096,14336 4608,3584 3584,3584 37888,3584 \
           3584,18944 128256,4096 152064,3584; do
    python3 "$D/bf16_baseline.py" warm --bi-dir "$D/vllm_bi" --shape $s \
      > "$W/warm_${s/,/x}.log" 2>&1 & pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "a warm process failed (exit $?)"; done
  tail -n 3 $W/*.log
  echo "triton warm: $(( $(date +%s) - t0 )) s"
  for m in ${METHODS:-torch lt triton}; do
    python3 "$D/bf16_baseline.py" run --method $m --bi-dir "$D/vllm_bi" \
      --out "$OUT/$m.jsonl" 2>&1 | tee -a "$OUT/run.log"
  done
  python3 "$D/bf16_baseline.py" table "$OUT"/*.jsonl | tee "$OUT/table.md"
  exit 0
fi
echo "usage: $0 build | gpu" >&2
exit 2
