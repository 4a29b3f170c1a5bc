"""vLLM general plugin (entry point group ``vllm.general_plugins``, name ``cached``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
At ``$CACHED_SOCKET``, or the default socket that answers (cached_client.paths.find_socket),
it starts that socket's prober (cached_client.integrations.vllm.state: the daemon's first
answer is waited for 0.25 s at most, then asked for in the background with backoff), logs
one line through vLLM's logger saying what is true now, and attaches the rest to imports,
so that it costs nothing where unused (no FlashInfer import, no CUDA call). The hooks are
installed whether or not the daemon answered: they ask it only while the prober hears from
it, so a daemon that is down or hung at start, or restarted later, is used again once it
answers (and told how many kernels the process compiled meanwhile):

* when FlashInfer is first imported: FlashInfer's CuTe-DSL kernels come from the daemon
  (:func:`cached_client.integrations.flashinfer.cute_dsl.install`), and its nvcc JIT
  modules are compiled once per node (:func:`cached_client.integrations.jit.nvcc.install`);
* when Humming's compiler module is first imported: its cubins are compiled once per node
  (:func:`cached_client.integrations.jit.humming.install`);
* Triton (installed with its remote-cache interface, and neither ``TRITON_CACHE_MANAGER``
  nor ``TRITON_REMOTE_CACHE_BACKEND`` set by the user): both are set so that Triton's
  kernels are compiled once per node (cached_client.integrations.jit.triton); the
  processes vLLM starts inherit them;
* when vLLM's linear-kernel registry is imported: the daemon-backed FP8 kernel class and
  the W4A16 pin (:func:`cached_client.integrations.vllm.kernel.attach_linear`); it is
  offered to a model only if the daemon answers when the model's kernels are chosen;
* when ``vllm.model_executor.layers.linear`` and ``.vocab_parallel_embedding`` are imported:
  under ``VLLM_BATCH_INVARIANT=1``, unquantized BF16 linears (router gates included) and the
  lm_head run ``cached.hopper_bf16`` from the daemon where it serves their shapes
  (:mod:`cached_client.integrations.vllm.bf16`), vLLM's batch-invariant kernel elsewhere;
* when ``vllm.config.kernel`` is imported: ``--linear-backend cached`` is accepted;
* when ``vllm.utils.flashinfer`` is imported, under ``VLLM_BATCH_INVARIANT=1`` on a vLLM that
  lacks vLLM #62192's pin: FlashInfer's FP8 bmm on ``cutlass`` instead of ``auto``;
* when ``vllm.v1.worker.gpu_worker`` is imported: the serving monitor
  (cached_client.monitor) starts as a worker's ``compile_or_warm_up_model`` returns.

Every line goes through vLLM's logging: the plugin's own through
``vllm.logger.init_logger("vllm.cached")``, the client's (``cached_client.*``: the hooks'
warnings, the circuit breaker, the prober, the monitor) by :func:`route_client_logs`. It
never raises: a missing or broken daemon costs compile time and the batch-invariant FP8
path, never the worker.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from ..import_hooks import when_imported
from .state import daemon

LOGGER_NAME = "vllm.cached"


def _logger() -> Any:
    try:
        from vllm.logger import init_logger
    except ImportError:  # the plugin's entry point called outside vLLM (tests)
        return logging.getLogger(LOGGER_NAME)
    return init_logger(LOGGER_NAME)


logger: Any = logging.getLogger(LOGGER_NAME)


def route_client_logs() -> bool:
    """Put the ``cached_client`` logger under vLLM's ``vllm`` logger (its parent), so every
    client line (the hooks' warnings, the circuit breaker's INFO line) takes vLLM's level,
    handler and format, as a ``vllm.*`` line does. Left alone where the user configured
    ``cached_client`` itself (a handler or a level of its own). Whether it was routed."""
    client_logger = logging.getLogger("cached_client")
    vllm_logger = logging.getLogger(LOGGER_NAME).parent
    if (client_logger.handlers or client_logger.level != logging.NOTSET
            or vllm_logger is None or vllm_logger.name != "vllm"):
        return False
    client_logger.parent = vllm_logger
    return True


def register() -> None:
    global logger
    try:
        logger = _logger()
        if "vllm" in sys.modules:
            route_client_logs()
        _register()
    except Exception as exc:  # noqa: BLE001 -- never fail the worker
        logger.warning("cached: plugin not installed (%s: %s); FlashInfer compiles in-process",
                       type(exc).__name__, exc)


def _register() -> None:
    d = daemon()
    when_imported("vllm.config.kernel", attach_kernel_config)
    when_imported("vllm.engine.arg_utils", lambda m: m._compute_kwargs.cache_clear())
    when_imported("vllm.model_executor.kernels.linear", _attach_linear)
    when_imported("vllm.utils.flashinfer", attach_flashinfer_utils)
    bi = os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0")
    mode = ("VLLM_BATCH_INVARIANT=1: default for FP8 linears where the family is certified "
            "on this device" if bi else "used with --linear-backend cached")
    if d.socket is None:
        logger.info("cached: pid %d: %s; nothing installed: FlashInfer, Triton and Humming "
                    "compile in-process, the FP8 linear kernel 'cached' is unavailable and "
                    "BF16 linears keep vLLM's kernels", os.getpid(), d.reason)
        return
    # installed whatever the daemon's state: the hooks ask it only while its prober hears
    # from it (cached_client.liveness), so a daemon that comes back is used again
    when_imported("flashinfer", _attach_flashinfer)
    when_imported("humming.jit.compiler", _attach_humming)
    when_imported("vllm.model_executor.layers.linear", _attach_bf16_linear)
    when_imported("vllm.model_executor.layers.vocab_parallel_embedding", _attach_bf16_lm_head)
    when_imported("vllm.v1.worker.gpu_worker", attach_worker)
    triton = select_triton_backend()
    if d.hello is None:
        logger.warning("cached: pid %d: %s; hooks installed: until it answers (asked again in "
                       "the background), FlashInfer, Triton and Humming compile in-process, "
                       "and models loaded meanwhile keep vLLM's FP8 linear kernels; %s",
                       os.getpid(), d.reason, triton)
        return
    logger.info("cached: pid %d: daemon at %s (toolchain %s, %d families); FP8 linear kernel "
                "'cached' registered (%s); %s; %s", os.getpid(), d.socket, d.toolchain(),
                len(d.hello.families), mode, environment_line(d.hello), triton)


def own_toolchain(hello: Any) -> str | None:
    """The daemon's toolchain with this environment's versions (``hello.toolchains``; the
    exact identity is checked per request), or None: the daemon compiles none of its
    FlashInfer kernels."""
    from cached_client import identity

    mine = identity.versions()
    keys = ("python", "nvidia-cutlass-dsl", "apache-tvm-ffi", "torch", "flashinfer-python")
    for t in hello.toolchains:
        theirs = t.get("versions") or {}
        if all(theirs.get(k) == mine.get(k) for k in keys):
            return str(t.get("name"))
    return None


def environment_line(hello: Any) -> str:
    """What the daemon does for this environment's FlashInfer kernels (:func:`own_toolchain`),
    for the plugin's first line."""
    from cached_client import identity

    mine = identity.versions()
    name = own_toolchain(hello)
    if name is not None:
        return (f"the daemon's toolchain {name} is this environment's: FlashInfer's "
                "CuTe-DSL kernels come from the daemon once FlashInfer is imported; its JIT, "
                "Triton and Humming kernels are compiled once per node")
    dsl = "nvidia-cutlass-dsl"
    there = "; ".join(f"{t.get('name')}: CuTe DSL {(t.get('versions') or {}).get(dsl)}"
                      for t in hello.toolchains) or "none"
    return (f"no toolchain of the daemon is this environment (CuTe DSL "
            f"{mine.get('nvidia-cutlass-dsl')}, TVM-FFI {mine.get('apache-tvm-ffi')}, torch "
            f"{mine.get('torch')}, FlashInfer {mine.get('flashinfer-python')}; the daemon has "
            f"{there}): the daemon compiles none of its kernels; they are compiled in this "
            "node's processes, once per node, and shared through the daemon (register it: "
            f"cached serve --toolchain NAME={sys.executable})")


def attach_worker(module: Any) -> None:
    """The serving monitor (cached_client.monitor) starts when a GPU worker's
    ``compile_or_warm_up_model`` returns: the model is loaded, compiled and captured."""
    worker = getattr(module, "Worker", None)
    original = getattr(worker, "compile_or_warm_up_model", None)
    if original is None or getattr(original, "__wrapped__", None) is not None:
        return
    import functools

    from cached_client import monitor

    @functools.wraps(original)
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        monitor.serving(daemon().live)
        return out

    worker.compile_or_warm_up_model = compile_or_warm_up_model


TRITON_BACKEND = {
    "TRITON_CACHE_MANAGER": "triton.runtime.cache:RemoteCacheManager",
    "TRITON_REMOTE_CACHE_BACKEND": "cached_client.integrations.jit.triton:DaemonBackend"}
"""Triton's own variables that select cached_client.integrations.jit.triton's backend."""


def _triton_has_remote_cache() -> bool:
    """Whether Triton is installed with the remote-cache interface the backend implements
    (read from its source file: Triton is not imported here)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    cache = os.path.join(next(iter(spec.submodule_search_locations)), "runtime", "cache.py")
    try:
        with open(cache) as f:
            text = f.read()
    except OSError:
        return False
    return "class RemoteCacheBackend" in text and "class RemoteCacheManager" in text


def select_triton_backend() -> str:
    """Set Triton's variables to the daemon's backend unless the user chose a cache manager
    or backend; says what was done (for the plugin's line)."""
    chosen = {k: os.environ[k] for k in TRITON_BACKEND if os.environ.get(k)}
    if chosen == TRITON_BACKEND:
        return "Triton kernels from the daemon (selected already)"
    if chosen:
        return ("Triton keeps the cache chosen in its environment ("
                + ", ".join(f"{k}={v}" for k, v in chosen.items()) + ")")
    if not _triton_has_remote_cache():
        return "Triton not installed (or without a remote cache): nothing to route"
    os.environ.update(TRITON_BACKEND)
    return "Triton kernels from the daemon (TRITON_REMOTE_CACHE_BACKEND set)"


def _attach_humming(module: Any) -> None:
    from ..jit import humming

    d = daemon()
    try:
        humming.install(client=d.client)
    except Exception as exc:  # noqa: BLE001 -- Humming then compiles as it would alone
        logger.warning("cached: Humming %s: its cubins are not routed to the daemon (%s: %s)",
                       _version("humming-kernels"), type(exc).__name__, exc)
        return
    logger.info("cached: Humming %s: cubins compiled once per node through the daemon at %s",
                _version("humming-kernels"), d.socket)


def _attach_linear(module: Any) -> None:
    from .kernel import attach_linear

    done = attach_linear(module)
    logger.debug("cached: attached to vLLM's linear kernels: %s", "; ".join(done))


def _attach_bf16_linear(module: Any) -> None:
    from .bf16 import attach_linear

    logger.debug("cached: attached to vLLM's unquantized linears: %s", attach_linear(module))


def _attach_bf16_lm_head(module: Any) -> None:
    from .bf16 import attach_embedding

    logger.debug("cached: attached to vLLM's lm_head: %s", attach_embedding(module))


def _attach_flashinfer(module: Any) -> None:
    from cached_client.gemm.plan import flashinfer_bi_available

    from ..flashinfer import cute_dsl as flashinfer
    from ..jit import nvcc as flashinfer_nvcc

    d = daemon()
    try:
        flashinfer_nvcc.install(client=d.client)
    except Exception as exc:  # noqa: BLE001 -- FlashInfer then builds them as it would alone
        logger.warning("cached: FlashInfer %s: its nvcc JIT modules are not routed to the "
                       "daemon (%s: %s)", _version("flashinfer-python"), type(exc).__name__,
                       exc)
    try:
        flashinfer.install(client=d.client)
    except Exception as exc:  # noqa: BLE001 -- FlashInfer then compiles as it would alone
        logger.warning("cached: FlashInfer %s: its kernels are not routed to the daemon "
                       "(%s: %s); it compiles in-process", _version("flashinfer-python"),
                       type(exc).__name__, exc)
        return
    if d.hello is None:
        logger.info("cached: FlashInfer %s: hooked; its CuTe-DSL kernels come from the daemon "
                    "at %s once it answers (until then FlashInfer compiles them in-process); %s",
                    _version("flashinfer-python"), d.socket, flashinfer_bi_available()[1])
        return
    if own_toolchain(d.hello) is None:
        logger.info("cached: FlashInfer %s: hooked; the daemon at %s has no toolchain of this "
                    "environment, so its CuTe-DSL kernels are compiled in this node's "
                    "processes, once per node, and shared through the daemon; %s",
                    _version("flashinfer-python"), d.socket, flashinfer_bi_available()[1])
        return
    logger.info("cached: FlashInfer %s: CuTe-DSL kernels now come from the daemon at %s; %s",
                _version("flashinfer-python"), d.socket, flashinfer_bi_available()[1])


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def attach_kernel_config(kernel_cfg: Any) -> None:
    """Accept ``cached`` as a ``--linear-backend`` value: ``KernelConfig.linear_backend``'s
    Literal (validated by pydantic) and argparse's choices, which vLLM derives from it."""
    import typing

    from pydantic.dataclasses import rebuild_dataclass

    names = typing.get_args(kernel_cfg.LinearBackend)
    if "cached" in names:
        return
    literal = typing.Literal[(*names, "cached")]  # type: ignore[valid-type]
    kernel_cfg.LinearBackend = literal
    cls = kernel_cfg.KernelConfig
    cls.__dataclass_fields__["linear_backend"].type = literal
    cls.__annotations__["linear_backend"] = literal
    rebuild_dataclass(cls, force=True)
    # argparse's choices come from arg_utils' cached kwargs; while arg_utils is itself
    # importing (it imports vllm.config), it has no cache yet: its own hook clears it then
    compute_kwargs = getattr(sys.modules.get("vllm.engine.arg_utils"), "_compute_kwargs", None)
    if compute_kwargs is not None:
        compute_kwargs.cache_clear()


def lacks_bmm_pin(flashinfer_scaled_fp8_mm: Any) -> bool:
    """Whether vLLM's FlashInfer FP8 GEMM lacks #62192's pin: its source never reads batch
    invariance before choosing FlashInfer's backend."""
    import inspect

    return "INVARIANT" not in inspect.getsource(flashinfer_scaled_fp8_mm).upper()


def attach_flashinfer_utils(fu: Any) -> None:
    """Under ``VLLM_BATCH_INVARIANT=1``, where vLLM lacks #62192's pin: FlashInfer's FP8 bmm
    (``vllm.utils.flashinfer.bmm_fp8``, which vLLM's FP8 linear calls with backend ``auto``)
    runs ``cutlass``; ``auto`` tunes across cutlass, cuBLAS and cuDNN per M bucket, so rows
    change with the batch. Without batch invariance nothing changes."""
    from vllm import envs

    original = getattr(fu, "bmm_fp8", None)
    if (not envs.VLLM_BATCH_INVARIANT or original is None
            or getattr(original, "__wrapped__", None) is not None
            or not lacks_bmm_pin(fu.flashinfer_scaled_fp8_mm)):
        return

    def bmm_fp8(A: Any, B: Any, A_scale: Any, B_scale: Any, dtype: Any, backend: str) -> Any:
        return original(A, B, A_scale, B_scale, dtype, "cutlass" if backend == "auto" else backend)

    bmm_fp8.__wrapped__ = original  # type: ignore[attr-defined]
    fu.bmm_fp8 = bmm_fp8
    logger.warning_once("cached: VLLM_BATCH_INVARIANT=1: FlashInfer's FP8 bmm runs the "
                        "'cutlass' backend instead of 'auto' (vLLM #62192's pin, missing in "
                        "this vLLM)")
