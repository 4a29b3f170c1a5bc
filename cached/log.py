"""Structured logging: one line per event, JSON when stderr is not a terminal.

When stderr is the journal's stream (``$JOURNAL_STREAM`` names its device and inode, as
systemd sets it for a service) every line starts with its syslog priority, ``<3>`` error,
``<4>`` warning, ``<6>`` info, ``<7>`` debug (sd-daemon(3)'s prefixes): journald stores it
as the entry's PRIORITY and strips it, so ``journalctl -p warning`` shows warnings and errors
only.

Use ``event(log, logging.INFO, "compile.done", key=..., seconds=...)``: the event name
is stable and greppable, the fields are data. Levels mean: DEBUG per-request detail,
INFO state changes and finished work, WARNING something was repaired or degraded,
ERROR a request or job failed for a reason an operator should see.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextvars import ContextVar
from typing import Any

request_pid: ContextVar[int | None] = ContextVar("cached_request_pid", default=None)
"""The pid of the peer whose request is being handled (set by cached.server), for events."""
request_uid: ContextVar[int | None] = ContextVar("cached_request_uid", default=None)
"""The uid of that peer (set by cached.server), for what is bounded per uid."""


PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6,
              logging.DEBUG: 7}
"""syslog priority of each logging level (a level between two takes the lower's)."""


def priority(levelno: int) -> int:
    """The syslog priority of a logging level number."""
    for level in sorted(PRIORITIES, reverse=True):
        if levelno >= level:
            return PRIORITIES[level]
    return 7


def to_journal(stream: Any = None) -> bool:
    """Whether ``stream`` (default stderr) is the journal's: ``$JOURNAL_STREAM`` is
    ``DEVICE:INODE`` of the stream systemd connected, which a redirect changes."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class _Formatter(logging.Formatter):
    def __init__(self, as_json: bool, prefixed: bool = False) -> None:
        super().__init__()
        self.as_json = as_json
        self.prefixed = prefixed

    def format(self, record: logging.LogRecord) -> str:
        text = self._format(record)
        if not self.prefixed:
            return text
        mark = f"<{priority(record.levelno)}>"
        return "\n".join(mark + line for line in text.split("\n"))

    def _format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        if self.as_json:
            doc = {
                "ts": round(record.created, 3),
                "level": record.levelname.lower(),
                "logger": record.name,
                "event": record.getMessage(),
                **fields,
            }
            if record.exc_info:
                doc["exc"] = self.formatException(record.exc_info)
            return json.dumps(doc, default=str)
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        kv = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
        line = f"{stamp} {record.levelname:<7} {record.getMessage()} {kv}".rstrip()
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if " " not in text else json.dumps(text)


def setup(level: str = "info", as_json: bool | None = None) -> None:
    """Configure the root logger once for a daemon or CLI process (priority prefixes when
    stderr is the journal's: :func:`to_journal`)."""
    if as_json is None:
        as_json = not sys.stderr.isatty()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(as_json, to_journal(sys.stderr)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class _CommandFormatter(logging.Formatter):
    """A command's own lines: ``cached COMMAND: event key=value ...`` (no time, no level
    word unless it is an error)."""

    def __init__(self, command: str) -> None:
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", {})
        kv = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
        severity = "error: " if record.levelno >= logging.ERROR else ""
        return f"cached {self.command}: {severity}{record.getMessage()} {kv}".rstrip()


def setup_command(command: str, level: str = "warning") -> None:
    """Log lines of a command working on a store itself (``gc --store``, ``verify
    --store``): warnings and errors on stderr as readable lines, not bare event names."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CommandFormatter(command))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimited(logging.Filter):
    """Pass each message (logger and format string) at most once every ``every`` seconds;
    the next one that passes says how many were dropped in between (``dropped``)."""

    MOST = 1024  # distinct messages remembered (then it starts over)

    def __init__(self, every: float = 10.0) -> None:
        super().__init__()
        self.every = every
        self._last: dict[tuple[str, Any], list[float]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.msg if isinstance(record.msg, str) else type(record.msg))
        now = time.monotonic()
        seen = self._last.get(key)
        if seen is not None and now - seen[0] < self.every:
            seen[1] += 1
            return False
        if len(self._last) >= self.MOST:
            self._last.clear()
        if seen is not None and seen[1]:
            fields = dict(getattr(record, "fields", {}))
            fields["dropped"] = int(seen[1])
            record.fields = fields
        self._last[key] = [now, 0]
        return True


def event(log: logging.Logger, level: int, name: str, **fields: Any) -> None:
    if log.isEnabledFor(level):
        log.log(level, name, extra={"fields": fields})


def one_line(data: bytes, limit: int = 800) -> str:
    """The last ``limit`` characters of a process's output as one printable line, for an
    event or an error message: invalid UTF-8 and control characters escaped, line breaks
    shown as `` | ``."""
    text = data.decode("utf-8", "backslashreplace").strip()
    text = " | ".join(line.strip() for line in text.splitlines() if line.strip())
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text[-limit:]
