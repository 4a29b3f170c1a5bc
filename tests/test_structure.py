"""The shape of the code: imports read one way, the wire surface and the settings are each
defined once, and the documents list exactly what the code has."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cached_client import BadReply, Client
from cached_client import protocol as p
from cached_client.errors import ERROR_CODES, InternalError
from conftest import ROOT, serve_once

from cached import config
from cached.server import Access, Server
from cached.stats import Stats

PACKAGES = {"cached": ROOT / "cached", "cached_client": ROOT / "client" / "cached_client"}


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every project module ``name`` imports, at its top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
            prefix = ".".join(base + [node.module] if node.module else base) \
                if node.level else node.module or ""
            # ``from pkg import mod`` imports the submodule; ``from mod import name``, mod
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in modules else prefix
                       for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_cycles_and_the_client_never_imports_the_daemon():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 40 and graph["cached.daemon"], "the walk found the project"
    leaks = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.startswith("cached_client")
                   for t in targets if t.split(".")[0] == "cached")
    assert not leaks
    # a module on a cycle reaches itself
    for start in graph:
        seen, stack = set(), list(graph[start])
        while stack:
            node = stack.pop()
            assert node != start, f"import cycle through {start}"
            if node not in seen:
                seen.add(node)
                stack.extend(graph[node])


# The client's integrations (FlashInfer, vLLM, the JIT hooks): the modules that know a
# framework, all under cached_client.integrations. The core (the rest of cached_client, the
# GEMM plans and kernels of cached_client.gemm among them) and the daemon never import them;
# they import the core. flashinfer_names and flashinfer_sources are framework-free data the
# core's identity reads, so they are core.
INTEGRATIONS = "cached_client.integrations"


def _is_integration(name: str) -> bool:
    return name == INTEGRATIONS or name.startswith(INTEGRATIONS + ".")


def _named(name: str, path: Path) -> set[str]:
    """Every absolute name ``name``'s imports spell (``from a import b``: a and a.b), at its
    top or inside a function, whether or not such a module exists."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                prefix = ".".join(base + [node.module] if node.module else base)
            else:
                prefix = node.module or ""
            found.add(prefix)
            found.update(f"{prefix}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    return {name: _named(name, path) for name, path in _modules().items()}


def test_the_client_core_never_imports_an_integration():
    graph = _graph()
    integrations = {m for m in graph if _is_integration(m)}
    assert {f"{INTEGRATIONS}.{m}" for m in (
        "flashinfer.cute_dsl", "jit.nvcc", "jit.humming", "jit.triton", "jit.hook",
        "jit.content", "vllm.plugin", "vllm.kernel", "vllm.state")} <= integrations, \
        "the integrations live in their package"
    assert "cached_client.keys" in graph["cached_client.gemm.plan"], "the walk read imports"
    core = [m for m in graph if m.split(".")[0] == "cached_client" and not _is_integration(m)]
    assert "cached_client.gemm.plan" in core and "cached_client.client" in core
    leaks = sorted(f"{m} -> {t}" for m in core for t in graph[m] if _is_integration(t))
    assert not leaks, f"the core imports an integration: {leaks}"


def test_the_daemon_never_imports_a_client_integration():
    graph = _graph()
    leaks = sorted(f"{m} -> {t}" for m, targets in graph.items() if m.split(".")[0] == "cached"
                   for t in targets if _is_integration(t))
    assert not leaks, f"the daemon imports a client integration: {leaks}"


def _doc_table(text: str, header: str) -> list[list[str]]:
    lines = text[text.index(header):].splitlines()[2:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_every_module_is_in_the_design_docs_module_table():
    """docs/design.md's module table names every module of both packages (cli/ as one)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("## Modules", 1)[1].split("\n## ", 1)[0]
    missing = []
    for root in PACKAGES.values():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            if path.name in ("__init__.py", "__main__.py") or rel.parts[0] == "cli":
                continue
            if not re.search(rf"(?<![\w.]){re.escape(path.stem)}\.py", table):
                missing.append(str(path.relative_to(ROOT)))
    assert "cli/" in table
    assert not missing, f"add to docs/design.md's module table: {missing}"


def _readme_layout() -> dict[str, dict[str, str]]:
    """{package: {folder inside it ("" for its root): the text README's Layout block gives
    that folder}}. A folder's text is its own line (first token ``name/``) and the lines
    indented deeper below it, up to its next sibling; the package's line starts at column 0
    (``client/cached_client/``, ``cached/``) and ends at the next line there."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    heads = {"client/cached_client/": "cached_client", "cached/": "cached"}
    out: dict[str, dict[str, str]] = {}
    package, stack = None, []  # stack: (indent, folder path inside the package)
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        token = line.split()[0]
        if indent == 0:
            package = heads.get(token)
            stack = [(-1, "")]
            if package:
                out[package] = {"": line[len(token):]}
            continue
        if package is None:
            continue
        while stack[-1][0] >= indent:
            stack.pop()
        if token.endswith("/"):
            path = f"{stack[-1][1]}{token}"
            stack.append((indent, path))
            line = line[indent + len(token):]
        folder = stack[-1][1]
        out[package][folder] = out[package].get(folder, "") + " " + line
    return out


def test_the_readme_layout_names_every_module_and_only_modules_that_exist():
    """README's Layout block names each module (``name.py``) in the text of the folder that
    holds it, and every ``name.py`` it names there exists; a package's ``__init__.py`` and
    ``__main__.py`` are the folder itself."""
    layout = _readme_layout()
    assert set(layout) == set(PACKAGES), "README's Layout has both packages' lines"
    missing, stale = [], []
    for package, root in PACKAGES.items():
        folders = layout[package]
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root)
            folder = "".join(f"{part}/" for part in rel.parts[:-1])
            if path.name in ("__init__.py", "__main__.py"):
                if folder and folder not in folders:
                    missing.append(f"{path.relative_to(ROOT)} (its folder {folder})")
                continue
            if not re.search(rf"(?<![\w./]){re.escape(path.name)}(?!\w)",
                             folders.get(folder, "")):
                missing.append(str(path.relative_to(ROOT)))
        for folder, words in folders.items():
            for name in re.findall(r"(?<![\w./])(\w+\.py)(?!\w)", words):
                if not (root / folder / name).is_file():
                    stale.append(f"{package}: {folder}{name}")
    assert not missing, f"add to README.md's Layout, in its folder's lines: {missing}"
    assert not stale, f"README.md's Layout names modules that do not exist: {stale}"


def test_benchmarks_doc_is_short_and_names_no_harness_path():
    """docs/benchmarks.md is the current figures (the history is docs/history.md): at most
    600 lines, and every command in it runs outside the project's GPU harness (no ``.dev/``
    bundle path); every raw log it links is in bench/results/, none in docs/."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 600, "move runs that are history to docs/history.md"
    assert ".dev/" not in text, "describe the bench script's public build/gpu modes instead"
    assert not (ROOT / "docs" / "results").exists() and "](results/" not in text, \
        "raw logs and JSON go to bench/results/ (linked as ../bench/results/NAME)"
    links = re.findall(r"\]\(\.\./(bench/results/[^)#\s]+)\)", text)
    assert links and all((ROOT / link).is_file() for link in links), \
        [link for link in links if not (ROOT / link).is_file()]


def test_protocol_doc_matches_the_op_table():
    doc = (ROOT / "docs" / "protocol.md").read_text()
    rows = {_names(r[0])[0]: r for r in _doc_table(doc, "| op | request fields |")}
    assert set(rows) == set(p.OPS)
    for name, op in p.OPS.items():
        request, reply, publish = rows[name][1], rows[name][2], rows[name][3]
        wire = [f.name for f in dataclasses.fields(op.request) if "check" in f.metadata]
        assert _names(request) == wire, name
        wire = [f.name for f in dataclasses.fields(op.reply) if "check" in f.metadata]
        assert _names(reply) == wire, name
        assert publish == ("yes" if op.publish else "no"), name
    codes = [_names(r[0])[0] for r in _doc_table(doc, "| code | when |")]
    assert sorted(codes) == sorted(ERROR_CODES)


def test_server_refuses_to_start_with_an_op_missing_or_unknown():
    handlers = {name: None for name in p.OPS}
    Server(dict(handlers), Access(), Stats())  # complete: accepted
    del handlers["verify"]
    with pytest.raises(InternalError, match="verify"):
        Server(dict(handlers), Access(), Stats())
    with pytest.raises(InternalError, match="bogus"):
        Server({**{name: None for name in p.OPS}, "bogus": None}, Access(), Stats())


def test_requests_are_checked_field_by_field_with_the_field_named():
    from cached_client.errors import InvalidArgument

    ok = p.GetRequest.from_wire({"request": {"family": "f", "params": {}, "arch": "sm_90a",
                                             "sm_count": 132, "max_active_clusters": 132}})
    assert ok.deadline_ms == 60_000 and ok.priority == "interactive"
    for field, value in (("priority", ["x"]), ("deadline_ms", float("nan")),
                         ("deadline_ms", 1e300), ("transfer", "carrier pigeon"),
                         ("deadline_ms", True)):
        with pytest.raises(InvalidArgument, match=field):
            p.GetRequest.from_wire({**ok.to_wire(), field: value})
    with pytest.raises(InvalidArgument, match="request"):
        p.GetRequest.from_wire({})


@pytest.mark.parametrize("reply_for, why", [
    (lambda m: {"ok": True, "id": m["id"]}, "does not follow the protocol"),
    (lambda m: {"ok": True, "id": m["id"], "v": "one", "ops": []}, "v must be"),
    (lambda m: {"ok": True, "id": m["id"] + 1, "v": 1, "ops": []}, "answered request"),
])
def test_a_malformed_or_mismatched_reply_is_a_typed_error(tmp_path, reply_for, why):
    path = str(tmp_path / "not-a-daemon.sock")
    thread = serve_once(path, reply_for)
    with pytest.raises(BadReply, match=why):
        Client(path, timeout=5, fallback=False).hello()
    thread.join(5)


def test_every_option_has_a_flag_an_environment_variable_a_file_key_and_a_row_here(tmp_path):
    settings_fields = [f.name for f in dataclasses.fields(config.Settings)
                       if f.name not in ("sources", "file", "file_source")]
    assert settings_fields == [o.name for o in config.OPTIONS]
    help_text = subprocess.run([sys.executable, "-m", "cached", "serve", "--help"],
                               capture_output=True, text=True, check=True).stdout
    ops_doc = (ROOT / "docs" / "operations.md").read_text()
    rows = {_names(r[0])[0]: r for r in _doc_table(ops_doc, "| option (file key) |")}
    samples = {"value": None, "list": "7", "switch": "true"}
    for option in config.OPTIONS:
        assert option.flag in help_text, option.name
        assert option.name in rows, f"docs/operations.md has no row for {option.name}"
        assert option.flag in rows[option.name][1] and option.env in rows[option.name][2]
        # the environment variable and the file key reach the setting, and say so
        raw = samples[option.kind] or {"http": "127.0.0.1:9", "socket_mode": "600",
                                       "log_level": "debug", "workers": "3"}.get(option.name,
                                                                                 "5")
        env = {option.env: raw}
        try:
            from_env = _resolve_with(env, None)
        except config.ConfigError:
            continue  # a value this sample does not fit (a path option takes any text)
        assert from_env.sources[option.name] == f"env {option.env}"
        toml = tmp_path / f"{option.name}.toml"
        key = option.name.replace("_", "-")
        toml.write_text(f"{key} = {raw!r}\n".replace("'", '"'))
        from_file = _resolve_with({}, str(toml))
        assert from_file.sources[option.name] == f"file {toml}"
        assert getattr(from_file, option.name) == getattr(from_env, option.name)


def _resolve_with(env: dict, config_file: str | None) -> config.Settings:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("CACHED_")}
    os.environ.update(env)
    try:
        return config.resolve({}, config_file)
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update(saved)


@pytest.mark.parametrize("flag, value, message", [
    ("--job-timeout", "nan", "job_timeout"), ("--job-timeout", "inf", "job_timeout"),
    ("--workers", "1.5", "workers"), ("--workers", "1000", "workers"),
    ("--socket-mode", "777777", "socket_mode"), ("--http", "127.0.0.1:99999", "http"),
])
def test_unusable_settings_are_refused_with_the_option_named(flag, value, message):
    out = subprocess.run([sys.executable, "-m", "cached", "config", flag, value],
                         capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
