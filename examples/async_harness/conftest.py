"""Fixtures for testing kernels with pytest and the anyio plugin.

* ``anyio_backend``: every async test runs on asyncio (debug mode), trio and uvloop (when
  installed), so a kernel is checked under every event loop the runtime supports;
* ``device``: every test that takes it runs on each device in ``HARNESS_DEVICES`` (default
  ``CPU,CPU:1``), one shared :class:`~aiotinyrt.Compiled` per device for the whole session;
* ``program``: compiles a kernel once per (device, source) and hands out the loaded Program;
* ``no_leaks`` (autouse): after each test, synchronizes every opened device and fails the test
  if device memory is still in use that was not in use before it (a buffer not freed), or if a
  device holds a sticky error.

Run it with ``python -m pytest examples/async_harness``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from aiotinyrt import Compiled, Device, Program, synchronize

_BACKENDS = [
    pytest.param(("asyncio", {"debug": True}), id="asyncio"),
    pytest.param(("trio", {}), id="trio"),
]
if importlib.util.find_spec("uvloop") is not None:
    _BACKENDS.append(pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"))

DEVICES = [d for d in os.environ.get("HARNESS_DEVICES", "CPU,CPU:1").split(",") if d]


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    """The event loop each async test runs on."""
    return request.param


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Compiled:
    """The device under test (shared by every test of the session)."""
    return Device[request.param]


_programs: dict[tuple[str, str, str], Program] = {}


@pytest.fixture
def program(device: Compiled) -> Callable[[str, str], Awaitable[Program]]:
    """``await program(name, src)``: the kernel, compiled once per device and source."""

    async def load(name: str, src: str) -> Program:
        key = (device.name, name, src)
        prog = _programs.get(key)
        if prog is None or prog.device is not device:  # a closed device reopens as a new one
            prog = _programs[key] = await device.program(name, src)
        return prog

    return load


def _in_use() -> dict[str, tuple[int, int]]:
    return {
        dev.name: (stats.bytes_in_use, stats.allocations)
        for dev in Device.opened()
        for stats in [dev.allocator.statistics()]
    }


@pytest.fixture(autouse=True)
async def no_leaks(anyio_backend: object) -> AsyncIterator[None]:
    """Fail the test if it leaves device memory allocated or a device in error."""
    await synchronize()
    before = _in_use()
    yield
    await synchronize()  # raises a device's sticky error; memory freed with work pending is released
    after = _in_use()
    leaks = [
        f"{name}: {nbytes - before.get(name, (0, 0))[0]} bytes in "
        f"{count - before.get(name, (0, 0))[1]} allocations"
        for name, (nbytes, count) in after.items()
        if (nbytes, count) != before.get(name, (0, 0))
    ]
    assert not leaks, "device memory leaked (a Buffer not freed?): " + "; ".join(leaks)
