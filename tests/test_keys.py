"""The key schema: everything that decides bits is in the key, nothing else is."""

from __future__ import annotations

import pytest
from cached_client import InvalidArgument, KernelRequest, artifact_key


def request(**overrides) -> KernelRequest:
    base = {"family": "flashinfer.mm_fp4", "params": {"mma_tiler_mn": [128, 64], "swap_ab": True},
            "arch": "sm_100a", "sm_count": 148, "max_active_clusters": 148}
    base.update(overrides)
    return KernelRequest(**base)


def test_equal_requests_share_a_key_whatever_the_container_types():
    a = request(params={"mma_tiler_mn": [128, 64], "swap_ab": True})
    b = request(params={"swap_ab": True, "mma_tiler_mn": (128, 64)})
    assert a == b and hash(a) == hash(b)
    assert artifact_key(a, "tc", "src") == artifact_key(b, "tc", "src")


@pytest.mark.parametrize("change", [
    {"arch": "sm_103a"}, {"sm_count": 132}, {"max_active_clusters": 74},
    {"family": "flashinfer.other"}, {"params": {"mma_tiler_mn": [128, 64], "swap_ab": False}},
])
def test_any_identity_field_changes_the_key(change):
    assert artifact_key(request(), "tc", "src") != artifact_key(request(**change), "tc", "src")
    assert request() != request(**change)


def test_toolchain_and_sources_change_the_key():
    r = request()
    assert artifact_key(r, "tc1", "src") != artifact_key(r, "tc2", "src")
    assert artifact_key(r, "tc", "src1") != artifact_key(r, "tc", "src2")


@pytest.mark.parametrize("bad, message", [
    ({"arch": "sm_80"}, "arch"), ({"sm_count": 0}, "sm_count"),
    ({"max_active_clusters": True}, "max_active_clusters"), ({"params": [1]}, "params"),
    ({"sm_count": 1 << 63}, "sm_count"),
])
def test_bad_requests_are_rejected_with_the_field_named(bad, message):
    with pytest.raises(InvalidArgument, match=message):
        request(**bad)


def test_wire_round_trip():
    r = request()
    assert KernelRequest.from_wire(r.to_wire()) == r
    with pytest.raises(InvalidArgument, match="missing"):
        KernelRequest.from_wire({"family": "x"})


def test_a_digest_with_a_trailing_newline_is_refused():
    """One sha256 check (protocol.HEX64_RE, ``\\Z``): a request's identity and a write-back
    request's source digest refuse ``<64 hex>\\n`` as they refuse a short one, naming the
    field."""
    from cached_client import InvalidTactic
    from cached_client import protocol as p

    from cached.families import get

    sha = "ab" * 32
    assert p.Identity(toolchain="t", sources={"f": sha}).sources == {"f": sha}
    with pytest.raises(InvalidArgument, match=r"identity.sources\['f'\]"):
        p.Identity(toolchain="t", sources={"f": sha + "\n"})
    family = get("flashinfer.jit")
    params = {"module": "m", "kernel": "k", "tvm_ffi": True, "source_sha256": sha}
    assert family.canonical_params(params, "sm_100a")["source_sha256"] == sha
    with pytest.raises(InvalidTactic, match="source_sha256"):
        family.canonical_params({**params, "source_sha256": sha + "\n"}, "sm_100a")
