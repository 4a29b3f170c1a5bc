"""Reduction-order classes through the daemon (``hello``, ``plan``), the policy's one class
per batch-invariant plan, and the framework-free plan core (cached_client.gemm.plan), against
a real ``cached serve`` on a real socket. The GPU half (eager vs CUDA graph, the seeds'
method, float64 reference, timings) is bench/gpu/gemm_plan_check.py on the H200."""

from __future__ import annotations

import functools
import subprocess

import pytest
from cached_client import Client
from cached_client.errors import InvalidArgument
from cached_client.gemm import plan as gemm_plan
from cached_client.gemm import policy
from cached_client.protocol import AutotunePutRequest, PlanReply, PlanShapeReply
from conftest import ROOT, DaemonProcess

from cached.families import get as family
from cached.families.hopper_fp8 import space as SPACE
from cached.families.hopper_fp8 import tactic as T

HOPPER = "cached.hopper_fp8"
H200 = "NVIDIA H200"


NEW_OPS = "plan_shape,get_batch"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("plan"), workers=0)  # plans in the daemon itself
    yield d
    d.stop()


@pytest.fixture(scope="module")
def old_daemon(tmp_path_factory):
    """A real daemon that acts as one predating plan_shape and get_batch (its hello lists
    neither; asking either is an unknown op): the per-bucket path's."""
    d = DaemonProcess(tmp_path_factory.mktemp("old"), workers=0,
                      extra_env={"CACHED_TEST_WITHHOLD_OPS": NEW_OPS})
    yield d
    d.stop()


@pytest.fixture(params=["daemon", "old_daemon"])
def either(request):
    """Each test twice: against this daemon (plan_shape) and an older one (plan per bucket)."""
    return request.getfixturevalue(request.param)


def _old(d) -> bool:
    return "plan_shape" not in d.client(timeout=10).hello().ops


class Recording(Client):
    """A real client that also notes each op it sends."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.ops: list[tuple[str, object]] = []

    def call(self, op, request=None, timeout=None):
        self.ops.append((op, request))
        return super().call(op, request, timeout)


def test_classes_round_trip_through_hello_and_plan(daemon):
    c = daemon.client(timeout=60)
    info = c.hello().reduction_classes
    assert info[HOPPER] == {"classes": list(T.REDUCTION_CLASSES), "m_independent": True}
    # 5 per-tensor fast classes, 5 per-token fast ones, the block one and 5 exact ones per
    # scheme (issue 27: S = 1, 2, 4, 8, 16)
    assert len(info[HOPPER]["classes"]) == 21
    assert "e4m3.c1" in info["flashinfer.bi.bmm_fp8"]["classes"]
    assert info["flashinfer.mm_fp4"] == {"classes": [], "m_independent": False}
    reply = c.plan_reply(HOPPER, (16, 4096, 14336), "sm_90a", 132)
    assert len(reply.classes) == len(reply.requests) > 0
    assert len(set(reply.classes)) == 5  # no option: every per-tensor fast class
    for request, cls in zip(reply.requests, reply.classes, strict=True):
        assert cls == family(HOPPER).reduction_class(request.params)
    bi = c.plan_reply(HOPPER, (16, 4096, 14336), "sm_90a", 132, {"batch_invariant": True})
    assert set(bi.classes) == {T.reduction_class_id(SPACE.choose_split(4096, 14336, 132))}
    # a reply whose classes do not match its requests is refused with the field named
    with pytest.raises(InvalidArgument, match="classes has 1 entries for 2 requests"):
        PlanReply.from_wire({"requests": [r.to_wire() for r in reply.requests[:2]],
                             "classes": ["x"]})


def test_policy_reads_classes_from_hello_not_a_table(daemon):
    assert not hasattr(policy, "M_INDEPENDENT")
    c = daemon.client(timeout=60)
    with_daemon = policy.select("bmm", "fp8", "sm_90a", True, client=c)
    assert (with_daemon.kernel, with_daemon.tactics) == (HOPPER, "set")
    assert f"{len(T.REDUCTION_CLASSES)} reduction-order classes" in with_daemon.reason
    without = policy.select("bmm", "fp8", "sm_100a", True)
    assert without.tactics == "one" and "no daemon to ask" in without.reason


def test_policy_refuses_to_mix_classes(daemon):
    c = daemon.client(timeout=60)
    s1 = c.plan_reply(HOPPER, (16, 4096, 4096), "sm_90a", 132,
                      {"reduction_class": T.reduction_class_id(1)})
    s2 = c.plan_reply(HOPPER, (16, 4096, 4096), "sm_90a", 132,
                      {"reduction_class": T.reduction_class_id(2)})
    assert policy.one_class([(s1.requests[0], s1.classes[0]),
                             (s1.requests[1], s1.classes[1])]) == T.reduction_class_id(1)
    with pytest.raises(policy.MixedReductionClasses, match="got 2: k128.acc1.s1.fixed"):
        policy.one_class([(s1.requests[0], s1.classes[0]), (s2.requests[0], s2.classes[0])])


def test_tactic_per_bucket_one_class_with_shared_winners_of_that_class(either):
    daemon = either
    n, k = 4096, 14336
    cls = T.reduction_class_id(SPACE.choose_split(n, k, 132))
    other_cls = next(c for c in T.REDUCTION_CLASSES if c != cls)
    c = daemon.client(timeout=60)
    ups = (1, 16, 64, 2048)
    base = policy.choose_tactics(c, HOPPER, n, k, "sm_90a", buckets=ups, sm_count=132,
                                 device=H200)
    assert base.reduction_class == cls and {b.reduction_class for b in base.buckets} == {cls}
    assert [b.source for b in base.buckets] == ["plan order"] * 4
    assert [b.upper for b in base.buckets] == list(ups)
    # a winner of the class for M<=16, and one of another class for M<=64
    same = c.plan_reply(HOPPER, (16, n, k), "sm_90a", 132, {"reduction_class": cls}).requests[3]
    other = c.plan_reply(HOPPER, (64, n, k), "sm_90a", 132,
                         {"reduction_class": other_cls}).requests[0]
    toolchain = c.hello().toolchain
    for bucket, req, req_cls in ((16, same, cls), (64, other, other_cls)):
        assert c.autotune_put(AutotunePutRequest(
            op_name="linear", n=n, k=k, dtype="fp8", arch="sm_90a", device=H200,
            bucket=bucket, kernel=HOPPER, tactic=dict(req.params), time_us=10.0,
            toolchain=toolchain, reduction_class=req_cls))
    rec = Recording(daemon.socket, timeout=60, fallback=False)
    tuned = policy.choose_tactics(rec, HOPPER, n, k, "sm_90a", buckets=ups, sm_count=132,
                                  device=H200)
    if _old(daemon):
        # each bucket's first tactic alone; the whole plan only where a winner of the class
        # is to be found
        asked = [(r.shape[0], r.limit) for op, r in rec.ops if op == "plan"]
        assert asked == [(u, 1) for u in ups] + [(16, None)]
    else:  # the whole shape in one request (after the connection's hello)
        assert [op for op, _ in rec.ops] == ["hello", "plan_shape"]
    by_upper = {b.upper: b for b in tuned.buckets}
    assert by_upper[16].source == "autotune" and by_upper[16].request == same
    assert by_upper[64].source == "plan order" and by_upper[64].reduction_class == cls
    assert len(tuned.warnings) == 1 and "is not a tactic of the class" in tuned.warnings[0]
    # without batch invariance each bucket may take its winner, whatever its class
    free = policy.choose_tactics(c, HOPPER, n, k, "sm_90a", buckets=ups, sm_count=132,
                                 device=H200, batch_invariant=False)
    assert {b.upper: b.source for b in free.buckets}[64] == "autotune"
    assert len({b.reduction_class for b in free.buckets}) >= 2
    for bad in ((), (4, 2), (0, 8)):
        with pytest.raises(ValueError, match="increasing positive"):
            policy.choose_tactics(c, HOPPER, n, k, "sm_90a", buckets=bad)


def test_plan_limit_gives_the_plans_first_requests_and_bad_limits_are_refused(daemon):
    c = daemon.client(timeout=60)
    opts = {"batch_invariant": True}
    full = c.plan_reply(HOPPER, (16, 4096, 4096), "sm_90a", 132, opts)
    assert len(full.requests) > 5
    for limit in (1, 5):
        part = c.plan_reply(HOPPER, (16, 4096, 4096), "sm_90a", 132, opts, limit=limit)
        assert part.requests == full.requests[:limit] and part.classes == full.classes[:limit]
    assert c.plan_reply(HOPPER, (16, 4096, 4096), "sm_90a", 132, opts,
                        limit=1 << 20).requests == full.requests
    for bad in (0, -3, "2", 1 << 21):
        with pytest.raises(InvalidArgument, match="limit must be an integer in"):
            c.plan_reply(HOPPER, (16, 4096, 4096), "sm_90a", 132, opts, limit=bad)
    # and the daemon still answers
    assert c.plan_reply(HOPPER, (16, 4096, 4096), "sm_90a", 132, opts,
                        limit=1).requests == full.requests[:1]


def test_plan_gemm_asks_plans_then_one_prefetch_and_nothing_else(either):
    daemon = either
    c = Recording(daemon.socket, timeout=60, fallback=False)
    plan = gemm_plan.plan_gemm(c, 2688, 4096, arch="sm_90a", sm_count=132, device=H200,
                               max_m=2048)
    ops = [op for op, _ in c.ops]
    if _old(daemon):
        assert ops[-1] == "prefetch" and ops.count("prefetch") == 1 and "get" not in ops
        assert ops.count("plan") == len(gemm_plan.buckets_up_to(2048)) == 12
        # no shared winners for this shape: every bucket asks for its first tactic alone
        assert {r.limit for op, r in c.ops if op == "plan"} == {1}
        sent = c.ops[-1][1].requests
        assert len(sent) == len(plan.requests) >= 1
    else:  # one request plans all 12 buckets and queues their kernels
        assert ops == ["hello", "plan_shape"] and c.ops[-1][1].prefetch is True
        assert len(c.ops[-1][1].buckets) == 12
    assert [b.upper for b in plan.choice.buckets] == list(gemm_plan.buckets_up_to(2048))
    assert plan.choice.reduction_class == T.reduction_class_id(SPACE.choose_split(2688, 4096, 132))
    line = plan.describe()
    assert "N=2688 K=4096" in line and plan.choice.reduction_class in line and "M<=1:" in line


def test_loaded_hopper_plan_buckets_and_workspace_for_the_largest_m(daemon):
    torch = pytest.importorskip("torch")
    from cached_client.gemm.hopper_fp8 import counter_elems, workspace_bytes

    c = daemon.client(timeout=60)
    n, k = 4096, 14336
    plan = gemm_plan.plan_gemm(c, n, k, arch="sm_90a", sm_count=132, max_m=512,
                               prefetch=False)
    split = T.HopperFp8Tactic(64, 128, splits=4, split_mode="cta").normalized().to_params()
    buckets = list(plan.choice.buckets)
    buckets[-1] = policy.BucketChoice(512, buckets[-1].request.__class__(
        family=HOPPER, params=split, arch="sm_90a", sm_count=132, max_active_clusters=132),
        buckets[-1].reduction_class, "plan order")
    plan.choice.buckets = buckets
    loaded = gemm_plan.HopperFp8Gemm(plan, [None] * len(buckets), "cpu")
    assert loaded.workspace.numel() * 4 >= workspace_bytes(split, 512, n) > 0
    assert loaded.counters.numel() >= counter_elems(split, 512, n)
    assert int(loaded.counters.abs().sum()) == 0 and loaded.workspace.dtype == torch.float32
    assert [loaded.bucket(m) for m in (1, 2, 3, 256, 257, 512, 10_000)] == [0, 1, 2, 8, 9, 9, 9]
    assert loaded.tactic(300) == split


def test_buckets_and_bad_arguments(daemon):
    assert gemm_plan.buckets_up_to(1) == (1,)
    assert gemm_plan.buckets_up_to(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_m"):
            gemm_plan.buckets_up_to(bad)
    c = daemon.client(timeout=60)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm_plan.plan_gemm(c, 4096, 4096, arch="sm_90a", out_dtype="float32")
    with pytest.raises(gemm_plan.PlanUnavailable, match="sm_80"):
        gemm_plan.family_for("sm_80")


def test_sm100_flashinfer_class_where_flashinfer_has_it(daemon):
    pytest.importorskip("flashinfer")
    ok, why = gemm_plan.flashinfer_bi_available()
    assert ok and "has flashinfer.batch_invariant" in why
    c = daemon.client(timeout=300)
    plan = gemm_plan.plan_gemm(c, 4096, 4096, arch="sm_100a", sm_count=148, max_m=256,
                               prefetch=False)
    assert plan.family == "flashinfer.bi.bmm_fp8" and plan.choice.reduction_class == "e4m3.c1"
    assert {family(plan.family).reduction_class(r.params) for r in plan.requests} == {"e4m3.c1"}


def test_sm100_is_not_offered_with_vllms_flashinfer_pin():
    """vLLM 0.33.0 pins FlashInfer 0.7.2.post1, which has no batch-invariant classes."""
    python = ROOT / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        pytest.skip("make setup-vllm builds .venv-vllm")
    code = ("from cached_client.gemm import plan as g\n"
            "print(g.flashinfer_bi_available())\n"
            "try:\n    g.family_for('sm_100a')\nexcept g.PlanUnavailable as e:\n"
            "    print('UNAVAILABLE', e)\n")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "client")}).stdout
    assert "(False, 'FlashInfer 0.7.2.post1" in out and "no flashinfer.batch_invariant" in out
    assert "UNAVAILABLE no batch-invariant FP8 class for sm_100a" in out


def test_loaded_bf16_plan_runs_without_per_call_checks_up_to_max_m(daemon):
    """``HopperBf16Gemm.run`` (the vLLM op's call, its weight checked once at load) picks the
    bucket, allocates the output and launches, with none of ``f(a, b)``'s checks (CPU tensors
    here, which those refuse); above max_m, which the workspace was sized for, it takes the
    checked path."""
    torch = pytest.importorskip("torch")
    c = daemon.client(timeout=120)
    plan = gemm_plan.plan_gemm(c, 4096, 4096, arch="sm_90a", ab_dtype="bf16",
                               out_dtype="float32", sm_count=132, max_m=64, prefetch=False)
    calls: list = []
    fns = [functools.partial(lambda i, *args: calls.append((i, args)), i)
           for i in range(len(plan.choice.buckets))]
    f = gemm_plan.HopperBf16Gemm(plan, fns, "cpu")
    b = torch.empty(4096, 4096, dtype=torch.bfloat16)
    for m, bucket in ((1, 0), (3, 2), (64, len(fns) - 1)):
        a = torch.empty(m, 4096, dtype=torch.bfloat16)
        out = f.run(a, b)
        i, args = calls[-1]
        assert i == bucket and args[0] is a and args[1] is b and args[2] is out
        assert out.shape == (m, 4096) and out.dtype == torch.float32
        assert args[5] is f.workspace and args[6] is f.counters
        assert args[3].numel() == 1 and args[3].data_ptr() == f.workspace.data_ptr()
    with pytest.raises(ValueError, match="CUDA"):
        f.run(torch.empty(65, 4096, dtype=torch.bfloat16), b)  # the checked path
    assert len(calls) == 3


@pytest.mark.parametrize("scales", ["tensor", "token", "block128"])
def test_loaded_fp8_plan_checks_a_weight_once_and_runs_unchecked_up_to_max_m(daemon, scales):
    """``HopperFp8Gemm.check`` (a layer's weight and scales, once at its load) refuses a
    weight the plan cannot run, saying why; ``HopperFp8Gemm.run`` (the vLLM op's call) then
    picks the bucket, allocates the output and launches with none of ``f(a, b, sa, sb)``'s
    checks (CPU tensors here, which those refuse); ``a`` of another dtype or M above max_m
    takes the checked path, which refuses it."""
    torch = pytest.importorskip("torch")
    c = daemon.client(timeout=120)
    plan = gemm_plan.plan_gemm(c, 4096, 4096, arch="sm_90a", sm_count=132, max_m=64,
                               prefetch=False, scales=scales)
    calls: list = []
    fns = [functools.partial(lambda i, *args: calls.append((i, args)), i)
           for i in range(len(plan.choice.buckets))]
    f = gemm_plan.HopperFp8Gemm(plan, fns, "cpu")
    fp8 = torch.float8_e4m3fn
    b = torch.empty(4096, 4096, dtype=fp8)
    sb = torch.ones({"tensor": (1,), "token": (4096,), "block128": (32, 32)}[scales])

    def scale_of(m: int):
        if scales == "block128":
            return torch.ones(32, m).t()  # column-major (M, K/128), as vLLM quantizes
        return torch.ones(1 if scales == "tensor" else m)

    with pytest.raises(ValueError, match=r"runs a \(4096, 4096\) torch.float8_e4m3fn weight, "
                                         r"got \(4096, 2048\) torch.float8_e4m3fn"):
        f.check(torch.empty(4096, 2048, dtype=fp8), sb)
    with pytest.raises(ValueError, match="got \\(4096, 4096\\) torch.float8_e5m2"):
        f.check(torch.empty(4096, 4096, dtype=torch.float8_e5m2), sb)
    with pytest.raises(ValueError, match="CUDA tensor"):
        f.check(b, sb)  # the rest is check_gemm_args, which a CPU weight does not pass
    for m, bucket in ((1, 0), (3, 2), (64, len(fns) - 1)):
        a, sa = torch.empty(m, 4096, dtype=fp8), scale_of(m)
        out = f.run(a, b, sa, sb)
        i, args = calls[-1]
        assert i == bucket and args[0] is a and args[1] is b and args[2] is out
        assert args[4] is sb and args[5] is f.workspace and args[6] is f.counters
        assert out.shape == (m, 4096) and out.dtype == torch.bfloat16
        if scales == "block128":  # the strides the kernel was compiled for
            assert args[3].shape == (m, 32) and args[3].stride() == (1, m)
        else:
            assert args[3] is sa
    with pytest.raises(ValueError, match="CUDA"):
        f.run(torch.empty(65, 4096, dtype=fp8), b, scale_of(65), sb)  # the checked path
    with pytest.raises(ValueError, match="float8_e4m3fn or both float8_e5m2, got bfloat16"):
        f.run(torch.empty(3, 4096, dtype=torch.bfloat16), b, scale_of(3), sb)
    assert len(calls) == 3


def test_planning_and_loading_a_shape_takes_at_most_3_round_trips_and_old_daemons_work(
        tmp_path, monkeypatch):
    """Every frame a fresh client sends to plan, prefetch and load one weight shape (with a
    device, so the shared winners are looked up): hello, plan_shape, get_batch. Then a
    daemon on the same store that predates both ops: the per-bucket path, the same
    kernels loaded."""
    from cached_client import transport

    sent: list[str] = []
    send = transport.Connection.send

    def counting(self, message, deadline):
        sent.append(message["op"])
        return send(self, message, deadline)

    monkeypatch.setattr(transport.Connection, "send", counting)
    n, k, max_m = 2688, 4096, 16  # 5 buckets, 2 kernels
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    d = DaemonProcess(tmp_path / "new", workers=2, store=tmp_path / "store")
    try:
        cold = d.client(timeout=600, fallback=False)  # compiles (its silence probes aside)
        first = gemm_plan.plan_gemm(cold, n, k, arch="sm_90a", sm_count=132, max_m=max_m)
        assert len(cold.load_many(first.requests, 600)) == 2
        c = d.client(timeout=600, fallback=False)  # a fresh process's client, kernels stored
        sent.clear()
        plan = gemm_plan.plan_gemm(c, n, k, arch="sm_90a", sm_count=132, device=H200,
                                   max_m=max_m)
        fns = c.load_many([b.request for b in plan.choice.buckets], 600)
        assert sent == ["hello", "plan_shape", "get_batch"], sent
        assert plan.requests == first.requests
        assert len(fns) == len(gemm_plan.buckets_up_to(max_m)) == 5 and all(map(callable, fns))
        assert len(set(map(id, fns))) == len(plan.requests) == 2  # each kernel loaded once
        compiled = d.stats()["compiles"]
        assert compiled == len(plan.requests)
    finally:
        d.stop()
    old = DaemonProcess(tmp_path / "old", workers=0, store=tmp_path / "store",
                        extra_env={"CACHED_TEST_WITHHOLD_OPS": NEW_OPS})
    try:
        c = old.client(timeout=120, fallback=False)
        sent.clear()
        again = gemm_plan.plan_gemm(c, n, k, arch="sm_90a", sm_count=132, device=H200,
                                    max_m=max_m)
        assert again.choice.buckets == plan.choice.buckets
        assert len(c.load_many(again.requests, 120)) == len(plan.requests)
        assert "plan_shape" not in sent and "get_batch" not in sent
        assert sent.count("plan") == 5 and sent.count("get") == len(plan.requests)
    finally:
        old.stop()


def test_plan_shape_refuses_bad_buckets_and_keeps_answering(daemon):
    """The daemon's own check (a raw frame, not the client's): invalid_argument naming the
    field, and the next request on the connection is answered."""
    import time

    c = daemon.client(timeout=60)
    with c.connect(time.monotonic() + 10) as raw:
        for i, bad in enumerate(([], [4, 2], [0, 8], [1] * 65, "8")):
            reply, _ = raw.request({"v": 1, "id": i, "op": "plan_shape", "family": HOPPER,
                                    "n": 4096, "k": 4096, "buckets": bad, "arch": "sm_90a"},
                                   time.monotonic() + 10)
            assert reply["ok"] is False and reply["error"]["code"] == "invalid_argument"
            assert "buckets" in reply["error"]["message"], reply
        reply, _ = raw.request({"v": 1, "id": 9, "op": "plan_shape", "family": HOPPER,
                                "n": 4096, "k": 4096, "buckets": [1, 8], "arch": "sm_90a",
                                "sm_count": 132}, time.monotonic() + 30)
    ok = PlanShapeReply.from_wire(reply)
    assert [b.upper for b in ok.buckets] == [1, 8] and ok.prefetch is None
    assert {b.reduction_class for b in ok.buckets} == {
        T.reduction_class_id(SPACE.choose_split(4096, 4096, 132))}


def test_a_light_familys_first_tactic_alone_is_its_plans_first():
    """What the daemon plans for a bucket's first tactic (Family.plan_first, never making
    the other hundreds) is the whole plan's first, for every scheme of both families."""
    for name, schemes in ((HOPPER, family(HOPPER).tune_schemes()),
                          ("cached.hopper_bf16", {"bf16": {"ab_dtype": "bf16"}})):
        f = family(name)
        assert f.light_planner
        for options in schemes.values():
            for m, n, k in ((1, 4096, 4096), (128, 2688, 4096), (8192, 28672, 4096)):
                opts = {**options, "batch_invariant": True}
                whole = f.plan((m, n, k), "sm_90a", 132, opts)
                assert f.plan_first((m, n, k), "sm_90a", 132, opts) == whole[0]
