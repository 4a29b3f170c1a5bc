"""Run a function right after a module is first imported, without importing it.

``when_imported(name, callback)`` calls ``callback(module)`` now if ``name`` is already
imported, else right after its first import finishes executing (a finder at the front of
``sys.meta_path`` wraps the module's loader for that one execution; the module's own spec
and loader are restored before its code runs). A callback that raises is logged and never
breaks the import. This is how the plugin costs nothing in a process that never imports
FlashInfer: the FlashInfer hooks attach when, and only when, something imports it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger("cached_client.import_hooks")

Callback = Callable[[ModuleType], None]
_pending: dict[str, list[Callback]] = {}
_lock = threading.RLock()
_finder: _Finder | None = None


def _initialised(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return not getattr(spec, "_initializing", False)


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (at once if it already is)."""
    module = sys.modules.get(name)
    if module is not None and _initialised(module):
        _call(name, callback, module)
        return
    with _lock:
        _pending.setdefault(name, []).append(callback)
        _install_finder()
    module = sys.modules.get(name)  # imported by another thread meanwhile
    if module is not None and _initialised(module):
        _fire(name, module)


def pending() -> list[str]:
    """Names whose import is still awaited."""
    with _lock:
        return sorted(_pending)


def _install_finder() -> None:
    global _finder
    if _finder is None:
        _finder = _Finder()
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _call(name: str, callback: Callback, module: ModuleType) -> None:
    try:
        callback(module)
    except Exception:  # noqa: BLE001 -- a hook must never break the import
        logger.warning("cached: the hook for %s failed", name, exc_info=True)


def _fire(name: str, module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(name, [])
    for callback in callbacks:
        _call(name, callback, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for an awaited name it asks the other finders and wraps the
    loader they return."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        with _lock:
            if fullname not in _pending:
                return None
        busy = getattr(self._busy, "names", None)
        if busy is None:
            busy = self._busy.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


class _Loader(importlib.abc.Loader):
    """The module's own loader, plus the callbacks after its code has run."""

    def __init__(self, loader: Any, name: str) -> None:
        self._loader = loader
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._loader, attr)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _fire(self._name, sys.modules.get(self._name, module))
