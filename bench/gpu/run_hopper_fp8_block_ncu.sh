#!/usr/bin/env bash
# Issue 27: why the block-FP8 kernel (scales block128, accum exact) is slow at large M.
# On the H200 (device tool, carry [".dev/ncu27"]), from the repository root:
#     bash .dev/ncu27/run.sh            # everything, report on stdout, reports under $OUT
#     bash .dev/ncu27/run.sh --dry      # CPU rehearsal: set-up, argument checks, an ncu shim
# Point: M x N x K = 8192 x 4096 x 4096 (docs: block128 428 us, per-tensor exact 241.7 us).
#   1. set-up: the cp312 tvm-ffi wheel -> $SITE, PYTHONPATH (each profile process unpacks
#      the DSL runtime into its own mkdtemp directory and checks its digest: bundle_natives.py)
#   2. kernel time without ncu (CUDA events, eager launches through the client's launcher)
#   3. ncu on each kernel, one launch after two warm-up launches (hopper_fp8_ncu.sh);
#      NCU_CUBLAS="cublas_fast0" profiles cuBLAS without fast accumulation too (default none)
# MNK and KERNELS (space-separated names in the bundle) pick another point and kernels.
# Built here with (worktree ncu27):
#   PYTHON=/work/main/.venv/bin/python bash bench/gpu/run_hopper_fp8.sh build final \
#     .dev/ncu27 --kernels m128n128_c1x1_rm_s1_st6_e4m3_bfloat16_b128_ex,m128n128_c1x1_rm_s1_st6_e4m3_bfloat16_ex
#   then libcute_dsl_runtime.so replaced by its .xz (`xz -6 libcute_dsl_runtime.so` in the
#   bundle; the manifest keeps the digest of the unpacked file) and this script copied into
#   the bundle as run.sh.
set -uo pipefail
B=$(cd "$(dirname "$0")" && pwd)
DRY=0
[[ ${1:-} == --dry ]] && DRY=1
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/ncu27_out}
mkdir -p "$OUT"
export OUT
MNK=${MNK:-8192,4096,4096}
KERNELS=${KERNELS:-m128n128_c1x1_rm_s1_st6_e4m3_bfloat16_b128_ex m128n128_c1x1_rm_s1_st6_e4m3_bfloat16_ex}
t0=$(date +%s)
echo "=== set-up ($(date -u))"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$B"/apache_tvm_ffi-*.whl || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -c "import tvm_ffi, sys; print('python', sys.version.split()[0], 'tvm_ffi', tvm_ffi.__version__)" || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | head -3
ncu --version 2>&1 | tail -1
"$PY" -c "import torch; print('torch', torch.__version__)" 2>&1 | tail -1

if [[ $DRY == 1 ]]; then
  # an ncu shim: prints its arguments, runs the profiled app with --dry (DRY_TORCH_PY: a
  # python with torch, CPU is enough), writes a stand-in report; hopper_fp8_ncu.sh runs as is
  shim=$(mktemp -d)
  cat > "$shim/ncu" <<'EOF'
#!/usr/bin/env bash
echo "[ncu shim] ncu $*"
if [[ $1 == -i || $1 == --query-metrics || $1 == --version ]]; then
  [[ " $* " == *" --page source "* ]] && echo '"Address","Source","Warp Stall Sampling (All Samples)"'
  [[ " $* " == *" --page raw "* ]] && echo "    launch__registers_per_thread   register/thread   0 (shim)"
  exit 0
fi
rep=""; app=()
while (($#)); do
  case $1 in
    -o) rep=$2; shift 2;;
    python3) shift; app=("$@"); break;;
    *) shift;;
  esac
done
"${DRY_TORCH_PY:-python3}" "${app[@]}" --dry || exit 1
[[ -n $rep ]] && echo "stand-in" > "$rep.ncu-rep"
exit 0
EOF
  chmod +x "$shim/ncu"
  export PATH=$shim:$PATH
fi

echo "=== kernel time without ncu, M,N,K = $MNK"
for k in $KERNELS; do
  if [[ $DRY == 1 ]]; then
    "${DRY_TORCH_PY:-$PY}" "$B/hopper_fp8_check.py" profile --bundle "$B" --kernel "$k" \
      --mnk "$MNK" --reps 5 --events 7 --iters 20 --dry || exit 1
  else
    timeout 90 "$PY" "$B/hopper_fp8_check.py" profile --bundle "$B" --kernel "$k" \
      --mnk "$MNK" --reps 5 --events 7 --iters 20 2>&1 | tail -3
  fi
done

# --metrics: local memory (spills), the LSU's global loads (the block scales: A and B come
# by TMA, so these are almost all scale loads) and their L1 hits; names this ncu does not
# know are left out (ncu --query-metrics), and hopper_fp8_ncu.sh retries without --metrics
want="l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum
smsp__sass_inst_executed_op_local_ld.sum smsp__sass_inst_executed_op_local_st.sum
l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum
l1tex__t_sectors_pipe_lsu_mem_global_op_ld_lookup_hit.sum smsp__sass_inst_executed_op_global_ld.sum
launch__registers_per_thread sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"
avail=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}')
(( $(wc -l <<< "$avail") < 100 )) && avail=""  # no list: keep them all (the retry covers)
metrics=""
for mt in $want; do
  if [[ -z $avail ]] || grep -qx "${mt%%.*}" <<< "$avail"; then
    metrics=${metrics:+$metrics,}$mt
  else
    echo "(metric ${mt} not in this ncu's gh100 list: left out)"
  fi
done
[[ -z $metrics ]] && metrics=$(tr -s ' \n' ',' <<< "$want" | sed 's/,$//')  # list unreadable
echo "=== ncu, M,N,K = $MNK, --metrics $metrics"
points=()
for k in $KERNELS; do points+=("$MNK,$k"); done
NCU_CUBLAS="${NCU_CUBLAS-}" NCU_EXPORT="$OUT/ncu27" NCU_METRICS="$metrics" \
NCU_SECTIONS="SpeedOfLight MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables InstructionStats LaunchStats Occupancy WarpStateStats SchedulerStats ComputeWorkloadAnalysis SourceCounters" \
  bash "$B/hopper_fp8_ncu.sh" "${points[@]}"

echo "=== summary (from the reports)"
for rep in "$OUT"/ncu27/*.ncu-rep; do
  [[ -s $rep ]] || continue
  echo "--- $(basename "$rep" .ncu-rep)"
  ncu -i "$rep" --page raw 2>/dev/null | grep -E \
    'launch__registers_per_thread |launch__occupancy_limit_registers |gpu__time_duration.sum |sm__cycles_elapsed.max |smsp__cycles_active.avg |lsu_mem_local_op_(ld|st).sum |launch__grid_size |launch__block_size |sm__warps_active.avg.pct_of_peak_sustained_active '
done
echo "=== done in $(( $(date +%s) - t0 )) s; reports and SASS pages under $OUT/ncu27"
ls -la "$OUT/ncu27" 2>/dev/null
