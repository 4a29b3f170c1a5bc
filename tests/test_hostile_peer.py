"""What a hostile local user did to the daemon's side tables and queues (issue 37), done again
by a second, unprivileged uid against a real daemon: tuning winners and certifications filed
for everyone, tables grown without bound, plans left queued after hanging up.

The hostile side runs the real client on the system python as a uid made for the test
(root is needed); root's side is this process. One daemon serves the module: the peer is
on its publish allowlist (``--publish-uid``), as in the reported attack.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from cached_client import protocol as p
from cached_client.errors import InvalidArgument
from cached_client.gemm import policy
from conftest import ROOT, DaemonProcess, raw_call, wait_for
from test_access import PEER_PY, peer_uid, shared_dir  # noqa: F401 -- fixtures

from cached import families
from cached.toolchain import trust
from cached.tools import tune

PEER = r"""
import json, socket, struct, sys, time
from cached_client import Client
from cached_client import protocol as p
from cached_client.errors import CachedError
from cached_client.transport import Connection
sock, action, arg = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
client = Client(sock, timeout=60, fallback=False, identity=False)
out = {}
def code(call):
    try:
        call()
        return "ok"
    except CachedError as exc:
        return exc.code
if action == "put":  # winners as given, each answered ok or its error code
    out["put"] = [code(lambda w=w: client.autotune_put(p.AutotunePutRequest(**w)))
                  for w in arg["winners"]]
elif action == "get":
    out["get"] = client.autotune_get(p.AutotuneGetRequest(**arg.get("where", {})))
elif action == "certify":
    out["certify"] = [code(lambda r=r: client.certify_record(r)) for r in arg["records"]]
    out["mine"] = client.certifications(arg["records"][0]["family"])
elif action == "flood":  # winners of one shape until the daemon refuses one
    w, n, codes = arg["winner"], 0, {}
    while n < arg["most"]:
        got = code(lambda: client.autotune_put(p.AutotunePutRequest(**{**w, "bucket": n + 1})))
        codes[got] = codes.get(got, 0) + 1
        n += 1
        if got != "ok":
            break
    out["codes"] = codes
    start = time.monotonic()
    got = client.autotune_get(p.AutotuneGetRequest(op_name=w["op_name"]))
    out["rows"] = len(got)
elif action == "plans":  # plans queued on one connection, one more, then hang up
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    for i in range(arg["queued"]):
        s.sendall(p.encode_frame({"id": i, "op": "plan", **arg["plan"]}))
    time.sleep(0.5)  # the daemon has read them
    deadline = time.monotonic() + 10
    with Connection(sock, deadline) as extra:
        reply, _ = extra.request({"id": 99, "op": "plan", **arg["plan"]}, deadline)
    out["extra"] = "ok" if reply["ok"] else reply["error"]["code"]
    s.close()  # hang up, every plan of it still queued or running
elif action == "report":  # the same big report, again and again
    for _ in range(arg["times"]):
        client.call("report", p.ReportRequest(fallbacks={arg["family"]: 1_000_000},
                                              outside={arg["family"]: 1_000_000}))
elif action == "unknown":  # gets from environments made up, one a fingerprint
    for i, ident in enumerate(arg["identities"]):
        deadline = time.monotonic() + 30
        with Connection(sock, deadline) as conn:
            reply, _ = conn.request({"id": i, "op": "get", "request": arg["request"],
                                     "identity": ident}, deadline)
        out.setdefault("codes", []).append(reply.get("error", {}).get("code"))
elif action == "planned":  # distinct shapes planned, one at a time
    for i in range(arg["shapes"]):
        client.plan("cached.test.fault", (1, 64 + i, 64), "sm_100a", 148)
print(json.dumps(out))
"""


def as_peer(uid: int, sock: str, action: str, **arg) -> dict:
    out = subprocess.run([PEER_PY, "-c", PEER, sock, action], user=uid, group=uid,
                         env={"PYTHONPATH": str(ROOT / "client"), "PATH": "/usr/bin:/bin"},
                         input=json.dumps(arg), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def node_dir():
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="cached-hostile-"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def node(node_dir, peer_uid):  # noqa: F811
    """The peer may connect and publish."""
    d = DaemonProcess(node_dir, workers=1,
                      extra_args=["--socket-mode", "666", "--publish-uid", "0",
                                  "--publish-uid", str(peer_uid)])
    yield d
    d.stop()


N, K, H200 = 4096, 14336, "NVIDIA H200"
MAX_GROUP_BYTES = 8 << 20  # cached.ops.scoped: a peer group's rows in one table
MAX_PLANNED_PER_UID = 256  # cached.ops.autotune: planned shapes one uid adds


def hopper_winners(m: int) -> tuple[str, list[dict]]:
    """The class of the hopper_fp8 plan at (m, N, K) on 132 SMs, and its tactics, slowest
    (the plan's last) first: what the hostile user filed."""
    family = families.get("cached.hopper_fp8")
    plan = family.plan((m, N, K), "sm_90a", 132, {})
    cls = family.reduction_class(plan[0].params)
    same = [dict(r.params) for r in plan if family.reduction_class(r.params) == cls]
    return cls, same[::-1]


def test_a_publishers_winners_are_its_own_groups_and_unstated_ones_are_refused(
        node, peer_uid):  # noqa: F811
    """The attack: a --publish-uid user files the worst tactics of the right class as
    winners for every bucket. Root's view (autotune_get, the policy's shared winners,
    ``cached tune``'s "published before") holds none of them; the peer's own group sees
    them; a winner that states no toolchain or no class is refused and stores nothing."""
    root = node.client(timeout=30)
    toolchain = root.hello().toolchain
    cls, worst = hopper_winners(64)
    put = dict(op_name="linear", n=N, k=K, dtype="fp8", arch="sm_90a", device=H200,
               kernel="cached.hopper_fp8", time_us=1e-3, replace=True, toolchain=toolchain,
               reduction_class=cls)
    buckets = [1, 16, 64, 256]
    winners = [{**put, "bucket": b, "tactic": worst[0]} for b in buckets]
    unstated = [{**winners[0], "toolchain": ""}, {**winners[0], "reduction_class": ""}]
    got = as_peer(peer_uid, node.socket, "put", winners=winners + unstated)
    assert got["put"] == ["ok"] * 4 + ["invalid_argument"] * 2
    where = dict(op_name="linear", n=N, k=K, dtype="fp8", arch="sm_90a", device=H200)
    assert root.autotune_get(p.AutotuneGetRequest(**where)) == []
    assert policy.autotune_results(root, "linear", N, K, "fp8", "sm_90a", H200, toolchain) == []
    target = tune.Target(H200, 132, toolchain)
    assert tune.published(root, N, K, target, cls) == {}  # cached tune times every bucket
    mine = as_peer(peer_uid, node.socket, "get", where=where)["get"]
    assert sorted(r["bucket"] for r in mine) == buckets
    assert {r["trust_group"] for r in mine} == {trust.group_name((peer_uid,))}
    # root's own tune is trusted by every peer, and the peer's rows never replace it
    best = hopper_winners(64)[1][-1]
    assert root.autotune_put(p.AutotunePutRequest(**{**put, "bucket": 64, "tactic": best,
                                                     "time_us": 5.0}))
    assert [r["tactic"] for r in root.autotune_get(p.AutotuneGetRequest(**where))] == [best]
    seen = {r["bucket"]: r for r in as_peer(peer_uid, node.socket, "get", where=where)["get"]}
    assert set(seen) == set(buckets)  # one row a bucket: the fastest the peer may see
    with pytest.raises(InvalidArgument, match="toolchain .* and reduction_class"):
        root.autotune_put(p.AutotunePutRequest(**{**put, "bucket": 2, "tactic": best,
                                                  "reduction_class": ""}))


def test_an_empty_certification_is_refused_and_a_peers_is_its_own_groups(
        node, peer_uid):  # noqa: F811
    """The attack: a certification with an empty rows_differing passed as "0 rows differ"
    for every user. Now it is refused; a complete one from the peer is served to its own
    group only, and an empty record already in the table is never served."""
    family = "cached.hopper_fp8"
    base = {"family": family, "n": 8192, "k": 8192, "device": H200, "arch": "sm_90a",
            "tactics": [{"t": 1}], "ms": [1, 2]}
    records = [{**base, "rows_differing": {}}, {**base, "rows_differing": {"mix": 0}},
               {**base, "tactics": [], "rows_differing": {"t0": 0, "mix": 0,
                                                          "cross_tactic": 0}},
               {**base, "rows_differing": {"t0": 0, "mix": 0, "cross_tactic": 0}}]
    got = as_peer(peer_uid, node.socket, "certify", records=records)
    assert got["certify"] == ["invalid_argument"] * 3 + ["ok"]
    assert [r["trust_group"] for r in got["mine"]] == [trust.group_name((peer_uid,))]
    root = node.client(timeout=30)
    assert policy.certified(root, family, 8192, 8192, H200) is None
    assert root.certifications(family) == []
    # a record stored empty before this check existed, as trusted: not served either
    db = sqlite3.connect(node.store / "index.sqlite", timeout=30)
    with db:
        db.execute("insert into certifications (family, n, k, device, arch, tactics, "
                   "rows_differing, trust_group, row_bytes) values (?, 8192, 8192, ?, "
                   "'sm_90a', '[]', '{}', 'trusted', 10)", [family, H200])
    db.close()
    assert root.certifications(family) == []
    assert policy.certified(root, family, 8192, 8192, H200) is None
    # root's complete record is served to both
    root.certify_record({**base, "rows_differing": {"t0": 0, "mix": 0, "cross_tactic": 0}})
    assert policy.certified(root, family, 8192, 8192, H200) is not None
    assert len(as_peer(peer_uid, node.socket, "certify", records=records[-1:])["mine"]) == 2


def test_a_peers_winners_stop_at_its_cap_and_every_reply_fits_a_frame(
        node, peer_uid):  # noqa: F811
    """The attack: 79 MB of winners in 3.2 s and a 77 MB autotune_get reply. Now the peer's
    group holds at most MAX_GROUP_BYTES (the next put is overloaded, nothing lost), its
    own reply fits the client's frame, and root's reply holds none of it."""
    winner = dict(op_name="flood", n=1, k=1, dtype="fp8", arch="sm_100a", device="d",
                  kernel="k", tactic={"pad": "x" * 3900}, time_us=1.0,
                  toolchain="t" * 8000, reduction_class="c")
    got = as_peer(peer_uid, node.socket, "flood", winner=winner, most=2000)
    assert got["codes"].get("overloaded") == 1 and 500 < got["codes"]["ok"] < 2000
    assert got["rows"] == got["codes"]["ok"]  # every stored row comes back, in one frame
    db = sqlite3.connect(node.store / "index.sqlite", timeout=30)
    held = db.execute("select sum(row_bytes), sum(length(tactic) + length(toolchain)) from "
                      "autotune_results where trust_group = ?",
                      [trust.group_name((peer_uid,))]).fetchone()
    db.close()
    assert held[1] <= held[0] <= MAX_GROUP_BYTES
    assert node.client(timeout=30).autotune_get(p.AutotuneGetRequest(op_name="flood")) == []


def test_made_up_environments_stay_few_and_small_and_a_real_one_is_still_shown(
        node, peer_uid, mm_fp4_requests):  # noqa: F811
    """Issue 37 (low): 40 made-up environments grew /stats to 2.4 MB and pushed real unknown
    environments off the page and out of the log. Now one uid adds at most 4, each keeps at
    most 24 distributions, and an environment asked for after them is still shown and
    logged."""
    from cached_client import identity

    base = identity.for_families(["flashinfer.mm_fp4"])
    fake = [{**base, "toolchain": f"cpython-311;fake{i};" + ";".join(
        f"pkg{j}x{i}==1.{j}:{'0' * 64}" for j in range(600))} for i in range(40)]
    got = as_peer(peer_uid, node.socket, "unknown", request=mm_fp4_requests[0].to_wire(),
                  identities=fake)
    assert set(got["codes"]) == {"unknown_toolchain"}
    real = {**base, "toolchain": "cpython-311;real;vllm==0.33.0:" + "1" * 64}
    reply = raw_call(node.socket, {"op": "get", "request": mm_fp4_requests[0].to_wire(),
                                   "identity": real})
    assert reply["error"]["code"] == "unknown_toolchain"
    stats = node.stats()
    shown = {u["fingerprint"] for u in stats["unknown_environments"]}
    assert identity.digest(real["toolchain"]) in shown
    assert len(shown & {identity.digest(f["toolchain"]) for f in fake}) <= 4
    assert len(json.dumps(stats)) < 100_000
    assert identity.digest(real["toolchain"]) in node.log_path.read_text()


def test_a_peer_adds_at_most_its_share_of_planned_shapes(node, peer_uid):  # noqa: F811
    """Any peer could fill the 4,096 planned-shape slots ``cached tune --planned`` reads;
    now a uid other than root's and the daemon's records at most MAX_PLANNED_PER_UID, and
    root's shapes are still recorded after it."""
    root = node.client(timeout=30)

    def fault_shapes() -> set[int]:
        return {s["n"] for s in root.planned("cached.test.fault")}

    before = fault_shapes()
    as_peer(peer_uid, node.socket, "planned", shapes=MAX_PLANNED_PER_UID + 40)
    wait_for(lambda: len(fault_shapes() - before) >= MAX_PLANNED_PER_UID - 2)
    root.plan("cached.test.fault", (1, 99999, 64), "sm_100a", 148)
    wait_for(lambda: 99999 in fault_shapes())
    peers = fault_shapes() - before - {99999}
    assert len(peers) <= MAX_PLANNED_PER_UID


HOLD_LOCKS = r"""
import fcntl, json, os, sys
held = []
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.append(path)
    except OSError as exc:
        pass
print(json.dumps(held), flush=True)
sys.stdin.read()
"""


def test_a_reader_of_the_store_cannot_hold_its_lock_and_a_refusal_names_the_holder(
        shared_dir, peer_uid):  # noqa: F811
    """The attack: any user who can read the store held flock on daemon.lock through a
    read-only descriptor, and the daemon could not restart (the refusal named the dead
    daemon's pid). Now the lock is in a directory only the daemon's user can open: the
    peer holds nothing that matters (the earlier versions' lock file, which it may hold,
    is ignored when another user holds it) and the daemon restarts; a process of the
    daemon's own uid holding that old lock is named in the refusal by its pid."""
    d = DaemonProcess(shared_dir, workers=1, extra_args=["--socket-mode", "666"])
    legacy = d.store / "daemon.lock"
    try:
        if not legacy.exists():  # a store an earlier version served
            legacy.write_text('{"pid": 1, "command": "serve"}\n')
            legacy.chmod(0o644)
        assert oct(os.stat(d.store).st_mode & 0o777) == "0o755"  # the peer reads the store
        locks = [str(d.store / ".lock" / "daemon.lock"), str(legacy)]
        d.stop()  # the peer takes what it can while no daemon runs
        peer = subprocess.Popen([PEER_PY, "-c", HOLD_LOCKS, *locks], user=peer_uid,
                                group=peer_uid, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
        try:
            assert json.loads(peer.stdout.readline()) == [str(legacy)]
            d = DaemonProcess(shared_dir, workers=1, extra_args=["--socket-mode", "666"])
            assert d.stats()["workers_ready"] == 1  # restarted, the peer's lock held
        finally:
            peer.communicate("", timeout=30)
        d.stop()
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCKS, str(legacy)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(holder.stdout.readline()) == [str(legacy)]
            refused = subprocess.run(
                [sys.executable, "-m", "cached", "serve", "--store", str(d.store), "--socket",
                 str(shared_dir / "other.sock"), "--workers", "1"], capture_output=True,
                text=True, timeout=120, env={**os.environ, "CACHED_TEST_FAMILIES": "1"})
            assert refused.returncode == 2, refused.stderr
            assert f"is in use by pid {holder.pid} (uid {os.getuid()}" in refused.stderr
        finally:
            holder.communicate("", timeout=30)
    finally:
        d.stop()
