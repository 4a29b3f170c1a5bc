"""A hostile daemon for the client's trust tests: a real process speaking the protocol on a
Unix socket (run it as any uid: ``python fake_daemon.py CONFIG.json``; stdlib and
cached_client.protocol only).

CONFIG: ``socket`` (its directory is created when missing, as this process's uid),
``log`` (one JSON line per request received: op, transfer), ``capabilities`` (what its
hello states), ``library`` (the file served as a ``get``'s object and library, by path or
as descriptors; ``by_tag``: another file for the requests whose ``tag`` param it names),
``runtime_path`` (the runtime library it names), ``override`` (artifact fields to
replace; a null value leaves the field out, as an older daemon would). Every
``get`` is answered with an artifact that echoes the request and the identity it states,
as a daemon built for that environment would, unless overridden. It writes ``ready`` next
to the log once it listens, and serves until killed.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import threading

from cached_client import protocol as p


def library(request: dict, config: dict) -> str:
    """The file served for ``request``: ``by_tag`` names one per request tag."""
    tag = (request.get("request") or {}).get("params", {}).get("tag")
    return config.get("by_tag", {}).get(str(tag), config["library"])


def artifact(request: dict, config: dict) -> dict:
    kernel = request["request"]
    identity = request.get("identity") or {}
    sha = hashlib.sha256(open(library(request, config), "rb").read()).hexdigest()
    size = os.path.getsize(library(request, config))
    out = {"key": "f" * 64, "family": kernel["family"], "kernel_name": "planted",
           "symbol": config.get("symbol", "planted"), "library_sha256": sha,
           "object_sha256": sha, "library_size": size, "object_size": size,
           "toolchain": identity.get("toolchain", ""),
           "source_sha256": (identity.get("sources") or {}).get(kernel["family"], ""),
           "runtime_library": {"name": "libcute_dsl_runtime.so",
                               "path": config.get("runtime_path")},
           "runtime": identity.get("runtime") or {}, "arch": kernel["arch"],
           "sm_count": kernel["sm_count"], "max_active_clusters": kernel["max_active_clusters"],
           "origin": "hit"}
    for name, value in config.get("override", {}).items():
        if value is None:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def serve(conn: socket.socket, config: dict) -> None:
    with conn:
        while True:
            header = conn.recv(4, socket.MSG_WAITALL)
            if len(header) < 4:
                return
            request = p.decode_body(conn.recv(p.frame_length(header, 1 << 20),
                                              socket.MSG_WAITALL))
            with open(config["log"], "a") as log:
                log.write(json.dumps({"op": request.get("op"),
                                      "transfer": request.get("transfer")}) + "\n")
            reply: dict = {"id": request.get("id"), "ok": True}
            fds: list[int] = []
            if request.get("op") == "hello":
                reply |= {"v": 1, "ops": sorted(p.OPS), "capabilities": config["capabilities"]}
            elif request.get("op") == "get":
                reply["artifact"] = artifact(request, config)
                if request.get("transfer") == "fd":
                    fds = [os.open(library(request, config), os.O_RDONLY) for _ in range(2)]
                    reply["fds"] = ["object", "library"]
                else:
                    reply["artifact"]["library_path"] = library(request, config)
                    reply["artifact"]["object_path"] = library(request, config)
            elif request.get("op") == "lease":
                reply |= {"state": "hit", "artifact": artifact(request, config)}
            elif request.get("op") == "stats":
                reply["stats"] = {"planted": True}
            else:
                reply = {"id": request.get("id"), "ok": True}
            frame = p.encode_frame(reply)
            if fds:
                socket.send_fds(conn, [frame[:1]], fds)
                conn.sendall(frame[1:])
                for fd in fds:
                    os.close(fd)
            else:
                conn.sendall(frame)


def main() -> None:
    config = json.load(open(sys.argv[1]))
    path = config["socket"]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(16)
    open(os.path.join(os.path.dirname(config["log"]), "ready"), "w").close()
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn, config), daemon=True).start()


if __name__ == "__main__":
    main()
