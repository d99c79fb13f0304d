"""How the AIO device's synchronous entry points reach aiotinyrt: which aiotinyrt device an
``AIO`` name is, and running an aiotinyrt coroutine to completion from synchronous code."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from aiotinyrt.registry import Device

T = TypeVar("T")

#: The aiotinyrt backends whose kernels tinygrad's C renderer can write.
SUPPORTED_BACKENDS = ("CPU",)


def backend_name() -> str:
    """The aiotinyrt backend ``AIO`` wraps: env ``AIO_BACKEND`` (default ``CPU``)."""
    return (os.environ.get("AIO_BACKEND") or "CPU").upper()


def aiotinyrt_name(device: str) -> str:
    """The aiotinyrt device behind a tinygrad ``AIO[:n]`` name (``AIO:1`` -> ``CPU:1``)."""
    head, _, index = device.partition(":")
    if head.upper() != "AIO":
        raise ValueError(f"{device!r} is not an AIO device")
    backend = backend_name()
    if backend not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"AIO_BACKEND={backend!r}: tinygrad's kernels can run on {', '.join(SUPPORTED_BACKENDS)} only"
        )
    return Device.canonicalize(f"{backend}:{index}" if index else backend)


def on_event_loop_thread() -> bool:
    """True when the calling thread is running an asyncio, uvloop or trio event loop."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        trio = sys.modules.get("trio")
        return trio is not None and bool(trio.lowlevel.in_trio_run())


def run_sync(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """Run an aiotinyrt coroutine function to completion from synchronous code (a private event
    loop in this thread). Raises ``RuntimeError`` on an event-loop thread."""
    if on_event_loop_thread():
        raise RuntimeError(
            "tinygrad's synchronous API on an AIO device was called on an event-loop thread, where "
            "it would block the loop; use aiotinyrt.tinygrad's awaitable API (realize, numpy, call)"
        )
    return anyio.run(fn, *args)
