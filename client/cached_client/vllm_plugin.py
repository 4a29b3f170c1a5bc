"""vLLM general plugin (entry point group ``vllm.general_plugins``, name ``cached``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers).
When ``CACHED_SOCKET`` names a live daemon, FlashInfer's CuTe-DSL kernels come from it
(:func:`cached_client.flashinfer.install`); otherwise it logs one line and does nothing. It
never raises: a missing or broken daemon costs compile time, never the worker.
"""

from __future__ import annotations

import logging
import os

from .paths import SOCKET_ENV

logger = logging.getLogger("cached_client.vllm")

PROBE_TIMEOUT_S = 2.0


def register() -> None:
    try:
        _register()
    except Exception as exc:  # noqa: BLE001 -- never fail the worker
        logger.warning("cached: plugin not installed (%s: %s); FlashInfer compiles in-process",
                       type(exc).__name__, exc)


def _register() -> None:
    path = os.environ.get(SOCKET_ENV)
    if not path:
        logger.info("cached: %s is not set; FlashInfer compiles its kernels in-process",
                    SOCKET_ENV)
        return
    from .client import Client
    from .errors import CachedError

    probe = Client(path, timeout=PROBE_TIMEOUT_S, fallback=False)
    try:
        hello = probe.hello(timeout=PROBE_TIMEOUT_S)
    except CachedError as exc:
        logger.info("cached: no live daemon at %s (%s); FlashInfer compiles in-process",
                    path, exc.message)
        return
    finally:
        probe.close()
    from . import flashinfer

    flashinfer.install(path)
    logger.info("cached: FlashInfer kernels come from the daemon at %s (pid %d, %d families)",
                path, os.getpid(), len(hello.families))
