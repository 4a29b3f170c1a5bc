"""Pre-warm manifests: every GEMM a model runs, and the families and targets to build.

A manifest is a TOML file (docs/operations.md, "Writing a manifest")::

    [model]
    name = "Llama-3.1-8B"
    source = "meta-llama/Llama-3.1-8B config.json: hidden 4096, ..."
    tensor_parallel = 1
    m = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]

    [[layer]]                # one per distinct linear layer; y[M,N] = x[M,K] W[N,K]^T
    name = "qkv_proj"
    n = 6144
    k = 4096
    parallel = "column"      # column: N is split by tensor_parallel; row: K; none

    [[build]]                # one per family
    family = "flashinfer.mm_fp4"
    targets = ["sm_100a", "sm_103a"]
    options = { quant = "nvfp4" }   # the family's plan options
    limit = 0                # tactics per shape (0: the whole tactic space)
    all_tactics = false      # cached.hopper_fp8: the whole space, not the plan's choice

    [[pending]]              # families the model needs that this daemon does not have yet
    family = "grouped GEMM for the MoE experts"
    targets = ["sm_100a", "sm_103a"]

``cached warm --manifest FILE`` plans every (layer, M) shape of every build on the
daemon, de-duplicates the requests and asks for them at pre-warm priority. A build whose
family this daemon does not know is an error unless ``--skip-missing`` is given. For the
batch-invariant GEMM family (cached.hopper_fp8) a build plans, per (N, K), the tactic per M
bucket up to the manifest's largest M that clients' ``plan_gemm`` picks (what a serving
node is asked for); ``limit`` or ``all_tactics = true`` plan its tactic space instead.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cached_client.client import Client
from cached_client.gemm import plan as gemm_plan

if TYPE_CHECKING:
    from cached_client.client import Client

from cached.families.base import DEFAULT_SM_COUNT

SEARCH_DIRS = (Path(__file__).resolve().parents[2] / "manifests",
               Path("/usr/share/cached/manifests"), Path("/etc/cached/manifests"))
PARALLEL = ("column", "row", "none")


class ManifestError(ValueError):
    pass


@dataclass(frozen=True)
class Layer:
    name: str
    n: int
    k: int
    parallel: str = "none"


@dataclass(frozen=True)
class Build:
    family: str
    targets: tuple[str, ...]
    options: dict = field(default_factory=dict)
    limit: int = 0
    sm_count: int | None = None
    all_tactics: bool = False


@dataclass(frozen=True)
class Manifest:
    path: Path
    model: str
    source: str
    tensor_parallel: int
    m: tuple[int, ...]
    layers: tuple[Layer, ...]
    builds: tuple[Build, ...]
    pending: tuple[dict, ...]

    def shapes(self) -> list[tuple[str, tuple[int, int, int]]]:
        """(layer name, (M, N, K)) for every layer and M, with N or K split by TP."""
        out = []
        tp = self.tensor_parallel
        for layer in self.layers:
            n, k = layer.n, layer.k
            if layer.parallel == "column":
                n //= tp
            elif layer.parallel == "row":
                k //= tp
            for m in self.m:
                out.append((layer.name, (m, n, k)))
        return out


def find(name: str) -> Path:
    """A manifest path as given, or a shipped manifest by name (``llama-3.1-8b``)."""
    path = Path(name)
    if path.exists():
        return path
    for directory in SEARCH_DIRS:
        for candidate in (directory / name, directory / f"{name}.toml"):
            if candidate.exists():
                return candidate
    raise ManifestError(f"no manifest {name!r}; shipped: {', '.join(shipped()) or 'none'}")


def shipped() -> list[str]:
    """Names of the manifests in :data:`SEARCH_DIRS` (what ``--manifest NAME`` finds)."""
    return sorted({p.stem for d in SEARCH_DIRS if d.is_dir() for p in d.glob("*.toml")})


def _positive(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ManifestError(f"{what} must be a positive integer, got {value!r}")
    return value


def load(name: str | Path) -> Manifest:
    path = find(str(name))
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: not valid TOML: {exc}") from None
    where = str(path)
    model = raw.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("name"), str):
        raise ManifestError(f"{where}: needs a [model] table with a name")
    tp = _positive(model.get("tensor_parallel", 1), f"{where}: model.tensor_parallel")
    ms = model.get("m")
    if not isinstance(ms, list) or not ms:
        raise ManifestError(f"{where}: model.m must list the token counts (M) to build for")
    ms = tuple(_positive(m, f"{where}: model.m entries") for m in ms)
    layers = []
    for i, layer in enumerate(raw.get("layer", [])):
        what = f"{where}: layer {i} ({layer.get('name', '?')})"
        parallel = layer.get("parallel", "none")
        if parallel not in PARALLEL:
            raise ManifestError(f"{what}: parallel must be one of {', '.join(PARALLEL)}")
        n, k = _positive(layer.get("n"), f"{what}: n"), _positive(layer.get("k"), f"{what}: k")
        split = n if parallel == "column" else k if parallel == "row" else None
        if split is not None and split % tp:
            raise ManifestError(f"{what}: {split} does not divide by tensor_parallel {tp}")
        layers.append(Layer(str(layer.get("name", f"layer{i}")), n, k, parallel))
    if not layers:
        raise ManifestError(f"{where}: needs at least one [[layer]]")
    builds = []
    for i, build in enumerate(raw.get("build", [])):
        what = f"{where}: build {i}"
        targets = build.get("targets")
        if not isinstance(build.get("family"), str) or not isinstance(targets, list):
            raise ManifestError(f"{what}: needs family (a name) and targets (a list)")
        for target in targets:
            if target not in DEFAULT_SM_COUNT:
                raise ManifestError(f"{what}: unknown target {target!r}; "
                                    f"known: {', '.join(DEFAULT_SM_COUNT)}")
        options = build.get("options", {})
        if not isinstance(options, dict):
            raise ManifestError(f"{what}: options must be a table")
        limit = build.get("limit", 0)
        if limit:
            _positive(limit, f"{what}: limit")
        sm_count = build.get("sm_count")
        if sm_count is not None:
            _positive(sm_count, f"{what}: sm_count")
        all_tactics = build.get("all_tactics", False)
        if not isinstance(all_tactics, bool):
            raise ManifestError(f"{what}: all_tactics must be true or false")
        builds.append(Build(build["family"], tuple(targets), options, limit or 0, sm_count,
                            all_tactics))
    if not builds:
        raise ManifestError(f"{where}: needs at least one [[build]]")
    return Manifest(path, model["name"], str(model.get("source", "")), tp, ms, tuple(layers),
                    tuple(builds), tuple(raw.get("pending", [])))


def plan(client: Client, manifest: Manifest, targets: set[str] | None = None,
         families: set[str] | None = None, known: set[str] | None = None,
         skip_missing: bool = False) -> dict[tuple[str, str], list]:
    """Requests per (family, target), planned by the daemon, de-duplicated, in order."""
    out: dict[tuple[str, str], list] = {}
    for build in manifest.builds:
        if families and build.family not in families:
            continue
        if known is not None and build.family not in known:
            if skip_missing:
                continue
            raise ManifestError(f"{manifest.path}: this daemon has no family {build.family!r}"
                                f" (known: {', '.join(sorted(known))}); --skip-missing skips it")
        for target in build.targets:
            if targets and target not in targets:
                continue
            requests: list = []
            if build.family == gemm_plan.HOPPER_FAMILY and not (build.limit
                                                                 or build.all_tactics):
                out[(build.family, target)] = _plans(client, manifest, build, target)
                continue
            for _, shape in manifest.shapes():
                planned = client.plan(build.family, shape, target, build.sm_count,
                                      dict(build.options), timeout=300)
                requests += planned[: build.limit] if build.limit else planned
            out[(build.family, target)] = list(dict.fromkeys(requests))
    return out


def _plans(client: Client, manifest: Manifest, build: Build, target: str) -> list:
    """The requests of ``plan_gemm`` (the code clients run) for every (N, K) of the
    manifest, M buckets up to its largest M: one tactic per bucket, de-duplicated."""
    weights = list(dict.fromkeys((n, k) for _, (_, n, k) in manifest.shapes()))
    options = dict(build.options)
    requests: list = []
    for n, k in weights:
        plan = gemm_plan.plan_gemm(
            client, n, k, arch=target, sm_count=build.sm_count, max_m=max(manifest.m),
            out_dtype=str(options.get("out_dtype", "bfloat16")),
            ab_dtype=str(options.get("ab_dtype", "e4m3")), prefetch=False)
        requests += plan.requests
    return list(dict.fromkeys(requests))
