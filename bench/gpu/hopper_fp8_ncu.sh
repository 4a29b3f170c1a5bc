#!/usr/bin/env bash
# Nsight Compute on points where the plan's first choice trails cuBLAS (run there, from the
# bundle, after run_hopper_fp8.sh gpu installed tvm-ffi into /tmp/site):
#   bash DIR/hopper_fp8_ncu.sh "M,N,K[,KERNEL]" ... > $OUT/ncu.txt
# For each point: our plan's first choice (the kernel the client runs; or KERNEL, a name
# from the bundle's manifest, with the scales of its scheme: per-tensor, per-token or
# block128) and cuBLAS with fast accumulation, Speed Of Light and memory sections, clocks
# left alone. NCU_CUBLAS="cublas_fast1 cublas_fast0" profiles cuBLAS without fast
# accumulation too; NCU_CUBLAS="" leaves cuBLAS out.
# Optional (defaults: the behaviour above):
#   NCU_SECTIONS="SpeedOfLight ..."  the sections (default SpeedOfLight MemoryWorkloadAnalysis)
#   NCU_METRICS="a,b"                --metrics as well; if ncu fails with them, the point is
#                                    profiled again without them (a name this ncu lacks)
#   NCU_EXPORT=DIR                   keep each report as DIR/<n>_<kernel>.ncu-rep and print
#                                    from it: the details page (--print-details all), the raw
#                                    metrics matching NCU_RAW_GREP and, with SourceCounters,
#                                    the SASS source page (to DIR/<n>_<kernel>_sass.csv)
#   NCU_TAIL=45                      lines of each report printed without NCU_EXPORT
set -uo pipefail
BUNDLE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
read -r -a sections <<< "${NCU_SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis}"
secargs=()
for s in "${sections[@]}"; do secargs+=(--section "$s"); done
raw_grep=${NCU_RAW_GREP:-'launch__|stall|local|spill|registers|occupancy|warps_active'}
i=0
for point in "$@"; do
  IFS=, read -r m n k name <<< "$point"
  mnk="$m,$n,$k"
  if [[ -z ${name:-} ]]; then
    name=$(python3 -c "import json; p=json.load(open('$BUNDLE/manifest.json'))['plan']; print(p['${n}x${k}']['by_m']['$m'][0])")
  fi
  for what in "$name" ${NCU_CUBLAS-cublas_fast1}; do
    i=$((i + 1))
    if [[ $what == cublas* ]]; then filt='regex:^(?!.*(cutlass_kernel|elementwise|distribution|fill|copy))'; else filt='regex:cutlass_kernel'; fi
    echo "=== $mnk $what"
    app=(python3 "$BUNDLE/hopper_fp8_check.py" profile --bundle "$BUNDLE" --kernel "$what"
         --mnk "$mnk" --reps 3)
    base=(ncu --clock-control none "${secargs[@]}" -k "$filt" --launch-skip 2 --launch-count 1)
    if [[ -z ${NCU_EXPORT:-} ]]; then
      timeout 120 "${base[@]}" ${NCU_METRICS:+--metrics "$NCU_METRICS"} "${app[@]}" 2>&1 \
        | grep -v "^==PROF==" | tail -"${NCU_TAIL:-45}"
      continue
    fi
    mkdir -p "$NCU_EXPORT"
    rep="$NCU_EXPORT/${i}_${what}"
    rm -f "$rep.ncu-rep"
    timeout 150 "${base[@]}" ${NCU_METRICS:+--metrics "$NCU_METRICS"} -f -o "$rep" \
      "${app[@]}" > "$rep.log" 2>&1
    rc=$?
    if [[ ! -s $rep.ncu-rep && -n ${NCU_METRICS:-} ]]; then
      echo "ncu rc=$rc and no report with --metrics $NCU_METRICS; its log:"
      grep -v "^==PROF==" "$rep.log" | tail -15
      echo "--- again without --metrics"
      timeout 150 "${base[@]}" -f -o "$rep" "${app[@]}" > "$rep.log" 2>&1
      rc=$?
    fi
    grep -v "^==PROF==" "$rep.log" | tail -8
    if [[ ! -s $rep.ncu-rep ]]; then echo "ncu rc=$rc: no report for $what"; continue; fi
    ncu -i "$rep.ncu-rep" --print-details all 2>/dev/null || ncu -i "$rep.ncu-rep"
    echo "--- $what: raw metrics matching '$raw_grep'"
    ncu -i "$rep.ncu-rep" --page raw 2>/dev/null | grep -E "$raw_grep"
    if [[ " ${sections[*]} " == *" SourceCounters "* ]]; then
      if ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep"_sass.csv \
           2>"$rep"_sass.err; then
        echo "--- $what: SASS source page with samples: $rep""_sass.csv ($(wc -l < "$rep"_sass.csv) lines)"
      else
        echo "--- $what: no SASS source page ($(head -c 300 "$rep"_sass.err))"
      fi
    fi
  done
done
