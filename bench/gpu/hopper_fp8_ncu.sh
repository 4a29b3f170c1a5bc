#!/usr/bin/env bash
# Nsight Compute on points where the plan's first choice trails cuBLAS (run there, from the
# bundle, after run_hopper_fp8.sh gpu installed tvm-ffi into /tmp/site):
#   bash DIR/hopper_fp8_ncu.sh "M,N,K[,KERNEL]" ... > $OUT/ncu.txt
# For each point: our plan's first choice (the kernel the client runs; or KERNEL, a name
# from the bundle's manifest) and cuBLAS with fast accumulation, Speed Of Light and memory
# sections, clocks left alone. NCU_CUBLAS="cublas_fast1 cublas_fast0" profiles cuBLAS without
# fast accumulation too.
set -uo pipefail
BUNDLE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
for point in "$@"; do
  IFS=, read -r m n k name <<< "$point"
  mnk="$m,$n,$k"
  if [[ -z ${name:-} ]]; then
    name=$(python3 -c "import json; p=json.load(open('$BUNDLE/manifest.json'))['plan']; print(p['${n}x${k}']['by_m']['$m'][0])")
  fi
  for what in "$name" ${NCU_CUBLAS:-cublas_fast1}; do
    if [[ $what == cublas* ]]; then filt='regex:^(?!.*(cutlass_kernel|elementwise|distribution|fill|copy))'; else filt='regex:cutlass_kernel'; fi
    echo "=== $mnk $what"
    timeout 120 ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
      -k "$filt" --launch-skip 2 --launch-count 1 \
      python3 "$BUNDLE/hopper_fp8_check.py" profile --bundle "$BUNDLE" --kernel "$what" \
      --mnk "$mnk" --reps 3 2>&1 | grep -v "^==PROF==" | tail -45
  done
done
