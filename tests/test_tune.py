"""``cached tune`` without a GPU: shape selection, candidates of one class, the margin rule,
publishing, resume after an interrupt, class purity, and the winners reaching a second
client and, through a real Redis, a second daemon. Real daemons, real sockets, real plans.

The timing core (cached.tune_cuda.CudaTimer) needs a GPU; here the Timer is
:class:`Preferring`, which answers fixed relative times (one candidate faster by a given
factor in every round) so that the tests can say which winner the rule must pick. No speed
is claimed from it: speed figures come from bench/gpu/run_tune.sh on the H200.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from cached_client import Client
from cached_client.errors import InvalidArgument
from cached_client.gemm import plan as gemm_plan
from cached_client.protocol import AutotuneGetRequest, AutotunePutRequest
from conftest import ROOT, DaemonProcess, run_cli

from cached import tune
from cached.families.hopper_fp8 import space as SPACE
from cached.families.hopper_fp8 import tactic as T

H200 = "NVIDIA H200"
SHAPE = (4608, 3584)  # no recorded winners (Qwen2.5-7B's qkv_proj)
BUCKETS = (1, 64, 2048)


class Preferring:
    """A Timer of fixed relative times: candidate ``faster[m]`` takes 1/ratio of the plan's
    first choice's 10 us in every round (the others 12 us); every call is recorded, and
    the ``stop_after``-th call raises KeyboardInterrupt (an operator's Ctrl-C)."""

    def __init__(self, faster: dict[int, tuple[int, float]] | None = None,
                 stop_after: int | None = None) -> None:
        self.faster = faster or {}
        self.stop_after = stop_after
        self.calls: list[tuple[int, int, int, int]] = []

    def time(self, n, k, m, kernels, rounds):
        self.calls.append((n, k, m, len(kernels)))
        if self.stop_after is not None and len(self.calls) >= self.stop_after:
            raise KeyboardInterrupt
        out = {i: [12.0] * rounds for i in range(len(kernels))}
        out[0] = [10.0] * rounds
        if m in self.faster:
            i, ratio = self.faster[m]
            out[i] = [10.0 / ratio] * rounds
        out[-1] = [11.0] * rounds  # the competitor's figure, reported only
        return out


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("tune"), workers=0)  # plans in the daemon
    yield d
    d.stop()


def target_of(client: Client) -> tune.Target:
    return tune.Target(H200, 132, client.hello().toolchain)


def rows(client: Client, n: int, k: int, **where) -> list[dict]:
    return client.autotune_get(AutotuneGetRequest(op_name="linear", n=n, k=k, dtype="fp8",
                                                  arch="sm_90a", device=H200, **where))


def test_pick_keeps_the_first_choice_unless_beaten_in_every_round():
    assert tune.pick({0: [10, 10, 10], 1: [9.7, 9.7, 9.7]}, 0.02) == 1  # 3 % > 2 %
    assert tune.pick({0: [10, 10, 10], 1: [9.7, 9.7, 9.7]}, 0.05) == 0
    assert tune.pick({0: [10, 10, 10], 1: [9.0, 9.0, 9.0]}, 0.05) == 1
    assert tune.pick({0: [10, 10, 10], 1: [9.0, 10.0, 9.0]}, 0.05) == 0  # one round lost
    assert tune.pick({1: [9.0], 2: [8.0]}, 0.05) == 2  # the first choice could not be timed
    assert tune.pick({-1: [1.0]}, 0.05) is None  # only the competitor: no winner


def test_tune_publishes_winners_a_second_process_plans_from_them(node):
    c = node.client(timeout=120)
    target = target_of(c)
    timer = Preferring({64: (1, 1.25), 2048: (2, 1.01)})  # 2048: within the margin
    [res] = tune.tune(c, [SHAPE], timer, target, buckets=BUCKETS, rounds=3)
    cls = T.reduction_class_id(SPACE.choose_split(*SHAPE, 132))
    assert res.reduction_class == cls and [b.m for b in res.buckets] == list(BUCKETS)
    assert [b.changed for b in res.buckets] == [False, True, False]
    _, at64 = tune.candidates(c, *SHAPE, 64, target)
    got = {r["bucket"]: r for r in rows(c, *SHAPE)}
    assert set(got) == set(BUCKETS)
    assert got[64]["tactic"] == dict(at64[1].params) and got[64]["time_us"] == 8.0
    assert {r["reduction_class"] for r in got.values()} == {cls}
    assert {r["toolchain"] for r in got.values()} == {target.toolchain}
    # the daemon's journal: one line per stored winner
    assert node.log().count('"autotune.stored"') >= 3
    # a second process plans from them, with no timing of its own
    code = ("import json, sys; from cached_client import Client; "
            "from cached_client.gemm import plan as gemm_plan; "
            "p = gemm_plan.plan_gemm(Client(sys.argv[1], timeout=60), 4608, 3584, "
            "arch='sm_90a', sm_count=132, device='NVIDIA H200', max_m=2048, prefetch=False); "
            "print(json.dumps([[b.upper, b.source, b.request.params] "
            "for b in p.choice.buckets]))")
    out = subprocess.run([sys.executable, "-c", code, node.socket], capture_output=True,
                         text=True, check=True, cwd=ROOT).stdout
    planned = {u: (src, params) for u, src, params in json.loads(out)}
    for m in BUCKETS:
        assert planned[m] == ("autotune", got[m]["tactic"])
    assert planned[2][0] == "plan order"  # a bucket tune did not time
    assert len(timer.calls) == len(BUCKETS)


def test_interrupted_tune_goes_on_where_it_stopped(node):
    c = node.client(timeout=120)
    target = target_of(c)
    shapes = [(3584, 4608), (1152, 16384)]
    first = Preferring(stop_after=5)  # 4 buckets timed and published, the 5th interrupted
    partial: list = []
    with pytest.raises(KeyboardInterrupt):
        tune.tune(c, shapes, first, target, buckets=BUCKETS, rounds=2, results=partial)
    assert [len(r.buckets) for r in partial] == [3, 1] and partial[1].unfinished == [64, 2048]
    assert [m for _, _, m, _ in first.calls] == [1, 64, 2048, 1, 64]
    assert {r["bucket"] for r in rows(c, 3584, 4608)} == set(BUCKETS)
    assert {r["bucket"] for r in rows(c, 1152, 16384)} == {1}
    again = Preferring()
    res = tune.tune(c, shapes, again, target, buckets=BUCKETS, rounds=2)
    assert [(n, m) for n, _, m, _ in again.calls] == [(1152, 64), (1152, 2048)]
    assert res[0].skipped == list(BUCKETS) and res[1].skipped == [1]
    # a third run has nothing left to time; --force times everything again
    idle = Preferring()
    tune.tune(c, shapes, idle, target, buckets=BUCKETS, rounds=2)
    assert idle.calls == []
    forced = Preferring()
    tune.tune(c, shapes[:1], forced, target, buckets=BUCKETS, rounds=2, force=True)
    assert len(forced.calls) == 3
    # another toolchain has tuned nothing yet
    other = tune.Target(H200, 132, "another-toolchain")
    assert tune.published(c, 3584, 4608, other, T.reduction_class_id(1)) == {}


def test_budget_per_shape_leaves_the_rest_for_the_next_run(node):
    c = node.client(timeout=120)
    target = target_of(c)

    class Slow(Preferring):
        def time(self, n, k, m, kernels, rounds):
            import time as _t
            _t.sleep(0.3)
            return super().time(n, k, m, kernels, rounds)

    slow = Slow()
    [res] = tune.tune(c, [(2304, 16384)], slow, target, buckets=BUCKETS, rounds=2,
                      budget_s=0.1)
    assert [b.m for b in res.buckets] == [1] and res.unfinished == [64, 2048]


def test_winners_never_mix_classes(node):
    c = node.client(timeout=120)
    target = target_of(c)
    n, k = 1152, 16384  # class S = 2 on 132 SMs
    cls = T.reduction_class_id(SPACE.choose_split(n, k, 132))
    assert cls != T.reduction_class_id(1)
    for m in BUCKETS:
        got_cls, cands = tune.candidates(c, n, k, m, target)
        assert got_cls == cls and len(cands) >= 3  # the plan's top 3, recorded neighbours'
        assert {T.tactic_from_params(r.params).reduction_class for r in cands} == {cls}
    s1 = c.plan_reply("cached.hopper_fp8", (64, n, k), "sm_90a", 132,
                      {"reduction_class": T.reduction_class_id(1)}).requests[0]
    put = dict(op_name="linear", n=n, k=k, dtype="fp8", arch="sm_90a", device=H200,
               bucket=64, kernel="cached.hopper_fp8", tactic=dict(s1.params), time_us=1.0,
               toolchain=target.toolchain)
    before = rows(c, n, k)
    # a tactic of class S = 1 cannot be filed under the S = 2 class...
    with pytest.raises(InvalidArgument, match="is of the class k128.acc1.s1.fixed"):
        c.autotune_put(AutotunePutRequest(**put, reduction_class=cls))
    assert rows(c, n, k) == before  # nothing stored
    # ... and filed under its own class, faster than anything, no plan of the S = 2 class
    # takes it
    assert c.autotune_put(AutotunePutRequest(**put, reduction_class=T.reduction_class_id(1)))
    plan = gemm_plan.plan_gemm(c, n, k, arch="sm_90a", sm_count=132, device=H200,
                               max_m=2048, prefetch=False)
    assert {b.reduction_class for b in plan.choice.buckets} == {cls}
    assert {T.tactic_from_params(b.request.params).reduction_class
            for b in plan.choice.buckets} == {cls}
    assert tune.published(c, n, k, target, cls).get(64, {}).get("tactic") != dict(s1.params)
    # a winner of the class timed with another toolchain's kernels is not this one's
    alien = c.plan_reply("cached.hopper_fp8", (4, n, k), "sm_90a", 132,
                         {"reduction_class": cls}).requests[5]
    assert c.autotune_put(AutotunePutRequest(**{**put, "bucket": 4, "time_us": 0.5,
                                                "toolchain": "another-toolchain",
                                                "tactic": dict(alien.params)},
                                             reduction_class=cls))
    again = gemm_plan.plan_gemm(c, n, k, arch="sm_90a", sm_count=132, device=H200,
                                max_m=2048, prefetch=False)
    at4 = {b.upper: b for b in again.choice.buckets}[4]
    assert at4.request.params != dict(alien.params) and at4.source == "plan order"


def test_planned_shapes_are_what_tune_planned_picks(node):
    c = node.client(timeout=120)
    gemm_plan.plan_gemm(c, 2560, 8960, arch="sm_90a", sm_count=132, device=H200,
                        max_m=64, prefetch=False)
    listed = [(r["n"], r["k"]) for r in c.planned("cached.hopper_fp8")]
    assert (2560, 8960) in listed and listed.count((2560, 8960)) == 1
    shapes = tune.shapes_to_tune(c, [(64, 64)], planned=True)
    assert shapes[0] == (64, 64) and (2560, 8960) in shapes
    manifest = tune.shapes_to_tune(c, manifest="llama-3.1-8b")
    assert manifest == [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


def test_cli_checks_its_arguments_and_needs_a_gpu(node):
    bad = run_cli("tune", "--socket", node.socket, "--weight", "4608,35", check=False)
    assert bad.returncode == 2 and "multiples of 16" in bad.stderr
    none = run_cli("tune", "--socket", node.socket, check=False)
    assert none.returncode == 2 and "no shapes" in none.stderr
    cpu = run_cli("tune", "--socket", node.socket, "--weight", "4608,3584", check=False)
    assert cpu.returncode == 2 and ("CPU build" in cpu.stderr or "no CUDA device" in cpu.stderr)


# -- through the fleet tier -----------------------------------------------------------------

redis = pytest.importorskip("redis")
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None,
                                 reason="redis-server is not installed (make setup installs it)")


@needs_redis
def test_winners_reach_a_second_daemon_through_redis_signed(tmp_path):
    from test_fleet import KeyPair, Node, RedisServer, publishing, read_only

    server = RedisServer(tmp_path / "redis")
    pair = KeyPair(tmp_path / "keys", "fleet")
    a = Node(tmp_path / "a", server.url, *publishing(pair), workers=0).ready()
    b = Node(tmp_path / "b", server.url, *read_only(pair.pub), workers=0).ready()
    try:
        ca, cb = a.client(timeout=120), b.client(timeout=120)
        target = target_of(ca)
        assert target_of(cb).toolchain == target.toolchain
        tune.tune(ca, [SHAPE], Preferring({64: (1, 1.25)}), target, buckets=BUCKETS,
                  rounds=2)
        a.wait_tier(lambda t: t["records_published"] >= len(BUCKETS))
        mine = {r["bucket"]: r for r in rows(ca, *SHAPE)}
        theirs = {r["bucket"]: r for r in rows(cb, *SHAPE)}
        assert {m: r["tactic"] for m, r in theirs.items()} == \
            {m: r["tactic"] for m, r in mine.items()}
        assert {r["source"] for r in theirs.values()} == {"fleet"}
        plan = gemm_plan.plan_gemm(cb, *SHAPE, arch="sm_90a", sm_count=132, device=H200,
                                   max_m=2048, prefetch=False)
        assert {b_.upper: b_.source for b_ in plan.choice.buckets if b_.upper in BUCKETS} \
            == dict.fromkeys(BUCKETS, "autotune")
        # a tampered record, or one filed under another bucket, is rejected by b
        r = server.client()
        [key] = r.keys("cached:v2:tune:*")
        fields = r.hgetall(key)
        rid64 = next(f for f, v in fields.items() if b'"bucket":64' in v)
        rid1 = next(f for f, v in fields.items() if b'"bucket":1,' in v)
        value = bytearray(fields[rid64])
        value[-3] ^= 1
        r.hset(key, rid64, bytes(value))
        r.hset(key, rid1, fields[next(f for f, v in fields.items() if b'"bucket":2048' in v)])
        c = Node(tmp_path / "c", server.url, *read_only(pair.pub), workers=0).ready()
        try:
            got = {x["bucket"] for x in rows(c.client(timeout=60), *SHAPE)}
            assert got == {2048} and c.tier()["rejected"] == 2
        finally:
            c.stop()
    finally:
        a.stop()
        b.stop()
        server.kill()
