"""tinygrad on aiotinyrt: ``import aiotinyrt.tinygrad`` makes ``AIO`` (``AIO:1``, ...) a tinygrad
device run by aiotinyrt (see :mod:`aiotinyrt.tinygrad.backend`), and gives async code an
awaitable way to run tinygrad models (:func:`realize`, :func:`numpy`, :func:`call`).

It is also a pytest plugin: ``DEV=AIO python -m pytest -p aiotinyrt.tinygrad ...`` runs tinygrad
tests on aiotinyrt.
"""

from __future__ import annotations

import sys

import tinygrad.runtime
from tinygrad.device import Device

from aiotinyrt.tinygrad import backend
from aiotinyrt.tinygrad.aio import call, call_numpy, copyin, numpy, realize
from aiotinyrt.tinygrad.backend import AIOAllocator, AIOCompiler, AIODevice, AIOProgram, AIORenderer
from aiotinyrt.tinygrad.graph import AIOGraph
from aiotinyrt.tinygrad.sync import aiotinyrt_name, backend_name

__all__ = [
    "AIOAllocator",
    "AIOCompiler",
    "AIODevice",
    "AIOGraph",
    "AIOProgram",
    "AIORenderer",
    "aiotinyrt_name",
    "backend_name",
    "call",
    "call_numpy",
    "copyin",
    "numpy",
    "realize",
    "register",
]


def register() -> None:
    """Make ``AIO`` a tinygrad device (done on import; idempotent). tinygrad finds a device
    ``X`` as the module ``tinygrad.runtime.ops_x`` with a class ``XDevice``: that module is
    :mod:`aiotinyrt.tinygrad.backend`."""
    sys.modules["tinygrad.runtime.ops_aio"] = backend
    tinygrad.runtime.ops_aio = backend  # type: ignore[attr-defined]
    if "AIO" not in Device._devices:
        Device._devices.append("AIO")


register()


def pytest_report_header() -> str:
    """pytest plugin hook: say which aiotinyrt backend ``AIO`` runs on."""
    return f"aiotinyrt.tinygrad: AIO runs on aiotinyrt {backend_name()}"
