"""``python -m cached.node.healthcheck``: exit status 0 if the daemon this environment configures
is healthy (at least one compile worker ready), 1 otherwise, with the reason on stderr.

The container's HEALTHCHECK runs it. It reads the configuration as ``cached serve`` without
flags does (``CACHED_*`` environment, then the TOML file, then the defaults) and asks
``GET /healthz`` on ``http``; a wildcard host (``0.0.0.0``, ``::``) is asked on loopback.
With ``http = off`` it asks the Unix socket (``socket``) for ``stats`` instead.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

WILDCARDS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "[::]": "[::1]"}


def healthz_url(http: str) -> str | None:
    """The /healthz URL for a configured ``http`` value (HOST:PORT), None for ``off``."""
    if http == "off":
        return None
    host, _, port = http.rpartition(":")
    host = WILDCARDS.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{port}/healthz"


def check(timeout: float = 4.0) -> tuple[bool, str]:
    """(healthy, what was asked and what it said)."""
    from cached import config

    try:
        settings = config.resolve()
    except config.ConfigError as exc:
        return False, f"configuration: {exc}"
    url = healthz_url(settings.http)
    if url is None:
        from cached_client import Client
        from cached_client.errors import CachedError

        try:
            stats = Client(settings.socket, timeout=timeout).stats()
        except (CachedError, OSError) as exc:
            return False, f"{settings.socket}: {exc}"
        ready = stats["workers_ready"]
        return ready > 0 or stats["serve_only"], f"{settings.socket}: {ready} workers ready"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            ok = json.load(reply).get("ok") is True
    except (OSError, ValueError) as exc:
        return False, f"{url}: {exc}"
    return ok, f"{url}: {'ok' if ok else 'no worker ready'}"


def main() -> int:
    healthy, why = check()
    print(why, file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
