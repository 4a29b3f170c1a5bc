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
    return _package_modules(PACKAGES)



def _imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a ``from ... import`` in ``package`` names."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join(base + [node.module] if node.module else base)

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
            prefix = _imported_from(node, package)
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


# -- the rules of the code's shape: rooms, types, sizes ---------------------------------
#
# Each rule is a checker over files (so a synthetic module in tmp_path can plant a
# violation) and a test running it over both packages.

ROOMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("the client's core", ("cached_client",)),
    ("the client's GEMM layer", ("cached_client.gemm",)),
    ("the client's integrations", ("cached_client.integrations",)),
    ("the client's command", ("cached_client.__main__",)),
    ("the daemon's base", ("=cached", "=cached.node", "=cached.toolchain", "=cached.tools",
                           "cached.config", "cached.log", "cached.stats", "cached.node.sizing",
                           "cached.node.systemd", "cached.toolchain.trust",
                           "cached.toolchain.compiler_stack")),
    ("families and toolchains", ("cached.families", "cached.toolchain.toolchains",
                                 "cached.toolchain.identity")),
    ("the store", ("cached.store",)),
    ("the fleet tier", ("cached.fleet",)),
    ("the request spine", ("cached.build", "cached.worker", "cached.pool", "cached.artifacts",
                           "cached.scheduler", "cached.peers", "cached.frames",
                           "cached.connection", "cached.server")),
    ("the views", ("cached.view",)),
    ("the ops", ("cached.service", "cached.ops")),
    ("wiring", ("cached.daemon", "cached.node.lifecycle", "cached.node.listeners",
                "cached.node.healthcheck")),
    ("operator tools", ("cached.tools", "cached.cli", "=cached.__main__")),
)
"""The rooms of the code, lowest first: a module imports only from its own room or a room
listed before it (at its top, inside a function, or for type checking alike). A name is a
package (it and what is under it) unless ``=`` makes it that one module; a module is in
the room of its longest matching name."""

MAX_MODULE_LINES = 700
MAX_DOCSTRING_LINES = 40
LONG_MODULES_PENDING: dict[str, str] = {}
"""Modules allowed over the 700-line rule while a split is under way (none now)."""
ANY_PENDING: dict[str, str] = {}
"""Modules allowed an ``Any`` for a project-owned type while they are typed (none now)."""


def room_of(module: str, rooms=ROOMS) -> int | None:
    """The rank of ``module``'s room in ``rooms`` (None: in none)."""
    best, rank = -1, None
    for i, (_, names) in enumerate(rooms):
        for spec in names:
            name = spec.lstrip("=")
            if module == name or (not spec.startswith("=") and module.startswith(name + ".")):
                if len(name) > best:
                    best, rank = len(name), i
    return rank


def upward_imports(graph: dict[str, set[str]], rooms=ROOMS) -> list[str]:
    """``importer -> imported`` for every import into a later room, and every module in no
    room."""
    out = [f"{m}: in no room (add it to ROOMS)" for m in sorted(graph)
           if room_of(m, rooms) is None]
    for m, targets in sorted(graph.items()):
        mine = room_of(m, rooms)
        for t in sorted(targets):
            theirs = room_of(t, rooms)
            if mine is not None and theirs is not None and theirs > mine:
                out.append(f"{m} ({rooms[mine][0]}) -> {t} ({rooms[theirs][0]})")
    return out


def _package_modules(packages: dict[str, Path]) -> dict[str, Path]:
    out = {}
    for package, root in packages.items():
        for path in root.rglob("*.py"):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _bound_modules(name: str, path: Path, tree: ast.AST, modules: dict[str, Path]
                   ) -> dict[str, str]:
    """{local name: project module} for every project module ``tree`` imports as a name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    bound[a.asname or a.name.split(".")[0]] = (a.name if a.asname
                                                               else a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            prefix = _imported_from(node, package)
            for a in node.names:
                if f"{prefix}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{prefix}.{a.name}"
    return bound


def private_imports(modules: dict[str, Path]) -> list[str]:
    """Every private name (``_x``, not a dunder) one project module takes from another:
    ``from mod import _x``, or ``mod._x`` on a project module it imported."""
    out = []
    for name, path in sorted(modules.items()):
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    prefix = ".".join(base + [node.module] if node.module else base)
                else:
                    prefix = node.module or ""
                if prefix not in modules or prefix == name:
                    continue
                out += [f"{name}: from {prefix} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
        bound = _bound_modules(name, path, tree, modules)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and bound.get(node.value.id, name) != name):
                out.append(f"{name}:{node.lineno}: {bound[node.value.id]}.{node.attr}")
    return out


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def any_for_project_types(modules: dict[str, Path], own: dict[str, set[str]]) -> list[str]:
    """Every parameter of a public function annotated ``Any`` (or ``Any | None``) whose name
    is a project class's (``client`` for ``Client``, ``store`` for ``Store``): the class
    the package owns is its type. ``own`` maps a top package to the packages whose classes
    its modules can name (the client's never the daemon's)."""
    classes: dict[str, set[str]] = {}
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                classes.setdefault(name.split(".")[0], set()).add(_snake(node.name))
    out = []
    for name, tree in sorted(trees.items()):
        names = set().union(*(classes.get(top, set()) for top in own[name.split(".")[0]]))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    or node.name.startswith("_") and not node.name.startswith("__"):
                continue
            for arg in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs):
                if (arg.annotation is not None and arg.arg in names
                        and ast.unparse(arg.annotation) in ("Any", "Any | None",
                                                            "Optional[Any]")):
                    out.append(f"{name}: {node.name}({arg.arg}: Any)")
    return out


def long_modules(paths: list[Path], limit: int = MAX_MODULE_LINES) -> list[str]:
    return [f"{path}: {n} lines" for path in paths
            if (n := len(path.read_text().splitlines())) > limit]


def long_docstrings(paths: list[Path], limit: int = MAX_DOCSTRING_LINES) -> list[str]:
    """Every module, class or function docstring over ``limit`` lines."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False)
            if doc is not None and len(doc.splitlines()) > limit:
                out.append(f"{path}: {getattr(node, 'name', '<module>')}: "
                           f"{len(doc.splitlines())} lines")
    return out


OWN = {"cached_client": {"cached_client"}, "cached": {"cached", "cached_client"}}
"""Whose classes a package's signatures can name: the client never the daemon's."""


def test_no_module_imports_from_a_later_room():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert room_of("cached.stats") < room_of("cached.view.snapshot") < room_of("cached.daemon")
    assert room_of("cached.scheduler") < room_of("cached.view.snapshot"), \
        "the views read the spine; the counters are below both"
    assert not upward_imports(graph)


def test_no_private_name_is_imported_across_modules():
    modules = _modules()
    assert "cached.store.store" in modules
    assert not private_imports(modules)


def test_no_public_signature_takes_any_for_a_type_the_project_owns():
    modules = _modules()
    pending = {name for name, path in modules.items()
               if str(path.relative_to(ROOT)) in ANY_PENDING}
    assert len(pending) == len(ANY_PENDING), "every pending entry names a module"
    assert not [f for f in any_for_project_types(modules, OWN)
                if f.split(":")[0] not in pending]


def test_no_module_is_over_700_lines():
    paths = [p for root in PACKAGES.values() for p in root.rglob("*.py")]
    over = [line for line in long_modules(paths)
            if line.split(":")[0] not in {str(ROOT / k) for k in LONG_MODULES_PENDING}]
    assert not over, "split it along its seams"


def test_no_docstring_is_over_40_lines():
    paths = [p for root in PACKAGES.values() for p in root.rglob("*.py")]
    assert not long_docstrings(paths), "an essay belongs in docs/; keep the invariants"


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return _package_modules({"pkg": root})


def test_each_rule_fails_on_a_planted_violation(tmp_path):
    modules = _plant(tmp_path, {
        "low.py": '"""Low."""\nfrom pkg import high\n\n\ndef f() -> int:\n    return high._x\n',
        "high.py": ('"""High."""\nfrom typing import Any\n\n_x = 1\n\n\nclass Store:\n'
                    '    pass\n\n\ndef keep(store: Any) -> None:\n    pass\n'),
        "thief.py": "from pkg.high import _x\n",
        "big.py": "x = 1\n" * (MAX_MODULE_LINES + 1),
        "essay.py": '"""' + "line\n" * MAX_DOCSTRING_LINES + 'one too many."""\n',
        "fine.py": ('"""Fine."""\nfrom pkg import high\nfrom pkg.high import Store\n\n\n'
                    'def keep(store: Store, other: object) -> object:\n    return high.Store\n'),
    })
    graph = {n: _imports(n, p, modules) for n, p in modules.items()}
    rooms = (("low", ("=pkg", "pkg.low", "pkg.big", "pkg.essay")),
             ("high", ("pkg.high", "pkg.fine", "pkg.thief")))
    assert upward_imports(graph, rooms) == ["pkg.low (low) -> pkg.high (high)"]
    assert upward_imports(graph, rooms[:1])[0] == "pkg.fine: in no room (add it to ROOMS)"
    assert not upward_imports({"pkg.fine": {"pkg.high"}}, rooms)
    assert sorted(private_imports(modules)) == ["pkg.low:6: pkg.high._x",
                                                "pkg.thief: from pkg.high import _x"]
    assert any_for_project_types(modules, {"pkg": {"pkg"}}) == ["pkg.high: keep(store: Any)"]
    assert not any_for_project_types(modules, {"pkg": set()}), "only the package's own types"
    paths = sorted(modules.values())
    assert long_modules(paths) == [f"{modules['pkg.big']}: {MAX_MODULE_LINES + 1} lines"]
    assert long_docstrings(paths) == [f"{modules['pkg.essay']}: <module>: "
                                      f"{MAX_DOCSTRING_LINES + 1} lines"]


def test_the_fp8_familys_digest_covers_every_module_its_kernel_is_built_from():
    """hopper_fp8's SOURCES (what its artifact keys hash) are exactly the modules compile.py
    reaches through the family's own package (kernel.py and its halves, tactic.py), so a
    module split out of the kernel is in every key; a file missing from it changes it."""
    from cached.families.hopper_fp8 import family
    from cached.toolchain import compiler_stack

    here = ROOT / "cached" / "families" / "hopper_fp8"
    modules = _modules()
    prefix = "cached.families.hopper_fp8."
    reached, todo = set(), [prefix + "compile"]
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        todo += [t for t in _imports(name, modules[name], modules) if t.startswith(prefix)]
    assert {prefix + "kernel", prefix + "mainloop", prefix + "epilogue"} <= reached
    assert sorted(f"{m[len(prefix):]}.py" for m in reached) == sorted(family.SOURCES)
    digest = compiler_stack.hash_files(tuple(here / n for n in family.SOURCES))
    assert family.HopperFp8().source_sha256() == digest
    assert compiler_stack.hash_files(tuple(here / n for n in family.SOURCES
                                           if n != "mainloop.py")) != digest
