"""The vLLM general plugin. First loaded as vLLM's loader loads it (entry points of the group
``vllm.general_plugins``) in processes of this environment; then with vLLM 0.33.0's own code
in the second environment (.venv-vllm, ``make setup-vllm``): its plugin loader and logging
configuration, ``init_fp8_linear_kernel`` on a CUDA platform of capability 90 and 100 (only
the capability patched: tests/vllm_harness.py), ``fp8_scaled_mm_is_batch_invariant``, the
CLI's ``--linear-backend``, the NVFP4 selection and FlashInfer's FP8 bmm backend. The daemon
is a real ``cached serve`` holding real certification records."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, DaemonProcess

LOADER = """
import json, logging, sys
from importlib.metadata import entry_points
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
plugins = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
assert "cached" in plugins, plugins
plugins["cached"].load()()          # what vllm.plugins.load_general_plugins() does
from cached_client.integrations.flashinfer import cute_dsl as flashinfer
result = {"installed_before": flashinfer.installed(),
          "flashinfer_imported": "flashinfer" in sys.modules}
if len(sys.argv) > 1:
    import flashinfer as fi         # the plugin's hooks attach now
    from cached_client.integrations.jit import nvcc as flashinfer_nvcc
    result["installed_after_import"] = flashinfer.installed()
    result["nvcc_after_import"] = flashinfer_nvcc.NvccHook.current() is not None
print("RESULT " + json.dumps(result))
"""


def _run(env: dict, *args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", LOADER, *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    logs = [x for x in proc.stderr.splitlines() if x.startswith("vllm.cached")]
    return json.loads(line[7:]), "\n".join(logs)


@pytest.mark.parametrize("socket", ["", "/nonexistent/cached.sock", "FILE"])
def test_without_a_live_daemon_one_log_line_and_nothing_else(tmp_path, socket):
    if socket == "FILE":
        socket = str(tmp_path / "not-a-socket")
        open(socket, "w").close()
    # XDG_RUNTIME_DIR: no default socket either (the per-user one under it, /run/cached's)
    result, logs = _run({"CACHED_SOCKET": socket, "XDG_RUNTIME_DIR": str(tmp_path)})
    assert result == {"installed_before": False, "flashinfer_imported": False}
    assert len(logs.splitlines()) == 1 and "in-process" in logs
    if not socket:
        assert f"no daemon socket exists at {tmp_path}/cached/cached.sock or " \
            "/run/cached/cached.sock" in logs, logs


def test_with_nothing_set_the_plugin_uses_the_default_socket(tmp_path):
    """No $CACHED_SOCKET: the plugin finds the daemon on the default socket, as Client() and
    the CLI do (was: nothing installed); the system socket: tests/test_ops_deploy.py."""
    (tmp_path / "cached").mkdir(mode=0o700)
    d = DaemonProcess(tmp_path / "cached", workers=1, ready_workers=0,
                      extra_env={"XDG_RUNTIME_DIR": str(tmp_path)})
    try:
        env = {k: v for k, v in os.environ.items() if k != "CACHED_SOCKET"}
        proc = subprocess.run([sys.executable, "-c", LOADER], capture_output=True, text=True,
                              env={**env, "XDG_RUNTIME_DIR": str(tmp_path)}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"daemon at {tmp_path}/cached/cached.sock (toolchain" in proc.stderr, \
            proc.stderr[-3000:]
    finally:
        d.stop()


def test_with_a_live_daemon_flashinfer_is_hooked_when_first_imported(tmp_path):
    pytest.importorskip("flashinfer")
    d = DaemonProcess(tmp_path, workers=1)
    try:
        env = {**os.environ, "CACHED_SOCKET": d.socket}
        procs = [subprocess.Popen([sys.executable, "-c", LOADER, "import"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=env) for _ in range(3)]
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            line = next(x for x in out.splitlines() if x.startswith("RESULT "))
            assert json.loads(line[7:]) == {"installed_before": False,
                                            "flashinfer_imported": False,
                                            "installed_after_import": True,
                                            "nvcc_after_import": True}
            assert "CuTe-DSL kernels now come from the daemon" in err
            assert f"daemon at {d.socket} (toolchain" in err
    finally:
        d.stop()


# -- with vLLM 0.33.0's own code (.venv-vllm) --------------------------------------------------

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
HARNESS = ROOT / "tests" / "vllm_harness.py"
H200, H100, B200 = "NVIDIA H200", "NVIDIA H100", "NVIDIA B200"
CACHED_BLOCK = "CachedFp8BlockScaledMMKernel"
CACHED, CUTLASS, FLASHINFER = ("CachedFP8ScaledMMLinearKernel", "CutlassFP8ScaledMMLinearKernel",
                               "FlashInferFP8ScaledMMLinearKernel")
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason="the vLLM environment: make setup-vllm")


def _flashinfer_074(tmp: Path) -> Path:
    """A directory that puts this environment's FlashInfer (0.7.4, with its batch-invariant
    classes) ahead of vLLM's pin on the vLLM environment's path, as an upgrade would."""
    spec = importlib.util.find_spec("flashinfer")
    site = Path(spec.origin).parents[1]
    overlay = tmp / "flashinfer-0.7.4"
    overlay.mkdir()
    (overlay / "flashinfer").symlink_to(site / "flashinfer")
    for dist in site.glob("flashinfer_python-*.dist-info"):
        (overlay / dist.name).symlink_to(dist)
    return overlay


def _harness(cap: int, scenarios: list[dict], env: dict, path: list[Path] = ()) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH")}
    full.update({"VLLM_HAS_FLASHINFER_CUBIN": "1", "PYTHONUNBUFFERED": "1",
                 "PYTHONPATH": os.pathsep.join([*map(str, path), str(ROOT / "client")]), **env})
    return subprocess.Popen([str(VLLM_PYTHON), str(HARNESS), str(cap), json.dumps(scenarios)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full)


SC90 = [{"bi": 1, "device": H200}, {"bi": 1, "device": H100}, {"bi": 0, "device": H200},
        {"bi": 0, "backend": "cached"}, {"bi": 1, "device": H200, "backend": "cutlass"}]
SC100 = [{"bi": 1, "device": B200}, {"bi": 1, "device": H200}, {"bi": 0, "device": B200}]


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory):
    """Every vLLM process of these tests, run two at a time against one daemon."""
    if not VLLM_PYTHON.exists():
        pytest.skip("the vLLM environment: make setup-vllm")
    pytest.importorskip("flashinfer")
    tmp = tmp_path_factory.mktemp("vllm")
    d = DaemonProcess(tmp, workers=0)
    try:
        c = d.client(timeout=30)
        for family, device, arch in (("cached.hopper_fp8", H200, "sm_90a"),
                                     ("flashinfer.bi.bmm_fp8", B200, "sm_100a")):
            c.certify_record({"family": family, "n": 4096, "k": 4096, "device": device,
                              "arch": arch, "tactics": [{}], "ms": [1, 2048],
                              "rows_differing": {"t0": 0, "mix": 0, "cross_tactic": 0}})
        c.certify_record({"family": "cached.hopper_fp8", "n": 4096, "k": 4096, "device": H100,
                          "arch": "sm_90a", "tactics": [{}],
                          "rows_differing": {"t0": 0, "mix": 3, "cross_tactic": 0}})
        live = {"CACHED_SOCKET": d.socket}
        fi = _flashinfer_074(tmp)
        jobs = {
            "90": (90, SC90, {**live, "VLLM_BATCH_INVARIANT": "1"}, []),
            "90-vllm": (90, SC90, {"VLLM_PLUGINS": "", "VLLM_BATCH_INVARIANT": "1"}, []),
            "100-pin": (100, SC100, {**live, "VLLM_BATCH_INVARIANT": "1"}, []),
            "100": (100, SC100, {**live, "VLLM_BATCH_INVARIANT": "1"}, [fi]),
            # vLLM alone, started without batch invariance (each scenario sets its own)
            "100-vllm": (100, SC100, {"VLLM_PLUGINS": "", "VLLM_BATCH_INVARIANT": "0"}, [fi]),
            "100-nobi": (100, [], {**live, "VLLM_BATCH_INVARIANT": "0"}, [fi]),
        }
        results, names = {}, list(jobs)
        while names:
            batch, names = names[:2], names[2:]
            procs = {n: _harness(*jobs[n]) for n in batch}
            for n, p in procs.items():
                out, _ = p.communicate(timeout=600)
                line = [x for x in out.splitlines() if x.startswith("RESULT ")]
                assert p.returncode == 0 and line, f"{n}:\n{out[-4000:]}"
                results[n] = (json.loads(line[-1][7:]), out)
        yield results
    finally:
        d.stop()


@needs_vllm
def test_vllms_loader_loads_the_plugin_and_its_lines_show_under_vllms_logging(vllm_runs):
    result, out = vllm_runs["90"]
    assert "cached_client.integrations.vllm.plugin" in result["plugins"]
    line = next(x for x in out.splitlines() if "cached: pid" in x)
    # vLLM's default format: "(MainProcess pid=N) INFO MM-DD hh:mm:ss [file:line] message"
    assert line.startswith("(MainProcess pid=") and " INFO " in line
    assert "[plugin.py:" in line and "daemon at " in line and "(toolchain " in line
    chosen = [x for x in out.splitlines() if "FP8 linears run cached.hopper_fp8" in x]
    assert len(chosen) == 2  # once per reason, however many layers ask
    assert "VLLM_BATCH_INVARIANT=1" in chosen[0] and "certified on NVIDIA H200" in chosen[0]
    assert "(--linear-backend cached)" in chosen[1]
    # the plugin is not loaded where vLLM is told to load none
    assert "cached_client.integrations.vllm.plugin" not in vllm_runs["90-vllm"][0]["plugins"]


@needs_vllm
@pytest.mark.parametrize("run,base,index,want", [
    ("90", "90-vllm", 0, CACHED),         # batch invariant, certified on this device
    ("90", "90-vllm", 1, None),           # H100's record has 3 differing rows: vLLM's choice
    ("90", "90-vllm", 2, None),           # no batch invariance: vLLM's choice
    ("90", "90-vllm", 3, CACHED),         # --linear-backend cached, asked for
    ("90", "90-vllm", 4, None),           # --linear-backend cutlass stays cutlass
    ("100", "100-vllm", 0, CACHED),       # FlashInfer 0.7.4: its batch-invariant FP8 class
    ("100", "100-vllm", 1, None),         # no certification for this device
    ("100", "100-vllm", 2, None),         # no batch invariance
    ("100-pin", "100-vllm", 0, None),     # vLLM's FlashInfer pin 0.7.2.post1: not offered
])
def test_fp8_linear_selection_at_capability_90_and_100(vllm_runs, run, base, index, want):
    got = vllm_runs[run][0]["selected"][index]
    vllm_choice = vllm_runs[base][0]["selected"][index]
    if want is None:
        assert got["static_tensor"] == vllm_choice["static_tensor"]
        assert got["static_tensor"][0] != CACHED
    else:
        assert got["static_tensor"] == [want, True]  # fp8_scaled_mm_is_batch_invariant: true
        if "config_error" in vllm_choice:  # vLLM alone refuses --linear-backend cached
            assert "linear_backend" in vllm_choice["config_error"]
        else:
            assert vllm_choice["static_tensor"][0] in (CUTLASS, FLASHINFER)
    others = ("dynamic_token", "dynamic_token_channel", "dynamic_tensor", "block",
              "block_k4112")
    if run == "90" and want == CACHED:
        # per-token activation x per-channel (FP8-dynamic) or per-tensor weight: the
        # family's per-token scheme, batch invariant
        assert got["dynamic_token"] == got["dynamic_token_channel"] == [CACHED, True]
        if SC90[index]["bi"]:  # a dynamic per-tensor scale is refused: vLLM's choice
            assert got["dynamic_tensor"][0] != CACHED
        else:  # asked for without batch invariance: served, and not called invariant
            assert got["dynamic_tensor"] == [CACHED, False]
        # block FP8 (1x128 x 128x128): the block kernel, batch invariant; K % 128 != 0:
        # vLLM's choice
        assert got["block"] == [CACHED_BLOCK, True]
        assert got["block_k4112"][0] != CACHED_BLOCK
        if "config_error" not in vllm_choice:
            assert got["dynamic_tensor"] == vllm_choice["dynamic_tensor"]
            assert vllm_choice["block"][0] != CACHED_BLOCK
            assert got["block_k4112"] == vllm_choice["block_k4112"]
    else:  # not this kernel's (or not on this arch): vLLM's choice stands
        for name in others:
            assert got[name] == vllm_choice[name], name


@needs_vllm
def test_the_kernel_says_why_it_refuses_a_layer(vllm_runs):
    """The kernel's own can_implement, through vLLM's config type: what it serves on sm_90a
    under batch invariance, and the reason for each layer it does not."""
    got = vllm_runs["90"][0]["selected"][0]
    assert got["can_implement static_tensor"] == [True, None]
    assert got["can_implement dynamic_token"] == [True, None]
    assert got["can_implement dynamic_token_channel"] == [True, None]
    ok, why = got["can_implement dynamic_tensor"]
    assert not ok and "amax over every row" in why and "per-token" in why
    ok, why = got["can_implement block"]
    assert not ok and "(128, 128)" in why and "(1, 128)" in why
    # the block kernel: block FP8 with K % 128 == 0 only, each refusal with its reason
    assert got["can_implement_block block"] == [True, None]
    ok, why = got["can_implement_block block_k4112"]
    assert not ok and "K % 128 == 0" in why and "K=4112" in why
    ok, why = got["can_implement_block static_tensor"]
    assert not ok and "(128, 128) weight blocks" in why and "static activation (-1, -1)" in why
    # without batch invariance a dynamic per-tensor scale is served (--linear-backend cached)
    assert vllm_runs["90"][0]["selected"][3]["can_implement dynamic_tensor"] == [True, None]
    # capability 100 (FlashInfer's per-tensor class): per-token scales are sm_90a's
    ok, why = vllm_runs["100"][0]["selected"][0]["can_implement dynamic_token_channel"]
    assert not ok and "served on sm_90a" in why


@needs_vllm
def test_without_certification_on_vllms_flashinfer_pin_the_log_says_why(vllm_runs):
    result, out = vllm_runs["100-pin"]
    assert result["selected"][0]["static_tensor"] == [FLASHINFER, False]
    assert any("not offered on sm_100a" in x and "FlashInfer 0.7.2.post1" in x
               and "no flashinfer.batch_invariant" in x for x in out.splitlines())


@needs_vllm
def test_the_kernels_custom_op_traces_with_fake_tensors(vllm_runs):
    assert vllm_runs["90"][0]["custom_op_fake"] == [[5, 32], "torch.float16"]
    # a direct dispatcher registration (CUDA kernel + fake), not torch.library.custom_op,
    # whose Python dispatch costs several times more per host call (bench/op_dispatch.py)
    assert vllm_runs["90"][0]["custom_op_direct"] == [True, True]


@needs_vllm
def test_linear_backend_cached_is_accepted_by_vllms_cli(vllm_runs):
    assert vllm_runs["90"][0]["cli"] == "cached"
    assert vllm_runs["90-vllm"][0]["cli"] == "refused"  # vLLM alone does not know the name


VLLM_CLI = ROOT / ".venv-vllm" / "bin" / "vllm"


@needs_vllm
def test_vllm_serve_parses_linear_backend_cached(tmp_path):
    """The console script `vllm serve` of the vLLM environment, as a user runs it (not the
    harness): its command line accepts --linear-backend cached from the plugin and goes on
    to load the model (absent here); an unknown backend is refused by vLLM's parser. (Was:
    `vllm serve` could not start: no uvicorn in .venv-vllm.)"""
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT / "client"), "XDG_RUNTIME_DIR": str(tmp_path)}
    env.pop("CACHED_SOCKET", None)
    model = str(tmp_path / "no-model-here")
    ran = {backend: subprocess.run([str(VLLM_CLI), "serve", model, "--linear-backend", backend],
                                   capture_output=True, text=True, env=env, timeout=300,
                                   cwd=tmp_path)
           for backend in ("cached", "nonsense")}
    out = ran["cached"].stdout + ran["cached"].stderr
    missing = set(re.findall(r"No module named '([\w.]+)'", out)) - {"vllm._C"}  # CPU build
    assert not missing and "'linear_backend': 'cached'" in out, out[-3000:]
    refused = ran["nonsense"]
    assert refused.returncode == 2 and "invalid choice: 'nonsense'" in refused.stderr
    assert "'cached'" in refused.stderr  # among the choices vLLM lists


@needs_vllm
def test_62192_pins_under_batch_invariance_only(vllm_runs):
    pinned, vllm_alone = vllm_runs["90"][0], vllm_runs["90-vllm"][0]
    # FlashInfer's FP8 bmm: vLLM 0.33.0 sends 'auto'; pinned to 'cutlass' under BI
    assert vllm_alone["bmm_backend"] == ["auto"] and pinned["bmm_backend"] == ["cutlass"]
    assert any("'cutlass' backend instead of 'auto'" in x and " WARNING " in x
               for x in vllm_runs["90"][1].splitlines())
    # W4A16 NVFP4: vLLM 0.33.0 forces a W4A4-only kernel; the pin asks for Humming (not
    # installed in this environment, so its own reason is given)
    assert "does not support W4A16" in vllm_alone["w4a16"]
    assert "runs on HummingNvFp4LinearKernel" in pinned["w4a16"]
    assert "Humming is not installed" in pinned["w4a16"]
    # without batch invariance vLLM's choices are untouched
    nobi, nobi_alone = vllm_runs["100-nobi"][0], vllm_runs["100-vllm"][0]
    assert nobi["bmm_backend"] == nobi_alone["bmm_backend"] == ["auto"]
    assert nobi["w4a16"] == nobi_alone["w4a16"] == "FlashInferCuteDslNvFp4W4A16LinearKernel"


@needs_vllm
def test_fp8_selection_neither_imports_flashinfer_nor_initialises_cuda(vllm_runs):
    for result, _ in vllm_runs.values():
        assert result["after_fp8_selection"] == {"flashinfer_imported": False,
                                                 "cuda_initialized": False}
        assert result["cuda_initialized"] is False
    # vLLM's own NVFP4 W4A16 selection imports FlashInfer; the plugin's hook attaches then
    result, out = vllm_runs["100-nobi"]
    assert result["flashinfer_imported"] is True
    # (this environment's DSL 4.8.0 is none of the daemon's toolchains: the line says so)
    assert any("cached: FlashInfer 0.7.4: hooked; the daemon at" in x
               and "has no toolchain of this environment" in x for x in out.splitlines())


PROBE = """
import json, sys
import torch
calls = []
for name in ("_lazy_init", "init", "device_count", "is_available", "get_device_capability",
             "get_device_properties", "get_device_name", "current_device"):
    original = getattr(torch.cuda, name)
    def wrapped(*a, _name=name, _original=original, **k):
        calls.append(_name)
        return _original(*a, **k)
    setattr(torch.cuda, name, wrapped)
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig())
from vllm.plugins import load_general_plugins
load_general_plugins()
before = {"flashinfer": "flashinfer" in sys.modules, "cuda_calls": sorted(set(calls)),
          "cuda_initialized": torch.cuda.is_initialized(),
          "plugin": "cached_client.integrations.vllm.plugin" in sys.modules}
import flashinfer
print("RESULT " + json.dumps(before), flush=True)
"""


@needs_vllm
def test_the_plugin_costs_nothing_until_flashinfer_is_imported(tmp_path):
    d = DaemonProcess(tmp_path, workers=0)
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH")}
        env.update({"CACHED_SOCKET": d.socket, "PYTHONPATH": str(ROOT / "client")})
        proc = subprocess.run([str(VLLM_PYTHON), "-c", PROBE], capture_output=True, text=True,
                              env=env, timeout=600)
    finally:
        d.stop()
    out = proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[7:]) == {"flashinfer": False, "cuda_calls": [],
                                    "cuda_initialized": False, "plugin": True}
    # the hook attached when FlashInfer was imported: vLLM's pin 0.7.2.post1 lacks what the
    # integration hooks (cached_client.integrations.flashinfer.cute_dsl, issue 11), and the
    # line says so
    assert any("cached: FlashInfer 0.7.2.post1" in x for x in out.splitlines()), out[-3000:]


ARG_UTILS_FIRST = """
import json, sys, types
# vllm/platforms/cuda.py imports its compiled extension at module level (needs libcuda.so.1)
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
from vllm.plugins import load_general_plugins
load_general_plugins()
first = "vllm.config.kernel" in sys.modules
from vllm.engine.arg_utils import EngineArgs  # imports vllm.config.kernel while importing
from vllm.config.kernel import KernelConfig
print("RESULT " + json.dumps({"kernel_imported_first": first,
                              "backend": KernelConfig(linear_backend="cached").linear_backend}))
"""


@needs_vllm
def test_the_kernel_config_hook_fires_cleanly_inside_arg_utils_own_import(tmp_path):
    """A worker that loads the plugin before vLLM's config (vllm.engine.arg_utils, mid-import,
    imports vllm.config.kernel, whose hook then ran before arg_utils had its kwargs cache):
    ``cached`` is accepted and no hook fails in the log."""
    d = DaemonProcess(tmp_path, workers=0)
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "PYTHONPATH")}
        env.update({"CACHED_SOCKET": d.socket, "PYTHONPATH": str(ROOT / "client")})
        proc = subprocess.run([str(VLLM_PYTHON), "-c", ARG_UTILS_FIRST], capture_output=True,
                              text=True, env=env, timeout=600)
    finally:
        d.stop()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    assert json.loads(line[7:]) == {"kernel_imported_first": False, "backend": "cached"}
    assert "hook for vllm.config.kernel failed" not in out, out[-3000:]
    assert "_compute_kwargs" not in out


@needs_vllm
def test_inside_vllm_every_client_line_goes_through_vllms_logging(tmp_path):
    """Issue 24, "Where it speaks", with vLLM 0.33.0's own logging configuration: the client's
    lines (the unknown_toolchain warning, the breaker's INFO line, the DaemonSilent warning,
    the prober's and the serving monitor's lines) come out through vLLM's handler in vLLM's
    format; before, the warnings were bare stderr lines and the INFO lines were lost. The
    daemon logs the unknown environment once, with the line that registers it, and its page
    names it; the monitor's count reaches the daemon once it answers again."""
    pytest.importorskip("flashinfer")
    d = DaemonProcess(tmp_path, workers=0)
    try:
        proc = _harness(100, [], {"CACHED_SOCKET": d.socket,
                                  "CACHED_HARNESS_SPEAK": str(d.proc.pid),
                                  "CUTE_DSL_ARCH": "sm_100a", "CACHED_SM_COUNT": "148",
                                  "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "fi")})
        out, _ = proc.communicate(timeout=600)
        (tmp_path / "harness.log").write_text(out)
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, out[-4000:]
        speak = json.loads(lines[-1][7:])["speak"]
        stats = d.stats()
        with urllib.request.urlopen(f"http://{stats['http']}/", timeout=10) as r:
            page = r.read().decode()
        daemon_log = d.log_path.read_text()
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        d.stop()
    assert speak["installed"] and speak["worker_wrapped"] and speak["usable_again"], speak
    assert speak["first"][1] == speak["second"][1] == "Function", speak
    assert speak["outside"] == {"flashinfer.mm_fp4": 1}, speak

    # every client line in vLLM's format: "(MainProcess pid=N) LEVEL MM-DD hh:mm:ss
    # [file:line] message"; none bare
    client = [x for x in out.splitlines() if "cached: " in x or "cached daemon at" in x]
    assert all(x.startswith("(MainProcess pid=") for x in client), client

    def through_vllm(text: str, level: str) -> str:
        found = [x for x in client if text in x and f") {level} " in x]
        assert found, f"{text!r} not logged at {level}:\n{out[-6000:]}"
        return found[0]

    first = through_vllm(" families); FP8 linear kernel 'cached' registered", "INFO")
    assert "no toolchain of the daemon is this environment (CuTe DSL 4.8.0" in first
    assert "come from the daemon" not in first and "--toolchain NAME=" in first
    assert "[cute_dsl.py:" in through_vllm("no toolchain of this daemon compiles "
                                             "flashinfer.mm_fp4", "WARNING")
    assert "[client.py:" in through_vllm("unusable (the daemon at", "INFO")  # the breaker
    silent = through_vllm("DaemonSilent: the daemon at", "WARNING")
    assert "FlashInfer compiles it in this process" in silent
    through_vllm("stopped answering", "INFO")
    through_vllm("answers again; its kernels are used again", "INFO")
    through_vllm("serving: kernels built or loaded outside the daemon", "INFO")
    monitor_line = through_vllm("was compiled in this process while serving", "WARNING")
    assert speak["second"][0] in monitor_line  # names the kernel
    # the daemon: the unknown environment logged once, with its versions and --toolchain line
    events = [json.loads(x) for x in daemon_log.splitlines()
              if '"toolchain.unknown_environment"' in x]
    assert len(events) == 1, events
    (ev,) = events
    assert ev["versions"]["nvidia-cutlass-dsl"] == "4.8.0" and ev["family"] == "flashinfer.mm_fp4"
    assert ev["register"] == f"cached serve --toolchain NAME={VLLM_PYTHON}"
    (unknown,) = stats["unknown_environments"]
    assert unknown["fingerprint"] == ev["fingerprint"] and unknown["requests"] >= 2
    assert 'id="unknown-environments"' in page and ev["fingerprint"] in page
    assert str(VLLM_PYTHON) not in page  # paths stay off HTTP
    # what the process told the daemon once it answered again
    assert stats["client_fallbacks"] == 1 and stats["client_outside_kernels"] == 1, stats
    assert stats["outside_kernels"][0]["kernel"] == f"flashinfer.mm_fp4:{speak['second'][0]}"


FP8_OP = """
import json, sys, torch
from cached_client import Client
from cached_client.gemm import plan as gp
from cached_client.integrations.vllm import kernel
client, fp8, out = Client(sys.argv[1], timeout=120), torch.float8_e4m3fn, {}

def refused(f):
    try:
        f()
    except ValueError as exc:
        return str(exc)
    return None

for scales, sb in (("tensor", torch.ones(1)), ("token", torch.ones(4096)),
                   ("block128", torch.ones(32, 32))):
    plan = gp.plan_gemm(client, 4096, 4096, arch="sm_90a", sm_count=132, max_m=16,
                        prefetch=False, scales=scales)
    calls = []
    kernel._gemms.append(gp.HopperFp8Gemm(plan, [lambda *a: calls.append(a)] * 5, "cpu"))
    i, b = len(kernel._gemms) - 1, torch.empty(4096, 4096, dtype=fp8)
    sa = (lambda m: torch.ones(32, m).t()) if scales == "block128" else (
        lambda m: torch.ones(1 if scales == "tensor" else m))
    got = out[scales] = {}
    got["load_refuses"] = refused(lambda: kernel.check_weight(
        i, torch.empty(4096, 4096, dtype=torch.float8_e5m2), sb))
    y = kernel.fp8_gemm(torch.empty(5, 4096, dtype=fp8), b, sa(5), sb, i, torch.bfloat16)
    got["ran"] = [list(y.shape), str(y.dtype), len(calls)]
    got["over_max_m"] = refused(lambda: kernel.fp8_gemm(
        torch.empty(17, 4096, dtype=fp8), b, sa(17), sb, i, torch.bfloat16))
    got["wrong_dtype"] = refused(lambda: kernel.fp8_gemm(
        torch.empty(5, 4096, dtype=torch.float8_e5m2), b, sa(5), sb, i, torch.bfloat16))
    got["calls"] = len(calls)
print("RESULT " + json.dumps(out))
"""


@needs_vllm
def test_the_fp8_op_checks_a_layers_weight_at_load_and_nothing_per_call(tmp_path):
    """The body of ``cached::fp8_gemm`` in vLLM's environment, on plans of each scale scheme
    from a real daemon (kernels that record their launch; CPU tensors): a layer's weight
    the plan cannot run is refused at its load (``check_weight``), naming the layer; a call
    runs the plan with no per-call argument checks (the checks refuse CPU tensors, and the
    call launches); an activation of another dtype, or M above the plan's max_m, takes the
    checked path and is refused with a ValueError, launching nothing."""
    d = DaemonProcess(tmp_path, workers=0)
    try:
        proc = subprocess.run([str(VLLM_PYTHON), "-c", FP8_OP, d.socket], capture_output=True,
                              text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "client")})
    finally:
        d.stop()
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-3000:]
    for scales, got in json.loads(line[-1][7:]).items():
        assert got["load_refuses"].startswith(
            f"cached: FP8 layer of N=4096 K=4096 ({scales} scales): the plan for N=4096 "
            "K=4096 runs a (4096, 4096) torch.float8_e4m3fn weight, got (4096, 4096) "
            "torch.float8_e5m2"), got
        assert got["ran"] == [[5, 4096], "torch.bfloat16", 1], got
        assert "must be a CUDA tensor" in got["over_max_m"], got
        assert "float8_e4m3fn or both float8_e5m2, got float8_e5m2 and float8_e4m3fn" \
            in got["wrong_dtype"], got
        assert got["calls"] == 1, got
