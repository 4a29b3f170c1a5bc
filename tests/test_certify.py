"""Certification logic on recorded outputs (CPU tensors), and its record in the daemon."""

from __future__ import annotations

import pytest
from cached_client import InvalidArgument, NotAllowed
from cached_client.gemm import certify as c

torch = pytest.importorskip("torch")


def recorded(n: int = 8, variant_below: int = 0, bump: float = 0.25):
    """A fake kernel's outputs: fixed rows; the first rows of small batches may be bumped."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(c.FULL_M, n, generator=g).bfloat16()

    def run(kernel: str, m: int):
        out = base[:m].clone()
        if kernel == "variant" and m < variant_below:
            out[: max(1, m // 2)] += bump
        return out

    return run


def test_invariant_kernel_has_zero_differing_rows():
    counts = c.invariance(recorded(), "stable")
    assert counts == {m: 0 for m in c.SEED_MS}


def test_batch_variant_kernel_is_counted_row_by_row():
    counts = c.invariance(recorded(variant_below=64), "variant")
    assert counts == {1: 1, 2: 1, 7: 3, 16: 8, 64: 0, 128: 0, 512: 0, 2048: 0}


def test_bitwise_compare_sees_nan_payloads_and_signed_zero():
    ref = torch.zeros(4, 2, dtype=torch.bfloat16)
    neg = ref.clone()
    neg[1, 0] = -0.0
    assert c.differing_rows(ref, neg) == 1
    nan = torch.full((4, 2), float("nan"), dtype=torch.bfloat16)
    assert c.differing_rows(nan, nan.clone()) == 0


def test_mix_and_cross_tactic_counts():
    run = recorded(variant_below=16)
    mix = c.mix_invariance(run, lambda m: "variant" if m < 64 else "stable")
    assert sum(mix.values()) == 1 + 1 + 3
    assert c.cross_tactic(run, ["stable", "variant"]) == 1 + 1 + 3
    summary = c.summarize({"a": {1: 0}, "b": {1: 2}}, mix, 7)
    assert summary == {"a": 0, "b": 2, "mix": 5, "cross_tactic": 7}


def record(**overrides) -> dict:
    rec = {"family": "cached.hopper_fp8", "n": 4096, "k": 4096, "device": "NVIDIA H200",
           "arch": "sm_90a", "tactics": [{"tile_m": 128}], "ms": list(c.SEED_MS),
           "rows_differing": {"t0": 0, "mix": 0, "cross_tactic": 0}}
    rec.update(overrides)
    return rec


def test_daemon_records_certifications_and_checks_them(daemon):
    client = daemon.client()
    client.certify_record(record())
    with pytest.raises(InvalidArgument, match="rows_differing"):
        client.certify_record(record(rows_differing={"t0": -1}))
    with pytest.raises(InvalidArgument, match="n must be"):
        client.certify_record(record(n="4096"))
    rows = client.certifications("cached.hopper_fp8")
    assert len(rows) == 1
    assert rows[0]["total_rows_differing"] == 0
    assert rows[0]["rows_differing"]["mix"] == 0


def test_only_publish_peers_may_record(tmp_path):
    import os

    from conftest import DaemonProcess

    d = DaemonProcess(tmp_path, workers=1, extra_args=["--publish-uid", str(os.getuid() + 1)])
    try:
        with pytest.raises(NotAllowed, match="may not use 'certify_record'"):
            d.client().certify_record(record())
        assert d.client().hello().may_publish is False
    finally:
        d.stop()
