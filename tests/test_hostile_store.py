"""Hostile disks, stores and configs (issue 16 items 1-3, 10-13, 16, 17): each test starts
real daemons on real stores (tmpfs mounts where a full filesystem is the point), breaks
the store the way a careless operator or a hostile local user would, and checks what
clients get, what the daemon says and what is left on disk. Kernels are the test family's
``build`` action (a real gcc object, linked, in well under a second)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cached_client import CachedError, Client, CompileFailed, KernelRequest
from cached_client import protocol as p
from cached_client.loader import sha256_file
from cached_client.writeback import lease, obtain
from conftest import ROOT, DaemonProcess, wait_for

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")


def kernel(tag: str, nbytes: int = 40_000) -> KernelRequest:
    """A real, deterministic kernel of about 2 x ``nbytes`` (object + library)."""
    return KernelRequest(family="cached.test.fault",
                         params={"action": "build", "tag": tag, "bytes": nbytes},
                         arch="sm_100a", sm_count=148, max_active_clusters=148)


def log_events(d: DaemonProcess, name: str) -> list[dict]:
    out = []
    for line in d.log_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == name:
            out.append(record)
    return out


def blob_files(store: Path) -> dict[str, int]:
    """Blob file name -> size, for every regular file under blobs/."""
    return {p.name: p.stat().st_size for p in (store / "blobs").glob("*/*")
            if p.is_file() and not p.is_symlink()}


@pytest.fixture
def tmpfs(tmp_path):
    """Mount tmpfs file systems under the test's directory (unmounted afterwards)."""
    mounts = []

    def mount(name: str, options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounts.append(path)
        return path

    yield mount
    for path in reversed(mounts):
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_inodes(directory: Path, leave: int) -> list[Path]:
    """Create empty files in ``directory`` until its file system has ``leave`` free
    inodes; returns them (delete them to give the inodes back)."""
    directory.mkdir(exist_ok=True)
    made = []
    while os.statvfs(directory).f_ffree > leave:
        path = directory / f"f{len(made)}"
        try:
            path.touch()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
            break
        made.append(path)
    return made


# -- item 1: a job whose work directory cannot be made ------------------------------------


@ROOT_ONLY
def test_workdir_failure_reaches_every_waiter_and_compiling_resumes(tmp_path, tmpfs):
    disk = tmpfs("disk", "size=20m,nr_inodes=400")
    d = DaemonProcess(tmp_path, workers=1, store=disk / "store")
    try:
        client = d.client(timeout=20, fallback=False)
        # tmp/ removed under the running daemon: made again, the compile goes through
        shutil.rmtree(d.store / "tmp")
        assert client.get(kernel("after-rm")).origin == "compiled"
        assert log_events(d, "store.tmp_recreated")
        # no inode left: the job fails at once, for every waiter, with the reason
        filler = fill_inodes(disk / "filler", leave=0)
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                d.client(timeout=20, fallback=False).get(kernel("while-full"))
            except BaseException as exc:  # noqa: BLE001 -- the test inspects it
                errors.append(exc)

        waiters = [threading.Thread(target=wait) for _ in range(3)]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join(60)
        assert len(errors) == 3 and all(isinstance(e, CompileFailed) for e in errors), errors
        assert all("work directory could not be made" in e.message
                   and "No space left on device" in e.message for e in errors)
        stats = d.stats()
        assert stats["failures"] >= 1 and stats["last_failures"]
        assert log_events(d, "compile.failed")
        # the cause gone, the same daemon compiles again (the same key, and a new one) on
        # its only worker: the failed job gave it back
        for path in filler:
            path.unlink()
        assert client.get(kernel("while-full")).origin == "compiled"
        assert client.get(kernel("afterwards")).origin == "compiled"
    finally:
        d.stop()


# -- item 2: blobs that are not regular files ---------------------------------------------


def _break(path: Path, how: str, target: Path | None = None) -> None:
    """Replace a blob by a FIFO, a link to /dev/zero (or ``target``), a directory, or make
    it unreadable."""
    if how == "unreadable":
        os.chmod(path, 0)
        return
    os.unlink(path)
    if how == "fifo":
        os.mkfifo(path)
    elif how == "zero":
        os.symlink(target or "/dev/zero", path)
    elif how == "dir":
        path.mkdir()
        (path / "inside").write_bytes(b"x")


def test_blobs_that_are_not_regular_files_are_dropped_and_recompiled_without_freezing(
        tmp_path):
    d = DaemonProcess(tmp_path, workers=1)
    hows = ("fifo", "zero", "dir")
    try:
        client = d.client(timeout=15, fallback=False, transfer="path")
        arts = {how: client.get(kernel(how)) for how in (*hows, "good")}
        for how in hows:
            _break(Path(arts[how].library_path), how)
            again = client.get(kernel(how))  # a FIFO opened for reading would block forever
            assert again.origin == "compiled"
            assert again.library_sha256 == arts[how].library_sha256
            assert sha256_file(again.library_path) == again.library_sha256
            assert client.get(kernel("good")).origin == "hit"
        for how in hows:
            _break(Path(arts[how].library_path), how)
        report = client.verify()
        assert report.checked == 4 and report.verified == 1, report
        reasons = sorted(b["reason"] for b in report.bad)
        assert any("a FIFO" in r for r in reasons)
        assert any("a symbolic link" in r for r in reasons)
        assert any("a directory" in r for r in reasons)
        for how in hows:  # stored again, then broken again behind the daemon's back
            assert client.get(kernel(how)).origin == "compiled"
    finally:
        d.stop()
    for how in hows:
        _break(Path(arts[how].library_path), how)
    restarted = DaemonProcess(tmp_path, workers=1)
    try:
        wait_for(lambda: log_events(restarted, "store.scan_done"), 20)  # never reads /dev/zero
        scan = log_events(restarted, "store.scan_done")[0]
        assert scan["checked"] == 4 and scan["dropped"] == 3
        client = restarted.client(timeout=15, fallback=False, transfer="path")
        assert client.get(kernel("good")).origin == "hit"
        assert client.get(kernel("zero")).origin == "compiled"
    finally:
        restarted.stop()


NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search"]
"""Runs a root daemon without the capabilities that let root read any file, so a mode 000
blob is unreadable to it as to any other daemon user."""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root and setpriv (a daemon that cannot read every file)")
def test_an_unreadable_blob_is_dropped_and_recompiled_and_verify_goes_on(tmp_path):
    d = DaemonProcess(tmp_path, workers=1, wrap=NO_DAC)
    try:
        client = d.client(timeout=15, fallback=False, transfer="path")
        first = client.get(kernel("u"))
        _break(Path(first.library_path), "unreadable")  # unreadable by the daemon's user
        again = client.get(kernel("u"))  # was: internal (PermissionError), for ever
        assert again.origin == "compiled" and again.library_sha256 == first.library_sha256
        client.get(kernel("v"))
        _break(Path(again.library_path), "unreadable")
        report = client.verify()
        assert report.checked == 2 and report.verified == 1
        assert "cannot be opened: Permission denied" in report.bad[0]["reason"]
    finally:
        d.stop()


# -- item 3: another process holding the index locked --------------------------------------


LOCKER = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], timeout=1)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
conn.rollback()
"""


def test_a_locked_index_never_holds_up_hits(tmp_path):
    d = DaemonProcess(tmp_path, workers=1)
    locker = None
    try:
        client = d.client(timeout=15, fallback=False, transfer="path")
        client.get(kernel("hit"))
        bad = client.get(kernel("bad"))
        path = Path(bad.library_path)
        os.chmod(path, 0o644)
        path.write_bytes(b"\0" * bad.library_size)  # same size, wrong digest
        locker = subprocess.Popen([sys.executable, "-c", LOCKER, str(d.store / "index.sqlite")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert locker.stdout.readline().strip() == "locked"
        results: dict[str, object] = {}

        def put() -> None:
            results["put"] = d.client(timeout=60).autotune_put(p.AutotunePutRequest(
                op_name="mm", n=1, k=1, dtype="fp8", arch="sm_100a", device="d", bucket=1,
                kernel="k", time_us=1.0, toolchain="t", reduction_class="c"))

        def recompile() -> None:  # drops the bad row, recompiles, waits to publish
            results["bad"] = d.client(timeout=60, fallback=False, transfer="path").get(
                kernel("bad")).origin

        side = [threading.Thread(target=put), threading.Thread(target=recompile)]
        for t in side:
            t.start()
        time.sleep(1.0)  # both are now waiting on the index
        fast = d.client(timeout=5, fallback=False)
        for _ in range(20):
            assert fast.get(kernel("hit")).origin == "hit"
        assert fast.stats()["entries"] >= 1
        assert locker.poll() is None and not results  # the lock was held all along
        locker.stdin.write("\n")
        locker.stdin.flush()
        locker.wait(10)
        for t in side:
            t.join(60)
        assert results == {"put": True, "bad": "compiled"}
    finally:
        if locker is not None and locker.poll() is None:
            locker.kill()
        d.stop()


# -- item 10: the index deleted or replaced under a running daemon --------------------------


def _index_rows(store: Path) -> int:
    conn = sqlite3.connect(store / "index.sqlite")
    try:
        return conn.execute("SELECT count(*) FROM entries").fetchone()[0]
    finally:
        conn.close()


def test_a_vanished_or_replaced_index_is_rebuilt_and_no_blob_is_deleted(tmp_path):
    d = DaemonProcess(tmp_path, workers=1)
    tags = ("i1", "i2", "i3")
    try:
        client = d.client(timeout=15, fallback=False)
        for tag in tags:
            client.get(kernel(tag))
        client.autotune_put(p.AutotunePutRequest(
            op_name="mm", n=8, k=8, dtype="fp8", arch="sm_100a", device="d", bucket=1,
            kernel="k", time_us=2.0, toolchain="t", reduction_class="c"))
        blobs = blob_files(d.store)
        assert len(blobs) == 6
        for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
            (d.store / name).unlink(missing_ok=True)
        wait_for(lambda: log_events(d, "store.index_rebuilt"), 10)
        assert log_events(d, "store.index_lost")[0]["reason"] == "vanished"
        assert _index_rows(d.store) == 3
        assert len(client.autotune_get(p.AutotuneGetRequest())) == 1  # side tables kept
        assert all(client.get(kernel(tag)).origin == "hit" for tag in tags)
        # a different file moved over the index: set aside, ours written back
        other = tmp_path / "other.sqlite"
        sqlite3.connect(other).execute("CREATE TABLE entries (key TEXT PRIMARY KEY)").close()
        os.replace(other, d.store / "index.sqlite")
        wait_for(lambda: len(log_events(d, "store.index_rebuilt")) == 2, 10)
        assert log_events(d, "store.index_lost")[1]["reason"] == "replaced"
        assert list(d.store.glob("index.sqlite.replaced-*"))
        assert _index_rows(d.store) == 3
        assert client.get(kernel("i4")).origin == "compiled"  # publishing works on the new file
    finally:
        d.stop()
    after = blob_files(d.store)
    assert blobs.items() <= after.items() and len(after) == 8
    restarted = DaemonProcess(tmp_path, workers=1)
    try:
        wait_for(lambda: log_events(restarted, "store.scan_done"), 20)
        assert restarted.stats()["entries"] == 4
        assert log_events(restarted, "store.scan_done")[0]["orphans_removed"] == 0
    finally:
        restarted.stop()
    # deleted while no daemon runs: the next start keeps every blob (an empty index is no
    # evidence), and a kernel compiled again reuses its identical blob
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (d.store / name).unlink(missing_ok=True)
    before = blob_files(d.store)
    again = DaemonProcess(tmp_path, workers=1)
    try:
        wait_for(lambda: log_events(again, "store.scan_done"), 20)
        scan = log_events(again, "store.scan_done")[0]
        assert scan["orphans_removed"] == 0 and scan["orphans_kept"] == 8
        assert log_events(again, "store.orphans_kept")
        assert blob_files(d.store) == before
        assert again.client(timeout=15).get(kernel("i1")).origin == "compiled"
        assert blob_files(d.store) == before
    finally:
        again.stop()


# -- item 11: rows and files of the store are input, not truth -----------------------------


def test_hostile_index_rows_are_dropped_and_never_followed_out_of_the_store(tmp_path):
    d = DaemonProcess(tmp_path, workers=1)
    try:
        client = d.client(timeout=15, fallback=False)
        client.get(kernel("g1"))
        client.get(kernel("g2"))
    finally:
        d.stop()
    victim = tmp_path / "victim.so"  # blobs/../../victim.so from the store's root
    victim.write_bytes(b"not yours")
    conn = sqlite3.connect(d.store / "index.sqlite")
    conn.row_factory = sqlite3.Row
    good = dict(conn.execute("SELECT * FROM entries LIMIT 1").fetchone())
    hostile = [
        {**good, "key": "1" * 64, "library_sha256": "../victim"},
        {**good, "key": "../escape"},
        {**good, "key": "2" * 64, "hits": "lots"},
        {**good, "key": "3" * 64, "object_size": "x"},
        {**good, "key": "4" * 64, "params": "not json"},
    ]
    for row in hostile:
        names = ", ".join(row)
        conn.execute(f"INSERT INTO entries ({names}) VALUES ({', '.join('?' * len(row))})",
                     list(row.values()))
    conn.commit()
    conn.close()
    restarted = DaemonProcess(tmp_path, workers=1)
    try:
        wait_for(lambda: log_events(restarted, "store.scan_done"), 20)
        assert victim.read_bytes() == b"not yours"  # was: deleted by the start-up scan
        assert len(log_events(restarted, "store.row_invalid")) == len(hostile)
        assert restarted.stats()["entries"] == 2
        client = restarted.client(timeout=15, fallback=False)
        assert client.get(kernel("g1")).origin == "hit"
        assert client.verify().bad == []
    finally:
        restarted.stop()
    assert _index_rows(d.store) == 2  # the bad rows left the index
    assert victim.read_bytes() == b"not yours"


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "CACHED_TEST_FAMILIES": "1"}
    return subprocess.run([sys.executable, "-m", "cached", "serve", "--http", "127.0.0.1:0",
                           "--workers", "1", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _store_case(case: str, tmp_path: Path, tmpfs) -> list[str]:
    store = tmp_path / "store"
    if case == "store-is-a-file":
        store.write_text("a file")
        return ["--store", str(store)]
    if case == "store-read-only":
        ro = tmpfs("ro", "ro,size=1m")
        return ["--store", str(ro / "store")]
    if case == "existing-store-read-only":
        rw = tmpfs("rw", "size=1m")
        (rw / "store" / "blobs").mkdir(parents=True)
        subprocess.run(["mount", "-o", "remount,ro", str(rw)], check=True)
        return ["--store", str(rw / "store")]
    store.mkdir()
    if case == "garbage-index":
        (store / "index.sqlite").write_bytes(os.urandom(4096))
        return ["--store", str(store)]
    if case == "foreign-index":
        sqlite3.connect(store / "index.sqlite").execute(
            "CREATE TABLE entries (key TEXT PRIMARY KEY, size TEXT)").close()
        return ["--store", str(store)]
    if case.startswith("identity-"):
        content = {"identity-garbage": b"\x00\xffnot json", "identity-list": b'["x"]',
                   "identity-types": b'{"toolchain": 3, "sources": []}',
                   "identity-missing": None}[case]
        if content is not None:
            (store / "identity.json").write_bytes(content)
        return ["--store", str(store), "--serve-only"]
    if case in ("job-timeout-nan", "job-timeout-inf"):
        return ["--store", str(store), "--job-timeout", case.rsplit("-", 1)[1]]
    raise AssertionError(case)


@ROOT_ONLY
@pytest.mark.parametrize("case", [
    "store-is-a-file", "store-read-only", "existing-store-read-only", "garbage-index",
    "foreign-index", "identity-garbage", "identity-list", "identity-types",
    "identity-missing", "job-timeout-nan", "job-timeout-inf"])
def test_an_unusable_store_is_refused_in_one_line_before_anything_is_bound(
        tmp_path, tmpfs, case):
    sock = tmp_path / "cached.sock"
    out = _serve("--socket", str(sock), *_store_case(case, tmp_path, tmpfs))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("cached serve: "), out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not sock.exists()


# -- item 12: nothing chmods or unlinks through a link --------------------------------------


def test_a_blob_swapped_for_a_link_never_changes_the_linked_file(tmp_path):
    private = tmp_path / "private"
    private.write_bytes(b"secret")
    os.chmod(private, 0o600)
    d = DaemonProcess(tmp_path, workers=1)
    try:
        client = d.client(timeout=15, fallback=False, transfer="path")
        first = client.get(kernel("link"))
        for blob in (Path(first.library_path), Path(first.object_path)):
            _break(blob, "zero", private)
            again = client.get(kernel("link"))
            assert again.origin == "compiled" and again.library_sha256 == first.library_sha256
            assert not blob.is_symlink()
            assert oct(private.stat().st_mode & 0o777) == "0o600"
            assert private.read_bytes() == b"secret"
        _break(Path(first.library_path), "zero", private)
        assert len(d.client(timeout=15).verify().bad) == 1
        assert oct(private.stat().st_mode & 0o777) == "0o600" and private.exists()
    finally:
        d.stop()


# -- item 13: the budget is a hard limit ---------------------------------------------------


def test_the_store_budget_is_hard_even_within_the_grace_period(tmp_path):
    budget = 250_000  # two ~93 KB kernels, not three
    d = DaemonProcess(tmp_path, workers=1,
                      extra_args=["--max-bytes", str(budget), "--evict-grace", "300"])
    try:
        client = d.client(timeout=15, fallback=False)
        for i in range(6):  # warmed in a row: every entry is within the grace period
            art = client.get(kernel(f"b{i}"))
            assert art.origin == "compiled"
            stats = d.stats()
            assert stats["bytes"] <= budget and not stats["over_budget"], stats
            assert sum(blob_files(d.store).values()) <= budget
        stats = d.stats()
        assert stats["entries"] == 2 and stats["evictions"] == 4
        assert client.get(kernel("b5")).origin == "hit"
        assert log_events(d, "store.evicted")
    finally:
        d.stop()
    # a budget that cannot hold a kernel this store holds: refused at start, in one line
    out = _serve("--store", str(d.store), "--socket", str(tmp_path / "small.sock"),
                 "--max-bytes", "50000")
    assert out.returncode == 2 and "smaller than a kernel this store holds" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    # on an empty store it cannot be known at start: the first kernel is served unstored
    (tmp_path / "s2").mkdir()
    small = DaemonProcess(tmp_path / "s2", workers=1, extra_args=["--max-bytes", "50000"])
    try:
        art = small.client(timeout=15, fallback=False).get(kernel("big"))
        assert art.origin == "unstored"
        assert sha256_file(art.library_path) == art.library_sha256
        stats = small.stats()
        assert stats["entries"] == 0 and stats["persist_failures"] == 1
        assert log_events(small, "store.budget_too_small")
    finally:
        small.stop()


# -- item 16: persistence is best effort -----------------------------------------------------


@ROOT_ONLY
def test_a_kernel_the_store_cannot_take_still_reaches_every_waiter(tmp_path, tmpfs):
    disk = tmpfs("disk", "size=20m,nr_inodes=400")
    d = DaemonProcess(tmp_path, workers=1, store=disk / "store")
    try:
        time.sleep(2.5)  # the index's WAL and the first flush exist before the fill
        # inodes for the work directory and the two built files, none for blobs/ab/
        filler = fill_inodes(disk / "filler", leave=3)
        got: dict[str, object] = {}

        def wait(transfer: str) -> None:
            try:
                got[transfer] = d.client(timeout=30, fallback=False,
                                         transfer=transfer).get(kernel("full"))
            except BaseException as exc:  # noqa: BLE001 -- the test inspects it
                got[transfer] = exc

        waiters = [threading.Thread(target=wait, args=(t,)) for t in ("path", "bytes", "fd")]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join(60)
        by_path, by_bytes, by_fd = got["path"], got["bytes"], got["fd"]
        for reply in (by_path, by_bytes, by_fd):
            assert not isinstance(reply, BaseException), reply
        assert by_path.origin == by_bytes.origin == by_fd.origin == "unstored"
        assert by_path.library_sha256 == by_bytes.library_sha256 == by_fd.library_sha256
        assert sha256_file(by_fd.library_path) == by_fd.library_sha256  # the client's copy
        assert Path(by_path.library_path).is_relative_to(d.store / "tmp")
        assert sha256_file(by_path.library_path) == by_path.library_sha256
        assert hashlib.sha256(by_bytes.library_bytes).hexdigest() == by_bytes.library_sha256
        stats = d.stats()
        assert stats["persist_failures"] == 1 and stats["failures"] == 0
        assert stats["entries"] == 0
        failed = log_events(d, "store.persist_failed")
        assert failed and "No space left on device" in failed[0]["error"]
        assert log_events(d, "compile.unstored")
        for path in filler:
            path.unlink()
        stored = d.client(timeout=30, fallback=False).get(kernel("full"))
        assert stored.origin == "compiled" and stored.library_sha256 == by_path.library_sha256
        assert d.client(timeout=15).verify().verified == 1
    finally:
        d.stop()


OBJECT_SOURCE = "int cached_writeback_test(void) { return 7; }\n"


def _jit_request(kernel_name: str) -> KernelRequest:
    return KernelRequest("flashinfer.jit", {
        "module": "wbtest", "kernel": kernel_name, "tvm_ffi": True, "source_sha256": "0" * 64},
        "sm_100a", 148, 148)


def _gcc_object(path: str) -> str:
    subprocess.run(["gcc", "-c", "-fPIC", "-x", "c", "-", "-o", path],
                   input=OBJECT_SOURCE, text=True, check=True)
    return "built here"


def _broken_object(path: str) -> str:
    Path(path).write_bytes(b"\x7fELF" + b"\0" * 60)  # passes the ELF check, cannot link
    return "built here"


def test_a_failed_write_back_publish_releases_its_lease_at_once(tmp_path):
    """The daemon refuses the upload (the store's budget is smaller than the kernel; an
    object that does not link): the publishing process releases its lease, so the next
    process is granted it at once instead of waiting out the 120 s time-to-live."""
    d = DaemonProcess(tmp_path, workers=1, extra_args=["--max-bytes", "1000"])
    try:
        for name, build, error in (("k1", _gcc_object, "does not fit the whole store budget"),
                                   ("k2", _broken_object, "does not link")):
            request = _jit_request(name)
            with pytest.raises(CompileFailed, match=error):
                obtain(d.client(timeout=30), request, build, ttl_s=120.0, timeout=30)
            reply = lease(d.client(timeout=30), request, ttl_s=120.0, wait_ms=0)
            assert reply.state == "granted", reply
        assert len(log_events(d, "writeback.lease_released")) == 2
    finally:
        d.stop()


# -- item 17: the memory limit of the daemon's own cgroup -----------------------------------


def _own_memory_cgroup() -> Path | None:
    """A writable directory of this process's memory cgroup (v2 with the memory
    controller, or v1's memory hierarchy), or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            if (base / "memory.max").exists():
                return base
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if base.is_dir():
                return base
    return None


@ROOT_ONLY
def test_the_daemons_own_cgroup_memory_limit_caps_an_explicit_worker_count(tmp_path):
    parent = _own_memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("no writable memory cgroup here")
    group = parent / f"cached-test-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:
        pytest.skip("cannot create a memory cgroup here")
    v2 = (group / "memory.max").exists()
    limit = 3 * (1 << 29)  # 1.5 GiB: one 1 GiB worker fits, three do not
    (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(limit))
    sock = tmp_path / "cached.sock"
    log = open(tmp_path / "daemon.log", "w")
    command = (f'echo $$ > {group}/cgroup.procs && exec {sys.executable} -m cached serve '
               f'--store {tmp_path}/store --socket {sock} --no-http --workers 3')
    proc = subprocess.Popen(["sh", "-c", command], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT}/client"})
    try:
        from cached_client import Client

        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "daemon.log").read_text()[-3000:]
            try:
                Client(str(sock), timeout=2).stats()
                return True
            except Exception:  # noqa: BLE001 -- not up yet
                return False

        wait_for(up, 60)
        assert Client(str(sock), timeout=5).stats()["workers"] == 1
        assert "sizing.workers_capped" in (tmp_path / "daemon.log").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_relative_store_and_socket_are_taken_from_the_daemons_directory(tmp_path):
    """bench/gpu/run_gemm_plan.sh found it: ``--store some/relative/dir`` made every compile
    fail in publishing (the workers, running elsewhere, wrote to another ``tmp/``), so a
    store warmed that way stayed empty. Relative paths are made absolute at start."""
    proc = subprocess.Popen([sys.executable, "-m", "cached", "serve", "--store", "rel/store",
                             "--socket", "cached.sock", "--no-http", "--workers", "1"],
                            cwd=tmp_path, env={**os.environ, "CACHED_TEST_FAMILIES": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        socket_path = str(tmp_path / "cached.sock")

        def answers() -> bool:
            try:
                return Client(socket_path, timeout=2, fallback=False).stats()["workers_ready"] == 1
            except CachedError:
                return False

        wait_for(answers, 60)
        art = Client(socket_path, timeout=60, fallback=False,
                     transfer="path").get(kernel("relative"))
        assert art.origin == "compiled"
        assert Path(art.library_path).is_relative_to(tmp_path / "rel" / "store" / "blobs")
        stats = Client(socket_path, timeout=10).stats()
        assert stats["entries"] == 1 and stats["failures"] == stats["persist_failures"] == 0
        assert stats["store"] == str(tmp_path / "rel" / "store")
    finally:
        proc.terminate()
        proc.wait(30)


def test_autotune_put_on_a_full_disk_is_overloaded_naming_the_disk_and_stores_nothing(
        tmp_path, tmpfs):
    """Issue 37 (low): autotune_put on a full disk answered ``internal``. Now it is
    overloaded, naming the store's disk; the daemon serves on, and once there is room the
    same winner is stored."""
    disk = tmpfs("disk", "size=12m")
    d = DaemonProcess(tmp_path, workers=1, store=disk / "store", ready_workers=0)
    try:
        client = d.client(timeout=30)
        winner = dict(op_name="mm", n=1, k=1, dtype="fp8", arch="sm_100a", device="d",
                      kernel="k", tactic={"pad": "x" * 4000}, time_us=1.0, toolchain="t",
                      reduction_class="c")
        client.autotune_put(p.AutotunePutRequest(**winner, bucket=1))
        filler = disk / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)
        codes, message = [], ""
        for bucket in range(2, 400):
            try:
                client.autotune_put(p.AutotunePutRequest(**winner, bucket=bucket))
                codes.append("ok")
            except CachedError as exc:
                codes.append(exc.code)
                message = exc.message
                break
        assert codes[-1] == "overloaded", codes
        assert "full" in message and str(d.store) in message
        stored = {r["bucket"] for r in client.autotune_get(p.AutotuneGetRequest(op_name="mm"))}
        assert stored == {1, *range(2, len(codes) + 1)}  # the refused one is not there
        assert client.hello().v == 1
        filler.unlink()
        assert client.autotune_put(p.AutotunePutRequest(**winner, bucket=len(codes) + 1))
    finally:
        d.stop()
