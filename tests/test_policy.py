"""The batch-invariant policy, row by row (warnings included), its CLI, and the shared
autotune results and certifications it reads from the daemon."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cached_client.gemm import policy
from conftest import DaemonProcess

BI = True
# (op, quant, arch, backend) -> (kernel, tactics, warning substring or None); without a daemon
# no family's reduction-order classes are known, so one tactic for every M (with a daemon:
# test_gemm_plan.py::test_policy_reads_classes_from_hello_not_a_table)
TABLE = [
    # FP8: FlashInfer's FP8 batch-invariant class where it serves the arch
    ("bmm", "fp8", "sm_100a", None, "flashinfer.bi.bmm_fp8", "one", None),
    ("bmm", "fp8", "sm_103a", "auto", "flashinfer.bi.bmm_fp8", "one", None),
    ("linear", "fp8", "sm_100a", None, "flashinfer.bi.bmm_fp8", "one", None),
    ("bmm", "fp8", "sm_100a", "cublas", "flashinfer.bi.bmm_fp8", "one",
     "overrides backend='cublas'"),
    # ... vLLM's pin to cutlass when asked for, and on Hopper without the project's family
    ("bmm", "fp8", "sm_100a", "cutlass", "cutlass", "one", None),
    ("bmm", "fp8", "sm_90a", "cutlass", "cutlass", "one", None),
    ("bmm", "fp8", "sm_90a", None, "cutlass", "one", "no daemon"),
    ("bmm", "fp8", "sm_90a", "cudnn", "cutlass", "one", "overrides backend='cudnn'"),
    # W4A16 NVFP4: Humming, with a warning when that overrides the requested backend
    ("linear", "nvfp4-w4a16", "sm_100a", None, "humming", "one", None),
    ("linear", "nvfp4-w4a16", "sm_100a", "humming", "humming", "one", None),
    ("linear", "nvfp4-w4a16", "sm_100a", "flashinfer-cutedsl", "humming", "one",
     "overrides backend='flashinfer-cutedsl'"),
    ("linear", "nvfp4-w4a16", "sm_90a", "marlin", "humming", "one", "overrides backend='marlin'"),
    # W4A4 NVFP4: a batch-invariant class
    ("linear", "nvfp4-w4a4", "sm_100a", None, "flashinfer.bi.mm_fp4", "one", None),
    ("linear", "nvfp4-w4a4", "sm_103a", "flashinfer-cutedsl", "flashinfer.bi.mm_fp4", "one",
     "split-K"),
    ("linear", "nvfp4-w4a4", "sm_100a", "cutlass", "cutlass", "one", None),
    ("linear", "nvfp4-w4a4", "sm_90a", None, "humming", "one", "not served on sm_90a"),
]


@pytest.mark.parametrize("op,quant,arch,backend,kernel,tactics,warning", TABLE)
def test_batch_invariant_rows(op, quant, arch, backend, kernel, tactics, warning):
    sel = policy.select(op, quant, arch, BI, backend)
    assert (sel.kernel, sel.tactics) == (kernel, tactics)
    if warning is None:
        assert sel.warnings == []
    else:
        assert len(sel.warnings) >= 1 and any(warning in w for w in sel.warnings), sel.warnings
    assert sel.reason


@pytest.mark.parametrize("quant,arch,backend,kernel", [
    ("fp8", "sm_100a", None, "flashinfer"),
    ("fp8", "sm_100a", "cublas", "cublas"),
    ("nvfp4-w4a4", "sm_100a", None, "flashinfer.mm_fp4"),
    ("nvfp4-w4a16", "sm_100a", None, "flashinfer-cutedsl"),
])
def test_without_batch_invariance_any_tactic_per_bucket(quant, arch, backend, kernel):
    sel = policy.select("linear", quant, arch, False, backend)
    assert (sel.kernel, sel.tactics, sel.warnings) == (kernel, "set", [])


def test_bad_input_and_bmm_is_fp8_only():
    for args in (("conv", "fp8", "sm_100a"), ("linear", "int4", "sm_100a"),
                 ("linear", "fp8", "sm_80"), ("bmm", "nvfp4-w4a4", "sm_100a")):
        with pytest.raises(ValueError):
            policy.select(*args, True)


def test_cli_json_equals_select_and_import_is_light():
    out = subprocess.run([sys.executable, "-m", "cached_client", "select", "--op", "linear",
                          "--quant", "nvfp4-w4a16", "--arch", "sm_100a", "--batch-invariant",
                          "--backend", "cutlass", "--json"], capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == policy.select("linear", "nvfp4-w4a16", "sm_100a", True,
                                            "cutlass").to_dict()
    assert set(json.loads(out)) == {"kernel", "reason", "warnings"}
    code = ("import sys, cached_client.gemm.policy; print([m for m in ('fastapi', 'cutlass', "
            "'flashinfer', 'torch', 'cached') if m in sys.modules])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


class FakeCertClient:
    """Answers the daemon's ``certifications`` op (cached certify's records)."""

    def __init__(self, records, families=("cached.hopper_fp8",), classes=None):
        self.records, self.families = records, list(families)
        self.classes = classes if classes is not None else {
            "cached.hopper_fp8": {"classes": ["k128.acc1.s1.fixed"], "m_independent": True}}

    def certifications(self, family=None, timeout=None):
        return [r for r in self.records if family in (None, r["family"])]

    def hello(self, timeout=None):
        from cached_client.protocol import HelloReply

        return HelloReply(v=1, ops=["certifications"], families=self.families,
                          reduction_classes=self.classes)


def test_hopper_family_when_the_daemon_has_it_and_certification_rule():
    client = FakeCertClient([])
    sel = policy.select("bmm", "fp8", "sm_90a", True, client=client)
    assert sel.kernel == "cached.hopper_fp8" and sel.warnings == [] and sel.tactics == "set"
    # a family that does not declare M-independence needs a 0-row certification on the device
    client.classes = {"cached.hopper_fp8": {"classes": [], "m_independent": False}}
    assert policy.select("bmm", "fp8", "sm_90a", True, client=client, n=4096, k=4096,
                         device="NVIDIA H200").tactics == "one"
    rec = {"family": "cached.hopper_fp8", "tactics": ["a", "b"], "n": 4096, "k": 4096,
           "device": "NVIDIA H200", "arch": "sm_90a", "rows_differing": 0, "checked_at": "t"}
    client.records = [dict(rec, rows_differing=3), dict(rec, device="NVIDIA H100")]
    assert policy.select("bmm", "fp8", "sm_90a", True, client=client, n=4096, k=4096,
                         device="NVIDIA H200").tactics == "one"
    client.records.append(rec)
    sel = policy.select("bmm", "fp8", "sm_90a", True, client=client, n=4096, k=4096,
                        device="NVIDIA H200")
    assert sel.tactics == "set" and "certified on NVIDIA H200" in sel.reason


def test_missing_certifications_op_means_none(tmp_path):
    from cached_client import Client

    class NoOp(Client):
        def call(self, op, request=None, timeout=None):
            from cached_client.errors import MalformedFrame
            raise MalformedFrame("unknown op 'certifications'")

    assert policy.certifications(NoOp(str(tmp_path / "x.sock"))) == []


def test_one_process_tunes_the_others_reuse_the_winner(tmp_path):
    d = DaemonProcess(tmp_path, workers=1)
    try:
        tuner = d.client()
        args = ("linear", 4096, 4096, "fp8", "sm_100a", "NVIDIA B200")
        cls = {"reduction_class": "flashinfer.autotuned"}
        assert policy.publish_autotune(tuner, *args, 64, "flashinfer", ["cutlass", 3], 12.5,
                                       **cls)
        assert policy.publish_autotune(tuner, *args, 2048, "flashinfer", ["cublas", 0], 80.0,
                                       **cls)
        assert not policy.publish_autotune(tuner, *args, 64, "flashinfer", ["cudnn", 1], 20.0,
                                           **cls)
        other = d.client()  # another process on the node
        sel = policy.select("linear", "fp8", "sm_100a", False, client=other, n=4096, k=4096,
                            device="NVIDIA B200")
        assert sel.per_bucket == {64: ["cutlass", 3], 2048: ["cublas", 0]}
        assert sel.kernel == "flashinfer" and "shared through the daemon" in sel.reason
        # under batch invariance the winners are ignored: one class, no backend switching
        bi = policy.select("linear", "fp8", "sm_100a", True, client=other, n=4096, k=4096,
                           device="NVIDIA B200")
        assert bi.kernel == "flashinfer.bi.bmm_fp8" and bi.per_bucket == {}
    finally:
        d.stop()


def test_plan_descriptions_tell_the_hopper_tactic_kinds_apart():
    """What the client logs per M bucket names each kind of cached.hopper_fp8 tactic the
    family plans (swapped operands, two warpgroups along N, ping-pong, programmatic
    dependent launch), not only its tile."""
    from cached import families

    family = families.get("cached.hopper_fp8")
    names: dict[tuple, set[str]] = {}
    for shape in [(128, 4608, 7168), (1, 4096, 4096), (4096, 4096, 512)]:
        for request in family.plan(shape, "sm_90a", 132, {}):
            p = request.params
            kind = (bool(p["swap_ab"]), p["wg_n"], bool(p["pingpong"]), bool(p.get("pdl")))
            names.setdefault(kind, set()).add(policy._tactic_name(request))
    marks = {(True, 1, False, False): " swap", (False, 2, False, False): " wg2",
             (False, 1, True, False): " pp", (True, 1, False, True): " swap pdl",
             (False, 2, False, True): " wg2 pdl"}
    assert set(marks) <= set(names)
    for kind, mark in marks.items():
        assert all(n.endswith(mark) for n in names[kind]), names[kind]
    assert not any(m in n for n in names[(False, 1, False, False)] for m in marks.values())
