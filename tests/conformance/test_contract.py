"""The async contract, on every compute backend: CPU and NULL (host-run, C ring), TOY (the
"writing a backend" skeleton: host-run, Python worker kernels), FAKE (driver-run queues over a
fake driver that completes commands from its own threads), CL (driver-run, OpenCL on PoCL:
tests/conftest.py asks PoCL for four devices, so CL:1 and CL:3 exist) and RAY (a device host's
CPU on the test run's local Ray cluster, tests/ray_cluster.py; marked slow, as it needs the
cluster). Each test names the backends it is meaningful on: NULL runs no code, so results are
checked only where kernels compute.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, BufferSpec, Device, DeviceError, Program, Signal, dtypes
from tests.fake_driver import FAKEDevice
from tests.helpers import GATE, INC, assert_cancelled_at_entry, fail_command

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent.parent
#: The shared Ray host's CPU (tests/ray_cluster.py), slow: it needs the local cluster.
RAY = pytest.param("RAY:t/CPU", marks=pytest.mark.slow, id="RAY")
COMPUTING = ["CPU", "TOY", "FAKE", "CL", RAY]
EVERY = ["CPU", "NULL", "TOY", "FAKE", "CL", RAY]

PY_INC = "def inc(out):\n    out.cast('i')[0] += 1\n"
PY_GATE = """
import time
def gate(flag, out, value):
    f = flag.cast("i")
    start = time.monotonic()
    while not f[0] and time.monotonic() - start < 30:
        time.sleep(0.0002)
    out.cast("i")[0] = value
"""

CL_INC = "__kernel void inc(__global int* out) { out[0] += 1; }"
#: spins until the host flips flag[0] (in host memory the device uses: CL_MEM_USE_HOST_PTR)
CL_GATE = """
__kernel void gate(__global volatile int* flag, __global int* out, int value) {
  for (long i = 0; i < 20000000000L && !flag[0]; i++) {}
  out[0] = value;
}
"""


#: RAY's gate: the host is another process, so the flag is a file (same machine), named by the
#: NUL-terminated path in the flag buffer; the kernel polls for it (giving up after 20 s)
RAY_GATE = """
#include <time.h>
#include <unistd.h>
void gate(const char* restrict path, int* restrict out, int value) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (access(path, F_OK) != 0) {
    usleep(100);
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > 20) break;
  }
  out[0] = value;
}
"""


def _source(device: str, c: str, cl: str, py: str) -> str:
    backend = device.partition(":")[0]
    return c if backend in ("CPU", "NULL", "RAY") else cl if backend == "CL" else py


async def inc_program(device: str) -> Program:
    return await Device[device].program("inc", _source(device, INC, CL_INC, PY_INC))


class Gate:
    """A flag the test flips through a zero-copy host view, read by a kernel that holds its
    queue until then and writes ``value`` to out[0]."""

    def __init__(self, prog: Program, flag: Buffer, view: memoryview) -> None:
        self.prog, self.flag, self.view = prog, flag, view

    def launch(self, out: Buffer, value: int = 42, **kwargs: object) -> Signal:
        return self.prog(self.flag, out, vals=(value,), writes=(1,), **kwargs)  # type: ignore[arg-type]

    def open(self) -> None:
        self.view.cast("i")[0] = 1


class FileGate(Gate):
    """RAY's gate: opening it creates the file whose path the flag buffer holds."""

    def __init__(self, prog: Program, flag: Buffer, path: Path) -> None:
        super().__init__(prog, flag, memoryview(b""))
        self.path = path

    def open(self) -> None:
        self.path.touch()


@asynccontextmanager
async def gate_on(device: str) -> AsyncIterator[Gate]:
    if device.startswith("RAY:"):
        async with file_gate_on(device) as gate:
            yield gate
        return
    prog = await Device[device].program("gate", _source(device, GATE, CL_GATE, PY_GATE))
    if device.startswith("CL"):  # no host views of device memory: the flag is host memory
        host = mmap.mmap(-1, mmap.PAGESIZE)
        address = np.frombuffer(host, np.int32).ctypes.data
        flag = await Buffer(device, 1, dtypes.int32, options=BufferSpec(external_ptr=address)).allocate()
        view = memoryview(host)
    else:
        flag = await Buffer(device, 1, dtypes.int32).allocate()
        view = await flag.as_memoryview()
    await flag.copyin(np.zeros(1, np.int32))
    gate = Gate(prog, flag, view)
    try:
        yield gate
    finally:
        gate.open()
        await Device[device].synchronize()
        await flag.free()


@asynccontextmanager
async def file_gate_on(device: str) -> AsyncIterator[Gate]:
    prog = await Device[device].program("gate", RAY_GATE)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "open"
        name = np.zeros(256, np.uint8)
        name[: len(str(path))] = np.frombuffer(str(path).encode(), np.uint8)
        flag = await Buffer(device, name.size, dtypes.uint8).allocate()
        await flag.copyin(name)
        gate = FileGate(prog, flag, path)
        try:
            yield gate
        finally:
            gate.open()
            await Device[device].synchronize()
            await flag.free()


async def int_buffer(device: str, value: int = 0) -> Buffer:
    buf = await Buffer(device, 1, dtypes.int32).allocate()
    await buf.copyin(np.full(1, value, np.int32))
    return buf


async def read(buf: Buffer) -> int:
    return int((await buf.numpy())[0])


def _backend(request: pytest.FixtureRequest) -> str:
    name = str(request.param)
    if name.startswith("RAY:"):
        request.getfixturevalue("ray_cluster")  # (the shared local cluster and its host t)
    return name


@pytest.fixture(params=COMPUTING)
def computing(request: pytest.FixtureRequest) -> str:
    """A backend whose kernels compute."""
    return _backend(request)


@pytest.fixture(params=EVERY)
def every(request: pytest.FixtureRequest) -> str:
    """Any backend."""
    return _backend(request)


async def test_launch_returns_a_pending_signal_at_once_and_await_gives_device_seconds(computing: str) -> None:
    out = await int_buffer(computing)
    async with gate_on(computing) as gate:
        sig = gate.launch(out)
        assert isinstance(sig, Signal) and not sig.done()
        gate.open()
        seconds = await sig
    assert isinstance(seconds, float) and seconds >= 0
    assert await read(out) == 42
    await out.free()


async def test_launches_on_one_queue_complete_in_order(every: str) -> None:
    prog = await inc_program(every)
    out = await int_buffer(every)
    sigs = [prog(out) for _ in range(500)]
    await sigs[-1]
    assert all(s.done() for s in sigs)
    if every != "NULL":
        assert await read(out) == 500
    await out.free()


async def test_cancelling_the_wait_leaves_the_work_running(computing: str) -> None:
    out = await int_buffer(computing)
    async with gate_on(computing) as gate:
        sig = gate.launch(out)
        with anyio.move_on_after(0.01) as scope:
            await sig
        assert scope.cancelled_caught and not sig.done()
        gate.open()
        await sig
    assert await read(out) == 42
    await out.free()


async def test_free_with_work_pending_releases_the_memory_when_it_completes(computing: str) -> None:
    stats = Device[computing].allocator.statistics
    out = await int_buffer(computing)
    async with gate_on(computing) as gate:
        in_use = stats().bytes_in_use
        sig = gate.launch(out)
        await out.free()
        assert stats().bytes_in_use == in_use, "freed while the kernel still writes it"
        gate.open()
        await sig
        assert stats().bytes_in_use == in_use - out.nbytes


async def test_a_copy_on_the_copy_queue_waits_for_the_kernel_writing_its_memory(computing: str) -> None:
    out = await int_buffer(computing)
    host = np.zeros(1, np.int32)
    async with gate_on(computing) as gate:
        gate.launch(out, 7)
        async with anyio.create_task_group() as tg:
            tg.start_soon(out.copyout, host)
            await anyio.wait_all_tasks_blocked()
            assert host[0] == 0
            gate.open()
    assert host[0] == 7
    await out.free()


async def test_copy_from_within_one_device_is_ordered_after_the_source_write(computing: str) -> None:
    src = await int_buffer(computing)
    dst = await int_buffer(computing, 5)
    async with gate_on(computing) as gate:
        gate.launch(src, 77)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dst.copy_from, src)
            await anyio.wait_all_tasks_blocked()
            gate.open()
    assert await read(dst) == 77
    assert not Device[computing].allocator.direct_from(Device["CPU:2"]) or computing == "CPU"
    await src.free()
    await dst.free()


@pytest.mark.parametrize("dest", COMPUTING)
async def test_copy_from_between_any_two_devices_is_ordered_after_the_source_write(
    computing: str, dest: str, request: pytest.FixtureRequest
) -> None:
    if dest.startswith("RAY:"):
        request.getfixturevalue("ray_cluster")
    target = dest if dest != computing else f"{dest}:1"
    src = await int_buffer(computing)
    dst = await int_buffer(target, 5)
    async with gate_on(computing) as gate:
        gate.launch(src, 99)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dst.copy_from, src)
            await anyio.wait_all_tasks_blocked()
            gate.open()
    assert await read(dst) == 99
    await src.free()
    await dst.free()


async def test_wait_for_orders_a_launch_after_another_kind_of_queue(computing: str) -> None:
    other = "FAKE" if computing != "FAKE" else "CPU"
    prog = await inc_program(computing)
    out = await int_buffer(computing)
    flagged = await int_buffer(other)
    async with gate_on(other) as gate:
        first = gate.launch(flagged, 1)
        sig = prog(out, wait_for=[first])
        await anyio.wait_all_tasks_blocked()
        assert not sig.done()
        gate.open()
        await sig
    assert await read(out) == 1
    await out.free()
    await flagged.free()


async def test_a_failed_command_is_sticky_until_reset(every: str) -> None:
    dev = Device[every]
    prog = await inc_program(every)
    out = await int_buffer(every)
    done = prog(out)
    await done
    failed = fail_command(dev)
    with pytest.raises(DeviceError) as info:
        await failed
    assert isinstance(info.value.cause, ValueError)
    later = prog(out)
    with pytest.raises(DeviceError):
        await later
    with pytest.raises(DeviceError):
        await dev.synchronize()
    assert done.error() is None  # what completed before the failure stays successful
    await dev.reset()
    await prog(out)
    if every != "NULL":
        assert await read(out) == 2
    await out.free()


async def test_commands_queued_behind_a_failing_one_fail_with_its_error(every: str) -> None:
    dev = Device[every]
    prog = await inc_program(every)
    out = await int_buffer(every)
    failed = fail_command(dev)
    behind = [prog(out) for _ in range(3)]  # queued before the failure happened
    with pytest.raises(DeviceError) as info:
        await failed
    for sig in behind:
        with pytest.raises(DeviceError) as later:
            await sig
        assert later.value is info.value
    await dev.reset()
    await out.free()


async def test_a_launch_depending_on_a_failed_signal_fails_without_running(computing: str) -> None:
    other = Device["CPU:1"]
    failed = fail_command(other)
    with pytest.raises(DeviceError):
        await failed
    prog = await inc_program(computing)
    out = await int_buffer(computing)
    sig = prog(out, wait_for=[failed])
    with pytest.raises(DeviceError, match="depends on failed"):
        await sig
    assert await read(out) == 0
    await other.reset()
    await out.free()


async def test_a_timeout_names_the_device_and_the_timeline_state(computing: str) -> None:
    out = await int_buffer(computing)
    async with gate_on(computing) as gate:
        sig = gate.launch(out)
        with pytest.raises(TimeoutError, match=rf"{computing}: timeline compute not set to {sig.value}, but"):
            await sig.wait(timeout=0.02)
        gate.open()
        await sig
    await out.free()


async def test_await_is_a_checkpoint_even_when_done(every: str) -> None:
    prog = await inc_program(every)
    out = await int_buffer(every)
    sig = prog(out)
    await sig
    await assert_cancelled_at_entry(sig.wait)
    await assert_cancelled_at_entry(lambda: sig)
    await assert_cancelled_at_entry(Device[every].synchronize)
    await out.free()


async def test_await_of_a_done_signal_makes_the_bare_checkpoint_alone(
    every: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``await sig`` of a command already done makes the checkpoint anyio's comes down to (a bare
    yield on asyncio and uvloop, trio's own on trio) and nothing else: anyio's checkpoint, behind
    wait()'s frames, cost ~7 of ~15 us of such an await on asyncio. The result is the same."""
    prog = await inc_program(every)
    out = await int_buffer(every)
    sig = prog(out)
    first = await sig
    made = 0
    checkpoint = anyio.lowlevel.checkpoint

    async def counted() -> None:
        nonlocal made
        made += 1
        await checkpoint()

    monkeypatch.setattr(anyio.lowlevel, "checkpoint", counted)
    assert await sig == first and made == 0
    monkeypatch.undo()
    await out.free()


@pytest.mark.slow
async def test_a_thousand_concurrent_awaits_cost_no_thread_each(computing: str) -> None:
    out = await int_buffer(computing)
    results: list[float] = []
    async with gate_on(computing) as gate:
        sig = gate.launch(out)

        async def wait() -> None:
            results.append(await sig)

        before = threading.active_count()
        async with anyio.create_task_group() as tg:
            for _ in range(1000):
                tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            assert threading.active_count() <= before + 1
            assert sig.timeline.pending_waiters() == 1000
            gate.open()
    assert len(results) == 1000
    await out.free()


async def test_captured_launches_replay_as_one_command(computing: str) -> None:
    if computing.startswith("RAY:"):
        pytest.skip("RAY devices have no graph capture: RAYDevice.capture raises NotImplementedError")
    dev = Device[computing]
    prog = await inc_program(computing)
    out = await int_buffer(computing)
    async with dev.capture(out=out) as graph:
        for _ in range(5):
            prog(out)
    await graph.replay()
    await graph.replay()
    assert await read(out) == 10
    await out.free()


async def test_open_device_closes_and_a_closed_device_refuses_work(computing: str) -> None:
    name = f"{computing}:3"
    async with rt.open_device(name) as dev:
        prog = await inc_program(name)
        out = await int_buffer(name)
        prog(out)
    assert dev.closed
    with pytest.raises(DeviceError, match="closed"):
        prog(out)


async def test_a_driver_run_queue_holds_back_a_command_until_its_host_run_dependency_completes() -> None:
    fake = Device["FAKE"]
    assert isinstance(fake, FAKEDevice)
    prog = await inc_program("FAKE")
    out = await int_buffer("FAKE")
    flagged = await int_buffer("CPU")
    async with gate_on("CPU") as gate:
        first = gate.launch(flagged, 1)
        enqueued = fake.driver.enqueued
        sig = prog(out, wait_for=[first])
        then = prog(out)  # no dependency of its own, but behind the held-back one
        assert fake.driver.enqueued == enqueued, "handed to the driver before its dependency completed"
        gate.open()
        await then
    assert sig.done() and await read(out) == 2
    await out.free()
    await flagged.free()


async def test_a_dependency_on_another_queue_of_the_same_driver_context_joins_the_wait_list() -> None:
    fake = Device["FAKE"]
    assert isinstance(fake, FAKEDevice)
    prog = await inc_program("FAKE")
    out = await int_buffer("FAKE")
    release = threading.Event()
    copying = fake._copy_queue.submit(release.wait, (30,))  # pending on the copy queue
    enqueued = fake.driver.enqueued
    sig = prog(out, wait_for=[copying])
    assert fake.driver.enqueued == enqueued + 1, "held back instead of waiting in the driver"
    assert not sig.done()
    release.set()
    await sig
    assert await read(out) == 1
    await out.free()


EXIT_SCRIPT = """
import sys
import anyio
import tests.conftest  # registers TOY and FAKE
from tests.conformance.test_contract import inc_program, int_buffer

if sys.argv[1].startswith("RAY:"):  # join the test run's cluster (RAY_ADDRESS), quietly
    import ray
    ray.init(logging_level="ERROR", log_to_driver=False)
    import aiotinyrt.ray

async def main(device):
    prog = await inc_program(device)
    out = await int_buffer(device)
    sigs = [prog(out) for _ in range(2000)]
    print("queued", len(sigs), flush=True)

anyio.run(main, sys.argv[1])
"""


@pytest.mark.slow
@pytest.mark.parametrize("device", EVERY)
def test_exit_with_work_queued_is_quiet_and_successful(device: str, request: pytest.FixtureRequest) -> None:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if device.startswith("RAY:"):
        env["RAY_ADDRESS"] = request.getfixturevalue("ray_cluster").address
    result = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, device],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("queued 2000"), result.stdout
    assert result.stderr == ""
