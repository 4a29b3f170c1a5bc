"""What identifies a JIT library's artifact by content: paths become tokens, tokens name content.

The JIT libraries decide a rebuild on text full of absolute paths (FlashInfer's
``build.ninja``, Humming's ``-I`` flags) and on file times (ninja's, Humming's header
map). The daemon's keys never hold a path or a time (docs/keys.md): :func:`tokenise`
replaces each known root in such text by a token, and :func:`content_id` says what the
token stands for by content:

- a path some installed distribution's RECORD lists (or a directory holding such files):
  ``name==version:sha256`` of each owning distribution's installed content
  (cached_client.identity.dist_component: path-free, as for the toolchain);
- anything else: the sha256 of its bytes (a file) or of every regular file under it by
  relative path, size and bytes (a directory; a link is hashed as its target's text).

Stdlib only, nothing of the libraries imported here; every value is computed once per
process (the directory hashes of a toolkit outside any distribution, e.g.
/usr/local/cuda/include, cost a few hundred milliseconds once).
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from cached_client import identity

_CHUNK = 1 << 20


def sha256_text(*parts: str) -> str:
    """sha256 of the parts, each followed by a NUL (so no two part lists collide)."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@functools.cache
def tree_sha256(root: str) -> str:
    """sha256 over (relative path, size, bytes) of every regular file under ``root`` and
    (relative path, target) of every link, sorted by path; links are not followed."""
    digest = hashlib.sha256()
    entries: list[tuple[str, str]] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                entries.append((os.path.relpath(full, root), "link"))
        for name in filenames:
            full = os.path.join(dirpath, name)
            entries.append((os.path.relpath(full, root),
                            "link" if os.path.islink(full) else "file"))
    for rel, kind in sorted(entries):
        full = os.path.join(root, rel)
        if kind == "link":
            digest.update(f"L\0{rel}\0{os.readlink(full)}\0".encode())
            continue
        try:
            size = os.path.getsize(full)
            digest.update(f"F\0{rel}\0{size}\0".encode())
            digest.update(bytes.fromhex(file_sha256(full)))
        except OSError:  # vanished or unreadable: stated as such
            digest.update(f"X\0{rel}\0".encode())
    return digest.hexdigest()


@functools.cache
def _owners_index() -> tuple[tuple[str, tuple[str, ...], identity.Dist], ...]:
    """(site directory, installed files, distribution) of every distribution on sys.path."""
    out = []
    for dist in identity.distributions().values():
        files = tuple(path for path, _ in identity.dist_files(dist))
        if files:
            out.append((str(dist.path.parent.resolve()), files, dist))
    return tuple(out)


def owners(path: str | Path) -> list[identity.Dist]:
    """The distributions that installed ``path`` (a file they list) or files under it (a
    directory), by their RECORDs."""
    target = str(Path(path).resolve())
    found = []
    for site, files, dist in _owners_index():
        if target != site and not target.startswith(site + os.sep):
            continue
        rel = os.path.relpath(target, site).replace(os.sep, "/")
        prefix = rel + "/"
        if any(f == rel or f.startswith(prefix) for f in files):
            found.append(dist)
    return found


@functools.cache
def content_id(path: str) -> str:
    """What ``path`` holds, by content and never by location (see the module doc):
    ``dist:<components>`` for what distributions installed, ``sha256:<hex>`` otherwise,
    ``absent`` for nothing there."""
    p = Path(path)
    if not p.exists():
        return "absent"
    dists = owners(p)
    if dists:
        return "dist:" + ";".join(sorted(identity.dist_component(d) for d in dists))
    if p.is_dir():
        return "sha256:" + tree_sha256(str(p.resolve()))
    return "sha256:" + file_sha256(p)


def tokenise(text: str, roots: Sequence[tuple[str | Path, str]]) -> str:
    """``text`` with every root path (given or resolved form) replaced by its token,
    longest first, so a nested root wins over the one holding it."""
    pairs: dict[str, str] = {}
    for root, token in roots:
        for form in {str(root), str(Path(root).resolve())}:
            if form and form not in ("/", "."):
                pairs.setdefault(form.rstrip("/"), token)
    for form in sorted(pairs, key=len, reverse=True):
        text = text.replace(form, pairs[form])
    return text


@functools.cache
def command_output(argv: tuple[str, ...]) -> str:
    """The stdout of a short version query (``nvcc --version``, ``c++ --version``), or a
    line saying it failed; one run per process."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {type(exc).__name__}"
    return out.stdout.strip() if out.returncode == 0 else f"exit {out.returncode}"


def contents(paths: Iterable[str | Path]) -> list[str]:
    """:func:`content_id` of each path, in order."""
    return [content_id(str(p)) for p in paths]
