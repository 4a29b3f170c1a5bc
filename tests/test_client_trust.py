"""The client trusts only what it checked (issue 22's first hole, issue 24's trust item), tried
as the hostile user would: a fake daemon (tests/fake_daemon.py, a real process speaking the
protocol) on a socket directory made after the client was built, or run as another uid; a
daemon naming a planted runtime library; a real older daemon (this repository's code before
the fix); daemons stating another environment's artifacts. Every planted library is a
shared object whose constructor writes a marker file: the marker never appears."""

from __future__ import annotations

import io
import json
import logging
import os
import pwd
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import cached_client
import pytest
from cached_client import (
    ArtifactMismatch,
    Client,
    DaemonTooOld,
    DaemonUnavailable,
    KernelRequest,
    UntrustedDaemon,
)
from cached_client import protocol as p
from conftest import ROOT, DaemonProcess

import cached

PEER_PY = shutil.which("python3", path="/usr/bin:/bin")
FAKE = Path(__file__).with_name("fake_daemon.py")
USER = "cachedtest"  # test_access.py's unprivileged peer
OLD_COMMIT = "0b546ab4781190d48e9730c82bef73baf5391a64"
"""This repository before the fix: its daemon states no identity capabilities."""
as_root = pytest.mark.skipif(os.geteuid() != 0 or not PEER_PY or not shutil.which("useradd"),
                             reason="needs root, useradd and a system python3")


@pytest.fixture(scope="module")
def other() -> pwd.struct_passwd:
    """A real unprivileged uid (created when missing, as test_access.py does)."""
    try:
        return pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", USER], capture_output=True)
        return pwd.getpwnam(USER)


def open_tmp() -> Path:
    """A fresh directory under /tmp that other uids may traverse (pytest's are root's only)."""
    d = Path(tempfile.mkdtemp(prefix="cached-trust-"))
    os.chmod(d, 0o755)
    return d


@pytest.fixture
def workdir() -> Path:
    d = open_tmp()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def planted() -> tuple[Path, Path]:
    """(a shared object whose constructor creates the marker file, the marker's path)."""
    d = open_tmp()
    marker = d / "constructor-ran"
    source = d / "planted.c"
    source.write_text('#include <fcntl.h>\n#include <unistd.h>\n'
                      '__attribute__((constructor)) static void planted(void) {\n'
                      f'  int fd = open("{marker}", O_WRONLY | O_CREAT, 0666);\n'
                      '  if (fd >= 0) close(fd);\n}\n')
    library = d / "libplanted.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    os.chmod(library, 0o644)
    yield library, marker
    shutil.rmtree(d, ignore_errors=True)


class Fake:
    """tests/fake_daemon.py as ``uid`` (default root) on ``socket``."""

    def __init__(self, workdir: Path, socket: Path, library: Path, uid: pwd.struct_passwd | None
                 = None, capabilities: tuple[str, ...] = p.CAPABILITIES, **config) -> None:
        self.dir = Path(os.path.realpath(workdir)) / f"fake-{time.monotonic_ns()}"
        self.dir.mkdir()
        os.chmod(self.dir, 0o777)
        self.log = self.dir / "requests.jsonl"
        conf = self.dir / "config.json"
        conf.write_text(json.dumps({"socket": str(socket), "log": str(self.log),
                                    "capabilities": list(capabilities),
                                    "library": str(library), **config}))
        ids = {} if uid is None else {"user": uid.pw_uid, "group": uid.pw_gid}
        python = sys.executable if uid is None else PEER_PY  # one another uid can run
        self.proc = subprocess.Popen([python, str(FAKE), str(conf)], **ids,
                                     env={"PYTHONPATH": str(ROOT / "client"),
                                          "PATH": "/usr/bin:/bin"})
        deadline = time.monotonic() + 30
        while not (self.dir / "ready").exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "fake not up"
            time.sleep(0.02)

    def requests(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] \
            if self.log.exists() else []

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def shared_tmp(workdir: Path, monkeypatch) -> Path:
    """A directory like /tmp (root's, mode 1777) as XDG_RUNTIME_DIR: the default socket is
    ``<it>/cached/cached.sock``, and any user may create ``<it>/cached``."""
    base = workdir / "shared"
    base.mkdir()
    os.chmod(base, 0o1777)
    monkeypatch.delenv("CACHED_SOCKET", raising=False)
    monkeypatch.delenv("CACHED_DAEMON_UID", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    return base


# -- issue 22, first hole: the socket -----------------------------------------------------------

@as_root
def test_a_fake_daemon_on_a_directory_made_after_the_client_was_built_is_never_used(
        shared_tmp, other, planted, mm_fp4_requests, caplog):
    """Another user creates the default socket's directory once the client exists and answers
    as the daemon, naming a planted library: the client refuses at connect (the directory is
    not root's or its own), says what to fix, compiles in-process; the fake hears nothing."""
    library, marker = planted
    client = Client(timeout=10)
    assert not (shared_tmp / "cached").exists()
    fake = Fake(shared_tmp.parent, shared_tmp / "cached" / "cached.sock", library, other,
                runtime_path=str(library))
    try:
        assert os.stat(shared_tmp / "cached").st_uid == other.pw_uid
        with pytest.raises(UntrustedDaemon, match=f"belongs to uid {other.pw_uid}") as refused:
            client.stats()
        assert isinstance(refused.value, DaemonUnavailable) and "\n" not in refused.value.message
        with caplog.at_level(logging.WARNING, logger="cached_client"):
            fn = client.load(mm_fp4_requests[0])  # the fallback: compiled in this process
        assert callable(fn)
        assert any("compiling in this process" in r.getMessage() and "belongs to uid" in
                   r.getMessage() for r in caplog.records)
        assert fake.requests() == [] and not marker.exists()
    finally:
        fake.stop()


@as_root
def test_a_named_socket_answered_by_another_uid_is_refused_until_that_uid_is_configured(
        workdir, other, planted, monkeypatch):
    """$CACHED_SOCKET or Client(path) skips the directory check but not the peer's uid: a
    server running as another uid is refused before a byte is sent; $CACHED_DAEMON_UID
    naming that uid (number or name) admits it; a value that is neither is a typed error."""
    library, marker = planted
    (workdir / "theirs").mkdir(mode=0o777)
    os.chmod(workdir / "theirs", 0o777)
    sock = workdir / "theirs" / "own" / "cached.sock"
    fake = Fake(workdir, sock, library, other)
    monkeypatch.delenv("CACHED_DAEMON_UID", raising=False)
    try:
        with pytest.raises(UntrustedDaemon, match=f"runs as uid {other.pw_uid}.*"
                           f"CACHED_DAEMON_UID={other.pw_uid}"):
            Client(str(sock), fallback=False, timeout=5).stats()
        assert fake.requests() == []
        monkeypatch.setenv("CACHED_DAEMON_UID", "no-such-user-here")
        with pytest.raises(UntrustedDaemon, match="neither a uid nor a user name"):
            Client(str(sock), fallback=False, timeout=5).stats()
        for configured in (str(other.pw_uid), USER):
            monkeypatch.setenv("CACHED_DAEMON_UID", configured)
            assert Client(str(sock), fallback=False, timeout=5).stats() == {"planted": True}
        assert [r["op"] for r in fake.requests()] == ["stats", "stats"]
        assert not marker.exists()
    finally:
        fake.stop()


@as_root
@pytest.mark.parametrize("replacement", ["another uid's", "a link", "group-writable"])
def test_a_socket_directory_replaced_after_the_client_used_it_is_refused(
        shared_tmp, other, planted, replacement):
    """The directory is checked at every connect, not once: the client used the daemon in a
    good directory; the directory then goes (a tmp cleaner, a stopped daemon) and comes back
    as another uid's, as a link, or writable by others, with a root server in it (so only the
    directory check can refuse it)."""
    library, marker = planted
    directory = shared_tmp / "cached"
    directory.mkdir(mode=0o700)
    fake = Fake(shared_tmp.parent, directory / "cached.sock", library)
    client = Client(fallback=False, timeout=5)
    try:
        assert client.stats() == {"planted": True}
    finally:
        fake.stop()
    shutil.rmtree(directory)
    if replacement == "a link":
        target = shared_tmp.parent / "elsewhere"
        target.mkdir(mode=0o700)
        directory.symlink_to(target)
    else:
        directory.mkdir(mode=0o700)
        if replacement == "another uid's":
            os.chown(directory, other.pw_uid, other.pw_gid)
        else:
            os.chmod(directory, 0o770)
    fake = Fake(shared_tmp.parent, directory / "cached.sock", library,
                runtime_path=str(library))
    try:
        client.close()  # the kept connection went with the old daemon
        with pytest.raises(UntrustedDaemon, match="not connecting"):
            client.stats()
        assert fake.requests() == [] and not marker.exists()
    finally:
        fake.stop()


# -- issue 22, first hole: the runtime library -----------------------------------------------

LOAD_SCRIPT = """
import json, sys
from cached_client import Client, KernelRequest
fn = Client(sys.argv[1], fallback=False, timeout=60).load(KernelRequest.from_wire(
    json.loads(sys.argv[2])))
print("loaded", callable(fn))
"""


def test_the_runtime_library_a_daemon_names_is_never_loaded(tmp_path, planted,
                                                              mm_fp4_requests):
    """A daemon (trusted uid) serves a real kernel and names a planted runtime library: a
    fresh process loads the kernel with its own DSL runtime; the planted one never runs."""
    library, marker = planted
    (tmp_path / "real").mkdir()
    real = DaemonProcess(tmp_path / "real", workers=1)
    try:
        art = real.client(timeout=600, transfer="path").get(mm_fp4_requests[0])
        kernel = tmp_path / "kernel.so"
        shutil.copyfile(art.library_path, kernel)
        os.chmod(kernel, 0o644)
    finally:
        real.stop()
    fake = Fake(tmp_path, tmp_path / "fake.sock", kernel, symbol=art.symbol,
                runtime_path=str(library))
    try:
        env = {k: v for k, v in os.environ.items() if k != "CACHED_DSL_RUNTIME"}
        env["PYTHONPATH"] = f"{Path(cached.__file__).parents[1]}:" \
            f"{Path(cached_client.__file__).parents[1]}"  # the code under test
        out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(tmp_path / "fake.sock"),
                              json.dumps(mm_fp4_requests[0].to_wire())], env=env,
                             capture_output=True, text=True, timeout=300)
        assert not marker.exists()
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "loaded True"
        assert [r["op"] for r in fake.requests()] == ["hello", "get"]
    finally:
        fake.stop()


# -- issue 24, trust: what the daemon says it built --------------------------------------------

def hopper_request() -> KernelRequest:
    return KernelRequest("cached.hopper_fp8", {"tile_m": 128}, "sm_90a", 132, 132)


OTHER_RUNTIME = {"tvm_ffi": "0.1.11", "dsl_runtime_sha256": "a" * 64}


@pytest.mark.parametrize("family, override, fields", [
    ("mm_fp4", {"toolchain": "cpython-311;torch==2.0:x"}, ("toolchain",)),
    ("mm_fp4", {"source_sha256": "0" * 64}, ("source_sha256",)),
    ("mm_fp4", {"arch": "sm_103a"}, ("arch",)),
    ("mm_fp4", {"sm_count": 132}, ("sm_count",)),
    ("mm_fp4", {"arch": None, "sm_count": None, "max_active_clusters": None},
     ("arch", "max_active_clusters", "sm_count")),  # an older daemon's artifact: not stated
    ("hopper", {"toolchain": "another", "runtime": OTHER_RUNTIME}, ("runtime",)),
    ("hopper", {"toolchain": "another", "runtime": None}, ("runtime",)),
])
def test_an_artifact_built_for_another_environment_is_a_miss_never_a_load(
        tmp_path, planted, mm_fp4_requests, caplog, family, override, fields):
    """A daemon stating capabilities it does not honour serves artifacts whose metadata
    differ from what this process asked for and is: each is ArtifactMismatch naming the
    fields (a miss: ``load`` would compile in-process), warned once, and never loaded."""
    library, marker = planted
    request = mm_fp4_requests[0] if family == "mm_fp4" else hopper_request()
    fake = Fake(tmp_path, tmp_path / "fake.sock", library, override=override)
    client = Client(str(tmp_path / "fake.sock"), fallback=False, timeout=10)
    try:
        with caplog.at_level(logging.WARNING, logger="cached_client"):
            for _ in range(2):
                with pytest.raises(ArtifactMismatch) as refused:
                    client.load(request)
                assert refused.value.fields == fields
        warned = [r.getMessage() for r in caplog.records if "another environment" in
                  r.getMessage()]
        assert len(warned) == 1 and all(f in warned[0] for f in fields)
        assert [r["op"] for r in fake.requests()] == ["hello", "get", "get"]
        assert not marker.exists()
    finally:
        fake.stop()


@pytest.mark.parametrize("capabilities, transfer", [
    (p.CAPABILITIES, "fd"),
    (tuple(c for c in p.CAPABILITIES if c != "transfer:fd"), "path"),
])
def test_an_artifact_stating_this_environment_passes_and_the_transfer_comes_from_hello(
        tmp_path, planted, mm_fp4_requests, capabilities, transfer):
    """The control of the test above: the same fake, stating what this process is, is
    served (a project family built by another toolchain with this runtime too, as the
    daemon routes them); the transfer is the one the daemon's hello offers."""
    library, marker = planted
    fake = Fake(tmp_path, tmp_path / "fake.sock", library, capabilities=capabilities)
    other_toolchain = Fake(tmp_path, tmp_path / "other.sock", library,
                           override={"toolchain": "another toolchain, this runtime"})
    try:
        art = Client(str(tmp_path / "fake.sock"), fallback=False).get(mm_fp4_requests[0])
        assert art.family == "flashinfer.mm_fp4" and os.path.isfile(art.library_path)
        assert [r["transfer"] for r in fake.requests() if r["op"] == "get"] == [transfer]
        assert Client(str(tmp_path / "other.sock"), fallback=False).get(
            hopper_request()).toolchain == "another toolchain, this runtime"
        assert not marker.exists()
    finally:
        fake.stop()
        other_toolchain.stop()


@pytest.fixture(scope="module")
def old_code(tmp_path_factory) -> Path:
    """The daemon and client packages at OLD_COMMIT (git archive), for a real older daemon."""
    out = subprocess.run(["git", "-C", str(ROOT), "archive", OLD_COMMIT, "cached", "client"],
                         capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"no git history here for {OLD_COMMIT}: {out.stderr.decode()[-200:]}")
    d = tmp_path_factory.mktemp("old-daemon-code")
    tarfile.open(fileobj=io.BytesIO(out.stdout)).extractall(d, filter="data")
    return d


def test_a_real_older_daemon_is_refused_with_one_line_and_compiles_nothing(
        tmp_path, old_code, mm_fp4_requests):
    """This repository's daemon from before the fix states no identity capabilities in its
    hello: the client never asks it for a kernel (one line saying why; a DaemonUnavailable,
    so ``load`` compiles in-process) and the older daemon compiles nothing; ops that return
    no artifact still work."""
    old = DaemonProcess(tmp_path, workers=1, cwd=old_code, extra_env={
        "PYTHONPATH": f"{old_code}:{old_code / 'client'}"})
    try:
        client = Client(old.socket, fallback=False, timeout=60)
        # python -m imports from its working directory first: the old code, which has no
        # cached_client.trust
        assert os.readlink(f"/proc/{old.proc.pid}/cwd") == str(old_code)
        assert not (old_code / "client" / "cached_client" / "trust.py").exists()
        hello = client.hello()
        assert "transfer:fd" in hello.capabilities and "identity:artifact" not in \
            hello.capabilities
        with pytest.raises(DaemonTooOld, match="older than this client") as refused:
            client.load(mm_fp4_requests[0])
        assert isinstance(refused.value, DaemonUnavailable) and "\n" not in refused.value.message
        stats = client.stats()
        assert stats["misses"] == 0 and stats["compiles"] == 0
    finally:
        old.stop()


def test_a_lease_hit_built_for_another_environment_is_never_handed_to_write_back(
        tmp_path, planted):
    """Write-back loads a ``lease`` hit (cached_client.writeback.obtain): its artifact is
    checked as a ``get``'s is, so a daemon stating another toolchain's object is refused."""
    from cached_client import writeback

    library, marker = planted
    request = KernelRequest("flashinfer.jit", {"module": "demo", "kernel": "k",
                                               "tvm_ffi": True, "source_sha256": "0" * 64},
                            "sm_100a", 148, 148)
    good = Fake(tmp_path, tmp_path / "good.sock", library)
    other = Fake(tmp_path, tmp_path / "other.sock", library,
                 override={"toolchain": "cpython-311;another stack", "sm_count": 1,
                           "max_active_clusters": 1})
    try:
        artifact, compiled = writeback.obtain(Client(str(tmp_path / "good.sock")), request,
                                              lambda path: None, 10.0)
        assert compiled is None and artifact.toolchain  # the control: a hit of this process
        with pytest.raises(ArtifactMismatch) as refused:
            writeback.obtain(Client(str(tmp_path / "other.sock")), request, lambda path: None,
                             10.0)
        assert refused.value.fields == ("toolchain",)
        assert [r["op"] for r in other.requests()] == ["hello", "lease"]
        assert not marker.exists()
    finally:
        good.stop()
        other.stop()


# -- issue 37: the client's own files (scratch directory, identity cache) ------------------------

BENIGN_C = """#include <stdint.h>
__attribute__((used)) static const unsigned char pad[256 << 10] = {1};
int __tvm_ffi_planted(void* self, const void* args, int32_t n, void* result) { return 0; }
"""
"""A kernel-sized shared object (more than a pipe holds) whose TVM-FFI function ``planted``
does nothing."""

# Issue 37 case 1, as the hostile user did it: the scratch directory was removed (a tmp
# cleaner) and made again by this uid; it watches for the client's copy to be renamed into
# place (learning how the client names the temporary file it writes first), then sets a
# trap on that name for the next kernel's copy (its digest is what the daemon tells anyone
# who asks): a link to a FIFO, renamed over by its planted library once the client has
# opened the FIFO to write and filled the pipe, so the client's own bytes hash right and
# the name it loads is the planted library.
SWAP_TRAP = r"""
import ctypes, fcntl, os, select, struct, sys, termios, time
scratch, planted, trap, out, next_name = sys.argv[1:6]
os.mkdir(scratch)
os.chmod(scratch, 0o777)
mine = os.path.join(trap, "mine.so")
with open(planted, "rb") as src, open(mine, "wb") as dst:
    dst.write(src.read())
libc = ctypes.CDLL(None, use_errno=True)
ifd = libc.inotify_init1(0)
libc.inotify_add_watch(ifd, scratch.encode(), 0x40)  # IN_MOVED_FROM
open(os.path.join(out, "ready"), "w").close()
if not select.select([ifd], [], [], 60)[0]:
    sys.exit(0)  # the client never wrote here
data = os.read(ifd, 4096)
size = struct.unpack_from("iIII", data)[3]
seen = data[16:16 + size].rstrip(b"\0").decode()
suffix = seen[seen.index(".tmp."):]  # the client's temporary name: <final>.tmp.<pid>.<tid>
fifo = os.path.join(trap, "x")
os.mkfifo(fifo, 0o666)
os.symlink(fifo, os.path.join(scratch, next_name + suffix))
open(os.path.join(out, "armed"), "w").close()
fd = os.open(fifo, os.O_RDONLY)  # returns once the client opened the name to write
while int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), "little") < 65536:
    time.sleep(0.001)  # the pipe is full: the client waits in its write
os.rename(mine, fifo)
while os.read(fd, 1 << 16):
    pass
open(os.path.join(out, "sprung"), "w").close()
"""


def fault_request(tag: int) -> KernelRequest:
    return KernelRequest("cached.test.fault", {"action": "build", "tag": str(tag)}, "sm_100a",
                         148, 148)


@pytest.fixture
def benign(workdir: Path) -> Path:
    """A shared object exporting the TVM-FFI function ``planted`` that does nothing."""
    source = workdir / "benign.c"
    source.write_text(BENIGN_C)
    library = workdir / "libbenign.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    os.chmod(library, 0o644)
    return library


@pytest.fixture
def shared_tmpdir(workdir: Path, monkeypatch) -> Path:
    """A directory like /tmp (root's, mode 1777) as this process's TMPDIR."""
    base = workdir / "tmp"
    base.mkdir()
    os.chmod(base, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    return base


@as_root
def test_a_scratch_directory_remade_by_another_uid_never_runs_its_code(
        workdir, shared_tmpdir, other, planted, benign, caplog):
    """Issue 37 case 1: a long-lived client loaded a kernel; a tmp cleaner removed its scratch
    directory; another uid made it again and trapped the name of the client's next copy (see
    SWAP_TRAP). The directory is checked at every use, so the client never writes or loads
    there: one warning naming the owner, a fresh private directory, the benign kernel every
    time, and the planted constructor never runs."""
    library, marker = planted
    scratch = shared_tmpdir / f"cached-client-{os.getuid()}"
    trap = workdir / "trap"
    trap.mkdir()
    os.chown(trap, other.pw_uid, other.pw_gid)
    other_kernel = workdir / "libbenign2.so"  # the next kernel: other bytes, other digest
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(other_kernel), "-x", "c", "-"],
                   input=BENIGN_C + "int variant = 2;\n", text=True, check=True)
    os.chmod(other_kernel, 0o644)
    fake = Fake(workdir, workdir / "fake.sock", benign, by_tag={"2": str(other_kernel)})
    client = Client(str(workdir / "fake.sock"), fallback=False, timeout=10)
    attacker = None
    try:
        assert client.load(fault_request(0))() is None
        assert os.stat(scratch).st_uid == 0 and (scratch / f"{sha256_of(benign)}.so").exists()
        shutil.rmtree(scratch)  # the tmp cleaner
        attacker = subprocess.Popen(
            [PEER_PY, "-c", SWAP_TRAP, str(scratch), str(library), str(trap), str(trap),
             f"{sha256_of(other_kernel)}.so"],
            user=other.pw_uid, group=other.pw_gid, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while not (trap / "ready").exists():
            assert attacker.poll() is None and time.monotonic() < deadline, attacker.stderr
            time.sleep(0.02)
        with caplog.at_level(logging.WARNING, logger="cached_client"):
            assert client.load(fault_request(1))() is None
            deadline = time.monotonic() + 3  # the attacker arms once it saw a copy made
            while not (trap / "armed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            try:
                fn = client.load(fault_request(2))
            finally:  # the code before: the planted library is what loads
                assert not marker.exists(), "the planted constructor ran as root"
            assert fn() is None
            art = client.get(fault_request(3), blobs=("object",))  # FlashInfer's hook's copy
        assert not marker.exists()
        assert not (trap / "armed").exists() and os.listdir(scratch) == []
        warned = [r.getMessage() for r in caplog.records if str(scratch) in r.getMessage()]
        assert len(warned) == 1 and f"belongs to uid {other.pw_uid}" in warned[0]
        fresh = Path(art.object_path).parent
        assert fresh != scratch and fresh.parent == shared_tmpdir
        st = os.lstat(fresh)
        assert st.st_uid == 0 and oct(st.st_mode & 0o777) == "0o700"
        assert sha256_of(Path(art.object_path)) == sha256_of(benign)
    finally:
        if attacker is not None:
            attacker.kill()
            attacker.wait()
        fake.stop()


def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@as_root
def test_a_scratch_directory_another_uid_made_first_is_a_warning_never_an_error(
        workdir, shared_tmpdir, other, planted, benign, caplog):
    """Issue 37 case 7: another uid makes this user's scratch directory before its first use.
    Every load still works (from the daemon, and through the in-process fallback, whose
    output directory is the fresh private one): one warning for the process, never an
    exception, nothing written into the other uid's directory."""
    library, marker = planted
    scratch = shared_tmpdir / f"cached-client-{os.getuid()}"
    subprocess.run([PEER_PY, "-c", f"import os; os.mkdir({str(scratch)!r}, 0o755)"],
                   user=other.pw_uid, group=other.pw_gid, check=True)
    fake = Fake(workdir, workdir / "fake.sock", benign)
    built: list[str] = []

    def fallback(request: KernelRequest, directory: str) -> p.Artifact:
        """An in-process compiler: gcc into the directory the client hands it."""
        built.append(directory)
        out = Path(directory) / "benign.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), "-x", "c", "-"],
                       input=BENIGN_C, text=True, check=True)
        sha = sha256_of(out)
        return p.Artifact(key="0" * 64, family=request.family, kernel_name="benign",
                          symbol="planted", library_sha256=sha, object_sha256=sha,
                          toolchain="", runtime_library={}, library_path=str(out))

    try:
        with caplog.at_level(logging.WARNING, logger="cached_client"):
            for i in range(2):  # two clients of one process
                client = Client(str(workdir / "fake.sock"), fallback=False, timeout=10)
                assert client.load(fault_request(10 + i))() is None
            offline = Client(str(workdir / "absent.sock"), fallback=fallback, timeout=5)
            assert offline.load(fault_request(12))() is None
        assert len(built) == 1 and Path(built[0]).parent != scratch
        assert os.stat(built[0]).st_uid == 0
        warned = [r.getMessage() for r in caplog.records if str(scratch) in r.getMessage()]
        assert len(warned) == 1 and "fresh private directory" in warned[0]
        assert os.listdir(scratch) == [] and not marker.exists()
    finally:
        fake.stop()


@as_root
def test_a_store_another_uid_can_write_is_copied_never_loaded_in_place(
        workdir, other, benign):
    """A library named by its digest, in a directory, each owned by a daemon's uid (root)
    and writable by it alone, is hashed and loaded where it is: no copy. Any other library
    the daemon passes is copied into the private scratch directory first: one another uid
    owns, one others may write, one in a directory others may write, one under another
    name. Bytes that hash wrong are refused in place as in a copy."""
    import hashlib

    from cached_client import IntegrityError
    from cached_client.loader import Scratch, load_library

    data = benign.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    store = workdir / "store"
    store.mkdir()
    os.chmod(store, 0o755)
    blob = store / f"{sha}.so"
    blob.write_bytes(data)
    os.chmod(blob, 0o444)
    scratch = Scratch(str(workdir / "scratch"))
    copy = workdir / "scratch" / f"{sha}.so"

    def load(path: Path) -> bool:
        """Load ``path`` as the daemon passes it (a descriptor); whether a copy was made."""
        fd = os.open(path, os.O_RDONLY)
        try:
            assert load_library(fd, "planted", sha, scratch)() is None
        finally:
            os.close(fd)
        made = copy.exists()
        if made:
            copy.unlink()
        return made

    assert load(blob) is False
    os.chown(blob, other.pw_uid, other.pw_gid)
    assert load(blob) is True
    copy.parent.mkdir(mode=0o700, exist_ok=True)  # a copy kept from before, bytes changed:
    copy.write_bytes(b"\0" * len(data))  # written again, never loaded
    fd = os.open(blob, os.O_RDONLY)
    try:
        assert load_library(fd, "planted", sha, scratch)() is None
    finally:
        os.close(fd)
    assert copy.read_bytes() == data
    copy.unlink()
    os.chown(blob, 0, 0)
    os.chmod(blob, 0o666)
    assert load(blob) is True
    os.chmod(blob, 0o444)
    os.chmod(store, 0o777)
    assert load(blob) is True
    os.chmod(store, 0o755)
    renamed = store / "libkernel.so"
    os.link(blob, renamed)
    assert load(renamed) is True
    assert load(blob) is False
    forged = store / f"{'0' * 64}.so"  # a digest's name over other bytes
    os.link(blob, forged)
    fd = os.open(forged, os.O_RDONLY)
    try:
        with pytest.raises(IntegrityError, match=f"sha256 {sha}, expected {'0' * 64}"):
            load_library(fd, "planted", "0" * 64, scratch)
    finally:
        os.close(fd)
    assert not (workdir / "scratch" / forged.name).exists()


def test_a_private_copy_replaces_a_dead_process_leftover_and_an_abandoned_one_leaves_nothing(
        tmp_path):
    """The private copy's temporary name (<final>.tmp.<pid>.<tid>) left by a dead process
    with this pid is replaced, not an error; a write whose bytes hash wrong raises
    IntegrityError and leaves neither the final name nor its temporary one."""
    import hashlib
    import threading

    from cached_client import IntegrityError
    from cached_client.loader import open_private_dir, place

    directory = open_private_dir(str(tmp_path / "scratch"))
    try:
        data = os.urandom(70_000)
        sha = hashlib.sha256(data).hexdigest()
        name = f"{sha}.so"
        leftover = f".{name}.tmp.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(leftover, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=directory)
        os.write(fd, b"half a copy")
        os.close(fd)
        place(directory, name, sha, data)
        assert sorted(os.listdir(directory)) == [name]
        with open(tmp_path / "scratch" / name, "rb") as f:
            assert f.read() == data
        wrong = "0" * 64
        with pytest.raises(IntegrityError, match="expected " + wrong):
            place(directory, f"{wrong}.so", wrong, data)
        assert sorted(os.listdir(directory)) == [name]  # nothing new, the first kept
    finally:
        os.close(directory)


# Issue 37 case 2: while root's scratch directory does not exist, another uid flips a
# directory holding a forged identity cache into that name and out again, as fast as it can.
FLIP = r"""
import os, sys
forged, name, stop = sys.argv[1:4]
while not os.path.exists(stop):
    os.rename(forged, name)
    os.rename(name, forged)
"""


@as_root
def test_an_identity_cache_another_uid_planted_is_never_trusted(
        workdir, shared_tmpdir, other, monkeypatch):
    """Issue 37 case 2: the forged cache names this environment's RECORD files with their
    real stamps and made-up components. Fresh root processes (the cache is read once per
    process: here as many as 3 s allow, by clearing it) never take one: the directory is
    checked through the descriptor the file is read from, so the forgery costs a
    recompute."""
    from cached_client import identity

    monkeypatch.delenv(identity.IDENTITY_CACHE_ENV, raising=False)
    scratch = shared_tmpdir / f"cached-client-{os.getuid()}"
    dists = [d for n, d in identity.distributions().items()
             if n in identity.STACK_NAMES or n.startswith(identity.STACK_PREFIX)]
    assert dists, "no stack distribution to forge"
    forged = shared_tmpdir / "forged"
    forged.mkdir()
    components = {str(d.path / "RECORD"): [identity._stamp(os.stat(d.path / "RECORD")),
                                           f"{d.name}==0.0:forged"] for d in dists}
    (forged / "stack-digests.json").write_text(json.dumps({"version": 1,
                                                           "components": components}))
    for path in (forged, forged / "stack-digests.json"):
        os.chown(path, other.pw_uid, other.pw_gid)
    os.chmod(forged, 0o755)
    stop = workdir / "stop"
    flipper = subprocess.Popen([PEER_PY, "-c", FLIP, str(forged), str(scratch), str(stop)],
                               user=other.pw_uid, group=other.pw_gid)
    taken = tries = 0
    try:
        deadline = time.monotonic() + 10
        while not scratch.exists() and time.monotonic() < deadline:
            pass  # flipping
        deadline = time.monotonic() + 3
        while not taken and time.monotonic() < deadline:  # the code before: taken at once
            identity._component_cache.cache_clear()
            cache = identity._component_cache()
            taken += any("forged" in c for _, c in cache.components.values())
            tries += 1
    finally:
        stop.touch()
        flipper.wait(10)
        identity._component_cache.cache_clear()
    assert flipper.returncode == 0 and tries > 100
    assert taken == 0


def test_a_deeply_nested_identity_cache_is_a_recompute_with_a_warning(tmp_path, caplog):
    """Issue 37, low: this uid's own cache file, nested too deeply for the JSON parser, is
    read as no cache (one warning), never a RecursionError out of the identity."""
    from cached_client import identity

    directory = tmp_path / "scratch"
    directory.mkdir(mode=0o700)
    path = directory / "stack-digests.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with caplog.at_level(logging.WARNING, logger="cached_client"):
        cache = identity.ComponentCache(str(path))
    assert cache.components == {}
    assert any("nested too deeply" in r.getMessage() for r in caplog.records)
    cache.put(str(path), [1, 2, 3, 4], "x==1:y")  # and it is rewritten well-formed
    assert identity.ComponentCache(str(path)).components == {str(path): ([1, 2, 3, 4],
                                                                         "x==1:y")}


# Issue 37 case 1, FlashInfer's hook: the object's path lies in a directory another uid
# controls (a remade scratch directory); it makes the name a link to a FIFO, and once the
# client has opened it to read, renames its planted object over it before writing the real
# bytes: the bytes hashed are the real ones, and a second open of the name is the planted.
READ_TRAP = r"""
import os, sys
directory, benign, planted, out = sys.argv[1:5]
fifo = os.path.join(directory, "x")
os.mkfifo(fifo, 0o666)
os.symlink(fifo, os.path.join(directory, "kernel.o"))
mine = os.path.join(directory, "mine.o")
with open(planted, "rb") as src, open(mine, "wb") as dst:
    dst.write(src.read())
data = open(benign, "rb").read()
open(os.path.join(out, "ready"), "w").close()
fd = os.open(fifo, os.O_WRONLY)  # returns once the client opened the name to read
os.rename(mine, fifo)
os.write(fd, data)
os.close(fd)
"""


@as_root
def test_the_flashinfer_hook_loads_the_object_bytes_it_hashed(workdir, other, planted):
    """Issue 37 case 1 (FlashInfer's hook): the hook reads the object once, into a sealed
    memfd hashed after sealing, and loads that: the planted object renamed over the name
    after the hash never loads (its function would create the marker)."""
    pytest.importorskip("cutlass")
    from types import SimpleNamespace

    from cached_client.integrations.flashinfer import cute_dsl

    _, marker = planted
    objects = {}
    for name, body in (("benign", "return 0;"), ("planted", MARK.format(marker=marker))):
        source = "#include <stdint.h>\n#include <fcntl.h>\n#include <unistd.h>\n" \
            "int __tvm_ffi_planted(void* s, const void* a, int32_t n, void* r) {" + body + "}\n"
        objects[name] = workdir / f"{name}.o"
        subprocess.run(["gcc", "-c", "-fPIC", "-O1", "-o", str(objects[name]), "-x", "c", "-"],
                       input=source, text=True, check=True)
        os.chmod(objects[name], 0o644)
    theirs = workdir / "theirs"
    theirs.mkdir()
    os.chown(theirs, other.pw_uid, other.pw_gid)
    attacker = subprocess.Popen(
        [PEER_PY, "-c", READ_TRAP, str(theirs), str(objects["benign"]),
         str(objects["planted"]), str(theirs)], user=other.pw_uid, group=other.pw_gid)
    try:
        deadline = time.monotonic() + 30
        while not (theirs / "ready").exists():
            assert attacker.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        sha = sha256_of(objects["benign"])
        artifact = p.Artifact(key="0" * 64, family="flashinfer.mm_fp4", kernel_name="k",
                              symbol="planted", library_sha256=sha, object_sha256=sha,
                              toolchain="", runtime_library={},
                              object_path=str(theirs / "kernel.o"))
        spec = SimpleNamespace(symbol="planted", enable_tvm_ffi=True)  # what _load reads
        fn = cute_dsl._load(spec, artifact)
        assert fn() is None
        assert not marker.exists()
    finally:
        attacker.kill()
        attacker.wait()


MARK = 'int fd = open("{marker}", O_WRONLY | O_CREAT, 0666); if (fd >= 0) close(fd); return 0;'


PUT_WINNER = """
import sys
from cached_client import Client
from cached_client import protocol as p
client = Client(sys.argv[1], fallback=False, timeout=30)
print(client.autotune_put(p.AutotunePutRequest(
    op_name="linear", n=4096, k=4096, dtype="fp8", arch="sm_100a", device="NVIDIA B200",
    bucket=64, kernel=sys.argv[2], tactic=["x", 1], time_us=0.001,
    toolchain=client.hello().toolchain, reduction_class="made.up.class")))
"""


@as_root
def test_select_never_recommends_a_kernel_a_peer_made_up(workdir, other):
    """Issue 37, low: a peer allowed to publish files a tuning winner naming a kernel that
    does not exist; ``python -m cached_client select`` still names a kernel it knows (the
    default backend): root's never sees the record (a peer's winners are its own group's,
    case 3), and the peer's own select sees it and says it ignored it."""
    daemon = DaemonProcess(workdir, workers=1, extra_args=[
        "--socket-mode", "666", "--publish-uid", str(other.pw_uid)])
    try:
        put = subprocess.run([PEER_PY, "-c", PUT_WINNER, daemon.socket, "made.up.kernel"],
                             user=other.pw_uid, group=other.pw_gid, capture_output=True,
                             text=True, env={"PYTHONPATH": str(ROOT / "client")}, timeout=60)
        assert put.returncode == 0 and put.stdout.strip() == "True", put.stderr[-2000:]
        select = [PEER_PY, "-m", "cached_client", "select", "--op", "linear", "--quant", "fp8",
                  "--arch", "sm_100a", "--socket", daemon.socket, "--n", "4096", "--k", "4096",
                  "--device", "NVIDIA B200", "--json"]
        env = {"PYTHONPATH": str(ROOT / "client")}
        for uid, gid, sees in ((0, 0, False), (other.pw_uid, other.pw_gid, True)):
            out = subprocess.run(select, capture_output=True, text=True, env=env, timeout=60,
                                 user=uid, group=gid)
            assert out.returncode == 0, out.stderr[-2000:]
            selection = json.loads(out.stdout)
            assert selection["kernel"] == "flashinfer", (uid, selection)
            warned = any("'made.up.kernel'" in w for w in selection["warnings"])
            assert warned == sees, (uid, selection["warnings"])
    finally:
        daemon.stop()
