"""vLLM 0.33.0's own code (.venv-vllm) with the plugin's BF16 path (issue 36):
under ``VLLM_BATCH_INVARIANT=1`` its unquantized linears, MoE router gate and lm_head plan
and load ``cached.hopper_bf16`` from a real daemon (real sm_90a compiles by the vLLM
environment's toolchain, loaded as TVM-FFI functions) at weight load and run
``cached::bf16_gemm``, which torch.compile traces into one graph; without batch invariance,
on another arch, for a shape or dtype the family refuses, with the daemon down or absent, or
without the plugin, vLLM's own path runs, with one log line per reason. The layers run on fake
CUDA tensors (tests/vllm_bf16_harness.py): no kernel runs on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, DaemonProcess

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
HARNESS = ROOT / "tests" / "vllm_bf16_harness.py"
H200 = "NVIDIA H200"
GEMM, VLLM_BI = "cached.bf16_gemm", "vllm.linear_batch_invariant"
KEEP = "on vLLM's batch-invariant kernel (matmul_persistent)"
SCENARIOS = [{"bi": 1, "cap": 90}, {"bi": 0, "cap": 90}, {"bi": 1, "cap": 100}]

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason="the vLLM environment: make setup-vllm")


def _harness(scenarios: list[dict], env: dict) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items()
            if k not in ("VLLM_PLUGINS", "PYTHONPATH", "CACHED_SOCKET")}
    full.update({"PYTHONUNBUFFERED": "1", "CACHED_DEVICE_NAME": H200,
                 "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT / "client")]),
                 **env})
    return subprocess.Popen([str(VLLM_PYTHON), str(HARNESS), json.dumps(scenarios)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The harness against a live daemon that knows the vLLM environment's toolchain (it
    compiles the plans' kernels with that environment's DSL), with the socket pointing at
    nothing, with no socket, and without the plugin; two processes at a time."""
    tmp = tmp_path_factory.mktemp("vllm_bf16")
    d = DaemonProcess(tmp, workers=1, extra_args=["--toolchain", f"main={sys.executable}",
                                                  "--toolchain", f"vllm={VLLM_PYTHON}"])
    try:
        jobs = {"live": (SCENARIOS, {"CACHED_SOCKET": d.socket}),
                "down": (SCENARIOS[:1], {"CACHED_SOCKET": str(tmp / "nothing.sock")}),
                "unset": (SCENARIOS[:1], {}),
                "vllm": (SCENARIOS[:1], {"VLLM_PLUGINS": ""})}
        results, names = {}, list(jobs)
        while names:
            batch, names = names[:2], names[2:]
            procs = {n: _harness(*jobs[n]) for n in batch}
            for n, p in procs.items():
                out, _ = p.communicate(timeout=900)
                line = [x for x in out.splitlines() if x.startswith("RESULT ")]
                assert p.returncode == 0 and line, f"{n}:\n{out[-4000:]}"
                results[n] = (json.loads(line[-1][7:]), out)
        results["stats"] = d.stats()
        yield results
    finally:
        d.stop()


def _lines(out: str, text: str) -> list[str]:
    return [x for x in out.splitlines() if text in x]


def test_under_batch_invariance_linears_gate_and_lm_head_run_the_daemons_bf16_gemm(runs):
    result, out = runs["live"]
    sc = result["scenarios"][0]["layers"]
    assert result["wrapped"] == {"linear": True, "lm_head": True}
    for name, shape, dtype in (("linear", [5, 256], "torch.bfloat16"),
                               ("gate", [5, 64], "torch.float32"),  # the router's fp32 logits
                               ("lm_head", [5, 1024], "torch.bfloat16")):
        got = sc[name]
        assert got["served"] >= 0 and got["out_dtype"] == dtype, (name, got)
        assert got["ran"] == [GEMM] and got["y"] == [shape, dtype], (name, got)
    assert result["scenarios"][0]["embedding_served"] is None  # the input embedding: a lookup
    # one line per served shape, naming the plan's class and tactics
    for n in (256, 64, 1024):
        (line,) = _lines(out, f"of N={n} K=512 on cached.hopper_bf16 from the daemon")
        assert " INFO " in line and "class k64.acc1.s" in line and "M<=16:" in line
    assert result["cuda_initialized"] is False


def test_the_plans_are_one_class_for_every_bucket_and_their_kernels_are_loaded(runs):
    result, _ = runs["live"]
    plans = {(p["n"], p["out_dtype"]): p for p in result["plans"]}
    assert set(plans) == {(256, "torch.bfloat16"), (64, "torch.float32"),
                          (1024, "torch.bfloat16")}
    for p in plans.values():
        assert p["family"] == "cached.hopper_bf16" and p["class"].startswith("k64.acc1.s")
        assert p["buckets"] == [1, 2, 4, 8, 16]  # up to max_num_batched_tokens
        assert p["loaded"] == ["Function"]  # TVM-FFI functions: compiled, fetched, loaded
    # compiled once, by the vLLM environment's toolchain (whose runtime loads them)
    stats = runs["stats"]
    assert stats["compiles"] >= 1 and stats["failures"] == 0


def test_layers_the_family_refuses_keep_vllms_kernel_with_the_reason(runs):
    result, out = runs["live"]
    sc = result["scenarios"][0]["layers"]
    for name in ("linear_n40", "linear_fp16"):
        assert sc[name]["served"] == -1 and sc[name]["ran"] == [VLLM_BI], (name, sc[name])
    (n40,) = _lines(out, "of N=40 K=512 " + KEEP)
    assert "multiples of 16" in n40
    (fp16,) = _lines(out, "not torch.float16 (256, 512)")
    assert KEEP in fp16


def test_without_batch_invariance_vllms_default_path_and_no_plan(runs):
    result, _ = runs["live"]
    sc = result["scenarios"][1]["layers"]
    for name in ("linear", "gate", "lm_head"):
        assert sc[name]["served"] == -1, (name, sc[name])
        assert VLLM_BI not in sc[name]["ran"] and GEMM not in sc[name]["ran"]
    for name in ("linear", "lm_head"):  # aten's GEMM: vLLM's default path
        assert sc[name]["ran"] and sc[name]["y"][1] == "torch.bfloat16", (name, sc[name])
    # the gate's default path is vLLM's CuTe-DSL router GEMM (its `quack` is not installed)
    assert "quack" in sc["gate"]["error"]
    assert len(result["plans"]) == 3  # the scenario planned nothing new


def test_on_another_arch_vllms_kernel_with_one_line(runs):
    result, out = runs["live"]
    sc = result["scenarios"][2]["layers"]
    for name in ("linear", "gate", "lm_head"):
        assert sc[name]["served"] == -1 and sc[name]["ran"] == [VLLM_BI], (name, sc[name])
    assert len(_lines(out, "serves sm_90a (capability 90), not capability 100")) == 1


@pytest.mark.parametrize("run", ["down", "unset", "vllm"])
def test_without_a_daemon_or_the_plugin_vllms_kernel_everywhere_with_one_line(runs, run):
    result, out = runs[run]
    sc = result["scenarios"][0]["layers"]
    for name in ("linear", "gate", "lm_head", "linear_n40"):
        assert sc[name]["served"] in (-1, None) and sc[name]["ran"] == [VLLM_BI], (name, sc)
    assert "plans" not in result or result["plans"] == []
    keep = _lines(out, KEEP)
    if run == "down":  # the hooks are installed; one line for every layer
        assert result["wrapped"] == {"linear": True, "lm_head": True}
        assert len(keep) == 1 and "nothing.sock" in keep[0] and " INFO " in keep[0], keep
    elif run == "unset":  # nothing installed: the plugin's one line says so
        assert result["wrapped"] == {"linear": False, "lm_head": False} and not keep
        (line,) = _lines(out, "nothing installed")
        assert "BF16 linears keep vLLM's kernels" in line
    else:
        assert result["wrapped"] == {"linear": False, "lm_head": False} and not keep
        assert not any(m.startswith("cached_client.integrations") for m in result["plugins"])


def test_torch_compile_traces_the_op_into_one_graph_for_every_m(runs):
    result, _ = runs["live"]
    compiled = result["scenarios"][0]["compiled"]
    assert "error" not in compiled, compiled
    (graph,) = compiled["graphs"]  # fullgraph, and M = 3 and 7 share it (M is dynamic)
    assert graph.count("cached.bf16_gemm") == 1 and "add_" in graph  # the bias, after
    assert compiled["y"] == [[[3, 256], "torch.bfloat16"], [[7, 256], "torch.bfloat16"]]
    # registered straight with the dispatcher (a CUDA kernel and a fake), not a custom_op
    assert result["op_direct"] == [True, True]
