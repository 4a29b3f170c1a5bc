"""Argument types shared by the subcommands: each refuses nonsense with a message argparse
prints before anything runs (exit status 2)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from .. import config

MAX_COUNT = 10_000_000
MAX_SM_COUNT = 1024


def count(low: int = 1, high: int = MAX_COUNT) -> Callable[[str], int]:
    """An integer in [low, high] (``--limit``, ``--sm-count``, ...)."""
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer from {low} to {high}, "
                                             f"got {value}")
        return value
    return parse


def seconds(low: float = 0.0, high: float = config.MAX_SECONDS,
            positive: bool = False) -> Callable[[str], float]:
    """A finite number of seconds in [low, high] (more than ``low`` with ``positive``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if not math.isfinite(value) or not low <= value <= high or (positive and value <= low):
            raise argparse.ArgumentTypeError(
                f"expected seconds {'above' if positive else 'from'} {low:g} "
                f"{'and at most' if positive else 'to'} {high:g}, got {text}")
        return value
    return parse


def size(text: str) -> int:
    """A size as the configuration takes it (``500MB``, ``20GiB``; see config.SIZE_UNITS)."""
    try:
        return config.parse_size(text)
    except config.ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
