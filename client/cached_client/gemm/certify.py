"""Batch-invariance certification by the seeds' method, run through the client on a GPU.

For a family, a tactic set and (N, K) shapes: ``x[:M]`` through a kernel is compared
bitwise with the first M rows of the M=2048 output, for M in :data:`SEED_MS`, for every
tactic, for the per-M mix an autotuner would choose (the family's best-ranked tactic for
each M), and across tactics at every M. The counts go to the daemon, where the
batch-invariant policy reads them. torch is imported lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..client import Client

SEED_MS = (1, 2, 7, 16, 64, 128, 512, 2048)
FULL_M = 2048

Run = Callable[[Any, int], Any]
"""run(kernel, M) -> the (M, N) output for the first M rows of the fixed input."""


def differing_rows(reference: Any, partial: Any) -> int:
    """Rows of ``partial`` (M, N) whose bits differ from ``reference[:M]`` (NaNs included)."""
    import torch

    ref = reference[: partial.shape[0]]
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[ref.element_size()]
    return int((ref.contiguous().view(width) != partial.contiguous().view(width))
               .any(dim=1).sum().item())


def invariance(run: Run, kernel: Any, ms: Sequence[int] = SEED_MS) -> dict[int, int]:
    """Differing rows per M for one kernel against its own M=2048 output."""
    full = run(kernel, FULL_M)
    return {m: differing_rows(full, run(kernel, m)) for m in ms}


def mix_invariance(run: Run, choose: Callable[[int], Any],
                   ms: Sequence[int] = SEED_MS) -> dict[int, int]:
    """Differing rows per M when each M runs the kernel ``choose(M)`` picks."""
    full = run(choose(FULL_M), FULL_M)
    return {m: differing_rows(full, run(choose(m), m)) for m in ms}


def cross_tactic(run: Run, kernels: Sequence[Any], ms: Sequence[int] = SEED_MS) -> int:
    """Rows, summed over M, where any kernel differs from the first one at the same M."""
    total = 0
    for m in ms:
        first = run(kernels[0], m)
        total += sum(differing_rows(first, run(k, m)) for k in kernels[1:])
    return total


def summarize(per_tactic: dict[str, dict[int, int]], mix: dict[int, int],
              cross: int) -> dict[str, int]:
    """The record's ``rows_differing``: one count per tactic, the mix and cross-tactic."""
    counts = {name: sum(c.values()) for name, c in per_tactic.items()}
    counts["mix"] = sum(mix.values())
    counts["cross_tactic"] = cross
    return counts


def hopper_fp8_runner(n: int, k: int, device: str = "cuda", seed: int = 0) -> Run:
    """Fixed Gaussian FP8 inputs for (FULL_M, K) x (N, K); run((fn, params), M) uses
    x[:M] (a split-K tactic gets a workspace sized for FULL_M)."""
    import torch

    from .hopper_fp8 import alloc_workspace, gemm

    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(FULL_M, k, device=device, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device, generator=g).to(torch.float8_e4m3fn)
    a_scale = torch.tensor([0.5], device=device)
    b_scale = torch.tensor([0.25], device=device)

    buffers: dict[str, Any] = {}

    def run(kernel: Any, m: int) -> Any:
        fn, params = kernel
        key = repr(sorted(params.items()))
        if key not in buffers:
            buffers[key] = alloc_workspace([params], FULL_M, n, device)
        ws, cnt = buffers[key]
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        return gemm(fn, a[:m], b, a_scale, b_scale, torch.bfloat16, out=out, params=params,
                    workspace=ws, counters=cnt)

    return run


RUNNERS = {"cached.hopper_fp8": hopper_fp8_runner}
#: plan options per family: a certification covers one reduction-order class per (N, K)
PLAN_OPTIONS: dict[str, dict] = {"cached.hopper_fp8": {"batch_invariant": True}}


def certify(client: Client, family: str, shapes: Sequence[tuple[int, int]], limit: int | None,
            record: bool = True) -> list[dict]:
    """Certify ``family`` on this process's GPU for each (N, K); returns the records."""
    import torch

    if family not in RUNNERS:
        raise ValueError(f"no certify runner for {family!r}; runners: {', '.join(RUNNERS)}")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    arch = f"sm_{props.major}{props.minor}a"
    records = []
    for n, k in shapes:
        plans = {m: client.plan(family, (m, n, k), arch, props.multi_processor_count,
                                PLAN_OPTIONS.get(family))
                 for m in SEED_MS}
        tactics = plans[FULL_M][:limit] if limit else plans[FULL_M]
        run = RUNNERS[family](n, k)

        def kernel(r: Any) -> tuple[Any, dict]:
            return client.load(r), dict(r.params)

        per_tactic = {_name(r): invariance(run, kernel(r)) for r in tactics}
        mix = mix_invariance(run, lambda m, plans=plans: kernel(plans[m][0]))
        cross = cross_tactic(run, [kernel(r) for r in tactics])
        rec = {"family": family, "n": n, "k": k, "device": props.name, "arch": arch,
               "tactics": [dict(r.params) for r in tactics], "ms": list(SEED_MS),
               "rows_differing": summarize(per_tactic, mix, cross),
               "toolchain": client.hello().toolchain}
        if record:
            client.certify_record(rec)
        records.append(rec)
    return records


def _name(request: Any) -> str:
    p = request.params
    return "_".join(f"{k}{v}" for k, v in sorted(p.items()))
