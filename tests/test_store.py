"""The store: atomic publish, digest on every read, repair at start-up."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

import cached.store.store
from cached.store.errors import PersistFailed
from cached.store.rows import SUFFIXES
from cached.store.store import Store


def K(name: str) -> str:
    """The store key a test names ``name`` (keys are sha256 hex digests)."""
    return hashlib.sha256(name.encode()).hexdigest()


def publish(store: Store, name: str, payload: bytes = b"x"):
    key = K(name)
    work = store.workdir()
    (work / "k.o").write_bytes(b"object" + payload)
    (work / "k.so").write_bytes(b"library" + payload)
    row = {"key": key, "family": "f", "kernel_name": "k", "symbol": "s", "params": {"a": 1},
           "arch": "sm_100a", "sm_count": 148, "max_active_clusters": 148, "toolchain": "t",
           "source_sha256": "s", "compile_seconds": 1.0, "meta": {}}
    entry = store.publish(row, work / "k.o", work / "k.so")
    work.rmdir()
    return entry


def test_publish_then_lookup_survives_reopen(tmp_path):
    store = Store(tmp_path)
    entry = publish(store, "k1")
    assert entry.library_path.read_bytes() == b"libraryx"
    assert oct(entry.library_path.stat().st_mode & 0o777) == "0o444"
    assert store.lookup(K("k1")).row.hits == 1
    store.close()
    again = Store(tmp_path)
    assert again.lookup(K("k1")).row.hits == 2
    assert again.rows()[0].params == '{"a": 1}'


def test_flipped_byte_is_detected_dropped_and_never_served(tmp_path):
    store = Store(tmp_path)
    entry = publish(store, "k1")
    os.chmod(entry.library_path, 0o644)
    data = bytearray(entry.library_path.read_bytes())
    data[0] ^= 0xFF
    entry.library_path.write_bytes(bytes(data))
    assert store.lookup(K("k1")) is None
    assert not store.contains(K("k1"))
    assert not entry.library_path.exists()
    assert Store(tmp_path).lookup(K("k1")) is None


def test_missing_blob_drops_the_row(tmp_path):
    store = Store(tmp_path)
    entry = publish(store, "k1")
    os.chmod(entry.object_path, 0o644)
    entry.object_path.unlink()
    assert store.lookup(K("k1")) is None
    assert store.totals() == (0, 0)


def test_scan_repairs_rows_and_removes_temporaries_and_orphans(tmp_path):
    store = Store(tmp_path)
    good = publish(store, "good", b"1")
    bad = publish(store, "bad", b"2")
    os.chmod(bad.library_path, 0o644)
    bad.library_path.write_bytes(b"corrupt")
    stray = store.workdir()
    (stray / "half.o").write_bytes(b"half")
    orphan = store.blob_dir / "ab" / ("ab" + "0" * 62 + ".so")
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"orphan")
    old = os.path.getmtime(stray) - 3600
    for path in (stray, orphan):
        os.utime(path, (old, old))
    store.close()
    reopened = Store(tmp_path)
    report = reopened.scan()
    assert report["dropped"] == 1 and report["tmp_removed"] == 1
    assert report["orphans_removed"] >= 1
    assert not stray.exists() and not orphan.exists()
    assert reopened.lookup(K("good")).library_path == good.library_path


def test_identical_bytes_are_stored_once(tmp_path):
    store = Store(tmp_path)
    a, b = publish(store, "k1"), publish(store, "k2")
    assert a.library_path == b.library_path
    assert len(list(store.blob_dir.glob("*/*"))) == 2


def test_a_blob_is_hashed_again_whenever_its_file_changed_at_all(tmp_path):
    """Checked once, a blob is trusted only while its file is the very same one: written
    (even with its times put back), replaced by a copy, or swapped for a link, it is
    hashed again on the next lookup. A blob is checked when it is placed (the first hit
    after a compile hashes nothing) and, in a store opened again, at its first lookup."""
    entry = publish(Store(tmp_path), "k1")
    store = Store(tmp_path)  # opened again: nothing checked in this process
    assert store.lookup_unchanged(K("k1")) is None  # never checked yet
    assert store.lookup(K("k1")) is not None
    assert store.lookup_unchanged(K("k1")).row.hits == 2  # checked: no hashing now
    lib = entry.library_path
    copy = tmp_path / "copy"
    shutil.copy2(lib, copy)
    os.chmod(lib, 0o644)
    os.replace(copy, lib)  # same bytes, another file
    assert store.lookup_unchanged(K("k1")) is None
    assert store.lookup(K("k1")) is not None  # hashed again: same digest, served
    assert store.lookup_unchanged(K("k1")) is not None
    before = os.stat(lib)
    with open(lib, "r+b") as f:
        f.write(b"L")  # same size, other bytes, times put back
    os.utime(lib, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert store.lookup_unchanged(K("k1")) is None
    assert store.lookup(K("k1")) is None and not store.contains(K("k1"))


def test_a_placed_blob_is_checked_and_one_written_after_its_digest_is_refused(
        tmp_path, monkeypatch):
    """A blob is checked once placed: the first hit after a publish is served with no
    hashing (``lookup_unchanged``). A built file written after its digest was taken (same
    size, times put back) is refused at its placing: PersistFailed, nothing indexed, no
    blob left under that digest."""
    store = Store(tmp_path)
    publish(store, "k1")
    assert store.lookup_unchanged(K("k1")).row.hits == 1  # no lookup() before it
    real = cached.store.store.prepare

    def written_after(path):
        digest = real(path)
        if path.suffix == ".so":
            before = os.stat(path)
            os.chmod(path, 0o644)
            path.write_bytes(b"LIBRARY" + b"y")
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        return digest

    monkeypatch.setattr(cached.store.store, "prepare", written_after)
    with pytest.raises(PersistFailed, match="changed once placed"):
        publish(store, "k2", b"y")
    assert not store.contains(K("k2"))
    digest = hashlib.sha256(b"libraryy").hexdigest()
    assert not store.blob_path(digest, SUFFIXES["library"]).exists()
    assert store.lookup(K("k1")) is not None  # what was stored before is untouched


def test_a_link_in_place_of_a_checked_blob_is_never_trusted(tmp_path):
    store = Store(tmp_path)
    entry = publish(store, "k1")
    assert store.lookup(K("k1")) is not None
    target = tmp_path / "elsewhere.so"
    shutil.copy2(entry.library_path, target)
    os.chmod(entry.library_path, 0o644)
    entry.library_path.unlink()
    os.symlink(target, entry.library_path)
    assert store.lookup_unchanged(K("k1")) is None
    assert store.lookup(K("k1")) is None and not store.contains(K("k1"))
    assert target.exists()  # what the link pointed to is not touched


def test_an_unchanged_blob_is_hashed_again_after_reverify_s(tmp_path, monkeypatch):
    store = Store(tmp_path)
    publish(store, "k1")
    assert store.lookup(K("k1")) is not None
    assert store.lookup_unchanged(K("k1")) is not None
    monkeypatch.setattr(cached.store.store, "REVERIFY_S", 0.0)
    assert store.lookup_unchanged(K("k1")) is None


def test_a_rows_hit_is_the_row_with_one_more_hit_and_every_other_column_kept():
    """``Row.hit`` (built positionally, on every served hit) equals ``dataclasses.replace``
    of hits and last_used, with each column given a distinct value: a field added or moved
    without updating it fails here."""
    import dataclasses

    from cached.store.rows import COLUMNS, Row

    fields = dataclasses.fields(Row)
    assert [f.name for f in fields] == list(COLUMNS)
    values = {f.name: (i if f.type in ("int", "float") else f"value {i}")
              for i, f in enumerate(fields)}
    row = Row(**values)
    assert row.hit(1e9) == dataclasses.replace(row, hits=row.hits + 1, last_used=1e9)
    assert row.hit(1e9) != row and row.hits == values["hits"]  # a new row, this one kept
    assert row.hit(1e9).same_version(row)  # what a hit changes is no new version
    for f in fields:
        if f.name not in ("hits", "last_used"):
            other = dataclasses.replace(row, **{f.name: values[f.name] + (
                1 if isinstance(values[f.name], int) else " changed")})
            assert not other.same_version(row), f.name
