"""``cached serve`` (run the daemon) and ``cached config`` (what it would run with).

Both take the flags :func:`cached.config.add_flags` generates from the option table.
"""

from __future__ import annotations

import argparse
import json
import sys

from .. import config


def add_parsers(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    serve = sub.add_parser("serve", help="run the daemon in the foreground",
                           description="Run the daemon in the foreground. Every option can "
                           "also come from the environment (CACHED_<NAME>) or the TOML file.")
    config.add_flags(serve)
    serve.set_defaults(run=cmd_serve)
    show = sub.add_parser("config", help="print the effective configuration and sources",
                          description="Print every setting cached serve would use with "
                          "these flags, and where each value came from; then, when a daemon "
                          "answers on the socket, the settings that daemon runs with (after "
                          "its last SIGHUP) and which of them differ.")
    config.add_flags(show)
    show.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    show.set_defaults(run=cmd_config)


def settings_from(args: argparse.Namespace, command: str) -> config.Settings | None:
    """The resolved settings, or None after printing why they cannot be used."""
    try:
        return config.resolve(args, args.config)
    except config.ConfigError as exc:
        print(f"cached {command}: configuration: {exc}", file=sys.stderr)
        return None


def cmd_serve(args: argparse.Namespace) -> int:
    from .. import log
    from ..daemon import serve

    settings = settings_from(args, "serve")
    if settings is None:
        return 2
    log.setup(settings.log_level)
    try:
        serve(settings, lambda: config.resolve(args, args.config))
    except config.ConfigError as exc:  # e.g. a fleet key file (cached.fleet.envelope.KeyFileError)
        print(f"cached serve: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    settings = settings_from(args, "config")
    if settings is None:
        return 2
    # a socket left at its default: the daemon a client would find (the per-user socket,
    # else the system one), not only the one a new serve would take
    asked = None if settings.sources.get("socket") == "default" else settings.socket
    running, answered = running_settings(asked)
    if args.json:
        print(json.dumps({"file": str(settings.file) if settings.file else None,
                          "file_source": settings.file_source, "options": settings.rows(),
                          "running": running}))
        return 0
    print(config.format_table(settings))
    if running is None:
        print(f"\nno daemon answers on {answered}: the above is what cached serve "
              "would use")
        return 0
    print(f"\nthe daemon running on {answered}:")
    print(config.format_rows(running["options"], running["file"], running["file_source"]))
    new = {r["name"]: r["value"] for r in json.loads(json.dumps(settings.rows()))}
    differ = [r["name"] for r in running["options"] if new.get(r["name"]) != r["value"]]
    print(f"differs from a new serve: {', '.join(differ) if differ else 'nothing'}")
    return 0


def running_settings(socket_path: str | None) -> tuple[dict | None, str]:
    """The settings of the daemon answering on ``socket_path`` (None: the default sockets,
    as a client searches them) as file, file_source and options (:meth:`config.Settings.rows`),
    or None when none answers (or it is too old to say); and the socket(s) asked."""
    from cached_client import Client, paths
    from cached_client.errors import CachedError

    client = Client(socket_path, timeout=5, identity=False)
    try:
        return client.stats().get("settings"), client.socket_path
    except CachedError:
        return None, socket_path or " nor ".join(paths.socket_candidates())
