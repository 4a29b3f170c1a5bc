"""The serving monitor: kernels this process builds or loads outside the daemon once it serves.

:func:`serving` marks the start of serving (the vLLM plugin calls it when a worker's
``compile_or_warm_up_model`` returns: the model loaded, compiled and captured). From then
on, every kernel a hook (cached_client.integrations: flashinfer.cute_dsl, jit.nvcc,
jit.humming, jit.triton) gets without the daemon serving it is :func:`outside`: counted by family,
warned about once per process (the first kernel, by name, in this process's log: vLLM's, inside
vLLM) and reported to the daemon by the prober (cached_client.liveness), whose ``stats``,
``/metrics`` (``cached_client_outside_kernels_total``) and page show it. Before :func:`serving`
nothing is counted: a cold daemon's kernels are compiled during model load on purpose.

What counts (``how``): ``compiled``, built in this process (a write-back compile under this
process's lease, a fallback while the daemon was unusable, the library's own build where
the daemon has no route for it); ``loaded``, taken from the library's own disk cache
(FlashInfer's CuTe-DSL cache) without asking the daemon. A daemon hit and FlashInfer's
prebuilt (AOT) modules do not count. Counting is a dict update under a lock: no I/O.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from typing import Any

logger = logging.getLogger("cached_client.monitor")

MAX_NAMES = 16
"""Kernel names kept for the next report (the first ones; the count has them all)."""

_lock = threading.Lock()
_serving = False
_counts: Counter[str] = Counter()
"""Family -> kernels outside the daemon since serving began (this process, all time)."""
_pending: Counter[str] = Counter()
_names: list[str] = []
_warned = False
_live: Any = None


class _Reporter:
    """What the prober sends: the counts and names not reported yet (cached_client.liveness)."""

    def take(self) -> dict:
        global _names
        with _lock:
            if not _pending:
                return {}
            out = {"outside": dict(_pending), "outside_kernels": list(_names)}
            _pending.clear()
            _names = []
            return out

    def restore(self, fields: dict) -> None:
        with _lock:
            _pending.update(fields.get("outside", {}))
            _names[:0] = fields.get("outside_kernels", [])
            del _names[MAX_NAMES:]


_reporter = _Reporter()


def serving(live: Any = None) -> None:
    """Serving begins now; ``live`` (a cached_client.liveness.Liveness) reports the counts."""
    global _serving, _live
    with _lock:
        _serving = True
        if live is not None and _live is not live:
            _live = live
            live.add_reporter(_reporter)
    logger.info("cached: pid %d: serving: kernels built or loaded outside the daemon from now "
                "on are counted and reported to it (one warning names the first)", os.getpid())


def is_serving() -> bool:
    return _serving


def outside(family: str, name: str, how: str) -> None:
    """A kernel of ``family`` named ``name`` was ``how`` (compiled, loaded) in this process
    without the daemon serving it: counted and reported once serving began."""
    global _warned
    if not _serving:
        return
    with _lock:
        _counts[family] += 1
        _pending[family] += 1
        if len(_names) < MAX_NAMES:
            _names.append(f"{family}:{name}"[:300])
        first, _warned = not _warned, True
    if first:
        logger.warning("cached: pid %d: kernel %s (%s) was %s in this process while serving, "
                       "outside the daemon; every such kernel is counted and reported to the "
                       "daemon (client_outside_kernels); a daemon warmed with this model's "
                       "kernels serves them instead", os.getpid(), name, family, how)
    live = _live
    if live is not None:
        live.poke()


def counts() -> dict[str, int]:
    """Family -> kernels outside the daemon since serving began, in this process."""
    with _lock:
        return dict(_counts)
