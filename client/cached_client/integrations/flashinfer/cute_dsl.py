"""FlashInfer integration: unmodified FlashInfer code gets its CuTe-DSL kernels from the daemon.

``install(socket_path=None)`` hooks FlashInfer (imported only then) at the depth that
catches every caller:

- ``JitSpecCuteDsl.build_and_load`` (the class method every ``build_and_load_cute_dsl_kernel``
  call ends in, however a module imported that function). After FlashInfer's own disk cache
  (``try_load``) misses, a kernel is
  * an **mm_fp4 tactic** (module ``mm_fp4``, name from ``_blockscaled_kernel_disk_name``):
    compiled by the daemon's ``flashinfer.mm_fp4`` family;
  * a **batch-invariant class kernel** (modules ``batch_invariant_gemm`` and
    ``batch_invariant_gemm_blockscaled``, called from ``bmm_fp8`` / ``mm_fp4`` under
    ``batch_invariant=True``): compiled by ``flashinfer.bi.bmm_fp8`` / ``flashinfer.bi.mm_fp4``;
  * anything else: **write-back** (``cached_client.writeback``): one process on the node
    compiles with FlashInfer's closure and publishes the object, the others wait on its lease.
    An mm_fp4 or batch-invariant kernel goes the same way when the daemon answers
    ``unknown_toolchain`` (no toolchain of it matches this environment): it is published
    under this environment's identity, so its other processes compile it once per node.
  The object is loaded as FlashInfer loads its own disk artifacts
  (``cute.runtime.load_module``), after checking its sha256.
- ``cute_dsl_core._hash_source_files``: wrapped to remember which key files a source hash
  stands for, so a written-back kernel's sources are stated by content and path relative to
  the flashinfer package (the same in every environment with these files).
- ``precompile_mm_fp4_tactics`` (the autotuner's precompile step for mm_fp4, imported by
  name into ``gemm_base``): replaced, wherever a module holds it, by one ``prefetch`` of every
  tactic about to be profiled; the profiling loop's loads then wait on the daemon.
- ``BatchInvariantGemmRunner.precompile_tactics``: one ``prefetch`` of the candidates first.
- ``bmm_fp8_batch_invariant`` / ``mm_fp4_batch_invariant``: wrapped to note the weight shape
  (N, K) of the call, the class the kernels are compiled for.

Identity: the arch is FlashInfer's compile arch (``CUTE_DSL_ARCH`` or the device), the SM count
is the calling process's device's, and ``max_active_clusters`` is the value the calling
process computed (FlashInfer puts it in the kernel name: ``_mac<N>``, ``_g<N>``), never
recomputed by the daemon; the client adds this environment's toolchain and sources
(cached_client.identity). ``uninstall()`` restores every replaced attribute exactly. Any daemon
failure falls back to FlashInfer's own path, logged once; a daemon that stops answering costs
one wait of a few seconds (docs/integration.md, "Recovery"). What an older FlashInfer lacks
is skipped with one log line, never stopping the rest (docs/integration.md, "Versions").
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import re
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from cached_client import flashinfer_sources, identity, liveness, monitor
from cached_client.client import Client
from cached_client.errors import CachedError, UnknownToolchain
from cached_client.flashinfer_names import (
    BI_DENSE_MODULE,
    BI_MODULES,
    MM_FP4_MODULE,
    WRITE_BACK_FAMILY,
    bi_request,
    mm_fp4_request,
    write_back_request,
)
from cached_client.gemm import plan as gemm_plan
from cached_client.keys import ARCHES, DEFAULT_SM_COUNT, KernelRequest
from cached_client.loader import sealed_copy
from cached_client.protocol import Artifact

from ..jit.hook import unreachable

logger = logging.getLogger("cached_client.flashinfer")

SM_COUNT_ENV = "CACHED_SM_COUNT"
_FI_PREFIX = "flashinfer"
MAX_KEY_FILE_SETS = 4096
#: (op, N, K) of the batch-invariant API call in progress on this thread/task
_BI_CALL: contextvars.ContextVar = contextvars.ContextVar("cached_bi_call", default=None)


class _State:
    def __init__(self, client: Client, ttl_s: float, wait_s: float | None = None) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.counts: Counter[str] = Counter()
        self.replaced: list[tuple[Any, str, Any, Any]] = []  # (owner, attr, original, new)
        self.class_attrs: list[tuple[type, str, Any, bool]] = []  # (cls, attr, original, own)
        self.wrappers: dict[int, Any] = {}  # id(wrapper) -> original
        self.warned: set[str] = set()
        self.lock = threading.Lock()
        self.key_files: dict[str, tuple[str, ...]] = {}  # FlashInfer source hash -> key files


_state: _State | None = None


# -- install / uninstall -------------------------------------------------------------------


def install(socket_path: str | None = None, *, client: Client | None = None,
            timeout: float = 600.0, lease_ttl_s: float = 120.0,
            lease_wait_s: float | None = None) -> None:
    """Route FlashInfer's CuTe-DSL kernels through the daemon at ``socket_path``
    ($CACHED_SOCKET or the default socket). Idempotent; FlashInfer is imported here. A
    written-back kernel another process holds the lease on is waited for at most
    ``lease_wait_s`` seconds (None: ``writeback.WAIT_S``), then compiled here
    (writeback.WaitedTooLong)."""
    global _state
    if _state is not None:
        return
    import flashinfer.gemm.gemm_base  # noqa: F401 -- imports the names we replace
    import flashinfer.gemm.gemm_mm_fp4_cute_dsl as mm_fp4
    from flashinfer.jit import cute_dsl_core
    from flashinfer.jit.cute_dsl_core import JitSpecCuteDsl

    try:
        import flashinfer.gemm.batch_invariant.api as bi_api
        import flashinfer.gemm.batch_invariant.tuning as bi_tuning
    except ImportError as exc:  # FlashInfer < 0.7.4: no batch-invariant classes
        bi_api = bi_tuning = None
        logger.info("cached: FlashInfer %s has no batch-invariant GEMMs (%s); their hooks are "
                    "skipped", identity.versions().get("flashinfer-python"), exc)
    state = _State(client or Client(socket_path, timeout=timeout, fallback=False), lease_ttl_s,
                   lease_wait_s)
    _patch_class(state, JitSpecCuteDsl, "build_and_load", _build_and_load)
    _patch_class(state, JitSpecCuteDsl, "compile_and_persist", _compile_and_persist)
    hasher = cute_dsl_core._hash_source_files
    _replace_everywhere(state, hasher, _wrap(hasher, _record_key_files))
    _replace_everywhere(state, mm_fp4.precompile_mm_fp4_tactics,
                        _wrap(mm_fp4.precompile_mm_fp4_tactics, _precompile_mm_fp4_tactics))
    if bi_api is not None and bi_tuning is not None:
        _patch_class(state, bi_tuning.BatchInvariantGemmRunner, "precompile_tactics",
                     _bi_precompile_tactics)
        for name, op in (("bmm_fp8_batch_invariant", "bmm_fp8"),
                         ("mm_fp4_batch_invariant", "mm_fp4")):
            original = getattr(bi_api, name)
            _replace_everywhere(state, original,
                                _wrap(original, functools.partial(_bi_call, op)))
    _state = state
    logger.info("cached: FlashInfer's CuTe-DSL kernels are now asked of the daemon at %s",
                state.client.socket_path)


def uninstall() -> None:
    """Restore FlashInfer exactly as it was before :func:`install`."""
    global _state
    state, _state = _state, None
    if state is None:
        return
    for cls, attr, original, own in reversed(state.class_attrs):
        if own:
            setattr(cls, attr, original)
        else:
            delattr(cls, attr)
    for owner, attr, original, new in reversed(state.replaced):
        if getattr(owner, attr, None) is new:
            setattr(owner, attr, original)
    # modules imported after install() took the wrapper from a patched module: restore them too
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith(_FI_PREFIX):
            continue
        for attr, value in list(vars(module).items()):
            original = state.wrappers.get(id(value))
            if original is not None:
                setattr(module, attr, original)
    state.client.close()


def installed() -> bool:
    return _state is not None


def stats() -> dict:
    """What the integration did in this process: daemon, write_back_hit, write_back_compiled,
    prefetched, fallback."""
    return dict(_state.counts) if _state is not None else {}


def _patch_class(state: _State, cls: type, attr: str, new: Any) -> None:
    own = attr in cls.__dict__
    original = cls.__dict__[attr] if own else getattr(cls, attr)
    state.class_attrs.append((cls, attr, original, own))
    setattr(cls, attr, _wrap(original, new))


def _wrap(original: Any, new: Any) -> Any:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _state is None:
            return original(*args, **kwargs)
        return new(original, *args, **kwargs)

    return wrapper


def _replace_everywhere(state: _State, original: Any, wrapper: Any) -> None:
    """Replace ``original`` in every loaded FlashInfer module that holds it (a module that
    did ``from x import f`` at its top has its own reference)."""
    state.wrappers[id(wrapper)] = original
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith(_FI_PREFIX):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, wrapper)
                state.replaced.append((module, attr, original, wrapper))


# -- the calling process's identity --------------------------------------------------------


def _arch() -> str | None:
    from flashinfer.jit.cute_dsl_core import _get_compile_arch

    m = re.match(r"^sm(\d+)([a-z]?)$", _get_compile_arch())
    arch = f"sm_{m.group(1)}{m.group(2)}" if m else ""
    return arch if arch in ARCHES else None


def _sm_count(arch: str) -> int:
    """The calling process's device's SM count ($CACHED_SM_COUNT, the current CUDA device, or
    the arch's usual part on a machine without one)."""
    if os.environ.get(SM_COUNT_ENV):
        return int(os.environ[SM_COUNT_ENV])
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(torch.cuda.current_device())
                       .multi_processor_count)
    except Exception:  # noqa: BLE001 -- no usable device: the arch's default part
        pass
    return DEFAULT_SM_COUNT[arch]


def _request_for(spec: Any, arch: str, sm_count: int) -> KernelRequest | None:
    if spec.module_name == MM_FP4_MODULE:
        return mm_fp4_request(spec.kernel_name, arch, sm_count)
    if spec.module_name in BI_MODULES:
        return bi_request(spec.module_name, spec.kernel_name, _BI_CALL.get(), arch, sm_count)
    return None


# -- the hooks -----------------------------------------------------------------------------


def _family_of(spec: Any) -> str:
    """The daemon family a FlashInfer CuTe-DSL module's kernels are filed under."""
    if spec.module_name == MM_FP4_MODULE:
        return "flashinfer.mm_fp4"
    if spec.module_name in BI_MODULES:
        return ("flashinfer.bi.bmm_fp8" if spec.module_name == BI_DENSE_MODULE
                else "flashinfer.bi.mm_fp4")
    return WRITE_BACK_FAMILY


def _compiled_here(state: _State, spec: Any, exc: BaseException | None) -> None:
    """FlashInfer compiles ``spec`` in this process (``exc``: the daemon problem that sent
    it there, None when the daemon was not asked): counted by the serving monitor; a daemon
    found unusable is told to this process's prober (cached_client.liveness), and told of
    this fallback once it answers."""
    family = _family_of(spec)
    monitor.outside(family, spec.kernel_name, "compiled")
    live = liveness.watched(state.client.socket_path)
    if live is not None and (exc is None or unreachable(exc)):
        if exc is not None:
            live.lost(exc)
        live.fell_back(family)


def _warn_once(state: _State, what: str, exc: BaseException) -> None:
    state.counts["fallback"] += 1
    if what not in state.warned:
        state.warned.add(what)
        logger.warning("cached: %s failed (%s: %s); FlashInfer compiles it in this process",
                       what, type(exc).__name__, exc)


def _tvm_ffi(spec: Any) -> bool:
    """Whether the spec's kernel is a TVM-FFI function (FlashInfer 0.7.2.post1: always)."""
    return bool(getattr(spec, "enable_tvm_ffi", True))


def _export(spec: Any, path: str) -> None:
    """Export the spec's compiled kernel as FlashInfer's own ``_export`` would."""
    if hasattr(spec, "_export_object"):
        spec._export_object(Path(path))
    else:  # FlashInfer 0.7.2.post1 exports inline, always as a TVM-FFI function
        spec._compiled_kernel.export_to_c(str(path), function_name=spec.symbol)


def _load(spec: Any, artifact: Artifact) -> Any:
    """Load a stored object as FlashInfer loads its own disk artifacts, from a sealed copy
    of its bytes hashed after sealing (cached_client.loader.sealed_copy): the path is read
    once, so nothing renamed over it afterwards is what loads. Checked before: the daemon's
    uid at connect and the artifact's stated identity (``Client.get``); here the digest.
    A forged object is refused in tests/test_client_trust.py
    (``test_the_flashinfer_hook_loads_the_object_bytes_it_hashed``)."""
    if artifact.symbol != spec.symbol or artifact.object_path is None:
        raise CachedError(f"the daemon's artifact exports {artifact.symbol!r}, FlashInfer "
                          f"expects {spec.symbol!r}")
    import cutlass.cute as cute

    fd = sealed_copy(artifact.object_path, artifact.object_sha256)
    try:
        module = cute.runtime.load_module(f"/proc/self/fd/{fd}", enable_tvm_ffi=_tvm_ffi(spec))
    finally:
        os.close(fd)
    return getattr(module, spec.symbol)


def _record_key_files(original: Any, paths: Any) -> str:
    """FlashInfer's source hash, remembering which key files it stands for."""
    sha = original(paths)
    state = _state
    if state is not None and len(state.key_files) < MAX_KEY_FILE_SETS:
        state.key_files[sha] = tuple(str(p) for p in paths)
    return sha


def _relative_key_files(state: _State, spec: Any) -> tuple[str, ...] | None:
    """The spec's key files relative to the flashinfer package, when FlashInfer hashed them
    in this process and all are inside it; else None."""
    paths = state.key_files.get(spec.expected_meta["source_sha256"])
    root = flashinfer_sources.package_dir()
    if not paths or root is None:
        return None
    base = root.resolve()
    try:
        return tuple(sorted({Path(p).resolve().relative_to(base).as_posix() for p in paths}))
    except (OSError, ValueError):
        return None


def _from_daemon(state: _State, spec: Any) -> Any:
    arch = _arch()
    if arch is None:
        raise CachedError("the compile arch is not one the daemon builds for")
    sm_count = _sm_count(arch)
    request = _request_for(spec, arch, sm_count)
    if request is None:
        files = _relative_key_files(state, spec)
        source = (identity.flashinfer_files_source(files) if files
                  else spec.expected_meta["source_sha256"])
        request = write_back_request(spec.module_name, spec.kernel_name, _tvm_ffi(spec),
                                     source, arch, sm_count, files)
        return _write_back(state, spec, request)
    try:
        artifact = state.client.get(request, blobs=("object",))
    except UnknownToolchain as exc:  # no toolchain of the daemon is this environment's
        state.counts["unknown_toolchain"] += 1
        if "unknown_toolchain" not in state.warned:
            state.warned.add("unknown_toolchain")
            logger.warning("cached: %s; this environment's kernels are compiled in its own "
                           "processes, once per node, and shared through the daemon",
                           exc.message)
        return _write_back(state, spec, request)
    if artifact.kernel_name != spec.kernel_name:
        raise CachedError(f"the daemon named {request.family} kernel "
                          f"{artifact.kernel_name!r}, FlashInfer {spec.kernel_name!r}")
    state.counts["daemon"] += 1
    return _load(spec, artifact)


def _write_back(state: _State, spec: Any, request: KernelRequest) -> Any:
    """Compile ``spec`` here under a lease on ``request`` (keyed under this environment's
    identity) and publish it, or load what another process of the node published."""
    from cached_client import writeback

    def compile_object(path: str) -> Any:
        spec._compiled_kernel = spec.compile_fn()
        _export(spec, path)
        return spec._compiled_kernel

    wait_s = writeback.WAIT_S if state.wait_s is None else state.wait_s
    artifact, compiled = writeback.obtain(state.client, request, compile_object, state.ttl_s,
                                          wait_s, kernel_name=spec.kernel_name)
    state.counts["write_back_compiled" if compiled is not None else "write_back_hit"] += 1
    if compiled is not None:
        monitor.outside(request.family, spec.kernel_name, "compiled")
    try:
        return _load(spec, artifact)
    except Exception:
        if compiled is not None:
            return compiled
        raise


def _down(state: _State) -> bool:
    """Whether this process's prober (if one runs) says the daemon does not answer now."""
    live = liveness.watched(state.client.socket_path)
    return live is not None and not live.usable()


def _build_and_load(original: Any, spec: Any) -> Any:
    state = _state
    cached = spec.try_load()  # FlashInfer's own disk cache first: nothing to ask for
    if cached is not None or state is None:
        if cached is not None:
            monitor.outside(_family_of(spec), spec.kernel_name, "loaded")
        return cached if cached is not None else original(spec)
    if _down(state):  # not asked: the prober tells when it answers again
        state.counts["fallback"] += 1
        _compiled_here(state, spec, None)
        return original(spec)
    try:
        return _from_daemon(state, spec)
    except Exception as exc:  # noqa: BLE001 -- a daemon problem costs speed, not correctness
        _warn_once(state, f"getting {spec.module_name} kernels from the daemon", exc)
        _compiled_here(state, spec, exc)
        return original(spec)


def _compile_and_persist(original: Any, spec: Any) -> None:
    state = _state
    if _down(state):
        state.counts["fallback"] += 1
        _compiled_here(state, spec, None)
        original(spec)
        return
    try:
        spec._compiled_kernel = _from_daemon(state, spec)
    except Exception as exc:  # noqa: BLE001
        _warn_once(state, f"getting {spec.module_name} kernels from the daemon", exc)
        _compiled_here(state, spec, exc)
        original(spec)


def _precompile_mm_fp4_tactics(original: Any, tactics: Any, m: int, n: int, real_k: int,
                               use_nvfp4: bool, enable_pdl: bool, out_dtype: Any,
                               kernel_cache: Any, device: Any, per_token_alpha: bool = False
                               ) -> None:
    """The autotuner's precompile step: one prefetch of every tactic it will profile."""
    state = _state
    try:
        from flashinfer.cute_dsl.utils import get_max_active_clusters
        from flashinfer.gemm.gemm_mm_fp4_cute_dsl import (
            _mm_fp4_cache_key,
            mm_fp4_l2_policy,
            per_token_alpha_mode,
        )
        from flashinfer.utils import get_device_index

        arch = _arch()
        if arch is None:
            raise CachedError("the compile arch is not one the daemon builds for")
        sm_count = _sm_count(arch)
        sf_vec_size = 16 if use_nvfp4 else 32
        index = get_device_index(device)
        macs: dict[int, int] = {}
        requests = []
        for tactic in tactics:
            tile, cluster, swap_ab, prefetch, kernel_type, tma = tactic
            if kernel_type not in ("sm100", "sm100sk"):
                continue
            alpha = per_token_alpha_mode(per_token_alpha, swap_ab)
            l2 = mm_fp4_l2_policy(m, tile, swap_ab, kernel_type)
            if (index, _mm_fp4_cache_key(sf_vec_size, tactic, enable_pdl, out_dtype, alpha,
                                         l2)) in kernel_cache:
                continue
            size = cluster[0] * cluster[1] * (tma if kernel_type == "sm100sk" else 1)
            if size not in macs:  # the calling process's own occupancy answer
                macs[size] = int(get_max_active_clusters(size))
            params = {"sf_vec_size": sf_vec_size, "mma_tiler_mn": list(tile),
                      "cluster_shape_mn": list(cluster), "swap_ab": bool(swap_ab),
                      "use_prefetch": bool(prefetch), "kernel_type": kernel_type,
                      "use_tma_store": tma, "enable_pdl": bool(enable_pdl),
                      "out_dtype": str(out_dtype).removeprefix("torch."),
                      "per_token_alpha": alpha, "l2_policy": l2}
            requests.append(KernelRequest("flashinfer.mm_fp4", params, arch, sm_count,
                                          macs[size]))
        if requests:
            state.client.prefetch(requests)
            state.counts["prefetch_calls"] += 1
            state.counts["prefetched"] += len(requests)
    except Exception as exc:  # noqa: BLE001
        _warn_once(state, "prefetching mm_fp4 tactics", exc)
        return original(tactics, m, n, real_k, use_nvfp4, enable_pdl, out_dtype, kernel_cache,
                        device, per_token_alpha)
    return None


def _bi_call(op: str, original: Any, *args: Any, **kwargs: Any) -> Any:
    a, b = args[0], args[1]
    k = int(a.shape[-1]) * (2 if op == "mm_fp4" else 1)  # mm_fp4's operands are packed
    token = _BI_CALL.set((op, int(b.shape[-1]), k))
    try:
        return original(*args, **kwargs)
    finally:
        _BI_CALL.reset(token)


def _bi_precompile_tactics(original: Any, runner: Any, inputs: Any, tactics: Any, profile: Any,
                           **kwargs: Any) -> Any:
    """Prefetch the batch-invariant candidates (and the default) in one call, then let
    FlashInfer's precompile load them (hits, or waits on compiles already running)."""
    state = _state
    try:
        if runner.api in ("bmm_fp8", "mm_fp4"):
            from flashinfer.gemm.batch_invariant.api import persistent_clusters

            arch = _arch()
            if arch is None:
                raise CachedError("the compile arch is not one the daemon builds for")
            sm_count = _sm_count(arch)
            m, n, k = runner._shape(inputs)
            family = f"flashinfer.bi.{runner.api}"
            requests = {}
            direct_only = True
            for tactic in [-1, *tactics]:
                cfg = runner.config_for(inputs, tactic)
                grid = persistent_clusters(inputs[0].device, cfg)
                knobs = {"mma_tiler_mn": list(cfg.mma_tiler_mn),
                         "cluster_shape_mn": list(cfg.cluster_shape_mn),
                         "use_2cta_instrs": cfg.use_2cta_instrs,
                         "use_tma_store": cfg.use_tma_store, "raster_along": cfg.raster_along,
                         "swizzle_size": cfg.swizzle_size, "cta_chunks": cfg.cta_chunks,
                         "cluster_k": cfg.cluster_k, "swap_ab": cfg.swap_ab}
                direct_only &= (runner.chunks == 1 or cfg.cta_chunks or cfg.cluster_k > 1)
                params = {"kind": "gemm", "n": n, "k": k, "in_fmt": runner.in_fmt,
                          "out_fmt": {"torch.bfloat16": "bf16", "torch.float16": "f16"}[
                              str(inputs[-1].dtype)], "chunks": runner.chunks,
                          "b_major": runner.b_major, "knobs": knobs}
                req = KernelRequest(family, params, arch, sm_count, int(grid))
                requests[req] = None
            if not direct_only:
                fixup = dict(params)
                for name in ("b_major", "knobs"):
                    fixup.pop(name)
                fixup["kind"] = "fixup"
                requests[KernelRequest(family, fixup, arch, sm_count, 1)] = None
            state.client.prefetch(list(requests))
            state.counts["prefetch_calls"] += 1
            state.counts["prefetched"] += len(requests)
    except Exception as exc:  # noqa: BLE001
        _warn_once(state, "prefetching batch-invariant candidates", exc)
    token = _BI_CALL.set((runner.api, *runner._shape(inputs)[1:]))
    try:
        return original(runner, inputs, tactics, profile, **kwargs)
    finally:
        _BI_CALL.reset(token)


gemm_plan.register_installer(gemm_plan.FLASHINFER_BI_FAMILY, install)
