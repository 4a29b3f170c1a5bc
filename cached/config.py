"""The daemon's settings: one table of options, one resolver, one frozen :class:`Settings`.

Every option is defined once, in :data:`OPTIONS`: its parser (which validates), default,
help, whether SIGHUP may change it, and from that its command-line flag (``--max-bytes``),
environment variable (``CACHED_MAX_BYTES``) and TOML key (``max_bytes`` or ``max-bytes``).
:func:`add_flags` generates ``cached serve``'s flags from the table and :func:`resolve`
returns the effective :class:`Settings` with where each value came from.

Precedence, highest first: a command-line flag, an environment variable, the TOML file,
the built-in default. The file is ``--config FILE``, else ``$CACHED_CONFIG``, else
``/etc/cached/cached.toml`` when it exists. Unknown file keys are an error, so a typo does
not silently leave a default in force. On SIGHUP the daemon resolves again and applies the
reloadable options that changed (:func:`changed`).

Bottom layer: imports nothing of the daemon (only the client's default paths).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from cached_client.paths import user_socket_path

SYSTEM_CONFIG = Path("/etc/cached/cached.toml")
MAX_WORKERS = 256
MAX_SECONDS = 7 * 24 * 3600.0


class ConfigError(ValueError):
    """A value that cannot be used, with the place it came from."""


# -- parsers: each takes a raw value (flag or env string, TOML value) and validates it ----


SIZE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
              "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
"""Size suffixes, lower case: decimal (``20G``, ``20GB``: 20*10^9 bytes) as ccache and disk
vendors count, binary with an ``i`` (``20Gi``, ``20GiB``: 20*2^30 bytes); a trailing ``B``
is optional."""
MAX_SIZE = 1 << 60


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``500MB``, ``20GiB``, ``1.5G`` (see
    :data:`SIZE_UNITS`: G is 10^9, GiB is 2^30); 0 means no limit."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if not 0 <= value <= MAX_SIZE:
            raise ConfigError(f"a size must be between 0 and {MAX_SIZE} bytes, got {value}")
        return value
    text = str(value).strip().lower().replace(" ", "")
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)([kmgt]?i?)b?", text)
    if not match or match.group(2) == "i":
        raise ConfigError(f"expected a size such as 500MB, 20GB (10^9 bytes each) or 20GiB "
                          f"(2^30 bytes each), got {value!r}")
    number, unit = match.groups()
    size = int(Decimal(number) * SIZE_UNITS[unit])
    if size > MAX_SIZE:
        raise ConfigError(f"a size must be at most {MAX_SIZE} bytes, got {value!r}")
    return size


def size_text(n: float) -> str:
    """Bytes as an operator reads them, the unit said: a whole number of decimal or binary
    units when ``n`` is one (``20 GB``, ``20 GiB``; the larger unit wins), else binary with
    one decimal (``55.8 MiB``)."""
    n = int(n)
    exact = [(n // size, unit) for unit, size in SIZE_UNITS.items()
             if unit and n >= size and n % size == 0]
    if exact:
        count, unit = min(exact)  # the fewest units: the largest unit that divides n
        return f"{count} {unit[0].upper() if unit != 'k' else 'k'}{unit[1:]}B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _integer(value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    text = str(value).strip()
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ConfigError(f"expected an integer, got {value!r}")
    return int(text)


def _workers(value: Any) -> int | None:
    if value in (None, "", "auto", 0, "0"):
        return None
    number = _integer(value)
    if not 1 <= number <= MAX_WORKERS:
        raise ConfigError(f"expected 1 to {MAX_WORKERS} workers or 'auto', got {value!r}")
    return number


def _count(value: Any) -> int:
    number = _integer(value)
    if number < 0:
        raise ConfigError(f"expected a non-negative integer, got {value!r}")
    return number


def _positive_count(value: Any) -> int:
    number = _integer(value)
    if not 1 <= number <= 1 << 31:
        raise ConfigError(f"expected a positive integer, got {value!r}")
    return number


def _seconds(value: Any) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        raise ConfigError(f"expected seconds, got {value!r}") from None
    if not 0 <= number <= MAX_SECONDS:  # also refuses NaN and infinities
        raise ConfigError(f"expected seconds between 0 and {MAX_SECONDS:.0f}, got {value!r}")
    return number


def _positive_seconds(value: Any) -> float:
    number = _seconds(value)
    if number <= 0:
        raise ConfigError(f"expected more than 0 seconds, got {value!r}")
    return number


def _mode(value: Any) -> int:
    try:
        mode = value if isinstance(value, int) and not isinstance(value, bool) else int(
            str(value), 8)
    except ValueError:
        raise ConfigError(f"expected an octal file mode such as 0660, got {value!r}") from None
    if not 0 <= mode <= 0o777:
        raise ConfigError(f"a socket mode is at most 0777 (no setuid, setgid or sticky bits), "
                          f"got {oct(mode)}")
    return mode


def _http(value: Any) -> str:
    text = str(value).strip()
    if text.lower() in ("", "off", "none", "false"):
        return "off"
    host, _, port = text.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"expected HOST:PORT (port 0-65535) or 'off', got {value!r}")
    return text


def _ids(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    ids = tuple(_integer(v) for v in items)
    if any(not 0 <= i < 1 << 32 for i in ids):
        raise ConfigError(f"expected numeric ids, got {value!r}")
    return ids


def _host_names(value: Any) -> tuple[str, ...]:
    """Host names (DNS names or IP literals, no port), lower case, without a trailing dot."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    names: list[str] = []
    for item in items:
        name = str(item).strip().lower().rstrip(".")
        bare = name[1:-1] if name.startswith("[") and name.endswith("]") else name
        try:
            ipaddress.ip_address(bare)
        except ValueError:
            if not name or len(name) > 253 or not all(
                    label and len(label) <= 63 and label.replace("-", "").replace("_", "")
                    .isalnum() and label.isascii() for label in name.split(".")):
                raise ConfigError(f"expected a host name (letters, digits, '-', '.'; no "
                                  f"port), got {item!r}") from None
        names.append(bare)
    return tuple(dict.fromkeys(names))


def _trust_groups(value: Any) -> tuple[tuple[int, ...], ...]:
    """Groups of uids whose written-back kernels are served to each other: a list of groups
    (each ``"1001,1002"`` or a list of uids), or one string of groups separated by ``;`` or
    spaces. Root is in none (what it writes back is served to every peer); a uid is in one
    group at most."""
    items = (value if isinstance(value, (list, tuple))
             else str(value).replace(";", " ").split())
    groups: list[tuple[int, ...]] = []
    for item in items:
        uids = _ids(item if isinstance(item, (list, tuple)) else str(item).split(","))
        if not uids:
            raise ConfigError(f"a trust group needs at least one uid, got {value!r}")
        if 0 in uids:
            raise ConfigError("uid 0 is in no trust group: what root writes back is served to "
                              "every peer, and root is served only what is trusted")
        groups.append(tuple(sorted(set(uids))))
    seen = [u for g in groups for u in g]
    twice = sorted({u for u in seen if seen.count(u) > 1})
    if twice:
        raise ConfigError(f"uid(s) {', '.join(map(str, twice))} in more than one trust group")
    return tuple(groups)


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


TOOLCHAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _toolchains(value: Any) -> tuple[tuple[str, str], ...]:
    """``NAME=PYTHON`` pairs (a list, or one string of them separated by commas or spaces):
    each an inference environment's interpreter the daemon compiles with."""
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    pairs = []
    for item in items:
        name, sep, python = str(item).partition("=")
        name, python = name.strip(), python.strip()
        if not sep or not TOOLCHAIN_NAME.match(name) or not python.startswith("/"):
            raise ConfigError(f"expected NAME=/absolute/path/to/python (NAME of letters, "
                              f"digits, '.', '_', '-'), got {str(item)[:200]!r}")
        pairs.append((name, python))
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise ConfigError(f"a toolchain name is given twice in {value!r}")
    return tuple(pairs)


def _path(value: Any) -> str:
    """An absolute path: a relative one is taken from the daemon's working directory now
    (compile workers run elsewhere, with the store's absolute path)."""
    text = str(value).strip()
    if not text:
        raise ConfigError("expected a path, got an empty string")
    return os.path.abspath(text)


def default_socket() -> str:
    """cached.sock in the runtime directory ($CACHED_SOCKET is this option's variable)."""
    return user_socket_path()


def default_store() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return str(Path(base) / "cached")


# -- the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One setting. ``kind``: ``value`` (one value), ``list`` (repeatable flag) or
    ``switch`` (a flag without a value that sets true)."""

    name: str
    parse: Callable[[Any], Any]
    default: Callable[[], Any]
    help: str
    reloadable: bool = False
    kind: str = "value"
    metavar: str | None = None
    aliases: tuple[tuple[str, Any], ...] = ()  # (flag, the value it stands for)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "CACHED_" + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option("socket", _path, default_socket,
           "Unix socket path (ignored under socket activation)", metavar="PATH"),
    Option("store", _path, default_store, "store directory (blobs and index)", metavar="DIR"),
    Option("http", _http, lambda: "127.0.0.1:8377",
           "HOST:PORT of the HTTP endpoint (port 0 picks one), or off", metavar="HOST:PORT",
           aliases=(("--no-http", "off"),)),
    Option("http_allow_host", _host_names, tuple,
           "also answer HTTP requests whose Host names NAME (repeatable): a DNS alias or the "
           "node's name a Prometheus scrapes by; others get 421 (DNS-rebinding guard)",
           kind="list", metavar="NAME"),
    Option("workers", _workers, lambda: None,
           f"compile workers, 1 to {MAX_WORKERS} (auto: from cores and memory)", metavar="N"),
    Option("job_timeout", _positive_seconds, lambda: 300.0,
           "seconds one compilation may take before its worker is replaced", True,
           metavar="SECONDS"),
    Option("log_level", _level, lambda: "info",
           "least severe log events written: debug, info, warning or error", True,
           metavar="LEVEL"),
    Option("socket_mode", _mode, lambda: 0o660,
           "file mode of the socket the daemon creates (octal, at most 0777)", metavar="MODE"),
    Option("max_bytes", parse_size, lambda: 0,
           "store budget: 20GB is 20*10^9 bytes, 20GiB 20*2^30 (0: unlimited); least "
           "recently used kernels are evicted to keep it", True, metavar="SIZE"),
    Option("max_files", _count, lambda: 0,
           "store budget in blob files, two per entry (0: unlimited)", True, metavar="N"),
    Option("evict_grace", _seconds, lambda: 30.0,
           "entries served or stored within this many seconds are evicted last", True,
           metavar="SECONDS"),
    Option("drain_timeout", _seconds, lambda: 30.0,
           "on SIGTERM, seconds running compilations get to finish", True, metavar="SECONDS"),
    Option("allow_uid", _ids, tuple, "uid allowed to connect (repeatable; default: any)", True,
           "list", "UID"),
    Option("allow_gid", _ids, tuple, "gid allowed to connect (repeatable; default: any)", True,
           "list", "GID"),
    Option("publish_uid", _ids, tuple,
           "uid allowed to publish and run gc (repeatable; default: root and the daemon's uid)",
           True, "list", "UID"),
    Option("publish_gid", _ids, tuple, "gid allowed to publish (repeatable)", True, "list",
           "GID"),
    # Write-back (cached/toolchain/trust.py, docs/reliability.md "Write-back").
    Option("writeback", _bool, lambda: True,
           "accept write-back (lease, publish): publish rights are code execution in every "
           "process of the publisher's trust group", True, aliases=(("--no-writeback", False),)),
    Option("trust_group", _trust_groups, tuple,
           "UID,UID,...: uids whose written-back kernels are served to each other "
           "(repeatable; default: each uid alone; root's are served to every peer)", True,
           "list", "UIDS"),
    Option("toolchain", _toolchains, tuple,
           "NAME=PYTHON: also compile for the environment of this interpreter (repeatable; the "
           "first is the default; none: the daemon's own interpreter)", kind="list",
           metavar="NAME=PYTHON"),
    Option("probe_timeout", _positive_seconds, lambda: 120.0,
           "seconds a toolchain's interpreter may take to state its identity at start; one "
           "that takes longer is killed with the processes it started", metavar="SECONDS"),
    Option("serve_only", _bool, lambda: False,
           "no compiler: serve a store built elsewhere (its keys are pinned in it)",
           kind="switch"),
    # The fleet tier (cached/fleet/, docs/fleet.md).
    Option("remote", _optional, lambda: None,
           "fleet tier: redis://HOST:PORT/DB, rediss://..., redis+cluster://HOST:PORT",
           metavar="URL"),
    Option("remote_signing_key", _optional, lambda: None,
           "Ed25519 private key (PEM) that signs what this node publishes", metavar="FILE"),
    Option("remote_verify_keys", _optional, lambda: None,
           "the fleet's Ed25519 public keys (PEM or base64 lines) entries must verify against",
           metavar="FILE"),
    Option("remote_read_only", _bool, lambda: False,
           "fetch from the fleet tier but never publish to it (GPU nodes)", kind="switch"),
    Option("remote_timeout", _positive_seconds, lambda: 2.0,
           "seconds per Redis operation before the tier counts as down", metavar="SECONDS"),
    # Per-peer limits (cached/server.py, docs/reliability.md "Memory and fairness").
    Option("max_connections", _positive_count, lambda: 1024,
           "connections open at once, all peers together", True, metavar="N"),
    Option("max_connections_per_uid", _positive_count, lambda: 128,
           "connections open at once from one peer uid", True, metavar="N"),
    Option("idle_timeout", _positive_seconds, lambda: 600.0,
           "seconds a connection with nothing in flight may stay silent before it is closed",
           True, metavar="SECONDS"),
    Option("max_queued_per_uid", _count, lambda: 1024,
           "compilations a peer without publish rights may have queued or running (0: no "
           "limit)", True, metavar="N"),
    Option("lease_max_hold", _positive_seconds, lambda: 3600.0,
           "seconds a write-back lease may be held in all, renewals included: then it ends "
           "and the next waiter gets it (clients renew for at most 1800 s of their own)",
           metavar="SECONDS"),
    Option("upload_timeout", _positive_seconds, lambda: 300.0,
           "seconds an unfinished write-back upload is kept after its last chunk", True,
           metavar="SECONDS"),
)
BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Settings:
    """The effective settings of one daemon: one field per option in :data:`OPTIONS`
    (same names), plus where each value came from and the file read."""

    socket: str
    store: str
    http: str
    http_allow_host: tuple[str, ...]
    workers: int | None
    job_timeout: float
    log_level: str
    socket_mode: int
    max_bytes: int
    max_files: int
    evict_grace: float
    drain_timeout: float
    allow_uid: tuple[int, ...]
    allow_gid: tuple[int, ...]
    publish_uid: tuple[int, ...]
    publish_gid: tuple[int, ...]
    writeback: bool
    trust_group: tuple[tuple[int, ...], ...]
    toolchain: tuple[tuple[str, str], ...]
    probe_timeout: float
    serve_only: bool
    remote: str | None
    remote_signing_key: str | None
    remote_verify_keys: str | None
    remote_read_only: bool
    remote_timeout: float
    max_connections: int
    max_connections_per_uid: int
    idle_timeout: float
    max_queued_per_uid: int
    lease_max_hold: float
    upload_timeout: float
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    file: Path | None = field(default=None, compare=False)
    file_source: str = field(default="none", compare=False)

    @property
    def http_address(self) -> tuple[str, int] | None:
        """(host, port) of the HTTP endpoint, or None when it is off."""
        if self.http == "off":
            return None
        host, _, port = self.http.rpartition(":")
        return host.strip("[]"), int(port)

    def rows(self) -> list[dict]:
        return [{"name": o.name, "value": getattr(self, o.name),
                 "source": self.sources.get(o.name, "default"), "reloadable": o.reloadable}
                for o in OPTIONS]


def _build(values: Mapping[str, Any], sources: Mapping[str, str], file: Path | None,
           file_source: str) -> Settings:
    return Settings(**values, sources=dict(sources), file=file, file_source=file_source)


def reload(old: Settings, new: Settings) -> tuple[Settings, list[str], list[str]]:
    """What is in force after a SIGHUP: ``new``'s values of the reloadable options, ``old``'s
    of the others; and the names of the changed options applied and of those that need a
    restart."""
    diff = [o for o in OPTIONS if getattr(old, o.name) != getattr(new, o.name)]
    applied = [o.name for o in diff if o.reloadable]
    ignored = [o.name for o in diff if not o.reloadable]
    values = {o.name: getattr(new if o.reloadable else old, o.name) for o in OPTIONS}
    sources = {o.name: (new if o.reloadable else old).sources.get(o.name, "default")
               for o in OPTIONS}
    return _build(values, sources, new.file, new.file_source), applied, ignored


# -- sources ------------------------------------------------------------------------------


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
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    out = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in BY_NAME:
            raise ConfigError(f"{path}: unknown key {key!r}; known: {', '.join(BY_NAME)}")
        out[name] = value
    return out


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option (and ``--config``); an absent flag parses as None."""
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML configuration (default: $CACHED_CONFIG, then "
                             f"{SYSTEM_CONFIG} if it exists)")
    for option in OPTIONS:
        text = f"{option.help} [env {option.env}]"
        if option.kind == "switch":
            parser.add_argument(option.flag, dest=option.name, action="store_const", const=True,
                                default=None, help=text)
        elif option.kind == "list":
            parser.add_argument(option.flag, dest=option.name, action="append", default=None,
                                metavar=option.metavar, help=text)
        else:
            parser.add_argument(option.flag, dest=option.name, default=None,
                                metavar=option.metavar, help=text)
        for alias, value in option.aliases:
            parser.add_argument(alias, dest=option.name, action="store_const", const=value,
                                help=f"same as {option.flag} {value}")


def resolve(flags: argparse.Namespace | Mapping[str, Any] | None = None,
            config_flag: str | None = None) -> Settings:
    """The effective settings: flags that were given (not None), then the environment,
    then the file, then defaults. ConfigError names the option and the source."""
    given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags or {})
    path, why = config_path(config_flag)
    file_values = read_file(path)
    values, sources = {}, {}
    for option in OPTIONS:
        flag_value = given.get(option.name)
        if flag_value is not None:
            raw, source = flag_value, f"flag {option.flag}"
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
    return _build(values, sources, path, why)


def format_table(settings: Settings) -> str:
    """``cached config``'s table: name, value, source; the columns stay aligned."""
    return format_rows(settings.rows(), settings.file, settings.file_source)


def format_rows(options: list[dict], file: Any, file_source: str) -> str:
    """:func:`format_table` of :meth:`Settings.rows` (as they are, or as JSON brought them
    back from a running daemon: lists for tuples)."""
    rows = []
    for row in options:
        value = row["value"]
        if BY_NAME[row["name"]].parse is parse_size:
            value = f"{size_text(value)} ({value} bytes)" if value else "0 (no limit)"
        elif row["name"] == "socket_mode":
            value = f"0{value:o}"
        elif value is None:
            value = "auto" if row["name"] == "workers" else "-"
        elif isinstance(value, (tuple, list)):
            value = (" ".join(",".join(map(str, g)) for g in value)
                     if row["name"] == "trust_group" else
                     ",".join("=".join(v) if isinstance(v, (tuple, list)) else str(v)
                              for v in value)) or "-"
        mark = "" if row["reloadable"] else "  (restart to change)"
        rows.append((row["name"], _printable(str(value)), row["source"] + mark))
    name_width = max(len(r[0]) for r in rows)
    value_width = min(VALUE_COLUMN, max(len(r[1]) for r in rows))
    lines = [f"config file: {file or '(none)'} ({file_source})"]
    for name, value, source in rows:
        if len(value) > value_width:  # its source goes under the source column
            lines += [f"{name:<{name_width}}  {value}", f"{'':<{name_width + value_width + 2}}"
                      f"  {source}"]
        else:
            lines.append(f"{name:<{name_width}}  {value:<{value_width}}  {source}")
    return "\n".join(lines)


VALUE_COLUMN = 40
"""The widest value ``cached config`` keeps on its row; a longer one gets a row to itself."""


def _printable(text: str) -> str:
    """``text`` on one line: control characters written as escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
