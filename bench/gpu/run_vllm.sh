#!/usr/bin/env bash
# vLLM 0.33.0 on the H200 with the daemon's batch-invariant FP8 GEMMs (issue 26): a small
# random-weight FP8 Llama (bench/gpu/vllm_fp8.py) served by vllm.LLM in three modes, a
# serve-only daemon holding a store built here.
#
# What travels does not fit one call (64 MiB with the checkout), so three calls on one warm
# machine (each within 30 s of the last; /tmp survives between them):
#   here:  bench/gpu/run_vllm.sh build        -> .dev/vllm-h200/{A,B,C} (git-ignored)
#   there: bash .dev/vllm-h200/A/run_vllm.sh A (carry [".dev/vllm-h200/A"]): vLLM's
#          _C_stable_libtorch.abi3.so, first half (xz)
#          bash .dev/vllm-h200/B/run_vllm.sh B (carry [".dev/vllm-h200/B"]): second half,
#          cp312 wheels (vLLM's missing pure deps, TVM-FFI, the daemon's deps)
#          bash .dev/vllm-h200/C/run_vllm.sh gpu (carry [".dev/vllm-h200/C"]): vLLM's
#          Python sources, the DSL runtime (xz), the store, this code; runs everything,
#          prints the tables last.
# Each folder holds a copy of this script. SCHEME=block (build): a block-FP8 checkpoint
# (128x128 weight blocks, dynamic 1x128 activation groups, DeepSeek-V3's format) and the
# store's block128 kernels instead of per-tensor ones; SCHEME=token: an FP8-dynamic
# checkpoint (compressed-tensors: per-channel weight scales, dynamic per-token activations)
# and the store's per-token kernels; SCHEME=bf16: a BF16 checkpoint (no quantization, the
# 128,256-word vocabulary unless VOCAB says otherwise) and the store's cached.hopper_bf16
# kernels for the four linears and the lm_head (what the plugin's BF16 path plans under
# VLLM_BATCH_INVARIANT=1); the FP8 schemes' stores hold the BF16 lm_head's kernels too
# (VOCAB x 4096). The gpu call reads the scheme and vocabulary from C/. TUNE=1 (build):
# the store also holds every candidate `cached tune` times for the model's shapes
# (tune_bundle.py: the plan's first 3 plus the 6 a widened bucket adds, and the 2 nearest
# recorded winners, per M bucket), and
# the gpu call runs `cached tune` against the daemon before the modes start, so (c) plans
# from this card's winners (BF16 and FP8-dynamic: the schemes bf16 and token-fast).
set -euo pipefail
SHAPES=(6144,4096 4096,4096 28672,4096 4096,14336)  # Llama-3.1-8B's qkv, o, gate_up, down
MAX_M=8192
mode=${1:-build}

if [[ $mode == build ]]; then
  cd "$(dirname "$0")/../.."
  main=$(git rev-parse --path-format=absolute --git-common-dir)/..
  D=${BUNDLE:-$main/.dev/vllm-h200}
  PY=${PYTHON:-.venv/bin/python}
  SITE=${VLLM_SITE:-$main/.venv-vllm/lib/python3.11/site-packages}
  exclude=$(git rev-parse --path-format=absolute --git-common-dir)/info/exclude
  grep -qx '/.dev/' "$exclude" 2>/dev/null || echo '/.dev/' >> "$exclude"  # never committed
  rm -rf "$D" && mkdir -p "$D/A" "$D/B/wheels" "$D/C/src/client"
  # the store: every kernel the client's plans pick for the four shapes, M up to MAX_M
  scheme=${SCHEME:-tensor}
  vocab=${VOCAB:-32768} && shapes=("${SHAPES[@]}") && ab=e4m3
  case $scheme in tensor) scales=tensor ;; block) scales=block128 ;; token) scales=token ;;
    bf16) scales=none ab=bf16 vocab=${VOCAB:-128256} shapes+=("$vocab,4096") ;;  # + lm_head
    *) echo "SCHEME is tensor, block, token or bf16, not $scheme"; exit 2 ;; esac
  echo "$scheme" > "$D/C/scheme" && echo "$vocab" > "$D/C/vocab"
  SCALES=$scales AB_DTYPE=$ab \
    CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/gemm_plan_bundle.py "$D/C/store" "$MAX_M" \
    "${shapes[@]}" | tee "$D/C/build.log"
  if [[ $ab != bf16 ]]; then  # the FP8 model's lm_head is BF16: the plugin serves it too
    AB_DTYPE=bf16 CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/gemm_plan_bundle.py \
      "$D/C/store" "$MAX_M" "$vocab,4096" | tee -a "$D/C/build.log"
  fi
  if [[ -n ${TUNE:-} ]]; then
    case $scheme in bf16) tune=bf16 ;; token) tune=token-fast ;; tensor) tune=tensor-fast ;;
      *) echo "TUNE covers SCHEME bf16, token and tensor"; exit 2 ;; esac
    CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/tune_bundle.py "$D/C/store" 3 2 \
      --schemes "$tune" "${shapes[@]}" | tee -a "$D/C/build.log"
    echo "$tune ${shapes[*]}" > "$D/C/tune"  # a line a scheme: the scheme, then its shapes
    if [[ $ab != bf16 ]]; then  # the FP8 model's BF16 lm_head is tuned too
      CUTE_DSL_ARCH=sm_90a nice -n 10 "$PY" bench/gpu/tune_bundle.py "$D/C/store" 3 2 \
        --schemes bf16 "$vocab,4096" | tee -a "$D/C/build.log"
      echo "bf16 $vocab,4096" >> "$D/C/tune"
    fi
  fi
  rm -rf "$D/C/store/tmp" "$D/C/store/index.sqlite-wal" "$D/C/store/index.sqlite-shm"
  tar -C "$D/C" -cf - store | xz -T2 -6 > "$D/C/store.tar.xz" && rm -rf "$D/C/store"
  # vLLM's compiled ops (stripped: 79 MB, 60 MiB as xz) in two halves, the DSL runtime
  tmp=$(mktemp -d)
  strip --strip-unneeded -o "$tmp/c.so" "$SITE/vllm/_C_stable_libtorch.abi3.so"
  xz -T2 -6 -c "$tmp/c.so" > "$tmp/c.so.xz" && rm "$tmp/c.so"
  split -b 33M "$tmp/c.so.xz" "$tmp/c.so.xz." && rm "$tmp/c.so.xz"
  mv "$tmp/c.so.xz.aa" "$D/A/" && mv "$tmp/c.so.xz.ab" "$D/B/" && rmdir "$tmp"
  xz -T2 -6 -c "$("$PY" -c 'from cached.toolchain.compiler_stack import runtime_library_path as p; print(p())')" \
    > "$D/C/dslrt.xz"
  # vLLM's Python sources: no .so (flash-attn's: vllm_site_patch.py), no vendored
  # third_party packages, no Rust
  tar -C "$SITE" --exclude='__pycache__' --exclude='*.so' --exclude='vllm/third_party/*/' \
    --exclude='vllm/vllm-rs' -cf - vllm vllm-0.33.0.dist-info | xz -T2 -6 > "$D/C/vllm.txz"
  # cp312 wheels: what vLLM imports that the H200's image lacks, TVM-FFI, the daemon's deps
  for spec in pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 \
      typing_inspection==0.4.5 pyzmq==27.3.0 msgspec==0.23.0 cbor2==6.3.0 pybase64==1.5.1 \
      cachetools==8.0.2 fastapi==0.136.3 starlette==1.10.0 sniffio==1.3.1 openai==3.57.0 \
      oss_harmony==0.0.11 partial-json-parser==0.2.1.1.post7 xgrammar==0.2.8 jiter==0.19.0 \
      httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 compressed-tensors==0.17.0 \
      loguru==0.7.3 depyf==0.20.0 astor==0.8.1 dill==0.4.1 llguidance==1.7.6 \
      "apache-tvm-ffi==$("$PY" -c "import importlib.metadata as m; print(m.version('apache-tvm-ffi'))")"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 -d "$D/B/wheels" "$spec"
  done
  for pkg in sqlite-utils click click-default-group python-dateutil tzdata pluggy tabulate \
             sqlite-fts4; do
    ver=$("$PY" -c "import importlib.metadata as m; print(m.version('$pkg'))")
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$D/B/wheels" "$pkg==$ver"
  done
  # B (with the checkout) would pass the 64 MiB a call carries: its two largest wheels go in C
  mkdir -p "$D/C/wheels" && mv "$D/B/wheels"/oss_harmony-*.whl "$D/B/wheels"/llguidance-*.whl \
    "$D/C/wheels/"
  cp -r cached "$D/C/src/" && cp -r client/cached_client "$D/C/src/client/"
  cp bench/gpu/vllm_fp8.py bench/gpu/vllm_site_patch.py "$D/C/"
  for part in A B C; do cp bench/gpu/run_vllm.sh "$D/$part/"; done
  find "$D/C/src" -name __pycache__ -prune -exec rm -rf {} +
  du -sh "$D"/*
  exit 0
fi

X=/tmp/vx  # what the three calls leave on the machine
if [[ $mode == A ]]; then
  D=$(cd "$(dirname "$0")/.." && pwd)
  mkdir -p $X && cp "$D/A/c.so.xz.aa" $X/
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv || true
  ls -la $X
  exit 0
fi
if [[ $mode == B ]]; then
  D=$(cd "$(dirname "$0")/.." && pwd)
  [[ -f $X/c.so.xz.aa ]] || { echo "no $X/c.so.xz.aa: the machine was not kept warm"; exit 3; }
  cat $X/c.so.xz.aa "$D/B/c.so.xz.ab" | xz -d > $X/_C_stable_libtorch.abi3.so
  rm $X/c.so.xz.aa
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$D/B/wheels"/*.whl
  ls -la $X && du -sh /tmp/site
  exit 0
fi

if [[ $mode == gpu ]]; then
  C=$(cd "$(dirname "$0")" && pwd)
  OUT=${OUT:-/tmp/vllm_out}
  L=/tmp/vllm_logs && rm -rf $L && mkdir -p "$OUT" $L
  [[ -f $X/_C_stable_libtorch.abi3.so && -d /tmp/site/pydantic ]] \
    || { echo "calls A and B did not leave their files: the machine was not kept warm"; exit 3; }
  if [[ -d $C/wheels ]]; then  # the wheels B could not carry
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "$C/wheels"/*.whl
  fi
  tar -C /tmp/site -xJf "$C/vllm.txz" && python3 "$C/vllm_site_patch.py" /tmp/site
  xz -d -c "$C/dslrt.xz" > $X/libcute_dsl_runtime.so
  cp $X/_C_stable_libtorch.abi3.so /tmp/site/vllm/
  # the client's vLLM plugin entry point, as its wheel would install it
  mkdir -p /tmp/site/cached_kernel_client-0.1.0.dist-info
  printf 'Metadata-Version: 2.1\nName: cached-kernel-client\nVersion: 0.1.0\n' \
    > /tmp/site/cached_kernel_client-0.1.0.dist-info/METADATA
  printf '[vllm.general_plugins]\ncached = cached_client.integrations.vllm.plugin:register\n' \
    > /tmp/site/cached_kernel_client-0.1.0.dist-info/entry_points.txt
  export PYTHONPATH=/tmp/site:$C/src/client:$C/src PYTHONUNBUFFERED=1
  export CACHED_DSL_RUNTIME=$X/libcute_dsl_runtime.so
  # the daemon refuses a socket in a world-writable directory without the sticky bit (/tmp
  # there is 0777): a private one
  S=/tmp/cachedd/cached.sock && mkdir -p -m 700 /tmp/cachedd
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv | tee $L/nvidia-smi.txt || true
  rm -rf /tmp/store && tar -C /tmp -xJf "$C/store.tar.xz"
  cd /tmp  # `python3 -m` puts the working directory first on sys.path
  python3 -m cached serve --serve-only --store /tmp/store --socket $S --no-http \
    > $L/daemon.log 2>&1 &
  for _ in $(seq 100); do
    python3 -c "from cached_client import Client; Client('$S', timeout=2,
      fallback=False).hello()" 2>/dev/null && break
    sleep 0.2
  done
  export CACHED_SOCKET=$S
  tunes=/dev/null && [[ -f $C/tune ]] && tunes=$C/tune
  while read -r -a tune; do  # this card's winners first: (c) plans from them
    args=() && for s in "${tune[@]:1}"; do args+=(--weight "$s"); done
    t1=$(date +%s)
    rc=0 && python3 -m cached tune --socket $S "${args[@]}" --scheme "${tune[0]}" --top 3 \
      --near 2 --rounds 5 --budget 60 --json > "$OUT/tune_${tune[0]}.json" \
      2>> $L/tune.log < /dev/null || rc=$?
    echo "cached tune --scheme ${tune[0]} ${tune[*]:1}: exit $rc, $(( $(date +%s) - t1 )) s"
  done < "$tunes"
  grep -E "buckets tuned" $L/tune.log 2>/dev/null | tail -10 || true
  set +e
  [[ -n ${PREFLIGHT:-} ]] && python3 "$C/vllm_fp8.py" preflight 2>&1 | grep -v "^W[0-9]" \
    | tee $L/preflight.log | tail -3
  python3 "$C/vllm_fp8.py" ckpt /tmp/ck --layers "${LAYERS:-4}" \
    --scheme "$(cat "$C/scheme" 2>/dev/null || echo tensor)" \
    --vocab "$(cat "$C/vocab" 2>/dev/null || echo 32768)" 2>&1 | tee $L/ckpt.log
  python3 -c "import importlib.util as u; print('cutlass (CuTe DSL compiler) importable:',
    u.find_spec('cutlass') is not None)" | tee $L/dsl.txt
  # the modes' processes start together: imports overlap; loads, then measurements, take
  # turns (vllm_fp8.py --turns), so each mode measures with the GPU to itself
  T=/tmp/turns && rm -rf $T && mkdir -p $T
  # MODE_TIMEOUT: seconds of a mode's own work (not its waits for the others' turns);
  # the process is ended at the latest when every mode could have used its whole share
  ORDER=${ORDER:-c,b,a} && pids=() && modes=(${ORDER//,/ }) && own=${MODE_TIMEOUT:-300}
  for m in "${modes[@]}"; do
    TRITON_CACHE_DIR=/tmp/triton_$m timeout $((own * ${#modes[@]})) python3 "$C/vllm_fp8.py" \
      engine /tmp/ck --mode "$m" --out $OUT/engine_$m.json --turns $T --order $ORDER \
      --mode-timeout "$own" \
      --compile-mode "${COMPILE_MODE:-0}" --trace-dir $L ${QUICK:+--quick} ${HOST:+--host} \
      ${NO_TIMELINE:+--no-timeline} ${CONTEXT:+--context $CONTEXT} ${BATCHES:+--batches $BATCHES} \
      ${GPU_UTIL:+--gpu-memory-utilization $GPU_UTIL} ${PROFILE_ONLY:+--profile-only} \
      > $OUT/engine_$m.log 2>&1 &  # under $OUT: back even if the call's limit stops it
    pids+=($!)
  done
  wait "${pids[@]}"  # the modes only: a bare `wait` also waits for the daemon, forever
  for m in ${ORDER//,/ }; do
    echo "mode $m triton files: $(find /tmp/triton_$m -type f 2>/dev/null | wc -l)" \
      | tee -a $L/modes.txt
    if grep -q '"stage": "done"' $OUT/engine_$m.json 2>/dev/null; then
      grep -E "^(kernels|invariance|perf|profile|timeline|host|monitor)" $OUT/engine_$m.log \
        | cut -c1-400 | tail -22
    else
      grep -v "^W[0-9]\|^\[rank0\]" $OUT/engine_$m.log | tail -25
    fi
  done
  if ! grep -q '"stage": "done"' $OUT/engine_c.json 2>/dev/null && [[ -z ${NO_LAYERS:-} ]]; then
    timeout 90 python3 "$C/vllm_fp8.py" layers /tmp/ck --out $L/layers.json > $L/layers.log 2>&1
    tail -20 $L/layers.log
  fi
  python3 -m cached stats --socket $S --json > $L/stats.json 2>&1
  python3 -c "import json; s=json.load(open('$L/stats.json')); print({k: s.get(k) for k in
    ('serve_only', 'entries', 'hits', 'misses', 'compiles',
    'client_outside_kernels', 'outside_kernels', 'client_fallbacks')})" 2>&1 | tee $L/stats.txt
  tar -C /tmp -czf "$OUT/logs.tgz" vllm_logs
  python3 "$C/vllm_fp8.py" summarize $OUT/engine_a.json $OUT/engine_b.json $OUT/engine_c.json \
    | tee "$OUT/summary.md"
  exit 0
fi
echo "usage: $0 build | A | B | gpu" >&2
exit 2
