"""vLLM 0.33.0 serving a small random-weight FP8 Llama on the H200, with and without the
daemon's batch-invariant GEMMs (issue 26). Run there by bench/gpu/run_vllm.sh.

Subcommands:

* ``ckpt DIR``: Llama-3.1-8B's architecture with ``--layers`` layers and a ``--vocab``-word
  vocabulary, random weights (seeded), saved as an FP8 checkpoint vLLM loads
  (``quant_method: fp8``; ``--scheme tensor``: per-tensor weight scales, static per-tensor
  activation scales; ``--scheme block``: DeepSeek-V3's block FP8, one ``weight_scale_inv``
  per 128x128 weight block, dynamic 1x128 activation groups; ``--scheme token``: an
  "FP8-dynamic" checkpoint in compressed-tensors' format, one weight scale per output
  channel, dynamic per-token activation scales), with a word-level tokenizer built by
  ``tokenizers`` covering every id.
* ``engine DIR --mode a|b|c``: ``vllm.LLM`` offline generate (in-process engine core), mode
  ``a`` vLLM's default FP8 path, ``b`` ``VLLM_BATCH_INVARIANT=1`` with vLLM's own FP8
  choice, ``c`` ``VLLM_BATCH_INVARIANT=1`` with ``--linear-backend cached``. Records: model
  load time; the FP8 kernel class of every linear layer; the real layers (after vLLM's
  weight loader and ``process_weights_after_loading``) against float64; greedy outputs of 8
  prompts alone and inside batches of 8/64/256 mixed-length prompts (token ids and logprobs,
  compared bitwise); prompt logprobs of 16 prompts (for the cross-mode comparison); output
  tokens/s and time per decode step at batch 1/8/64/256. Writes ``--out`` JSON.
* ``layers``: level 3 alone (when the engine does not run): vLLM's Fp8LinearMethod layers
  built, loaded through their weight loaders, processed and applied inside a CUDA graph.
* ``summarize A.json B.json C.json``: the tables (markdown), last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
BATCHES = (8, 64, 256)
PERF_BATCHES = (1, 8, 64, 256)
GEN_TOKENS = 24
PERF_PROMPT, PERF_TOKENS = 128, 64
PERF_REPEATS = 3  # timed generate calls per (batch, length); the minimum is kept
PROFILE_STEPS = 16  # decode steps of a profiled generate (after its prefill step)
TIMELINE_PROMPT, TIMELINE_STEPS = 16, 32  # short prompts: the decode steps dominate
HOST_BATCH, HOST_TOP = 256, 40  # the host profile's batch; functions listed
GEMM_MARKS = ("cutlass", "gemm", "Gemm", "matmul", "nvjet", "cublas", "sm90_xmma", "wgmma")
# vLLM's CUTLASS per-tensor / per-token and blockwise FP8 GEMMs, ours
FP8_GEMM_MARKS = ("cutlass_3x_gemm_sm90_fp8", "cutlass_3x_gemm_fp8_blockwise",
                  "HopperFp8GemmKernel")
# attention: vLLM's Triton backend (kernel_unified_attention, reduce_segments), FlashAttention
ATTENTION_MARKS = ("attention", "attn", "reduce_segments", "flash_fwd", "fmha")
TARGET_LENS = (5, 17, 33, 64, 100, 128, 200, 257)
MAX_BATCHED = 8192


# -- the checkpoint -------------------------------------------------------------------------


SCHEMES = ("tensor", "block", "token", "bf16")
BLOCK = 128  # the block scheme's weight block (rows and columns) and activation group


def llama_config(layers: int, vocab: int, scheme: str = "tensor") -> dict:
    """Llama-3.1-8B's config.json with ``layers`` layers, ``vocab`` words and an FP8 format
    vLLM reads: static per-tensor activation scales, (``block``) 128x128 weight blocks with
    dynamic activation groups, or (``token``) compressed-tensors' FP8-dynamic scheme; or
    (``bf16``) none: a BF16 model."""
    quant = {"bf16": None,  # unquantized: every linear and the lm_head a BF16 GEMM
             "tensor": {"quant_method": "fp8", "activation_scheme": "static"},
             "block": {"quant_method": "fp8", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]},
             "token": {"quant_method": "compressed-tensors", "format": "float-quantized",
                       "quantization_status": "compressed", "ignore": ["lm_head"],
                       "config_groups": {"group_0": {
                           "targets": ["Linear"],
                           "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                       "strategy": "channel", "dynamic": False},
                           "input_activations": {"num_bits": 8, "type": "float",
                                                 "symmetric": True, "strategy": "token",
                                                 "dynamic": True}}}}}[scheme]
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": HIDDEN, "intermediate_size": INTER, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": layers,
        "vocab_size": vocab, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    }
    if quant is not None:
        cfg["quantization_config"] = quant
    return cfg


def write_tokenizer(d: Path, vocab: int) -> None:
    """A word-level tokenizer whose words are every id of the model's vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<unk>", "model_max_length": 4096,
        "clean_up_tokenization_spaces": False}))


def write_checkpoint(d: Path, layers: int, vocab: int, seed: int,
                     scheme: str = "tensor") -> dict:
    """Random weights (Gaussian, std 1/sqrt(K)), each linear's weight quantized to e4m3 with
    its own per-tensor scale (so vLLM requantizes fused shards to their max) and a static
    activation scale per linear; or (``block``) with one scale per 128x128 block
    (``weight_scale_inv``, absmax / 448) and no activation scale; or (``token``) one scale
    per output channel (``weight_scale`` (N, 1), row absmax / 448) and no activation
    scale; or (``bf16``) kept in bfloat16."""
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(seed)
    t: dict[str, torch.Tensor] = {}

    def rand(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev) * std

    def fp8_linear(name: str, n: int, k: int, act_scale: float) -> None:
        w = rand(n, k, std=k ** -0.5)
        if scheme == "bf16":
            t[f"{name}.weight"] = w.bfloat16().cpu()
            return
        if scheme == "block":
            blocks = w.reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
            scale = blocks.abs().amax(dim=(1, 3)) / 448.0  # (N/128, K/128)
            q = blocks / scale[:, None, :, None]
            t[f"{name}.weight"] = q.reshape(n, k).clamp(-448, 448).to(torch.float8_e4m3fn).cpu()
            t[f"{name}.weight_scale_inv"] = scale.float().cpu()
            return
        if scheme == "token":
            scale = w.abs().amax(dim=1, keepdim=True) / 448.0  # (N, 1)
            t[f"{name}.weight"] = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).cpu()
            t[f"{name}.weight_scale"] = scale.float().cpu()
            return
        scale = w.abs().max() / 448.0
        t[f"{name}.weight"] = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).cpu()
        t[f"{name}.weight_scale"] = scale.float().reshape(()).cpu()
        t[f"{name}.input_scale"] = torch.tensor(act_scale, dtype=torch.float32)

    for i in range(layers):
        p = f"model.layers.{i}"
        for proj, n in (("q_proj", HEADS * HEAD_DIM), ("k_proj", KV_HEADS * HEAD_DIM),
                        ("v_proj", KV_HEADS * HEAD_DIM)):
            fp8_linear(f"{p}.self_attn.{proj}", n, HIDDEN, 0.012)
        fp8_linear(f"{p}.self_attn.o_proj", HIDDEN, HEADS * HEAD_DIM, 0.006)
        fp8_linear(f"{p}.mlp.gate_proj", INTER, HIDDEN, 0.012)
        fp8_linear(f"{p}.mlp.up_proj", INTER, HIDDEN, 0.012)
        fp8_linear(f"{p}.mlp.down_proj", HIDDEN, INTER, 0.004)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"{p}.{norm}.weight"] = (1 + rand(HIDDEN, std=0.05)).bfloat16().cpu()
    t["model.embed_tokens.weight"] = rand(vocab, HIDDEN, std=1.0).bfloat16().cpu()
    t["model.norm.weight"] = (1 + rand(HIDDEN, std=0.05)).bfloat16().cpu()
    t["lm_head.weight"] = rand(vocab, HIDDEN, std=HIDDEN ** -0.5).bfloat16().cpu()
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = llama_config(layers, vocab, scheme)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                          "eos_token_id": 2}))
    write_tokenizer(d, vocab)
    return {"tensors": len(t), "bytes": sum(x.numel() * x.element_size() for x in t.values())}


# -- prompts --------------------------------------------------------------------------------


def prompts_for(seed: int, vocab: int, lens) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lens]


def fillers(seed: int, vocab: int, count: int) -> tuple[list[list[int]], list[int]]:
    """``count`` prompts of mixed lengths (4..300 tokens) and mixed output lengths."""
    rng = random.Random(seed)
    lens = [rng.randrange(4, 300) for _ in range(count)]
    return prompts_for(seed + 1, vocab, lens), [rng.randrange(1, 2 * GEN_TOKENS)
                                                for _ in range(count)]


# -- the engine -----------------------------------------------------------------------------


def _fp8_kernel(mod):
    """The FP8 linear kernel vLLM chose for a layer: on its quant method (fp8) or its
    compressed-tensors scheme; None for a layer without one."""
    kern = getattr(getattr(mod, "quant_method", None), "fp8_linear", None)
    return kern if kern is not None else getattr(getattr(mod, "scheme", None),
                                                 "fp8_linear", None)


def _kernels(model) -> dict:
    """Per linear layer class: the FP8 kernel vLLM chose (counted), and for BF16 layers
    whether the plugin serves them (``cached.hopper_bf16``) or vLLM's kernel runs them."""
    out: dict = {}
    for _name, mod in model.named_modules():
        served = getattr(mod, "_cached_bf16", None)  # cached_client.integrations.vllm.bf16
        if served is not None:
            key = f"{type(mod).__name__}:bf16:{'cached.hopper_bf16' if served >= 0 else 'vllm'}"
            out[key] = out.get(key, 0) + 1
        kern = _fp8_kernel(mod)
        if kern is None:
            continue
        key = f"{type(mod).__name__}:{type(kern).__name__}"
        out[key] = out.get(key, 0) + 1
    return out


def _block_dequant(w, scale):
    """An (N, K) e4m3 weight with one scale per 128x128 block (N/128, K/128), as float64."""
    n, k = w.shape
    wd = w.double().reshape(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    return (wd * scale.double()[:, None, :, None]).reshape(n, k)


def _layer_check(model) -> dict:
    """Layer 0's linears, as vLLM loaded and processed them, against float64 on fresh
    Gaussian inputs (M ragged), eager and inside a CUDA graph (bitwise), and the rows of
    M = 1..256 against M = 512 (bitwise)."""
    import torch

    layer = model.model.layers[0]
    mods = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
            "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
    res = {}
    g = torch.Generator(device="cuda").manual_seed(7)
    for name, mod in mods.items():
        block = getattr(mod, "weight_scale_inv", None) is not None
        w = mod.weight
        ws = mod.weight_scale_inv if block else mod.weight_scale
        xs = None if block else getattr(mod, "input_scale", None)  # None: dynamic per token
        # the weight as (K, N) float64, dequantized (a kernel may keep (N, K) or its
        # transpose, and the block scales either way round; per-channel scales (N, 1) or
        # (1, N))
        if block:
            n_out, k_in = mod.output_size_per_partition, mod.input_size_per_partition
            wnk = w if tuple(w.shape) == (n_out, k_in) else w.t()
            snk = ws if tuple(ws.shape) == (-(-n_out // BLOCK), k_in // BLOCK) else ws.t()
            wd = _block_dequant(wnk, snk).t()
        elif ws.numel() > 1:
            wd = w.double() * ws.double().reshape(1, -1)
        else:
            wd = w.double() * ws.double().reshape(-1)[0]
        k = wd.shape[0]
        r = {"weight_shape": list(w.shape), "weight_stride": list(w.stride()),
             "weight_scale_shape": list(ws.shape),
             "kernel": type(_fp8_kernel(mod)).__name__}
        errs = {}
        x_all = torch.randn(512, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.5
        with torch.no_grad():
            full = mod(x_all)
            full = full[0] if isinstance(full, tuple) else full
            for m in (1, 7, 77, 512):
                x = x_all[:m]
                y = mod(x)
                y = y[0] if isinstance(y, tuple) else y
                if block:  # dynamic 1x128 groups, scale absmax / 448 (vLLM's own quant op may round
                    # its scales otherwise: docs/history.md, block FP8 inside vLLM)
                    g_ = x.float().reshape(m, k // BLOCK, BLOCK)
                    sx = (g_.abs().amax(dim=2, keepdim=True) / 448.0).clamp(min=1e-10)
                    xq = (g_ / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
                    xd = (xq.double() * sx.double()).reshape(m, k)
                elif xs is None:  # dynamic per-token scales, absmax / 448
                    sx = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-10)
                    xq = (x.float() / sx).clamp(-448, 448).to(torch.float8_e4m3fn)
                    xd = xq.double() * sx.double()
                else:
                    xq = (x.float() / xs.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
                    xd = xq.double() * xs.double()
                ref = xd @ wd
                errs[m] = float((y.double() - ref).norm() / ref.norm())
            r["rel_err_vs_f64"] = errs
            rows = {}
            for m in (1, 2, 3, 8, 16, 64, 100, 256):
                y = mod(x_all[:m])
                y = y[0] if isinstance(y, tuple) else y
                rows[m] = int((y != full[:m]).any(dim=1).sum())
            r["rows_differing_vs_m512"] = rows
            x = x_all[:64].clone()
            eager = mod(x)
            eager = eager[0] if isinstance(eager, tuple) else eager
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                mod(x)
            torch.cuda.current_stream().wait_stream(s)
            gph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gph):
                out = mod(x)
            out = out[0] if isinstance(out, tuple) else out
            gph.replay()
            torch.cuda.synchronize()
            r["graph_vs_eager_rows_differing"] = int((out != eager).any(dim=1).sum())
        res[name] = r
    return res


def _device_us(prof) -> dict[str, list[float]]:
    """Kernel name -> [device time in us, launches] over a profiled region."""
    out: dict[str, list[float]] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        t = getattr(e, "self_cuda_time_total", 0) if t is None else t
        if t > 0:
            out[e.key] = [float(t), float(e.count)]
    return out


def _fp8_gemm_us(kernels) -> float:
    """The FP8 linears' share of (kernel name, us) pairs."""
    return sum(t for name, t in kernels if any(m in name for m in FP8_GEMM_MARKS))


def _gpu_profile(llm, vocab: int, SamplingParams,  # noqa: N803 -- vLLM's class
                 fp8_model: bool = True, batches=PERF_BATCHES, context: int = PERF_PROMPT
                 ) -> dict:
    """Per decode step, at each batch of ``batches`` with prompts of ``context`` tokens: the
    GPU time of every kernel (us) and
    its launches, as the difference of two profiled generates (1 token, then
    1 + PROFILE_STEPS tokens: the same prefill) divided by PROFILE_STEPS. GEMM kernels are
    those whose name holds one of GEMM_MARKS (the lm_head's among them), the FP8 linears'
    those holding one of FP8_GEMM_MARKS; CuTe-DSL kernels are named by their class."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    res: dict = {}
    for b in batches:
        ps = [{"prompt_token_ids": p} for p in prompts_for(2000 + b, vocab, [context] * b)]
        sums, walls = {}, {}
        for n in (1, PROFILE_STEPS + 1):
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                detokenize=False)
            llm.generate(ps, sp, use_tqdm=False)  # warm-up: same shapes
            torch.cuda.synchronize()
            ts = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(ps, sp, use_tqdm=False)
                torch.cuda.synchronize()
            walls[n] = time.perf_counter() - ts
            sums[n] = _device_us(prof)
        one, many = sums[1], sums[PROFILE_STEPS + 1]
        kernels = {}
        for name, (t, c) in many.items():
            t0, c0 = one.get(name, [0.0, 0.0])
            if (t - t0) > 0:
                kernels[name] = [(t - t0) / PROFILE_STEPS, (c - c0) / PROFILE_STEPS]
        gemm = {k: v for k, v in kernels.items() if any(m in k for m in GEMM_MARKS)}
        attention = {k: v for k, v in kernels.items()
                     if k not in gemm and any(m in k for m in ATTENTION_MARKS)}
        # (the BF16 family's kernels share the FP8 family's kernel class, so its name: in a
        # BF16 model every GEMM is a BF16 one)
        fp8 = _fp8_gemm_us((k, v[0]) for k, v in kernels.items()) if fp8_model else 0.0
        gemm_us = sum(v[0] for v in gemm.values())
        res[b] = {"step_wall_us": (walls[PROFILE_STEPS + 1] - walls[1]) / PROFILE_STEPS * 1e6,
                  "step_gpu_us": sum(v[0] for v in kernels.values()),
                  "step_gemm_us": gemm_us,
                  "step_fp8_gemm_us": fp8,
                  # every GEMM that is not FP8: the BF16 ones, the lm_head's among them
                  "step_bf16_gemm_us": gemm_us - fp8,
                  "step_attention_us": sum(v[0] for v in attention.values()),
                  "step_launches": sum(v[1] for v in kernels.values()),
                  "top": sorted(([k[:200], round(v[0], 2), v[1]] for k, v in kernels.items()),
                                key=lambda r: -r[1])[:14]}
        print("profile", b, {k: v for k, v in res[b].items() if k != "top"}, flush=True)
    return res


def _timeline(llm, vocab: int, SamplingParams, mode: str,  # noqa: N803
              trace_dir: str | None) -> dict:
    """Where a decode step's wall time goes, at batch 64 and 256: one generate of
    1 + TIMELINE_STEPS tokens from TIMELINE_PROMPT-token prompts (one short prefill step),
    profiled with CPU and CUDA activity: the host ops' self CPU time per step (top ones), the
    GPU's busy time (the union of kernel intervals) and its idle time (gaps between kernels
    of more than 20 us). With ``trace_dir``, the Chrome trace too (gzipped)."""
    import gzip
    import shutil

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    res: dict = {}
    for b in (64, 256):
        ps = [{"prompt_token_ids": p}
              for p in prompts_for(3000 + b, vocab, [TIMELINE_PROMPT] * b)]
        sp = SamplingParams(temperature=0.0, max_tokens=TIMELINE_STEPS + 1, ignore_eos=True,
                            detokenize=False)
        llm.generate(ps, sp, use_tqdm=False)
        torch.cuda.synchronize()
        ts = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(ps, sp, use_tqdm=False)
            torch.cuda.synchronize()
        wall = time.perf_counter() - ts
        kern = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == DeviceType.CUDA)
        busy, gaps = 0.0, []
        end = kern[0][0] if kern else 0.0
        for s0, e0 in kern:
            if s0 > end:
                gaps.append(s0 - end)
            busy += max(0.0, e0 - max(s0, end))
            end = max(end, e0)
        big = sorted((g for g in gaps if g > 20), reverse=True)
        cpu = sorted(((e.key, e.self_cpu_time_total / TIMELINE_STEPS, e.count / TIMELINE_STEPS)
                      for e in prof.key_averages() if e.self_cpu_time_total > 0),
                     key=lambda r: -r[1])[:25]
        res[b] = {"wall_us": wall * 1e6, "gpu_span_us": (end - kern[0][0]) if kern else 0,
                  "gpu_busy_us": busy, "gaps_over_20us": len(big),
                  "gap_us_total": sum(big), "largest_gaps_us": [round(g) for g in big[:12]],
                  "cpu_top_per_step": [[k[:120], round(t, 1), round(c, 2)] for k, t, c in cpu]}
        print("timeline", b, {k: v for k, v in res[b].items() if k != "cpu_top_per_step"},
              flush=True)
        if trace_dir:
            path = Path(trace_dir) / f"trace_{mode}_{b}.json"
            prof.export_chrome_trace(str(path))
            with open(path, "rb") as f, gzip.open(f"{path}.gz", "wb") as g:
                shutil.copyfileobj(f, g)
            path.unlink()
    return res


def _task_cpu() -> dict[str, tuple[str, float]]:
    """CPU seconds (user + system) of every OS thread of this process, by tid: name, s."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[tid] = (comm, (int(fields[11]) + int(fields[12])) / tick)
    return out


def _host_profile(llm, vocab: int, SamplingParams) -> dict:  # noqa: N803
    """Where the host's time goes in a decode step at batch HOST_BATCH: one generate of
    1 + TIMELINE_STEPS tokens from TIMELINE_PROMPT-token prompts, timed bare, then with the
    garbage collector's passes timed (gc.callbacks) and the CPU time of every OS thread of
    the process, then under cProfile (the calling thread: the engine core runs in it). Per
    step: wall, collections and their time, CPU per thread, the functions by own time and
    by cumulative time."""
    import cProfile
    import gc
    import pstats
    import threading

    import torch

    ps = [{"prompt_token_ids": p}
          for p in prompts_for(3000 + HOST_BATCH, vocab, [TIMELINE_PROMPT] * HOST_BATCH)]
    sp = SamplingParams(temperature=0.0, max_tokens=TIMELINE_STEPS + 1, ignore_eos=True,
                        detokenize=False)
    llm.generate(ps, sp, use_tqdm=False)

    def timed() -> float:
        torch.cuda.synchronize()
        ts = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - ts

    res: dict = {"batch": HOST_BATCH, "steps": TIMELINE_STEPS,
                 "wall_ms_bare": min(timed() for _ in range(3)) * 1e3,
                 "switch_interval_s": sys.getswitchinterval(), "gc_enabled": gc.isenabled(),
                 "gc_frozen": gc.get_freeze_count(), "gc_threshold": gc.get_threshold(),
                 "gc_count": gc.get_count(),
                 "threads": [[t.name, t.daemon] for t in threading.enumerate()]}
    passes: list = []
    began: dict = {}

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began["t"] = time.perf_counter()
        else:
            passes.append((info["generation"], time.perf_counter() - began.get("t", 0.0)))

    before = _task_cpu()
    gc.callbacks.append(on_gc)
    try:
        wall = timed()
    finally:
        gc.callbacks.remove(on_gc)
    after = _task_cpu()
    res["wall_ms_gc_timed"] = wall * 1e3
    res["gc_passes"] = {str(g): [sum(1 for gen, _ in passes if gen == g),
                                 round(sum(t for gen, t in passes if gen == g) * 1e3, 2)]
                        for g in (0, 1, 2)}
    res["thread_cpu_ms"] = sorted(
        ([after[tid][0], round((after[tid][1] - before.get(tid, (None, 0.0))[1]) * 1e3, 1)]
         for tid in after), key=lambda r: -r[1])[:12]
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    ts = time.perf_counter()
    prof.enable()
    llm.generate(ps, sp, use_tqdm=False)
    torch.cuda.synchronize()
    prof.disable()
    res["wall_ms_cprofile"] = (time.perf_counter() - ts) * 1e3
    st = pstats.Stats(prof)
    steps = TIMELINE_STEPS + 1
    res["calls_per_step"] = st.total_calls / steps

    def rows(key: int) -> list:
        ranked = sorted(st.stats.items(), key=lambda kv: -kv[1][key])[:HOST_TOP]
        return [[f"{Path(f).name}:{line}({fn})"[:110], round(v[1] / steps, 1),
                 round(v[2] / steps * 1e6, 1), round(v[3] / steps * 1e6, 1)]
                for (f, line, fn), v in ranked]

    res["by_own_time"] = rows(2)  # [where, calls/step, own us/step, cumulative us/step]
    res["by_cumulative"] = rows(3)
    print("host", HOST_BATCH, {k: v for k, v in res.items()
                               if k not in ("by_own_time", "by_cumulative")}, flush=True)
    for r in res["by_own_time"][:20]:
        print("host own", r, flush=True)
    return res


def _outputs(outs) -> list[dict]:
    rec = []
    for o in outs:
        c = o.outputs[0]
        lps = [float(d[t].logprob) for d, t in zip(c.logprobs, c.token_ids, strict=True)]
        rec.append({"tokens": list(c.token_ids), "logprobs": lps})
    return rec


def _wait(path: Path | None, deadline_s: float = 400.0) -> None:
    """Wait until ``path`` exists (another mode's process wrote it), at most deadline_s.
    The wait does not count against ``--mode-timeout``: its timer (ITIMER_REAL, whose
    SIGALRM ends the process) is paused while waiting and re-armed with the time it had
    left, to the microsecond (``signal.alarm`` would round it to whole seconds, and drop
    it under half a second)."""
    left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    t = time.monotonic()
    while path is not None and not path.exists() and time.monotonic() - t < deadline_s:
        time.sleep(0.2)
    if left:
        signal.setitimer(signal.ITIMER_REAL, left)


def _turns(args: argparse.Namespace) -> tuple[Path | None, Path | None, Path | None, Path | None]:
    """The files that order the modes' processes, started together: imports overlap, model
    loads run one after the other, then each mode measures alone once every mode has
    loaded (all stay resident, idle while another measures)."""
    if not args.turns:
        return None, None, None, None
    d, order = Path(args.turns), args.order.split(",")
    i = order.index(args.mode)
    prev = order[i - 1] if i else None
    return (d / f"loaded_{prev}" if prev else None, d / f"loaded_{args.mode}",
            d / f"measured_{prev}" if prev else d / f"loaded_{order[-1]}",
            d / f"measured_{args.mode}")


def _invariance(llm, vocab: int, SamplingParams) -> tuple[list, dict]:  # noqa: N803
    """Greedy outputs of the target prompts alone, and per batch of BATCHES how many of them
    change (tokens, logprobs bitwise) inside that batch of mixed-length fillers."""
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS, logprobs=1,
                            ignore_eos=True, detokenize=False)
    targets = prompts_for(11, vocab, TARGET_LENS)
    tp = [{"prompt_token_ids": p} for p in targets]
    alone = [_outputs(llm.generate([p], greedy, use_tqdm=False))[0] for p in tp]
    inv = {}
    for b in BATCHES:
        fill, ntoks = fillers(100 + b, vocab, b - len(targets))
        batch = [({"prompt_token_ids": p}, SamplingParams(
            temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=True, detokenize=False))
            for p, n in zip(fill, ntoks, strict=True)]
        rng = random.Random(b)
        slots = sorted(rng.sample(range(b), len(targets)))
        for j, s in enumerate(slots):
            batch.insert(s, (tp[j], greedy))
        outs = _outputs(llm.generate([x[0] for x in batch], [x[1] for x in batch],
                                     use_tqdm=False))
        got = [outs[s] for s in slots]
        inv[b] = {"tokens_changed": sum(g["tokens"] != a["tokens"]
                                        for g, a in zip(got, alone, strict=True)),
                  "logprobs_changed": sum(g["logprobs"] != a["logprobs"]
                                          for g, a in zip(got, alone, strict=True)),
                  "max_abs_logprob_diff": max(
                      max(abs(x - y) for x, y in zip(g["logprobs"], a["logprobs"],
                                                     strict=True))
                      for g, a in zip(got, alone, strict=True))}
        print("invariance", b, inv[b], flush=True)
    return alone, inv


def _prompt_logprobs(llm, vocab: int, SamplingParams) -> list:  # noqa: N803
    """Prompt logprobs of 16 prompts (the cross-mode comparison)."""
    plp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    lp_prompts = prompts_for(21, vocab, [64] * 16)
    outs = llm.generate([{"prompt_token_ids": p} for p in lp_prompts], plp, use_tqdm=False)
    return [[None if d is None else {"tok": p[i], "lp": float(d[p[i]].logprob),
                                     "top": min(d, key=lambda t: d[t].rank)}
             for i, d in enumerate(o.prompt_logprobs)]
            for o, p in zip(outs, lp_prompts, strict=True)]


def _throughput(llm, vocab: int, SamplingParams, batches,  # noqa: N803
                context: int = PERF_PROMPT) -> dict:
    """Per batch, prompts of ``context`` tokens: wall time of a 1-token and a
    (1 + PERF_TOKENS)-token generate (the
    minimum of PERF_REPEATS, after a warm-up), the decode step as their difference."""
    import torch

    perf = {}
    for b in batches:
        ps = [{"prompt_token_ids": p}
              for p in prompts_for(1000 + b, vocab, [context] * b)]
        row = {}
        for n in (1, PERF_TOKENS + 1):
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                detokenize=False)
            llm.generate(ps, sp, use_tqdm=False)  # warm-up: same shapes
            times = []
            for _ in range(PERF_REPEATS):
                torch.cuda.synchronize()
                ts = time.perf_counter()
                llm.generate(ps, sp, use_tqdm=False)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - ts)
            row[n] = min(times)
        step = (row[PERF_TOKENS + 1] - row[1]) / PERF_TOKENS
        perf[b] = {"t_prefill_s": row[1], "t_total_s": row[PERF_TOKENS + 1],
                   "decode_step_ms": step * 1e3,
                   "out_tok_s": b * (PERF_TOKENS + 1) / row[PERF_TOKENS + 1],
                   "decode_tok_s": b / step}
        print("perf", b, perf[b], flush=True)
    return perf


def engine(args: argparse.Namespace) -> None:
    wait_load, loaded, wait_measure, measured = _turns(args)
    if args.mode_timeout:
        signal.setitimer(signal.ITIMER_REAL, args.mode_timeout)  # its own work: _wait pauses it
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # FlashInfer is not on the H200: the V2 runner's sampler would import vLLM's FlashInfer
    # backend to ask whether FlashInfer's top-k/top-p sampler applies (greedy here)
    os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ["VLLM_BATCH_INVARIANT"] = "0" if args.mode == "a" else "1"
    if args.mode != "c":
        # under batch invariance the plugin serves every BF16 GEMM by itself (no
        # certification, no --linear-backend: a BF16 model's linears, an FP8 model's
        # lm_head), so (a) and (b) run without the daemon: vLLM's own kernels only
        os.environ.pop("CACHED_SOCKET", None)
    res: dict = {"mode": args.mode, "stage": "import", "errors": []}

    def save() -> None:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))

    t0 = time.perf_counter()
    try:
        from vllm import LLM, SamplingParams

        res["import_s"] = time.perf_counter() - t0
        res["stage"] = "load"
        save()
        cfg = json.loads((Path(args.ckpt) / "config.json").read_text())
        res["config"] = {k: cfg[k] for k in ("num_hidden_layers", "vocab_size",
                                             "quantization_config") if k in cfg}
        res["context"] = args.context
        vocab = cfg["vocab_size"]
        batches = tuple(int(b) for b in args.batches.split(","))
        kw = dict(model=args.ckpt, dtype="bfloat16",
                  max_model_len=max(1024, args.context + PERF_TOKENS + 16), max_num_seqs=256,
                  max_num_batched_tokens=MAX_BATCHED,
                  gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
                  enable_prefix_caching=False, attention_backend="TRITON_ATTN",
                  compilation_config={"mode": args.compile_mode,
                                      "cudagraph_mode": "FULL_DECODE_ONLY",
                                      "cudagraph_capture_sizes": list(batches)})
        if args.mode == "c":
            kw["linear_backend"] = "cached"
        _wait(wait_load)
        t1 = time.perf_counter()
        try:
            llm = LLM(**kw)
        finally:
            if loaded is not None:
                loaded.touch()
        res["load_s"] = time.perf_counter() - t1
        res["kernels"] = llm.apply_model(_kernels)[0]
        print("kernels", res["kernels"], flush=True)
        _wait(wait_measure)
        res["measure_start"] = time.time()
        if args.host:
            res["stage"] = "host"
            save()
            res["perf"] = _throughput(llm, vocab, SamplingParams, (HOST_BATCH,))
            res["host"] = _host_profile(llm, vocab, SamplingParams)
        else:
            if not args.quick and "quantization_config" in cfg:  # FP8 layers to check
                res["stage"] = "layers"
                save()
                try:
                    res["layer_check"] = llm.apply_model(_layer_check)[0]
                except Exception as exc:  # noqa: BLE001 -- recorded, the engine part goes on
                    res["errors"].append(f"layer_check: {type(exc).__name__}: {exc}"[:2000])
                    traceback.print_exc()
            if not args.quick:
                res["stage"] = "invariance"
                save()
                res["alone"], res["invariance"] = _invariance(llm, vocab, SamplingParams)
                res["stage"] = "prompt_logprobs"
                save()
                res["prompt_logprobs"] = _prompt_logprobs(llm, vocab, SamplingParams)
            if not args.profile_only:
                res["stage"] = "throughput"
                save()
                res["perf"] = _throughput(llm, vocab, SamplingParams, batches, args.context)
            res["stage"] = "profile"
            save()
            res["gpu_profile"] = _gpu_profile(llm, vocab, SamplingParams,
                                              "quantization_config" in cfg, batches,
                                              args.context)
            if not args.no_timeline:
                res["stage"] = "timeline"
                save()
                res["timeline"] = _timeline(llm, vocab, SamplingParams, args.mode,
                                            args.trace_dir)
                res["perf_after"] = _throughput(llm, vocab, SamplingParams, (64, 256))
        res["stage"] = "done"
    except Exception as exc:  # noqa: BLE001 -- recorded: how far vLLM ran is the result
        res["errors"].append(f"{res['stage']}: {type(exc).__name__}: {exc}"[:4000])
        res["traceback"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
    try:  # the serving monitor of this process (the engine core runs in it)
        from cached_client import monitor

        res["monitor"] = {"serving": monitor.is_serving(), "outside": monitor.counts()}
        print("monitor", res["monitor"], flush=True)
    except Exception as exc:  # noqa: BLE001 -- recorded
        res["errors"].append(f"monitor: {type(exc).__name__}: {exc}"[:500])
    res["wall_s"] = time.perf_counter() - t0
    save()
    for f in (loaded, measured):  # never leave the next mode waiting
        if f is not None:
            f.touch()


# -- what vLLM's serving path imports ---------------------------------------------------------

PREFLIGHT = (
    "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.worker.gpu.model_runner", "vllm.v1.structured_output",
    "vllm.model_executor.model_loader.default_loader", "vllm.model_executor.models.llama",
    "vllm.model_executor.layers.quantization.fp8", "vllm.v1.attention.backends.triton_attn",
    "vllm.compilation.backends", "vllm.compilation.cuda_graph", "vllm.v1.sample.sampler",
    "vllm.model_executor.determinism.batch_invariant", "vllm.model_executor.kernels.linear")


def preflight(args: argparse.Namespace) -> None:
    """Import each module of vLLM's offline serving path, record the failures, and list the
    top-level names asked for that nothing here provides (optional ones included)."""
    import importlib
    import importlib.util

    asked: set[str] = set()

    class Record:
        def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
            asked.add(name.split(".")[0])

    sys.meta_path.insert(0, Record())
    fails = {}
    for m in PREFLIGHT:
        try:
            importlib.import_module(m)
        except Exception as exc:  # noqa: BLE001 -- recorded
            fails[m] = f"{type(exc).__name__}: {exc}"[:300]
    missing = []
    for n in sorted(asked - set(sys.stdlib_module_names)):
        try:
            if n and importlib.util.find_spec(n) is None:
                missing.append(n)
        except (ImportError, ValueError):
            missing.append(n)
    import torch

    out = {"fails": fails, "missing_top_level": missing, "torch": torch.__version__,
           "vllm_C": "vllm._C_stable_libtorch" in sys.modules,
           "cutlass_scaled_mm": hasattr(torch.ops._C, "cutlass_scaled_mm")}
    print("PREFLIGHT " + json.dumps(out), flush=True)


# -- level 3 alone --------------------------------------------------------------------------


def layers(args: argparse.Namespace) -> None:
    """vLLM's own FP8 linear layers (Fp8LinearMethod through QKV/Merged/RowParallelLinear),
    built under a VllmConfig with ``--linear-backend`` cached and cutlass, loaded through
    their weight loaders, processed, applied eagerly and in a CUDA graph, against float64."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    res: dict = {"errors": []}
    try:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.distributed import (
            init_distributed_environment,
            initialize_model_parallel,
        )
        from vllm.engine.arg_utils import EngineArgs
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
        from vllm.plugins import load_general_plugins
        from vllm.utils.torch_utils import set_default_torch_dtype

        load_general_plugins()
        first = EngineArgs(model=args.ckpt, dtype="bfloat16", enforce_eager=True,
                           attention_backend="TRITON_ATTN",
                           max_model_len=1024).create_engine_config()
        with set_current_vllm_config(first):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method="tcp://127.0.0.1:29533",
                                         backend="nccl")
            initialize_model_parallel(1, 1)
        g = torch.Generator(device="cuda").manual_seed(3)
        for backend in ("cached", "cutlass"):
            qc = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="static")
            vc = EngineArgs(model=args.ckpt, dtype="bfloat16", linear_backend=backend,
                            attention_backend="TRITON_ATTN", enforce_eager=True,
                            max_model_len=1024).create_engine_config()
            with (set_current_vllm_config(vc), set_default_torch_dtype(torch.bfloat16),
                  torch.device("cuda")):
                mods = {
                    "qkv_proj": QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS,
                                                  bias=False, quant_config=qc,
                                                  prefix="l.qkv_proj"),
                    "o_proj": RowParallelLinear(HIDDEN, HIDDEN, bias=False, quant_config=qc,
                                                prefix="l.o_proj"),
                    "gate_up_proj": MergedColumnParallelLinear(HIDDEN, [INTER] * 2,
                                                               bias=False, quant_config=qc,
                                                               prefix="l.gate_up_proj"),
                    "down_proj": RowParallelLinear(INTER, HIDDEN, bias=False,
                                                   quant_config=qc, prefix="l.down_proj"),
                }
                shards = {"qkv_proj": [("q", HIDDEN), ("k", 1024), ("v", 1024)],
                          "gate_up_proj": [(0, INTER), (1, INTER)]}
                for name, mod in mods.items():
                    k = mod.input_size
                    for sid, n in shards.get(name, [(None, mod.output_size)]):
                        w = torch.randn(n, k, generator=g, device="cuda") * k ** -0.5
                        sc = w.abs().max() / 448
                        wq = (w / sc).to(torch.float8_e4m3fn)
                        extra = () if sid is None else (sid,)
                        mod.weight.weight_loader(mod.weight, wq, *extra)
                        mod.weight_scale.weight_loader(mod.weight_scale, sc.reshape(()),
                                                       *extra)
                        mod.input_scale.weight_loader(mod.input_scale,
                                                      torch.tensor(0.01, device="cuda"),
                                                      *extra)
                    mod.quant_method.process_weights_after_loading(mod)
                ns = SimpleNamespace
                model = ns(model=ns(layers=[ns(
                    self_attn=ns(qkv_proj=mods["qkv_proj"], o_proj=mods["o_proj"]),
                    mlp=ns(gate_up_proj=mods["gate_up_proj"], down_proj=mods["down_proj"]))]))
                res[backend] = _layer_check(model)
                print(backend, json.dumps(res[backend])[:1500], flush=True)
    except Exception as exc:  # noqa: BLE001 -- recorded
        res["errors"].append(f"{type(exc).__name__}: {exc}"[:4000])
        res["traceback"] = traceback.format_exc()[-6000:]
        traceback.print_exc()
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))


# -- summary --------------------------------------------------------------------------------


def _load(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def _ratio_table(runs: dict, names: dict, field: str, what: str, ratio: str, cell) -> None:
    """One row per batch: each mode's ``cell(r[field][batch])`` (a time, its text) and the
    time of (a) and (b) over (c)'s (> 1: (c) faster); rows no mode measured are left out."""
    batches = sorted({b for r in runs.values() for b in (r.get(field) or {})}, key=int)
    if not batches:
        return
    print("\n| batch | " + " | ".join(f"{names[m]} {what}" for m in runs)
          + f" | a {ratio} / c {ratio} | b {ratio} / c {ratio} |")
    print("|---|" + "---|" * (len(runs) + 2))
    for b in batches:
        cells, times = [], {}
        for m, r in runs.items():
            p = (r.get(field) or {}).get(b)
            if p:
                times[m], text = cell(p)
                cells.append(text)
            else:
                cells.append("-")
        ratios = [f"{times[o] / times['c']:.2f}" if times.get("c") and o in times else "-"
                  for o in "ab"]
        print(f"| {b} | " + " | ".join(cells) + f" | {ratios[0]} | {ratios[1]} |")


def _host_tables(runs: dict, names: dict) -> None:
    """The host profile (``engine --host``): per mode the step's wall time bare, with the
    collector timed and under cProfile, the collections, the busiest threads; then the
    functions whose own time per step differs most between (c) and (a)."""
    hosts = {m: r["host"] for m, r in runs.items() if r.get("host")}
    if not hosts:
        return
    steps = TIMELINE_STEPS + 1
    print("\n| mode | wall ms/step bare | with gc timed | under cProfile | calls/step | "
          "gc passes gen0/1/2 (ms) | busiest threads (CPU ms over the generate) |")
    print("|---|---|---|---|---|---|---|")
    for m, h in hosts.items():
        gcp = " / ".join(f"{n} ({ms})" for n, ms in h["gc_passes"].values())
        threads = ", ".join(f"{n} {ms:.0f}" for n, ms in h["thread_cpu_ms"][:4])
        print(f"| {names[m]} | {h['wall_ms_bare'] / steps:.2f} | "
              f"{h['wall_ms_gc_timed'] / steps:.2f} | {h['wall_ms_cprofile'] / steps:.2f} | "
              f"{h['calls_per_step']:.0f} | {gcp} | {threads} |")
    for m, h in hosts.items():
        print(f"\n{names[m]}: threads {h['threads']}; gc enabled {h['gc_enabled']}, frozen "
              f"{h['gc_frozen']}; functions by own time per step (calls, own us, cum us):")
        for where, calls, own, cum in h["by_own_time"][:25]:
            print(f"  {own:9.1f} {cum:9.1f} {calls:8.1f}  {where}")
    if "a" in hosts and "c" in hosts:
        own = {m: {w: (o, c) for w, c, o, _ in hosts[m]["by_own_time"]} for m in "ac"}
        keys = set(own["a"]) | set(own["c"])
        diff = sorted(keys, key=lambda w: -abs(own["c"].get(w, (0, 0))[0]
                                               - own["a"].get(w, (0, 0))[0]))
        print("\nown us/step, (c) minus (a), where they differ most (listed in either top "
              f"{HOST_TOP}):")
        for w in diff[:20]:
            oc, ca = own["c"].get(w, (0.0, 0.0)), own["a"].get(w, (0.0, 0.0))
            print(f"  {oc[0] - ca[0]:+9.1f}  c {oc[0]:8.1f} ({oc[1]:.1f} calls)  "
                  f"a {ca[0]:8.1f} ({ca[1]:.1f} calls)  {w}")


def summarize(args: argparse.Namespace) -> None:
    runs = {m: _load(p) for m, p in zip("abc", args.files, strict=False)}
    ran = [r["config"] for r in runs.values() if r.get("config")]  # a mode not run has none
    bf16 = bool(ran) and all("quantization_config" not in c for c in ran)
    names = {"a": f"(a) vLLM default {'BF16' if bf16 else 'FP8'}",
             "b": "(b) vLLM batch-invariant", "c": "(c) BI + cached kernels"}
    contexts = {r.get("context", PERF_PROMPT) for r in runs.values() if r.get("config")}
    print(f"\nprompts of {', '.join(map(str, sorted(contexts)))} tokens in the throughput and "
          "profile batches")
    print("\n| mode | reached | load s | FP8 kernels | errors |")
    print("|---|---|---|---|---|")
    for m, r in runs.items():
        err = "; ".join(r.get("errors", []))[:300].replace("|", "/").replace("\n", " ")
        print(f"| {names[m]} | {r.get('stage', '-')} | {r.get('load_s', float('nan')):.1f} | "
              f"{r.get('kernels', '-')} | {err or '-'} |")
    print("\n| mode | batch | prompts with changed tokens | with changed logprobs | "
          "max abs logprob diff |")
    print("|---|---|---|---|---|")
    for m, r in runs.items():
        for b, v in r.get("invariance", {}).items():
            print(f"| {names[m]} | {b} | {v['tokens_changed']}/8 | {v['logprobs_changed']}/8 | "
                  f"{v['max_abs_logprob_diff']:.3g} |")
    def perf_cell(p: dict) -> tuple[float, str]:
        return p["decode_step_ms"], f"{p['out_tok_s']:.0f} ({p['decode_step_ms']:.2f})"

    def gpu_cell(p: dict) -> tuple[float, str]:
        return p["step_gpu_us"], (f"{p['step_gpu_us']:.0f} ({p['step_gemm_us']:.0f}, "
                                  f"{p['step_launches']:.0f})")

    def fp8_cell(p: dict) -> tuple[float, str]:
        # a run recorded before FP8_GEMM_MARKS named a kernel stored 0: its kernels are
        # counted again from the step's top kernels, with today's marks
        us = (p["step_fp8_gemm_us"] if "step_bf16_gemm_us" in p  # split recorded
              else p.get("step_fp8_gemm_us") or _fp8_gemm_us((n, t) for n, t, _ in p["top"]))
        return us, f"{us:.0f}"

    _ratio_table(runs, names, "perf", "tok/s (step ms)", "step", perf_cell)
    _ratio_table(runs, names, "gpu_profile", "GPU us/step (all GEMMs us, launches)",
                 "GPU step", gpu_cell)
    _ratio_table(runs, names, "gpu_profile", "FP8 linears' GPU us/step", "FP8 GEMM", fp8_cell)
    print("\n| mode | batch | GPU us/step | FP8 GEMMs | BF16 GEMMs (lm_head incl.) | attention | "
          "the rest |")
    print("|---|---|---|---|---|---|---|")
    for m, r in runs.items():
        for b, p in (r.get("gpu_profile") or {}).items():
            if "step_attention_us" not in p:  # recorded before the split
                continue
            fp8 = p["step_fp8_gemm_us"]
            rest = p["step_gpu_us"] - p["step_gemm_us"] - p["step_attention_us"]
            print(f"| {names[m]} | {b} | {p['step_gpu_us']:.0f} | {fp8:.0f} | "
                  f"{p['step_bf16_gemm_us']:.0f} | {p['step_attention_us']:.0f} | {rest:.0f} |")
    _host_tables(runs, names)
    print("\n| mode | batch | wall us/token (generate) | GPU busy us/step | GPU idle gaps > 20 us "
          "per step (us) | step ms, measured again after |")
    print("|---|---|---|---|---|---|")
    for m, r in runs.items():
        for b, t in (r.get("timeline") or {}).items():
            again = (r.get("perf_after") or {}).get(b, {}).get("decode_step_ms", float("nan"))
            print(f"| {names[m]} | {b} | {t['wall_us'] / (TIMELINE_STEPS + 1):.0f} | "
                  f"{t['gpu_busy_us'] / (TIMELINE_STEPS + 1):.0f} | "
                  f"{t['gap_us_total'] / (TIMELINE_STEPS + 1):.0f} | {again:.2f} |")
    for m, r in runs.items():
        for b, t in (r.get("timeline") or {}).items():
            print(f"\n{names[m]} batch {b}: host ops per step (self CPU us, calls); largest GPU "
                  f"gaps {t['largest_gaps_us']}")
            for name, us, c in t["cpu_top_per_step"][:18]:
                print(f"  {us:9.1f} {c:6.2f}  {name}")
    for m, r in runs.items():
        profiled = sorted((r.get("gpu_profile") or {}).items(), key=lambda kv: int(kv[0]))
        shown = sorted({0, len(profiled) // 2, len(profiled) - 1})  # smallest, middle, largest
        for b, p in (profiled[i] for i in shown if profiled):
            if p:
                print(f"\n{names[m]} batch {b}, kernels per decode step (us, launches):")
                for name, t, c in p["top"]:
                    print(f"  {t:9.2f} {c:5.1f}  {name[:150]}")
    c = runs.get("c", {}).get("prompt_logprobs")
    for m in "ab":
        other = runs.get(m, {}).get("prompt_logprobs")
        if not (other and c):
            continue
        diffs, agree, same, total = [], 0, 0, 0
        for po, pc in zip(other, c, strict=True):
            for x, y in zip(po, pc, strict=True):
                if x is None:
                    continue
                diffs.append(abs(x["lp"] - y["lp"]))
                agree += x["top"] == y["top"]
                same += x["lp"] == y["lp"]
                total += 1
        print(f"\nprompt logprobs, (c) vs ({m}) on {total} positions: max abs diff "
              f"{max(diffs):.4g}, median {statistics.median(diffs):.3g}, bitwise equal "
              f"{same}/{total}, top-1 agreement {agree}/{total}")
    for m, r in runs.items():
        for name, v in (r.get("layer_check") or {}).items():
            print(f"layer {names[m]} {name}: {v.get('kernel')} rel err "
                  f"{max(v['rel_err_vs_f64'].values()):.2e}, rows vs M=512 "
                  f"{sum(v['rows_differing_vs_m512'].values())}, graph vs eager "
                  f"{v['graph_vs_eager_rows_differing']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ckpt")
    p.add_argument("dir")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--scheme", choices=SCHEMES, default="tensor")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("engine")
    p.add_argument("ckpt")
    p.add_argument("--mode", choices="abc", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--compile-mode", type=int, default=0)
    p.add_argument("--turns", help="directory of the files that order the modes' processes")
    p.add_argument("--order", default="c,b,a", help="the modes, in their turns' order")
    p.add_argument("--mode-timeout", type=int, default=0,
                   help="seconds of this mode's own work (its imports, load and measurements; "
                        "not its waits for the other modes' turns) before it is ended; 0: none")
    p.add_argument("--trace-dir", help="where the timeline's Chrome traces go (gzipped)")
    p.add_argument("--context", type=int, default=PERF_PROMPT,
                   help="prompt tokens of the throughput and profile batches")
    p.add_argument("--batches", default=",".join(map(str, PERF_BATCHES)),
                   help="the throughput and profile batches (and CUDA graph sizes)")
    p.add_argument("--profile-only", action="store_true",
                   help="the GPU profile without the throughput runs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25,
                   help="each mode's share of the GPU (all modes stay resident)")
    p.add_argument("--quick", action="store_true",
                   help="load, throughput, profile and timeline only (no layer check, "
                        "invariance or prompt logprobs)")
    p.add_argument("--no-timeline", action="store_true",
                   help="skip the host timeline and the throughput measured again after it")
    p.add_argument("--host", action="store_true",
                   help="load, throughput at the host profile's batch and the host "
                        "profile only")
    p = sub.add_parser("layers")
    p.add_argument("ckpt")
    p.add_argument("--out", required=True)
    sub.add_parser("preflight")
    p = sub.add_parser("summarize")
    p.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.cmd == "ckpt":
        t = time.perf_counter()
        info = write_checkpoint(Path(args.dir), args.layers, args.vocab, args.seed,
                                args.scheme)
        print(json.dumps({**info, "s": time.perf_counter() - t}), flush=True)
    elif args.cmd == "engine":
        engine(args)
    elif args.cmd == "layers":
        layers(args)
    elif args.cmd == "preflight":
        preflight(args)
    else:
        summarize(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
