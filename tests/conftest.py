"""Shared fixtures: every async test runs on asyncio (debug mode), trio, and uvloop when installed."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# PoCL offers as many CPU devices as POCL_DEVICES names: four, so CL:1 and CL:3 exist (set before
# the OpenCL loader is first used; subprocesses of tests inherit it).
os.environ.setdefault("POCL_DEVICES", "pthread pthread pthread pthread")

from aiotinyrt import Device, native
from tests.fake_driver import FAKEDevice
from tests.ray_cluster import ray_cluster, ray_host  # noqa: F401 - the shared Ray cluster's fixtures
from tests.toy_backend import TOYDevice

# The test backends of the conformance suite (tests/conformance): the skeleton of "Writing a
# backend" and a driver-run backend over a fake driver.
Device.register("TOY", TOYDevice)
Device.register("FAKE", FAKEDevice)

_BACKENDS = [
    pytest.param(("asyncio", {"debug": True}), id="asyncio"),
    pytest.param(("trio", {}), id="trio"),
]
if importlib.util.find_spec("uvloop") is not None:
    _BACKENDS.append(pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"))


@pytest.fixture(params=_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> object:
    """The event loop each async test runs on."""
    return request.param


@pytest.fixture(autouse=True, scope="session")
def _private_compile_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point the persistent compile cache at a per-session file, so tests never touch ~/.cache."""
    path = tmp_path_factory.mktemp("cache") / "cache.db"
    old = os.environ.get("CACHEDB")
    os.environ["CACHEDB"] = str(path)
    # Build the native queue library (kept next to the cache) now, outside every test: the first
    # build takes ~0.7 s, which would otherwise land inside whichever test opens a device first.
    native.load()
    yield path
    if old is None:
        os.environ.pop("CACHEDB", None)
    else:
        os.environ["CACHEDB"] = old


@pytest.fixture(autouse=True)
def _keep_dev() -> Iterator[None]:
    """tinygrad writes the default device it chose into ``DEV`` (for its child processes), and
    aiotinyrt's ``Device.DEFAULT`` reads ``DEV``: a test that touched tinygrad's default must not
    choose the default device of the tests after it."""
    old = os.environ.get("DEV")
    yield
    if os.environ.get("DEV") != old:
        if old is None:
            os.environ.pop("DEV", None)
        else:
            os.environ["DEV"] = old
