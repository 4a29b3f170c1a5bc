"""The vLLM GPU bench's checkpoint (bench/gpu/vllm_fp8.py ckpt), written here on the CPU with
vLLM 0.33.0's environment: the block scheme is the format vLLM's Fp8Config reads as block
FP8, the token scheme what its compressed-tensors config reads as FP8-dynamic (per-channel
weights, dynamic per-token activations), and a bad scheme is refused before anything is
written."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BENCH = ROOT / "bench" / "gpu" / "vllm_fp8.py"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason="needs .venv-vllm (make setup-vllm)")

CHECK = r"""
import json, sys
import torch
from safetensors import safe_open
from vllm.model_executor.layers.quantization.fp8 import Fp8Config

d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
qc = Fp8Config.from_config(cfg["quantization_config"])
out = {"block": qc.weight_block_size, "activation": qc.activation_scheme, "linears": {}}
f = safe_open(f"{d}/model.safetensors", "pt")
keys = set(f.keys())
out["input_scales"] = sorted(k for k in keys if k.endswith("input_scale"))
for k in sorted(keys):
    if not k.endswith(".weight_scale_inv"):
        continue
    name = k[: -len(".weight_scale_inv")]
    w, s = f.get_tensor(name + ".weight"), f.get_tensor(k)
    n, kk = w.shape
    blocks = w.float().reshape(n // 128, 128, kk // 128, 128).abs().amax(dim=(1, 3))
    out["linears"][name.split(".")[-1]] = {
        "weight": [n, kk], "dtype": str(w.dtype), "scale": list(s.shape),
        "scale_dtype": str(s.dtype), "block_absmax": [blocks.min().item(), blocks.max().item()],
        "scales_positive": bool((s > 0).all())}
print(json.dumps(out))
"""


def write_and_read_back(tmp_path: Path, scheme: str, check: str) -> dict:
    """Write a 1-layer checkpoint of ``scheme`` with the bench script, then run ``check``
    on it in vLLM's environment: the JSON it prints last."""
    ck = tmp_path / "ck"
    proc = subprocess.run([str(VLLM_PYTHON), str(BENCH), "ckpt", str(ck), "--layers", "1",
                           "--vocab", "256", "--scheme", scheme], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(subprocess.run([str(VLLM_PYTHON), "-c", check, str(ck)], check=True,
                                     capture_output=True, text=True, timeout=600
                                     ).stdout.splitlines()[-1])


@needs_vllm
def test_the_block_checkpoint_is_what_vllm_reads_as_block_fp8(tmp_path):
    res = write_and_read_back(tmp_path, "block", CHECK)
    assert res["block"] == [128, 128] and res["activation"] == "dynamic"
    assert res["input_scales"] == []  # dynamic activation groups: none stored
    want = {"q_proj": [4096, 4096], "k_proj": [1024, 4096], "v_proj": [1024, 4096],
            "o_proj": [4096, 4096], "gate_proj": [14336, 4096], "up_proj": [14336, 4096],
            "down_proj": [4096, 14336]}
    assert {k: v["weight"] for k, v in res["linears"].items()} == want
    for name, v in res["linears"].items():
        n, k = v["weight"]
        assert v["dtype"] == "torch.float8_e4m3fn" and v["scale_dtype"] == "torch.float32"
        assert v["scale"] == [n // 128, k // 128] and v["scales_positive"], name
        # each block is scaled by its own absmax / 448: its largest element is e4m3's 448
        assert v["block_absmax"] == [448.0, 448.0], name


CHECK_TOKEN = r"""
import json, sys
import torch
from safetensors import safe_open
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig)

d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
qc = CompressedTensorsConfig.from_config(cfg["quantization_config"])
out = {"layers": {}, "linears": {}}
for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj", "lm_head"):
    sd = qc.get_scheme_dict(torch.nn.Linear(8, 8), name)
    if sd is None:
        out["layers"][name] = None
        continue
    w, a = sd["weights"], sd["input_activations"]
    out["layers"][name] = {"w": [w.num_bits, str(w.type), str(w.strategy),
                                 w.dynamic], "a": [a.num_bits, str(a.type),
                                                   str(a.strategy), a.dynamic],
                           "fp8_w8a8": qc._is_fp8_w8a8(w, a)}
f = safe_open(f"{d}/model.safetensors", "pt")
keys = set(f.keys())
out["input_scales"] = sorted(k for k in keys if k.endswith("input_scale"))
for k in sorted(keys):
    if not k.endswith(".weight_scale"):
        continue
    name = k[: -len(".weight_scale")]
    w, s = f.get_tensor(name + ".weight"), f.get_tensor(k)
    rows = w.float().abs().amax(dim=1)
    out["linears"][name.split(".")[-1]] = {
        "weight": list(w.shape), "dtype": str(w.dtype), "scale": list(s.shape),
        "scale_dtype": str(s.dtype), "row_absmax": [rows.min().item(), rows.max().item()],
        "scales_positive": bool((s > 0).all())}
print(json.dumps(out))
"""


@needs_vllm
def test_the_token_checkpoint_is_what_vllm_reads_as_fp8_dynamic(tmp_path):
    res = write_and_read_back(tmp_path, "token", CHECK_TOKEN)
    fp8_dynamic = {"w": [8, "float", "channel", False], "a": [8, "float", "token", True],
                   "fp8_w8a8": True}
    assert res["layers"] == {"model.layers.0.self_attn.q_proj": fp8_dynamic,
                             "model.layers.0.mlp.down_proj": fp8_dynamic, "lm_head": None}
    assert res["input_scales"] == []  # dynamic per-token activations: none stored
    assert sorted(res["linears"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                      "up_proj", "v_proj"]
    for name, v in res["linears"].items():
        n, _ = v["weight"]
        assert v["dtype"] == "torch.float8_e4m3fn" and v["scale_dtype"] == "torch.float32"
        assert v["scale"] == [n, 1] and v["scales_positive"], name
        # each row is scaled by its own absmax / 448: its largest element is e4m3's 448
        assert v["row_absmax"] == [448.0, 448.0], name


@needs_vllm
def test_an_unknown_scheme_is_refused_and_writes_nothing(tmp_path):
    ck = tmp_path / "ck"
    proc = subprocess.run([str(VLLM_PYTHON), str(BENCH), "ckpt", str(ck), "--layers", "1",
                           "--scheme", "blocks"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "invalid choice: 'blocks'" in proc.stderr
    assert "'tensor', 'block', 'token'" in proc.stderr
    assert not ck.exists()


CHECK_BF16 = r"""
import json, sys
from safetensors import safe_open

d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
f = safe_open(f"{d}/model.safetensors", "pt")
print(json.dumps({"quantized": "quantization_config" in cfg, "vocab": cfg["vocab_size"],
                  "dtypes": sorted({str(f.get_tensor(k).dtype) for k in f.keys()}),
                  "lm_head": list(f.get_tensor("lm_head.weight").shape),
                  "keys": sorted(k.split(".")[-2] for k in f.keys() if ".layers.0." in k)}))
"""


@needs_vllm
def test_the_bf16_checkpoint_is_unquantized_with_its_vocabulary(tmp_path):
    """SCHEME=bf16 (issue 36): no quantization config, every tensor bfloat16, no scales, the
    lm_head (vocab, hidden)."""
    res = write_and_read_back(tmp_path, "bf16", CHECK_BF16)
    assert res["quantized"] is False and res["vocab"] == 256
    assert res["dtypes"] == ["torch.bfloat16"] and res["lm_head"] == [256, 4096]
    assert res["keys"] == ["down_proj", "gate_proj", "input_layernorm", "k_proj", "o_proj",
                           "post_attention_layernorm", "q_proj", "up_proj", "v_proj"]


WAIT_THEN_WORK = r"""
import importlib.util, signal, sys, threading, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("vllm_fp8", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
turn = Path(sys.argv[2])
threading.Timer(3.0, turn.touch).start()
signal.setitimer(signal.ITIMER_REAL, 2)  # what --mode-timeout 2 arms
bench._wait(turn)    # 3 s waiting for another mode's turn: not counted
time.sleep(1.0)      # 1 s of its own work
print("alive", flush=True)
time.sleep(3.0)      # past its 2 s
print("not reached", flush=True)
"""


def test_a_modes_wait_for_its_turn_does_not_count_against_its_own_timeout(tmp_path):
    """run_vllm.sh's MODE_TIMEOUT is a mode's own work (engine --mode-timeout): a wait for
    the modes before it pauses the alarm, and the alarm still ends the mode past its share."""
    import signal
    import sys

    r = subprocess.run([sys.executable, "-c", WAIT_THEN_WORK, str(BENCH), str(tmp_path / "t")],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["alive"], r.stdout + r.stderr
    assert r.returncode == -signal.SIGALRM
