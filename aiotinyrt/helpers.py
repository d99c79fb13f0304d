"""Small shared helpers: environment variables, DEBUG levels and logging, arithmetic.

DEBUG output goes through the standard :mod:`logging` module, to the logger ``aiotinyrt`` and its
children (``aiotinyrt.device``, ``aiotinyrt.queue``, ``aiotinyrt.compiler``, ``aiotinyrt.allocator``,
``aiotinyrt.native``), all at level ``DEBUG``. The environment variable ``DEBUG=n`` chooses which
messages are produced (1 opens, 2 per-launch timing, 4 kernel source, 7 alloc/free: some cost
work, e.g. per-launch timing runs every command through the Python worker) and turns them on: it
sets the ``aiotinyrt`` logger to ``DEBUG`` unless the application set a level, and where nothing
handles log records (no handler on it or on the root logger) adds one writing to stderr. A service
routes the records like any other library's.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os
import shlex
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: The package's logger; modules log to children of it (see :func:`get_logger`).
logger = logging.getLogger("aiotinyrt")
_handler: list[logging.Handler] = []


def environ_get(key: str) -> str:
    """``os.environ.get(key, "")``, read at each call, for the hot paths. ``os.environ.get`` of
    an unset variable raises and catches a ``KeyError`` inside (about 2 us here, twice per
    completed command when it ran on every report); on POSIX the mapping's own dict of encoded
    names is read instead, which ``os.environ``'s every change updates; on any other mapping
    put in its place, its ``get``."""
    environ: Any = os.environ  # (looked up at each call: a test may replace it)
    data = getattr(environ, "_data", None)
    if type(data) is not dict or not hasattr(environ, "encodekey"):
        return str(environ.get(key, ""))
    if environ is _OS_ENVIRON:  # (its names, encoded once)
        name = _ENCODED.get(key)
        if name is None:
            name = _ENCODED[key] = environ.encodekey(key)
    else:
        name = environ.encodekey(key)
    raw = data.get(name)
    return "" if raw is None else str(environ.decodevalue(raw))


_OS_ENVIRON = os.environ
_ENCODED: dict[str, Any] = {}  # (the names as the process's os.environ's own dict holds them)


def getenv(key: str, default: int = 0) -> int:
    """Read an integer environment variable, or ``default`` when unset or empty.

    Read at each call (not cached): tests and long-running services change the environment.
    """
    value = environ_get(key)
    if value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


def getenv_str(key: str, default: str = "") -> str:
    """Read a string environment variable, or ``default`` when unset or empty."""
    return environ_get(key) or default


def check_timeout(timeout: object) -> float:
    """``timeout`` as float seconds: any real number but bool (negative: already expired,
    ``inf``: no limit). ``TypeError`` for anything else, ``ValueError`` for NaN."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds or None, got {type(timeout).__name__}")
    seconds = float(timeout)
    if math.isnan(seconds):
        raise ValueError("timeout must not be NaN")
    return seconds


def env_wait_timeout() -> float | None:
    """The default wait timeout in seconds from ``WAIT_TIMEOUT_MS`` (milliseconds, fractions
    allowed); None when unset, empty, 0 or negative (no limit). ``ValueError`` naming the
    variable when it is not a finite number."""
    raw = environ_get("WAIT_TIMEOUT_MS")
    if raw == "":
        return None
    try:
        ms = float(raw)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms):
        raise ValueError(
            f"environment variable WAIT_TIMEOUT_MS={raw!r} is not a finite number of milliseconds "
            "(unset or 0: no limit)"
        )
    return ms / 1000 if ms > 0 else None


def debug_level() -> int:
    """The current DEBUG level (1 opens, 2 per-launch timing, 4 source, 7 alloc/free). A level
    above 0 turns the ``aiotinyrt`` logger on (see the module docstring)."""
    level = getenv("DEBUG")
    if level > 0 and not _handler:
        _enable_debug_logging()
    return level


def _enable_debug_logging() -> None:
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.DEBUG)
    handler: logging.Handler = logging.NullHandler()
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    _handler.append(handler)


def get_logger(name: str) -> logging.Logger:
    """The logger ``aiotinyrt.<name>``."""
    return logger.getChild(name)


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


def cache_path() -> Path:
    """Where the persistent compile cache lives (``CACHEDB`` wins over ``XDG_CACHE_HOME``); the
    first-use build of the native queue library is kept beside it."""
    explicit = getenv_str("CACHEDB")
    if explicit:
        return Path(explicit).expanduser()
    xdg = getenv_str("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "aiotinyrt" / "cache.db"


def find_cc() -> list[str] | None:
    """The C compiler command: ``$CC`` (None when it names no program), else clang, else gcc
    (clang first: kernels tinygrad generates use clang's vector extensions)."""
    env = getenv_str("CC")
    if env:
        argv = shlex.split(env)
        return argv if argv and shutil.which(argv[0]) else None
    for name in ("clang", "gcc", "cc"):
        path = shutil.which(name)
        if path is not None:
            return [path]
    return None


def fmt_time(seconds: float) -> str:
    """Format a duration for humans (``12.3 µs``)."""
    if math.isnan(seconds):
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
