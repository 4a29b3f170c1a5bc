"""The vLLM GPU bench's checkpoint (bench/gpu/vllm_fp8.py ckpt), written here on the CPU with
vLLM 0.33.0's environment: the block scheme is the format vLLM's Fp8Config reads as block
FP8, and a bad scheme is refused before anything is written."""

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


@needs_vllm
def test_the_block_checkpoint_is_what_vllm_reads_as_block_fp8(tmp_path):
    ck = tmp_path / "ck"
    proc = subprocess.run([str(VLLM_PYTHON), str(BENCH), "ckpt", str(ck), "--layers", "1",
                           "--vocab", "256", "--scheme", "block"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(subprocess.run([str(VLLM_PYTHON), "-c", CHECK, str(ck)], check=True,
                                    capture_output=True, text=True, timeout=600
                                    ).stdout.splitlines()[-1])
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


@needs_vllm
def test_an_unknown_scheme_is_refused_and_writes_nothing(tmp_path):
    ck = tmp_path / "ck"
    proc = subprocess.run([str(VLLM_PYTHON), str(BENCH), "ckpt", str(ck), "--layers", "1",
                           "--scheme", "blocks"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "invalid choice: 'blocks'" in proc.stderr and "'tensor', 'block'" in proc.stderr
    assert not ck.exists()
