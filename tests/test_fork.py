"""Fork: a device opened by the parent refuses use in a forked child at once, with a clear
error (its worker threads do not exist there); the child opens devices of its own.

Runs in a subprocess per loop and worker (forking the test runner itself would copy its
threads' state), with a bounded timeout: a child that waits forever is a failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import INC, LOOPS, SPIN, WORKERS

pytestmark = pytest.mark.slow  # forked interpreters

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import os
import sys

import anyio
import numpy as np

from aiotinyrt import Buffer, Device, DeviceError, dtypes

SPIN, INC = {spin!r}, {inc!r}
state = {{}}


async def parent():
    dev = Device["CPU"]
    spin = await dev.program("spin", SPIN)
    buf = await Buffer("CPU", 1, dtypes.int32).allocate()
    await buf.copyin(np.zeros(1, np.int32))
    state.update(dev=dev, spin=spin, buf=buf, sig=spin(buf, vals=(1000,)))  # pending at the fork
    state["null"] = Device["NULL"]  # a device whose allocator lock is a plain Lock


def refused(what, call):
    try:
        call()
    except DeviceError as exc:
        assert "fork" in str(exc), exc
        return
    raise AssertionError(f"{{what}} was not refused in the child")


async def arefused(what, call):
    try:
        await call()
    except DeviceError as exc:
        assert "fork" in str(exc), exc
        return
    raise AssertionError(f"{{what}} was not refused in the child")


async def child():
    with anyio.fail_after(20):  # refusals are immediate; a wait would end here
        dev, spin, buf, sig = state["dev"], state["spin"], state["buf"], state["sig"]
        refused("a launch", lambda: spin(buf, vals=(1,)))
        await arefused("awaiting the parent's pending signal", lambda: sig.wait())
        await arefused("a copy in", lambda: buf.copyin(np.ones(1, np.int32)))
        await arefused("a read", buf.numpy)
        await arefused("an allocation", lambda: dev.allocator.alloc(64))
        await arefused("a synchronize", dev.synchronize)
        refused("loading a program", lambda: dev.runtime("spin", spin.lib))
        await arefused("a NULL allocation", lambda: state["null"].allocator.alloc(64))
        fresh = Device["CPU"]  # the child's own device
        assert fresh is not dev
        inc = await fresh.program("inc", INC)
        out = await Buffer("CPU", 1, dtypes.int32).allocate()
        await out.copyin(np.full(1, 41, np.int32))
        await fresh.run(inc, out)
        assert (await out.numpy()).tolist() == [42]
        await out.free()
    print("child ok", flush=True)


loop = sys.argv[1]
options = {{"use_uvloop": True}} if loop == "uvloop" else {{}}
backend = "asyncio" if loop == "uvloop" else loop
anyio.run(parent, backend=backend, backend_options=options)
pid = os.fork()
if pid == 0:
    try:
        anyio.run(child, backend=backend, backend_options=options)
        code = 0
    except BaseException as exc:
        print("child failed:", repr(exc), file=sys.stderr, flush=True)
        code = 1
    os._exit(code)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status), flush=True)
anyio.run(state["sig"].wait, backend=backend, backend_options=options)  # the parent's runs on
print("parent ok", flush=True)
"""


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("loop", LOOPS)
def test_a_forked_child_is_refused_the_parents_device_at_once_and_opens_its_own(
    loop: str, worker: str
) -> None:
    try:
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT.format(spin=SPIN, inc=INC), loop],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONDONTWRITEBYTECODE": "1",
                "NATIVE_QUEUE": "1" if worker == "native" else "0",
            },
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung: {exc.stdout!r} {exc.stderr!r}")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "child ok\nchild exit 0\nparent ok\n", (result.stdout, result.stderr)
    assert result.stderr == ""
