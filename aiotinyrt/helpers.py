"""Small shared helpers: environment variables, DEBUG levels, arithmetic."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable


def getenv(key: str, default: int = 0) -> int:
    """Read an integer environment variable, or ``default`` when unset or empty.

    Read at each call (not cached): tests and long-running services change the environment.
    """
    value = os.environ.get(key, "")
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


def getenv_str(key: str, default: str = "") -> str:
    """Read a string environment variable, or ``default`` when unset or empty."""
    return os.environ.get(key, "") or default


def debug_level() -> int:
    """The current DEBUG level (1 opens, 2 per-launch timing, 4 source, 7 alloc/free)."""
    return getenv("DEBUG")


def prod(xs: Iterable[int]) -> int:
    """Product of integers (1 for an empty iterable)."""
    return math.prod(xs)


def round_up(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``multiple``."""
    return (n + multiple - 1) // multiple * multiple


@functools.cache
def page_size() -> int:
    """The host's memory page size in bytes."""
    return os.sysconf("SC_PAGE_SIZE")


def format_bytes(n: int) -> str:
    """Human-readable byte count (``1.50 MiB``)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
