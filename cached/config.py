"""The daemon's configuration: defaults, a TOML file, environment variables and flags.

Precedence, highest first: a command-line flag, an environment variable (``CACHED_*``),
the TOML file, the built-in default. The file is ``--config FILE``, else
``$CACHED_CONFIG``, else ``/etc/cached/cached.toml`` when it exists. ``cached config``
prints every value with where it came from. On SIGHUP the daemon reads the file again
and applies the values marked reloadable (flags and environment still win).

File keys are the option names below (``max_bytes`` or ``max-bytes``); unknown keys are
an error, so a typo does not silently leave a default in force.
"""

from __future__ import annotations

import argparse
import os
import re
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYSTEM_CONFIG = Path("/etc/cached/cached.toml")


class ConfigError(ValueError):
    """A value that cannot be used, with the place it came from."""


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``500M``, ``20GiB``, ``1.5G``; 0 = no limit."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"a size cannot be negative: {value}")
        return value
    text = str(value).strip().lower().replace(" ", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)([kmgt]?)(i?b?)", text)
    if not match:
        raise ConfigError(f"expected a size such as 500M or 20GiB, got {value!r}")
    number, unit, _ = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit or " "))


def _int_or_auto(value: Any) -> int | None:
    if value in (None, "", "auto", 0, "0"):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected a positive integer or 'auto', got {value!r}") from None
    if number < 1:
        raise ConfigError(f"expected a positive integer or 'auto', got {value!r}")
    return number


def _nonneg_int(value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected an integer, got {value!r}") from None
    if number < 0 or isinstance(value, bool):
        raise ConfigError(f"expected a non-negative integer, got {value!r}")
    return number


def _seconds(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"expected seconds, got {value!r}") from None
    if number < 0:
        raise ConfigError(f"expected non-negative seconds, got {value!r}")
    return number


def _mode(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value), 8)
    except ValueError:
        raise ConfigError(f"expected an octal file mode such as 0660, got {value!r}") from None


def _http(value: Any) -> str:
    text = str(value).strip()
    if text.lower() in ("", "off", "none", "false"):
        return "off"
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"expected HOST:PORT or 'off', got {value!r}")
    return text


def _ids(value: Any) -> list[int]:
    items = value if isinstance(value, list) else str(value).replace(",", " ").split()
    try:
        return [int(v) for v in items]
    except (TypeError, ValueError):
        raise ConfigError(f"expected a list of numeric ids, got {value!r}") from None


def _level(value: Any) -> str:
    text = str(value).lower()
    if text not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"log level must be debug, info, warning or error, got {value!r}")
    return text


def _optional(value: Any) -> str | None:
    text = "" if value is None else str(value).strip()
    return text or None


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected true or false, got {value!r}")


def _default_socket() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "cached" if runtime else Path(f"/tmp/cached-{os.getuid()}")
    return str(base / "cached.sock")


def _default_store() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return str(Path(base) / "cached")


@dataclass(frozen=True)
class Option:
    name: str
    parse: Callable[[Any], Any]
    default: Callable[[], Any]
    flags: tuple[str, ...]
    reloadable: bool
    help: str

    @property
    def env(self) -> str:
        return "CACHED_" + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("socket", str, _default_socket, ("--socket",), False,
           "Unix socket path (ignored under socket activation)"),
    Option("store", str, _default_store, ("--store",), False, "store directory"),
    Option("http", _http, lambda: "127.0.0.1:8377", ("--http", "--no-http"), False,
           "HOST:PORT of the HTTP endpoint, or off"),
    Option("workers", _int_or_auto, lambda: None, ("--workers",), False,
           "compile workers (auto: from cores and memory)"),
    Option("job_timeout", _seconds, lambda: 300.0, ("--job-timeout",), True,
           "seconds one compilation may take"),
    Option("log_level", _level, lambda: "info", ("--log-level",), True, "log level"),
    Option("socket_mode", _mode, lambda: 0o660, ("--socket-mode",), False,
           "file mode of the socket the daemon creates"),
    Option("max_bytes", parse_size, lambda: 0, ("--max-bytes",), True,
           "store budget in bytes (0: unlimited); LRU eviction keeps it"),
    Option("max_files", _nonneg_int, lambda: 0, ("--max-files",), True,
           "store budget in blob files, two per entry (0: unlimited)"),
    Option("evict_grace", _seconds, lambda: 30.0, ("--evict-grace",), True,
           "an entry served or stored within this many seconds is never evicted"),
    Option("drain_timeout", _seconds, lambda: 30.0, ("--drain-timeout",), True,
           "on SIGTERM, seconds to let running compilations finish"),
    Option("allow_uid", _ids, list, ("--allow-uid",), True, "uids allowed to connect"),
    Option("allow_gid", _ids, list, ("--allow-gid",), True, "gids allowed to connect"),
    Option("publish_uid", _ids, list, ("--publish-uid",), True,
           "uids allowed to publish and run gc (default: root and the daemon's uid)"),
    Option("publish_gid", _ids, list, ("--publish-gid",), True, "gids allowed to publish"),
    # The fleet tier (cached/remote.py, docs/fleet.md).
    Option("remote", _optional, lambda: None, ("--remote",), False,
           "fleet tier: redis://HOST:PORT/DB, rediss://..., redis+cluster://HOST:PORT"),
    Option("remote_signing_key", _optional, lambda: None, ("--remote-signing-key",), False,
           "Ed25519 private key (PEM) that signs what this node publishes"),
    Option("remote_verify_keys", _optional, lambda: None, ("--remote-verify-keys",), False,
           "the fleet's Ed25519 public keys (PEM or base64 lines) entries must verify against"),
    Option("remote_read_only", _bool, lambda: False, ("--remote-read-only",), False,
           "fetch from the fleet tier but never publish to it (GPU nodes)"),
    Option("remote_timeout", _seconds, lambda: 2.0, ("--remote-timeout",), False,
           "seconds per Redis operation before the tier counts as down"),
)
BY_NAME = {o.name: o for o in OPTIONS}


def config_path(flag_value: str | None) -> tuple[Path | None, str]:
    """The TOML file to read and why: the flag, $CACHED_CONFIG or the system file."""
    if flag_value:
        return Path(flag_value), "flag --config"
    if os.environ.get("CACHED_CONFIG"):
        return Path(os.environ["CACHED_CONFIG"]), "env CACHED_CONFIG"
    if SYSTEM_CONFIG.exists():
        return SYSTEM_CONFIG, "default path"
    return None, "none"


def read_file(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in BY_NAME:
            raise ConfigError(f"{path}: unknown key {key!r}; known: {', '.join(BY_NAME)}")
        out[name] = value
    return out


def explicit_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """Option names given on the command line (compared by flag spelling, so a flag
    given with its default value still counts as given)."""
    given = set()
    tokens = [t.split("=", 1)[0] for t in argv if t.startswith("--")]
    for option in OPTIONS:
        if any(flag in tokens for flag in option.flags):
            given.add(option.name)
    return given


def _flag_value(name: str, args: argparse.Namespace) -> Any:
    if name == "http":
        if getattr(args, "no_http", False):
            return "off"
        host, port = args.http
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if name == "store":
        return str(args.store)
    return getattr(args, name)


@dataclass
class Effective:
    values: dict[str, Any]
    sources: dict[str, str]
    file: Path | None
    file_source: str

    def as_rows(self) -> list[dict]:
        return [{"name": o.name, "value": self.values[o.name], "source": self.sources[o.name],
                 "reloadable": o.reloadable} for o in OPTIONS]


def resolve(args: argparse.Namespace | None = None, given: set[str] | None = None,
            config_flag: str | None = None) -> Effective:
    """The effective configuration: flags in ``given`` (read from ``args``), then the
    environment, then the file, then defaults."""
    given = given or set()
    path, why = config_path(config_flag)
    file_values = read_file(path)
    values, sources = {}, {}
    for option in OPTIONS:
        if option.name in given and args is not None:
            raw, source = _flag_value(option.name, args), f"flag {option.flags[0]}"
        elif option.env in os.environ:
            raw, source = os.environ[option.env], f"env {option.env}"
        elif option.name in file_values:
            raw, source = file_values[option.name], f"file {path}"
        else:
            raw, source = option.default(), "default"
        try:
            values[option.name] = option.parse(raw)
        except ConfigError as exc:
            raise ConfigError(f"{option.name} ({source}): {exc}") from None
        sources[option.name] = source
    return Effective(values, sources, path, why)


def apply(effective: Effective, args: argparse.Namespace) -> None:
    """Write the effective values onto a ``cached serve`` namespace."""
    v = effective.values
    args.socket, args.store = v["socket"], Path(v["store"])
    if v["http"] == "off":
        args.no_http = True
    else:
        host, _, port = v["http"].rpartition(":")
        args.no_http, args.http = False, (host.strip("[]"), int(port))
    for name in ("workers", "job_timeout", "log_level", "socket_mode", "max_bytes",
                 "max_files", "evict_grace", "drain_timeout", "allow_uid", "allow_gid",
                 "publish_uid", "publish_gid", "remote", "remote_signing_key",
                 "remote_verify_keys", "remote_read_only", "remote_timeout"):
        setattr(args, name, v[name])


def format_table(effective: Effective) -> str:
    lines = [f"config file: {effective.file or '(none)'} ({effective.file_source})"]
    for row in effective.as_rows():
        value = row["value"]
        if row["name"] == "socket_mode":
            value = f"0{value:o}"
        elif value is None:
            value = "auto"
        mark = "" if row["reloadable"] else "  (restart to change)"
        lines.append(f"{row['name']:<14} {str(value):<40} {row['source']}{mark}")
    return "\n".join(lines)
