#!/usr/bin/env bash
# `cached certify` and `cached tune` on a GPU node installed as a node is: the daemon's and
# the client's wheels (built here from this checkout) installed with their dependencies'
# wheels into a venv there (`python3 -m venv --system-site-packages`: the image's CUDA
# torch; `pip install --no-index --no-deps`), the commands run from its bin/ (no
# PYTHONPATH), a serve-only daemon holding a store built here; then a second process plans
# from the winners and times the plans before and after (bench/gpu/tune_check.py).
#
#   here:  BUNDLE=DIR [VLLM=1] bench/gpu/run_tune.sh build   -> DIR (git-ignored): store/
#          (every candidate cached tune times: tune_bundle.py; what certify runs:
#          certify_bundle.py) and store.tar.xz (the same, 1/30 the size: what is carried),
#          the DSL runtime (xz), wheels/ (cached-kernel-daemon and
#          cached-kernel-client from this checkout, cp312 wheels of the daemon's pure-Python
#          dependencies and of TVM-FFI), this script, tune_check.py and vllm_cutlass.py;
#          VLLM=1: also vLLM 0.33.0's _C (xz -6 of .venv-vllm's _C_stable_libtorch.abi3.so,
#          for its CUTLASS cutlass_scaled_mm: tune_check.py --vllm-so), too big for one call
#          beside the rest, split in two: DIR/v1/vllmC.part00 (its first VLLM_SPLIT bytes,
#          default 43000000) and DIR/v2/vllmC.part01 (the rest, beside a copy of the DSL
#          runtime's xz), the .so's sha256 in env.sh (the whole xz is kept as
#          DIR/vllmC.so.xz, never carried, so a new VLLM_SPLIT is quick). env.sh also holds
#          the DSL runtime's sha256, checked there once it is unpacked.
#          The build prints what each call carries and its size with the tree the device
#          tool sends too (64 MiB a call in all), and the largest VLLM_SPLIT call 1 fits.
#   there, without vLLM, one call:
#          bash DIR/run_tune.sh gpu          (device tool: carry DIR's wheels, store.tar.xz,
#          libcute_dsl_runtime.so.xz, env.sh, run_tune.sh, tune_check.py)
#   there, with vLLM (VLLM=1 build), three calls in a row, each while the machine is
#   still warm (/tmp is kept between calls on a warm machine, 30 s):
#     call 1: bash bench/gpu/run_tune.sh part1 DIR v1   (carry [DIR/v1]: part00 to /tmp)
#     call 2: bash bench/gpu/run_tune.sh part1 DIR v2   (carry [DIR/v2]: part01 and the
#             runtime to /tmp)
#     call 3: bash DIR/run_tune.sh gpu               (carry the six above less the runtime,
#             and DIR/vllm_cutlass.py; never all of DIR)
#   gpu takes vllmC.part01 and the runtime's xz from DIR or else /tmp, joins
#   /tmp/vllmC.part00 and vllmC.part01 when both are there, prints vLLM's relative errors
#   first (tune_check.py smoke) and passes --vllm-so and --vllm-sha256 to tune_check.py,
#   which loads only a sealed copy with that digest (vllm_cutlass.load) (per-tensor and per-token fast against the faster of torch's and vLLM's
#   CUTLASS; block128 against vLLM's CUTLASS blockwise kernel); else it says vLLM is left out
#   and block128 is not checked.
set -euo pipefail
# RUNS: groups "SCHEMES=N,K N,K ...", separated by ';' (SCHEMES: cached tune's names,
# comma-separated; a group's schemes are tuned on its shapes only), here and there alike;
# without RUNS, one group "$SCHEMES=$SHAPES". The default: models not in manifests/:
# Qwen2.5-7B (qkv, o, gate_up, down), Gemma-2-9B (qkv, o, gate_up, down), Llama-3.1-405B's
# qkv_proj at tensor parallel 16 (a small N, a large K), per-tensor fast.
SHAPES=${SHAPES:-4608,3584 3584,3584 37888,3584 3584,18944 8192,3584 3584,4096 28672,3584 3584,14336 1152,16384}
SCHEMES=${SCHEMES:-tensor-fast}
RUNS=${RUNS:-$SCHEMES=$SHAPES}
# CERTIFY: the FP8 weight shapes `cached certify` measures (CERTIFY_LIMIT tactics each)
CERTIFY=${CERTIFY:-${SHAPES%% *}} CERTIFY_LIMIT=${CERTIFY_LIMIT:-3}
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
    IFS=';' read -r -a groups <<< "$RUNS"
    for g in "${groups[@]}"; do
      read -r -a shapes <<< "${g#*=}"
      CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/tune_bundle.py "$BUNDLE/store" "$TOP" \
        "$NEAR" --schemes "${g%%=*}" "${shapes[@]}" | tee -a "$BUNDLE/build.log"
    done
    read -r -a cert <<< "$CERTIFY"
    CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/certify_bundle.py "$BUNDLE/store" \
      "$CERTIFY_LIMIT" "${cert[@]}" | tee -a "$BUNDLE/build.log"
  fi
  rm -rf "$BUNDLE/store/tmp" "$BUNDLE/store/index.sqlite-wal" "$BUNDLE/store/index.sqlite-shm" \
    "$BUNDLE/wheels" "$BUNDLE/src"
  tar -C "$BUNDLE" -cf - store | xz -6 -T2 > "$BUNDLE/store.tar.xz"
  mkdir -p "$BUNDLE/wheels"
  [[ -f $BUNDLE/libcute_dsl_runtime.so.xz ]] || xz -6 -c \
    "$("$PY" -c 'from cached.toolchain.compiler_stack import runtime_library_path as p; print(p())')" \
    > "$BUNDLE/libcute_dsl_runtime.so.xz"
  source bench/gpu/wheels.sh
  cp312_wheels "$PY" "$BUNDLE/wheels" "${DAEMON_DEPS[@]}"  # the image's torch is CUDA's
  # the project's two distributions, as a node installs them (pure Python: any version)
  rm -rf build client/build
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$BUNDLE/wheels" ./client .
  rm -rf build client/build ./*.egg-info client/*.egg-info
  cp bench/gpu/run_tune.sh bench/gpu/tune_check.py bench/gpu/vllm_cutlass.py "$BUNDLE/"
  carry=(wheels store.tar.xz libcute_dsl_runtime.so.xz env.sh run_tune.sh tune_check.py)
  vsha=""
  if [[ -n ${VLLM:-} ]]; then
    so=.venv-vllm/lib/python3.11/site-packages/vllm/_C_stable_libtorch.abi3.so
    split=${VLLM_SPLIT:-43000000}
    [[ -f $so ]] || { echo "VLLM=1: no $so (make .venv-vllm first)" >&2; exit 1; }
    # the whole xz is kept (not carried): xz -6 of ~93 MB takes a while, a new split does
    # not (remove DIR/vllmC.so.xz after a new vLLM)
    if [[ ! -f $BUNDLE/vllmC.so.xz ]]; then
      nice -n 10 xz -6 -T2 -c "$so" > "$BUNDLE/vllmC.so.xz.tmp"
      mv "$BUNDLE/vllmC.so.xz.tmp" "$BUNDLE/vllmC.so.xz"
    fi
    mkdir -p "$BUNDLE/v1" "$BUNDLE/v2"
    head -c "$split" "$BUNDLE/vllmC.so.xz" > "$BUNDLE/v1/vllmC.part00"
    tail -c +$((split + 1)) "$BUNDLE/vllmC.so.xz" > "$BUNDLE/v2/vllmC.part01"
    cp "$BUNDLE/libcute_dsl_runtime.so.xz" "$BUNDLE/v2/"
    vsha=$(sha256sum < "$so" | cut -d' ' -f1)  # what tune_check.py loads: checked there
    carry=(wheels store.tar.xz env.sh run_tune.sh tune_check.py vllm_cutlass.py)
  fi
  rsha=$(xz -dc "$BUNDLE/libcute_dsl_runtime.so.xz" | sha256sum | cut -d' ' -f1)
  printf 'RUNS="%s"\nCERTIFY="%s"\nCERTIFY_LIMIT=%s\nVLLM_SO_SHA256=%s\nRUNTIME_SHA256=%s\n' \
    "$RUNS" "$CERTIFY" "$CERTIFY_LIMIT" "$vsha" "$rsha" > "$BUNDLE/env.sh"  # what the store holds
  ls -la "$BUNDLE/wheels"
  du -sh "$BUNDLE"
  # what the device tool sends besides the carried paths: this checkout's tracked and
  # untracked-not-ignored files
  tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s \
    2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
  limit=$((64 << 20))
  say_call() {  # NAME BYTES CARRY...
    local name=$1 bytes=$2
    shift 2
    local paths
    paths=$(printf '"%s", ' "$@")
    echo "$name: carry [${paths%, }]: $bytes bytes carried + $tree of the tree =" \
      "$((bytes + tree)) of $limit$([[ $((bytes + tree)) -gt $limit ]] && echo \
      "  OVER THE LIMIT: a smaller VLLM_SPLIT moves bytes from call 1 to call 2, or carry less")"
  }
  paths=()
  for p in "${carry[@]}"; do paths+=("$BUNDLE/$p"); done
  echo "the second call carries:"
  du -cb "${paths[@]}"
  du -ch "${paths[@]}" | tail -1
  if [[ -n ${VLLM:-} ]]; then
    say_call "call 1 (part1 v1)" "$(du -cb "$BUNDLE/v1" | tail -1 | cut -f1)" "$BUNDLE/v1"
    say_call "call 2 (part1 v2)" "$(du -cb "$BUNDLE/v2" | tail -1 | cut -f1)" "$BUNDLE/v2"
    echo "  (the largest VLLM_SPLIT call 1 fits with 256 KiB to spare:" \
      "$((limit - tree - 8192 - (256 << 10))))"
    say_call "call 3 (gpu)" "$(du -cb "${paths[@]}" | tail -1 | cut -f1)" "${paths[@]}"
  else
    say_call "the call (gpu)" "$(du -cb "${paths[@]}" | tail -1 | cut -f1)" "${paths[@]}"
  fi
  exit 0
fi

if [[ $mode == part1 ]]; then  # calls 1 and 2 of three: DIR/v1 or DIR/v2 to /tmp
  B=${2:-${BUNDLE:-.gpubundle/tune}}
  cp "$B/${3:-v1}"/* /tmp/ && ls -la "$B/${3:-v1}"
  exit 0
fi

if [[ $mode == gpu ]]; then
  BUNDLE=$(cd "$(dirname "$0")" && pwd)
  # the groups the store was built for (env.sh, written by build)
  if [[ -f $BUNDLE/env.sh ]]; then source "$BUNDLE/env.sh"; fi
  IFS=';' read -r -a groups <<< "$RUNS"
  OUT=${OUT:-/tmp/tune_out}
  # this run's own paths (a warm machine may hold another run's daemon and store)
  RUN=/tmp/tune_run STORE=/tmp/tune_run/store SOCK=/tmp/tune_run.sock
  mkdir -p "$OUT"
  t0=$(date +%s)
  for f in vllmC.part01 libcute_dsl_runtime.so.xz; do  # here, or an earlier call's in /tmp
    [[ -f $BUNDLE/$f || ! -f /tmp/$f ]] || ln -sf "/tmp/$f" "$BUNDLE/$f"
  done
  # vLLM's _C: call 1's part (in /tmp) and this bundle's. Its bytes are checked against
  # env.sh's VLLM_SO_SHA256 where it is loaded (vllm_cutlass.load: a sealed copy, hashed)
  vso=""
  if [[ -z ${VLLM_SO_SHA256:-} ]]; then
    echo "vLLM is left out: the bundle was built without VLLM=1"
  elif [[ ! -f /tmp/vllmC.part00 || ! -f $BUNDLE/vllmC.part01 ]]; then
    echo "vLLM is left out: no /tmp/vllmC.part00 (call 1, part1, on this machine first)" \
      "or no $BUNDLE/vllmC.part01 (carry it)"
  elif cat /tmp/vllmC.part00 "$BUNDLE/vllmC.part01" | xz -dc \
      > /tmp/vllm_C_stable_libtorch.abi3.so; then
    vso=/tmp/vllm_C_stable_libtorch.abi3.so
  else
    echo "vLLM is left out: its _C did not decompress (parts of another build?)"
  fi
  vargs=()
  [[ -z $vso ]] || vargs=(--vllm-so "$vso" --vllm-sha256 "$VLLM_SO_SHA256")
  nvidia-smi -L | tee "$OUT/nvidia-smi-L.txt" || true
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
    | tee "$OUT/nvidia-smi.txt" || true
  # the node's environment: a venv over the image's CUDA torch, the wheels installed in it
  rm -rf /tmp/tune_node  # a warm machine may hold another run's
  NODE=/tmp/tune_node/bin
  # the image's CUDA torch may itself sit in a venv (python3 on PATH): a venv made from it
  # sees the base interpreter's site only, so the node's venv is pointed at torch's too
  TORCH_SITE=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null || true)
  if python3 -m venv --system-site-packages /tmp/tune_node 2> "$OUT/venv.log"; then
    "$NODE/python" -m pip install -q --no-index --no-deps --no-cache-dir "$BUNDLE"/wheels/*.whl
  else  # an image without ensurepip: the venv without pip, the system's pip installs into it
    cat "$OUT/venv.log"
    python3 -m venv --system-site-packages --without-pip /tmp/tune_node
    python3 -m pip --python "$NODE/python" install -q --no-index --no-deps --no-cache-dir \
      "$BUNDLE"/wheels/*.whl
  fi
  if [[ -n $TORCH_SITE ]]; then
    echo "$TORCH_SITE" > "$("$NODE/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/image-torch.pth"
  fi
  # the runtime every kernel load opens: unpacked into the venv this run made (root's),
  # then checked against the build's digest (it may come from an earlier call's /tmp)
  xz -dc "$BUNDLE/libcute_dsl_runtime.so.xz" > /tmp/tune_node/libcute_dsl_runtime.so
  got=$(sha256sum < /tmp/tune_node/libcute_dsl_runtime.so | cut -d' ' -f1)
  if [[ $got != "${RUNTIME_SHA256:-}" ]]; then
    echo "the DSL runtime has sha256 $got, not the build's (env.sh RUNTIME_SHA256=${RUNTIME_SHA256:-}): not running" >&2
    exit 1
  fi
  # a serve-only node has no DSL compiler installed: its clients open the runtime named here
  export CACHED_DSL_RUNTIME=/tmp/tune_node/libcute_dsl_runtime.so PYTHONUNBUFFERED=1
  unset PYTHONPATH
  cd /tmp  # nothing of the bundle on sys.path: the installed packages only
  "$NODE/python" - <<'PY' | tee "$OUT/installed.txt"
import importlib.metadata as m, cached, cached_client, tvm_ffi
for d in ("cached-kernel-daemon", "cached-kernel-client", "apache-tvm-ffi", "sqlite-utils"):
    print(d, m.version(d))
print("cached from", cached.__file__)
print("cached_client from", cached_client.__file__)
try:
    import torch
    print("torch", torch.__version__, "CUDA", torch.version.cuda, "from", torch.__file__)
except ImportError as exc:
    print("no torch here:", exc)
PY
  if [[ -n $vso ]]; then  # vLLM's op against the float reference, before anything is timed
    set +e
    "$NODE/python" "$BUNDLE/tune_check.py" smoke "${vargs[@]}" 2>&1 \
      | tee "$OUT/vllm_smoke.txt"
    smoke=${PIPESTATUS[0]}
    set -e
    # 0: right; 1: a wrong result (tune_check leaves vLLM out where it is wrong); 2: it did
    # not load (tune_check says so); anything else (a crash) would take tune_check with it
    if (( smoke > 2 )); then
      echo "vLLM is left out: its smoke exited $smoke" | tee -a "$OUT/vllm_smoke.txt"
      vso="" vargs=()
    fi
  fi
  rm -rf "$RUN" && mkdir -p "$RUN"
  if [[ -f $BUNDLE/store.tar.xz ]]; then tar -C "$RUN" -xJf "$BUNDLE/store.tar.xz"
  else cp -r "$BUNDLE/store" "$STORE"; fi
  "$NODE/cached" serve --serve-only --store "$STORE" --socket "$SOCK" --no-http \
    > "$OUT/daemon.log" 2>&1 &
  daemon=$!
  for _ in $(seq 100); do  # the socket file exists before the daemon listens: ask it
    "$NODE/python" -c "from cached_client import Client; Client('$SOCK', timeout=2,
      fallback=False).hello()" 2>/dev/null && break
    sleep 0.2
  done
  echo "setup $(( $(date +%s) - t0 )) s"
  set +e
  rc=0
  read -r -a cert <<< "$CERTIFY"
  args=()
  for s in "${cert[@]}"; do args+=(--weight "$s"); done
  t1=$(date +%s)
  "$NODE/cached" certify --socket "$SOCK" --family cached.hopper_fp8 "${args[@]}" \
    --limit "$CERTIFY_LIMIT" --json > "$OUT/certify.jsonl" 2> "$OUT/certify.log"
  echo "cached certify: exit $?, $(( $(date +%s) - t1 )) s"; cat "$OUT/certify.log"
  "$NODE/python" -c "
import json
for line in open('$OUT/certify.jsonl'):
    r = json.loads(line)
    print(r['family'], f\"{r['n']}x{r['k']}\", r['device'], len(r['tactics']), 'tactics,',
          'rows differing', sum(r['rows_differing'].values()))"
  i=0
  for g in "${groups[@]}"; do
    i=$((i + 1))
    schemes=${g%%=*}
    read -r -a shapes <<< "${g#*=}"
    args=()
    for s in "${shapes[@]}"; do args+=(--weight "$s"); done
    for scheme in ${schemes//,/ }; do  # one call per scheme: its wall time
      t1=$(date +%s.%N)
      "$NODE/cached" tune --socket "$SOCK" "${args[@]}" --top "$TOP" --near "$NEAR" \
        --scheme "$scheme" --rounds "$ROUNDS" --budget "$BUDGET" --json \
        2> >(tee "$OUT/tune_$scheme.log" >&2) > "$OUT/tune_$scheme.json"
      echo "cached tune --scheme $scheme (${shapes[*]}): exit $?, $(python3 -c \
        "import time; print(f'{time.time() - $t1:.1f}')") s in all" | tee -a "$OUT/tune_times.txt"
    done
    if [[ -n ${REPEAT:-} ]]; then  # again: every bucket is published, nothing is timed
      t1=$(date +%s)
      "$NODE/cached" tune --socket "$SOCK" "${args[@]}" --scheme "$schemes" --json \
        2> >(tee "$OUT/tune_again_$i.log" >&2) > "$OUT/tune_again_$i.json"
      echo "cached tune again ($schemes): $(( $(date +%s) - t1 )) s in all"
    fi
  done
  if [[ -n ${WIDE:-} ]]; then  # a wider search on one shape, replacing its winners
    "$NODE/cached" tune --socket "$SOCK" --weight "$WIDE" --force \
      --buckets "${WIDE_BUCKETS:-1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192}" \
      --top "${WIDE_TOP:-16}" --near "${WIDE_NEAR:-3}" --rounds "$ROUNDS" --budget 60 \
      --json 2> >(tee "$OUT/tune_wide.log" >&2) > "$OUT/tune_wide.json"
  fi
  i=0
  for g in "${groups[@]}"; do
    i=$((i + 1))
    read -r -a shapes <<< "${g#*=}"
    "$NODE/python" "$BUNDLE/tune_check.py" --socket "$SOCK" --out "$OUT" \
      --rounds "$ROUNDS" --schemes "${g%%=*}" --name "tune_check_$i" \
      ${vargs[@]+"${vargs[@]}"} "${shapes[@]}" 2>&1 | tee "$OUT/tune_check_$i.log"
    [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
  done
  cat "$OUT/tune_times.txt"
  [[ ! -f $OUT/vllm_smoke.txt ]] || cat "$OUT/vllm_smoke.txt"  # again, in the output's tail
  [[ -n $vso ]] || echo "vLLM was left out"
  grep -c '"autotune.stored"' "$OUT/daemon.log" || true
  tail -3 "$OUT/daemon.log"
  kill "$daemon"
  exit "$rc"
fi
echo "usage: $0 build | part1 DIR [v1|v2] | gpu" >&2
exit 2
