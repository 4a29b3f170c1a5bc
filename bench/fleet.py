"""Fleet tier: time to warm a fresh node from Redis against compiling locally.

One model's GEMMs (Llama-3.1-8B, NVFP4 ``flashinfer.mm_fp4`` on sm_100a, M=256: q/k/v,
o, gate/up and down projections) are warmed twice, each on a fresh store:

1. a build node (compile farm: ``cached serve --remote``) runs ``cached warm`` and so
   compiles every kernel and publishes it to a local ``redis-server``;
2. a fresh GPU-style node (``--remote-read-only``, public key only) runs the same
   ``cached warm`` and pulls every kernel from the tier (zero compilations).

It also reports what the tier stores: raw and stored bytes per artifact (zlib, when it
pays), and Redis's ``used_memory`` growth per artifact. Needs ``redis-server``.
Usage: python bench/fleet.py [--limit N] [--workers W]   (N=0: all 240)
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from cached_client import Client
from common import save

# Llama-3.1-8B: hidden 4096, 32 query and 8 KV heads of 128, intermediate 14336.
LLAMA_3_1_8B = {"qkv_proj": (256, 6144, 4096), "o_proj": (256, 4096, 4096),
                "gate_up_proj": (256, 28672, 4096), "down_proj": (256, 4096, 14336)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, workdir: Path, name: str, flags: list[str], workers: int) -> None:
        self.socket = str(workdir / f"{name}.sock")
        self.log = open(workdir / f"{name}.log", "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cached", "serve", "--store", str(workdir / name),
             "--socket", self.socket, "--no-http", "--workers", str(workers), *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            try:
                stats = Client(self.socket, timeout=5).stats()
                if stats["workers_ready"] == stats["workers"]:
                    break
            except Exception:  # noqa: BLE001 -- not up yet
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{name} exited") from None
            time.sleep(0.1)
        self.ready_s = time.monotonic() - self.started

    def stats(self) -> dict:
        return Client(self.socket, timeout=10).stats()

    def warm(self, limit: int) -> dict:
        args = [sys.executable, "-m", "cached", "warm", "--socket", self.socket, "--family",
                "flashinfer.mm_fp4", "--arch", "sm_100a", "--json"]
        for shape in LLAMA_3_1_8B.values():
            args += ["--shape", ",".join(map(str, shape))]
        if limit:
            args += ["--limit", str(limit)]
        started = time.monotonic()
        out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        result["wall_s"] = round(time.monotonic() - started, 3)
        return result

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        self.log.close()


def write_key_pair(workdir: Path) -> tuple[Path, Path]:
    """A fleet Ed25519 pair: the private key for the build node, the public for the GPU node."""
    from cryptography.hazmat.primitives import serialization as ser
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    key, pub = workdir / "fleet.key", workdir / "fleet.pub"
    key.write_bytes(private.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8,
                                          ser.NoEncryption()))
    pub.write_bytes(private.public_key().public_bytes(ser.Encoding.PEM,
                                                      ser.PublicFormat.SubjectPublicKeyInfo))
    return key, pub


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=60,
                        help="first N kernels of the model's manifest (0: all 240)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is missing: make setup installs it")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        port = free_port()
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL)
        r = redis.Redis(port=port)
        while True:
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        key, pub = write_key_pair(workdir)
        url = f"redis://127.0.0.1:{port}/0"
        tier = ["--remote", url]
        memory_before = r.info("memory")["used_memory"]
        try:
            build = Node(workdir, "build", [*tier, "--remote-signing-key", str(key)],
                         args.workers)
            compiled = build.warm(args.limit)
            started = time.monotonic()
            while (s := build.stats())["remote"]["publish_queue"] or s["in_flight"]:
                time.sleep(0.05)
            drain_s = time.monotonic() - started
            build_stats = build.stats()
            build.stop()

            fresh = Node(workdir, "gpu", [*tier, "--remote-read-only", "--remote-verify-keys",
                                          str(pub)], args.workers)
            pulled = fresh.warm(args.limit)
            fresh_stats = fresh.stats()
            fresh.stop()
        finally:
            memory_after = r.info("memory")["used_memory"]
            server.kill()
            server.wait()
    n = compiled["compiled"]
    published = build_stats["remote"]
    raw = build_stats["bytes"]
    result = {
        "model": "Llama-3.1-8B", "family": "flashinfer.mm_fp4", "arch": "sm_100a",
        "shapes": LLAMA_3_1_8B, "kernels": n, "workers": args.workers,
        "compile_locally": {"warm": compiled, "daemon_ready_s": round(build.ready_s, 2),
                            "compile_seconds_sum": build_stats["compile_seconds"],
                            "publish_drain_after_warm_s": round(drain_s, 3)},
        "warm_from_tier": {"warm": pulled, "daemon_ready_s": round(fresh.ready_s, 2),
                           "compiles": fresh_stats["compiles"],
                           "remote_hits": fresh_stats["remote_hits"],
                           "bytes_in": fresh_stats["remote"]["bytes_in"]},
        "speedup": round(compiled["wall_s"] / pulled["wall_s"], 1),
        "tier": {"published": published["published"], "raw_bytes": raw,
                 "stored_bytes": published["bytes_out"],
                 "compression_ratio": published["compression_ratio"],
                 "raw_bytes_per_kernel": round(raw / max(n, 1)),
                 "stored_bytes_per_kernel": round(published["bytes_out"] / max(n, 1)),
                 "redis_used_memory_growth": memory_after - memory_before,
                 "redis_bytes_per_kernel": round((memory_after - memory_before) / max(n, 1))},
    }
    save("fleet", result)


if __name__ == "__main__":
    main()
