"""The ``AIO`` device class tinygrad opens (``tinygrad.runtime.ops_aio`` is this module)."""

from __future__ import annotations

import platform

from tinygrad.device import Compiled

import aiotinyrt
from aiotinyrt.program import Signal
from aiotinyrt.tinygrad.backend import AIOAllocator, AIOProgram, AIORenderer, aiotinyrt_name
from aiotinyrt.tinygrad.graph import AIOGraph


def _arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "aarch64": "arm64"}.get(machine, machine) + ",native"


class AIODevice(Compiled):
    """A tinygrad device backed by the aiotinyrt device ``aiotinyrt_name(device)``."""

    def __init__(self, device: str) -> None:
        self.rt: aiotinyrt.Compiled = aiotinyrt.Device[aiotinyrt_name(device)]
        super().__init__(device, AIOAllocator(self), [AIORenderer], AIOProgram, AIOGraph, arch=_arch())

    def synchronize(self, timeout: int | None = None) -> None:
        """Block until everything submitted to the device so far completed (``timeout`` in ms);
        raises the device's sticky ``DeviceError``. ``RuntimeError`` on an event-loop thread."""
        limit = None if timeout is None else timeout / 1000
        for timeline in self.rt.timelines:
            sig = Signal(timeline, timeline.submitted)
            if not sig.done():
                sig.wait_blocking(limit)
        error = self.rt._error
        if error is not None:
            raise error

    def finalize(self) -> None:
        """At interpreter exit: nothing to do (aiotinyrt finalizes its devices itself)."""
