"""Families ``flashinfer.bi.bmm_fp8`` and ``flashinfer.bi.mm_fp4``: FlashInfer 0.7.4's
batch-invariant GEMM classes (``flashinfer.batch_invariant``, ``flashinfer/gemm/batch_invariant``).

A class is fixed by the weight shape (N, K), the input format and the output format: its
chunk rule ``chunks_for(N, K, fmt)`` is a function of those alone, and every configuration
of its enumerated space computes the same bits (FlashInfer's R3), so the reduction order
is M-independent by construction (``reduction_order_m_independent = True``). The kernels
themselves have dynamic M, N and K; what decides their bits is FlashInfer's kernel name:
the configuration (``Knobs``), the weight layout, the chunk count, the persistent grid in
clusters (``_g<clusters>``: the request's ``max_active_clusters``), the formats and, for
``bmm_fp8``'s unsplit class, the batched flag. A split class (chunks > 1) whose
configuration stores partials also needs FlashInfer's split-K fixup kernel (``kind:
fixup``).

Parameters: ``kind`` (``gemm`` or ``fixup``), ``n`` and ``k`` (the weight shape whose class
the artifact serves: the artifact records that class's ``fingerprint()``, which is a
function of K, the chunk count and the formats), ``in_fmt``, ``out_fmt``, ``chunks`` and,
for ``gemm``, ``b_major`` and ``knobs``. Compilation goes through FlashInfer's own
``get_compiled_gemm`` / ``get_compiled_blockscaled`` / ``get_fixup`` with its
``jit.build_and_load`` intercepted, so the compile closure and the kernel name are
FlashInfer's; the symbol is ``<module>_<kernel>`` as ``JitSpecCuteDsl`` exports it.

The main process never imports FlashInfer here: the modules' sources are FlashInfer's own
closure walk (``flashinfer/batch_invariant/jit.py``, loaded from its file by
cached_client.flashinfer_sources), hashed with the FlashInfer distribution by
cached_client.identity. FlashInfer 0.7.2.post1 has no batch-invariant modules: there these
families are absent (the environment states no sources for them, and its toolchain has
none).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cached_client import flashinfer_names as names
from cached_client import identity
from cached_client.errors import InvalidTactic
from cached_client.keys import KernelRequest

from .base import BuiltObject, Family, require, set_compile_arch

ARCH_FAMILY = {"sm_100a": "sm_100", "sm_103a": "sm_103", "sm_107a": "sm_107"}
OUT_FMTS = ("bf16", "f16")
TILES_M = (64, 128, 256, 512)
TILES_N = (8, 16, 32, 64, 96, 128, 160, 192, 224, 256)
CLUSTER_DIMS = (1, 2, 4, 8, 16)
KNOB_FIELDS = ("mma_tiler_mn", "cluster_shape_mn", "use_2cta_instrs", "use_tma_store",
               "raster_along", "swizzle_size", "cta_chunks", "cluster_k", "swap_ab")
MAX_CHUNKS = 128
DEFAULT_TOPK = 1


def _positive(params: Mapping[str, Any], name: str, limit: int = 1 << 30) -> int:
    value = params.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise InvalidTactic(f"parameter {name} must be a positive integer, got {value!r}")
    return value


def _knobs(value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise InvalidTactic("parameter knobs must be an object of FlashInfer Knobs fields")
    unknown = sorted(set(value) - set(KNOB_FIELDS))
    if unknown:
        raise InvalidTactic(f"knobs has no field(s) {', '.join(unknown)}")
    tm, tn = require(value, "mma_tiler_mn", tuple((m, n) for m in TILES_M for n in TILES_N))
    cm, cn = require(value, "cluster_shape_mn",
                     tuple((a, b) for a in CLUSTER_DIMS for b in CLUSTER_DIMS if a * b <= 16))
    return {
        "mma_tiler_mn": [tm, tn], "cluster_shape_mn": [cm, cn],
        "use_2cta_instrs": require(value, "use_2cta_instrs", (False, True)),
        "use_tma_store": require(value, "use_tma_store", (True,), True),
        "raster_along": require(value, "raster_along", ("m", "n"), "m"),
        "swizzle_size": require(value, "swizzle_size", (1, 2, 4, 8), 1),
        "cta_chunks": require(value, "cta_chunks", (False, True), False),
        "cluster_k": require(value, "cluster_k", (1, 2, 4), 1),
        "swap_ab": require(value, "swap_ab", (False, True), False),
    }


def knobs_of(params: Mapping[str, Any]) -> Any:
    """FlashInfer's ``Knobs`` for a canonical ``gemm`` request (grid left to the launch)."""
    from flashinfer.gemm.batch_invariant.generator import Knobs

    k = params["knobs"]
    return Knobs(tuple(k["mma_tiler_mn"]), tuple(k["cluster_shape_mn"]), k["use_2cta_instrs"],
                 k["use_tma_store"], k["raster_along"], k["swizzle_size"], 0, k["cta_chunks"],
                 k["cluster_k"], k["swap_ab"])


def knobs_params(cfg: Any) -> dict:
    return {"mma_tiler_mn": list(cfg.mma_tiler_mn), "cluster_shape_mn": list(cfg.cluster_shape_mn),
            "use_2cta_instrs": bool(cfg.use_2cta_instrs), "use_tma_store": bool(cfg.use_tma_store),
            "raster_along": cfg.raster_along, "swizzle_size": int(cfg.swizzle_size),
            "cta_chunks": bool(cfg.cta_chunks), "cluster_k": int(cfg.cluster_k),
            "swap_ab": bool(cfg.swap_ab)}


@contextlib.contextmanager
def _captured_build():
    """Run FlashInfer's compile wrappers with ``jit.build_and_load`` compiling in memory and
    recording the module and kernel name it was called with (no disk cache involved)."""
    from flashinfer.batch_invariant import jit

    seen: dict = {}
    original = jit.build_and_load

    def capture(module: str, kernel: str, compile_fn: Any) -> Any:
        seen.update(module=module, kernel=jit.sanitize_symbol_name(kernel))
        return compile_fn()

    jit.build_and_load = capture
    try:
        yield seen
    finally:
        jit.build_and_load = original


class _BatchInvariantFamily(Family):
    op: str
    in_fmts: tuple[str, ...]
    modules: tuple[str, ...]
    reduction_order_m_independent = True
    arches = ("sm_100a", "sm_103a", "sm_107a")
    sources = "flashinfer"

    # -- main process ------------------------------------------------------------------

    def canonical_params(self, params: Mapping[str, Any], arch: str) -> dict:
        kind = require(params, "kind", ("gemm", "fixup"), "gemm")
        known = {"kind", "n", "k", "in_fmt", "out_fmt", "chunks"}
        if kind == "gemm":
            known |= {"b_major", "knobs"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise InvalidTactic(f"{self.name} ({kind}) has no parameter(s) {', '.join(unknown)}")
        p: dict[str, Any] = {
            "kind": kind, "n": _positive(params, "n"), "k": _positive(params, "k"),
            "in_fmt": require(params, "in_fmt", self.in_fmts),
            "out_fmt": require(params, "out_fmt", OUT_FMTS, "bf16"),
            "chunks": _positive(params, "chunks", MAX_CHUNKS),
        }
        if p["chunks"] & (p["chunks"] - 1):
            raise InvalidTactic(f"chunks must be a power of two, got {p['chunks']}")
        if p["in_fmt"].endswith(("_k128", "_k64")) and arch != "sm_107a":
            raise InvalidTactic(f"{p['in_fmt']} is the sm_107 instruction's class, not {arch}'s")
        if kind == "gemm":
            p["b_major"] = require(params, "b_major", self.b_majors, "k")
            p["knobs"] = _knobs(params.get("knobs"))
        return p

    b_majors: tuple[str, ...] = ("k",)

    def reduction_class(self, params: Mapping[str, Any]) -> str:
        """``<in_fmt>.c<chunks>``: FlashInfer's class for a weight shape is its input format
        and chunk count (every configuration and the split's fixup compute the same bits)."""
        in_fmt = require(params, "in_fmt", self.in_fmts)
        return f"{in_fmt}.c{_positive(params, 'chunks', MAX_CHUNKS)}"

    def reduction_classes(self) -> tuple[str, ...]:
        chunks = [1 << i for i in range(MAX_CHUNKS.bit_length())]
        return tuple(f"{fmt}.c{c}" for fmt in self.in_fmts for c in chunks)

    def canonical_request(self, request: KernelRequest) -> KernelRequest:
        request = super().canonical_request(request)
        if request.params["kind"] == "fixup":  # no persistent grid: one key per device
            request = KernelRequest(family=request.family, params=request.params,
                                    arch=request.arch, sm_count=request.sm_count,
                                    max_active_clusters=1)
        return request

    def source_sha256(self) -> str:
        """This environment's sources of the family (cached_client.identity.family_source)."""
        sha = identity.family_source(self.name)
        if sha is None:
            raise InvalidTactic(f"{self.name} needs FlashInfer's batch-invariant modules, which "
                                "this environment's FlashInfer lacks")
        return sha

    def published_name(self, request: KernelRequest, kernel_name: str | None
                       ) -> tuple[str, str]:
        """FlashInfer's name of a class kernel (with the weight shape of its request) reads
        back as the request: a client publishes under the request its name stands for."""
        p = request.params
        module = names.BI_DENSE_MODULE if p["kind"] == "fixup" or self.op == "bmm_fp8" \
            else names.BI_BLOCKSCALED_MODULE
        parsed = names.bi_request(module, kernel_name or "", (self.op, p["n"], p["k"]),
                                  request.arch, request.sm_count, in_fmt=p["in_fmt"])
        if parsed is None or self.canonical_request(parsed) != request:
            raise InvalidTactic(f"kernel name {str(kernel_name)[:200]!r} is not the "
                                f"{self.name} kernel of this request")
        assert kernel_name is not None
        return kernel_name, names.symbol(module, kernel_name)

    # -- worker ------------------------------------------------------------------------

    def preload(self) -> None:
        import flashinfer.batch_invariant  # noqa: F401
        import flashinfer.gemm.batch_invariant.blocks.compile  # noqa: F401
        import flashinfer.gemm.batch_invariant.blocks.compile_blockscaled  # noqa: F401
        import flashinfer.gemm.batch_invariant.fixup  # noqa: F401

    def class_of(self, n: int, k: int, arch: str, options: Mapping[str, Any]) -> tuple[str, int]:
        """(in_fmt, chunks): the class FlashInfer's dispatcher runs for this weight shape."""
        raise NotImplementedError

    def fingerprint(self, p: Mapping[str, Any], arch: str) -> str:
        raise NotImplementedError

    def plan(
        self, shape: tuple[int, int, int], arch: str, sm_count: int, options: Mapping[str, Any]
    ) -> list[KernelRequest]:
        """The configurations FlashInfer's dispatcher picks (``default_config``, or its
        autotuner's ``rank_topk`` candidates with option ``topk``) for every token bucket of
        its tuner up to M, for the weight (N, K); at the family's nominal part (the device's
        co-resident cluster counts when the query fails), with ``sm_count`` SMs."""
        self.check_arch(arch)
        from flashinfer.fused_moe.utils import get_hybrid_num_tokens_buckets
        from flashinfer.gemm.batch_invariant.heuristic import capacity_for
        from flashinfer.gemm.batch_invariant.schedule import rank_topk

        m, n, k = shape
        fam = ARCH_FAMILY[arch]
        out_fmt = require(options, "out_dtype", OUT_FMTS, "bf16")
        b_major = require(options, "b_major", self.b_majors, "k")
        topk = options.get("topk", DEFAULT_TOPK)
        if not isinstance(topk, int) or not 1 <= topk <= 10:
            raise InvalidTactic(f"option topk must be 1..10, got {topk!r}")
        in_fmt, chunks = self.class_of(n, k, arch, options)
        capacity = capacity_for(fam, sm_count, nominal=True)
        buckets = sorted(set(get_hybrid_num_tokens_buckets(m)) | {m})
        seen: dict[tuple, KernelRequest] = {}
        fixup = False
        for bucket in buckets:
            for cfg in rank_topk(bucket, n, k, chunks, b_major, sm_count, topk, fam, in_fmt,
                                 nominal=True):
                size = cfg.cluster_shape_mn[0] * cfg.cluster_shape_mn[1]
                grid = cfg.grid_clusters or capacity.get(size) or max(1, sm_count // size)
                params = {"kind": "gemm", "n": n, "k": k, "in_fmt": in_fmt, "out_fmt": out_fmt,
                          "chunks": chunks, "b_major": b_major, "knobs": knobs_params(cfg)}
                fixup |= not self._direct(cfg, chunks)
                seen.setdefault((cfg, grid), KernelRequest(
                    family=self.name, params=params, arch=arch, sm_count=sm_count,
                    max_active_clusters=grid))
        requests = list(seen.values())
        if fixup:
            requests.append(KernelRequest(
                family=self.name, arch=arch, sm_count=sm_count, max_active_clusters=1,
                params={"kind": "fixup", "n": n, "k": k, "in_fmt": in_fmt, "out_fmt": out_fmt,
                        "chunks": chunks}))
        return requests

    def _direct(self, cfg: Any, chunks: int) -> bool:
        return chunks == 1 or bool(cfg.cta_chunks)

    def build(self, request: KernelRequest, workdir: Path) -> BuiltObject:
        set_compile_arch(request.arch)
        p = request.params
        in_fmt, chunks = self.class_of(p["n"], p["k"], request.arch,
                                       {"quant": _quant_of(p["in_fmt"]), "dtype": p["in_fmt"]})
        if (in_fmt, chunks) != (p["in_fmt"], p["chunks"]):
            raise ValueError(
                f"weight ({p['n']}, {p['k']}) is the class {in_fmt} with {chunks} chunks on "
                f"{request.arch}, not {p['in_fmt']} with {p['chunks']}")
        with _captured_build() as seen:
            compiled = self._compile(p, request)
        module, kernel = seen["module"], seen["kernel"]
        symbol = names.symbol(module, kernel)
        object_path = workdir / f"{kernel}.o"
        compiled.export_to_c(str(object_path), function_name=symbol)
        meta = {"flashinfer_module": module, "op": self.op,
                "fingerprint": self.fingerprint(p, request.arch),
                "reduction_order": "m_independent (FlashInfer batch-invariant class)"}
        return BuiltObject(kernel, symbol, object_path, meta)

    def _compile(self, p: Mapping[str, Any], request: KernelRequest) -> Any:
        raise NotImplementedError


def _quant_of(in_fmt: str) -> str:
    return "mxfp4" if in_fmt.startswith("mxfp4") else "nvfp4"


class FlashInferBiBmmFp8(_BatchInvariantFamily):
    """``flashinfer.bmm_fp8(..., batch_invariant=True)``: the classes gemm.e4m3 / gemm.e5m2."""

    name = "flashinfer.bi.bmm_fp8"
    op = "bmm_fp8"
    in_fmts = ("e4m3", "e5m2")
    b_majors = ("k", "n")
    modules = (names.BI_DENSE_MODULE,)

    def class_of(self, n: int, k: int, arch: str, options: Mapping[str, Any]) -> tuple[str, int]:
        from flashinfer.gemm.batch_invariant.schedule import chunks_for

        in_fmt = require(options, "dtype", self.in_fmts, "e4m3")
        return in_fmt, chunks_for(n, k, in_fmt)

    def fingerprint(self, p: Mapping[str, Any], arch: str) -> str:
        from flashinfer.batch_invariant import fingerprint

        return fingerprint("bmm_fp8", N=p["n"], K=p["k"], dtype=p["in_fmt"],
                           out_dtype=p["out_fmt"])

    def _compile(self, p: Mapping[str, Any], request: KernelRequest) -> Any:
        fam = ARCH_FAMILY[request.arch]
        if p["kind"] == "fixup":
            from flashinfer.gemm.batch_invariant.fixup import get_fixup

            return get_fixup.__wrapped__(p["chunks"], p["out_fmt"], True)
        from flashinfer.gemm.batch_invariant.blocks.compile import get_compiled_gemm

        # bmm_fp8 runs its unsplit class as one batched launch, its split classes per element
        batched = p["chunks"] == 1
        return get_compiled_gemm.__wrapped__(knobs_of(p), p["b_major"], p["chunks"],
                                             request.max_active_clusters, p["in_fmt"],
                                             p["out_fmt"], batched, family=fam)


class FlashInferBiMmFp4(_BatchInvariantFamily):
    """``flashinfer.mm_fp4(..., batch_invariant=True)``: the NVFP4 and MXFP4 classes."""

    name = "flashinfer.bi.mm_fp4"
    op = "mm_fp4"
    in_fmts = ("nvfp4", "mxfp4", "nvfp4_k128", "mxfp4_k128")
    # the split's fixup lives in the dense module
    modules = (names.BI_BLOCKSCALED_MODULE, names.BI_DENSE_MODULE)

    def class_of(self, n: int, k: int, arch: str, options: Mapping[str, Any]) -> tuple[str, int]:
        from flashinfer.gemm.batch_invariant.schedule import chunks_for, fp4_class_for, mx_class_for

        quant = require(options, "quant", ("nvfp4", "mxfp4"), "nvfp4")
        fam = ARCH_FAMILY[arch]
        in_fmt = fp4_class_for(n, k, fam) if quant == "nvfp4" else mx_class_for("mxfp4", fam)
        return in_fmt, chunks_for(n, k, in_fmt)

    def fingerprint(self, p: Mapping[str, Any], arch: str) -> str:
        from flashinfer.batch_invariant import fingerprint

        return fingerprint("mm_fp4", N=p["n"], K=p["k"], out_dtype=p["out_fmt"],
                           use_nvfp4=p["in_fmt"].startswith("nvfp4"), arch=ARCH_FAMILY[arch])

    def _direct(self, cfg: Any, chunks: int) -> bool:
        return chunks == 1 or bool(cfg.cta_chunks) or cfg.cluster_k > 1

    def _compile(self, p: Mapping[str, Any], request: KernelRequest) -> Any:
        fam = ARCH_FAMILY[request.arch]
        if p["kind"] == "fixup":
            from flashinfer.gemm.batch_invariant.fixup import get_fixup

            return get_fixup.__wrapped__(p["chunks"], p["out_fmt"], alpha_given=True)
        from flashinfer.gemm.batch_invariant.blocks.compile_blockscaled import (
            get_compiled_blockscaled,
        )

        return get_compiled_blockscaled.__wrapped__(knobs_of(p), p["chunks"],
                                                    request.max_active_clusters, p["in_fmt"],
                                                    p["out_fmt"], family=fam)
