"""The store's errors: one it cannot be opened with, one it cannot take an entry with."""

from __future__ import annotations

from collections.abc import Mapping

from cached_client.errors import CompileFailed

from ..config import ConfigError


class StoreError(ConfigError):
    """The store directory or its index cannot be used (raised when the store is opened,
    before the daemon binds anything); the message says what to do."""


class PersistFailed(CompileFailed):
    """The store could not take an entry (disk or inodes full, read-only, an I/O or index
    error, or an entry larger than the whole budget). Nothing of it is indexed; files
    already moved into ``blobs/`` are unreferenced and verified like any other blob;
    ``moved`` maps each built file's path that publish had already moved (or found
    stored) to its digest."""

    def __init__(self, message: str, moved: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.moved = dict(moved or {})
