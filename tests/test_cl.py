"""The CL backend (OpenCL on PoCL): discovery, memory, errors, the compiler, and every Kernel of
the renderer suite executed on CL and compared with the CPU. The async contract runs on CL in
tests/conformance."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from aiotinyrt import Buffer, CompileError, Device, DeviceError, dtypes, get_available_devices, native
from aiotinyrt.backends import cl_build, cl_queue
from aiotinyrt.backends import opencl as ocl
from aiotinyrt.backends.ops_cl import CLDevice, cl_command, ffi
from aiotinyrt.device import Compiled
from aiotinyrt.driverqueue import Done
from aiotinyrt.program import Program
from tests.helpers import CASES, Case, cl_ring, run_cpu

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
INC = "__kernel void inc(__global int* out) { out[0] += 1; }"


def _in_subprocess(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **env},
    )


DISCOVER = """
import aiotinyrt
from aiotinyrt import Device, get_available_devices
try:
    Device["CL"]
except RuntimeError as exc:
    print("error:", exc)
print("available:", get_available_devices())
"""


def test_no_platform_is_a_clear_error_and_cl_is_not_available() -> None:
    result = _in_subprocess(DISCOVER, OCL_ICD_VENDORS="/nonexistent-icd-dir")
    assert result.returncode == 0, result.stderr
    assert "error: CL: the OpenCL ICD loader found no platform" in result.stdout
    assert "'CL'" not in result.stdout.split("available:")[1]


def test_no_icd_loader_is_a_clear_error() -> None:
    code = "import aiotinyrt.backends.opencl as o\ndef gone(name): raise OSError(name + ': not found')\n"
    code += "o.ffi.dlopen = gone\n" + DISCOVER
    result = _in_subprocess(code)
    assert result.returncode == 0, result.stderr
    assert "error: CL: no OpenCL ICD loader (libOpenCL.so.1) could be loaded" in result.stdout


def test_devices_follow_the_platform_order_and_a_missing_index_is_named() -> None:
    found = ocl.devices()
    assert Device["CL"].count() == len(found) == 4  # POCL_DEVICES (tests/conftest.py)
    dev = Device["CL:1"]
    assert isinstance(dev, CLDevice) and dev.device_id == found[1][1]
    assert "CL" in get_available_devices()
    with pytest.raises(RuntimeError, match="CL:9: no OpenCL device 9; this machine has 4"):
        Device["CL:9"]


async def test_out_of_memory_names_the_device_the_size_and_the_memory_in_use() -> None:
    held = await Buffer("CL", 1024, dtypes.uint8).allocate()
    oom = r"CL: out of memory allocating 17592186044416 bytes .*1024 bytes in use.*CL_"
    with pytest.raises(MemoryError, match=oom):
        await Device["CL"].allocator.alloc(1 << 44)
    await held.free()


async def test_copies_round_trip_through_views() -> None:
    buf = await Buffer("CL", 64, dtypes.int32).allocate()
    await buf.copyin(np.arange(64, dtype=np.int32))
    view = buf.view(16, dtypes.int32, 32 * 4)
    await view.copyin(np.full(16, -1, np.int32))
    out = await buf.numpy()
    assert out.tolist() == list(range(32)) + [-1] * 16 + list(range(48, 64))
    await buf.free()


async def test_a_kernel_on_a_view_sees_only_the_view() -> None:
    prog = await Device["CL"].program("inc", INC)
    buf = await Buffer("CL", 64, dtypes.int32).allocate()
    await buf.copyin(np.zeros(64, np.int32))
    await prog(buf.view(1, dtypes.int32, 32 * 4))  # 128 bytes: PoCL's sub-buffer alignment
    assert (await buf.numpy()).tolist() == [0] * 32 + [1] + [0] * 31
    await buf.free()


async def test_a_build_failure_is_a_compile_error_with_the_build_log() -> None:
    with pytest.raises(CompileError, match="CL_BUILD_PROGRAM_FAILURE") as info:
        await Device["CL"].program("broken", "__kernel void broken(__global int* o) { o[0] = nope; }")
    assert "nope" in info.value.diagnostics


async def test_the_binary_is_cached_under_the_device_and_driver_version() -> None:
    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    identity = await dev.compiler.identity()
    assert dev.driver_version in identity and dev.device_name in identity
    src = f"// {os.urandom(8).hex()}\n" + INC  # a source no earlier run compiled
    compiles = dev.compiler.compiles
    lib = await dev.compiler.compile_cached(src)
    assert await Device["CL:2"].compiler.compile_cached(src) == lib  # same device kind: shared
    assert dev.compiler.compiles == compiles + 1


async def test_builds_run_in_a_compile_server_and_one_that_exited_is_replaced() -> None:
    dev = Device["CL:3"]
    assert isinstance(dev, CLDevice)
    pool = dev.compiler.servers
    src = f"// {os.urandom(8).hex()}\n" + INC
    lib = await dev.compiler.compile(src)
    assert ocl.load(dev.context, dev.device_ids, lib, "inc")[1] != ffi.NULL
    (server,) = pool._idle  # the build ran in it, a process of its own
    assert server.proc.pid != os.getpid() and server.proc.poll() is None
    server.proc.kill()
    server.proc.wait()
    assert await dev.compiler.compile(src.replace("//", "// again")) != b""  # on a fresh server
    assert len(pool._idle) == 1 and pool._idle[0] is not server


async def test_an_opencl_error_code_is_a_sticky_device_error_naming_the_code_and_the_call() -> None:
    dev = Device["CL"]
    prog, out = await _inc_and_zero(dev)
    bad = r"clEnqueueNDRangeKernel\(inc\) failed: CL_INVALID_WORK_GROUP_SIZE"
    with pytest.raises(DeviceError, match=bad):
        await prog(out, global_size=(3, 1, 1), local_size=(2, 1, 1))  # 3 is no multiple of 2
    with pytest.raises(DeviceError):
        await prog(out)  # sticky
    await dev.reset()
    await prog(out)
    assert (await out.numpy())[0] == 1
    await out.free()


async def test_a_failed_event_fails_its_signal_and_the_device_until_reset() -> None:
    dev = Device["CL"]
    cl, err = ocl.lib(), ffi.new("cl_int*")
    user = cl.clCreateUserEvent(dev.context, err)

    @cl_command
    def the_user_event(queue: object, n: int, wl: object) -> object:
        cl.clRetainEvent(user)  # (the driver releases the command's event)
        return user  # a command whose event the test fails

    sig = dev._compute_queue.submit(the_user_event, ())
    assert not sig.done()
    cl.clSetUserEventStatus(user, -5)  # the command's event fails
    with pytest.raises(DeviceError, match=r"execution status\) failed: CL_OUT_OF_RESOURCES \(-5\)"):
        await sig
    prog = await dev.program("inc", INC)
    out = await Buffer("CL", 1, dtypes.int32).allocate()
    with pytest.raises(DeviceError):
        await out.copyin(np.zeros(1, np.int32))
    await dev.reset()
    await out.copyin(np.zeros(1, np.int32))
    await prog(out)
    assert (await out.numpy())[0] == 1
    cl.clReleaseEvent(user)
    await out.free()


def _user_event_command(event: object) -> object:
    cl = ocl.lib()

    @cl_command
    def the_user_event(queue: object, n: int, wl: object) -> object:
        cl.clRetainEvent(event)  # (the driver releases the command's event)
        return event

    return the_user_event


async def test_a_failed_event_in_a_completed_batch_fails_its_signal_and_the_later_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dev = Device["CL"]
    cl, err = ocl.lib(), ffi.new("cl_int*")
    prog, out = await _inc_and_zero(dev)
    gate, failing = cl.clCreateUserEvent(dev.context, err), cl.clCreateUserEvent(dev.context, err)
    sizes: list[int] = []  # (the commands each take of the waiter held)
    queue = dev._compute_queue
    real, report = cl_queue.CLQueue._report_taken, cl_queue.report

    def spy(driver: cl_queue.CLQueue, n: int, taken: Any) -> None:
        if driver is queue.driver:
            sizes.append(n)
        real(driver, n, taken)

    def spy_report(batch: list[tuple[Done, float, BaseException | None]]) -> None:  # (NATIVE_QUEUE=0)
        if batch[0][0].queue is queue:  # type: ignore[attr-defined]
            sizes.append(len(batch))
        report(batch)

    if queue.driver._ring is None:  # type: ignore[attr-defined]
        monkeypatch.setattr(cl_queue, "report", spy_report)
    else:
        monkeypatch.setattr(cl_queue.CLQueue, "_report_taken", spy)
    first = queue.submit(_user_event_command(gate), ())  # holds the waiter: the rest is one batch
    before, failed, after = prog(out), queue.submit(_user_event_command(failing), ()), prog(out)
    kernels = ffi.new("cl_event[2]", [queue._event(s.value) for s in (before, after)])
    assert cl.clWaitForEvents(2, kernels) == 0  # (they need not wait for the user events)
    cl.clSetUserEventStatus(failing, -5)
    cl.clSetUserEventStatus(gate, ocl.COMPLETE)
    with pytest.raises(DeviceError, match=r"execution status\) failed: CL_OUT_OF_RESOURCES"):
        await after  # (completed after the failure: the device's sticky error)
    assert sizes == [4]
    assert first.error() is None and before.error() is None
    assert failed.error() is dev._error and after.error() is dev._error
    await dev.reset()
    for event in (gate, failing):
        cl.clReleaseEvent(event)
    await out.free()


async def test_a_host_command_runs_after_the_commands_before_it_in_its_batch_completed() -> None:
    dev = Device["CL"]
    cl, err = ocl.lib(), ffi.new("cl_int*")
    prog, out = await _inc_and_zero(dev)
    queue = dev._compute_queue
    gate = cl.clCreateUserEvent(dev.context, err)
    queue.submit(_user_event_command(gate), ())  # holds the waiter: what follows is one batch
    kernel = prog(out)
    seen: list[object] = []

    def host() -> None:  # may even wait for an earlier command of its own queue
        seen.append(kernel.done())
        seen.append(kernel.wait_blocking(timeout=10))

    ran = queue.submit(host, ())
    cl.clSetUserEventStatus(gate, ocl.COMPLETE)
    await ran
    assert seen[0] is True and isinstance(seen[1], float)
    cl.clReleaseEvent(gate)
    await out.free()


async def test_thousands_of_commands_in_flight_complete_in_order() -> None:
    """More events than the native completion ring's first 1,024 slots are in flight at once (a
    user event holds the waiter on the first): the ring grows and every command completes."""
    dev = Device["CL"]
    queue = dev._compute_queue
    cl, err = ocl.lib(), ffi.new("cl_int*")
    prog, out = await _inc_and_zero(dev)
    gate = cl.clCreateUserEvent(dev.context, err)
    held = queue.submit(_user_event_command(gate), ())
    sigs = [prog(out) for _ in range(3000)]
    assert not held.done() and not any(s.done() for s in sigs)
    cl.clSetUserEventStatus(gate, ocl.COMPLETE)
    await sigs[-1]
    assert all(s.done() and s.error() is None for s in sigs)
    assert (await out.numpy())[0] == 3000
    cl.clReleaseEvent(gate)
    await out.free()


async def _inc_and_zero(dev: Compiled) -> tuple[Program, Buffer]:
    """``inc`` on ``dev`` and an int there holding 0."""
    prog = await dev.program("inc", INC)
    out = await Buffer(dev.name, 1, dtypes.int32).allocate()
    await out.copyin(np.zeros(1, np.int32))
    return prog, out


async def _on_the_ring() -> tuple[CLDevice, Any, Program, Buffer]:
    """CL, its compute queue (skipped without the native completion ring), ``inc`` and a zeroed
    int."""
    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    queue = dev._compute_queue
    if queue.driver._ring is None:  # type: ignore[attr-defined]
        pytest.skip("NATIVE_QUEUE=0: no completion ring (the Python waiter takes every event)")
    prog, out = await _inc_and_zero(dev)
    return dev, queue, prog, out


class _RingFull:
    """The native library with clq_push refusing every event (as when out of memory)."""

    def __init__(self, lib: object) -> None:
        self.lib = lib

    def __getattr__(self, name: str) -> object:
        return getattr(self.lib, name)

    def clq_push(self, ring: object, event: object, tag: int, urgent: int) -> int:
        return -1


async def test_a_command_the_completion_ring_refuses_fails_after_the_device_is_done_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A launch is enqueued before its event is handed over: if the ring refuses the event, the
    command fails only once the device finished with its memory, and a refused Python command
    does not hold the queue's later commands behind its barrier."""
    dev, queue, prog, out = await _on_the_ring()
    driver, ran = queue.driver, []
    monkeypatch.setattr(driver, "_native", _RingFull(driver._native))  # type: ignore[attr-defined]
    host = queue.submit(lambda: ran.append(True), ())
    monkeypatch.undo()
    with pytest.raises(DeviceError, match="completion ring"):
        await host
    await dev.reset()
    after = prog(out)
    await after.wait(timeout=30)  # (behind the refused command's barrier, had it stayed shut)
    ahead: list[bool] = []
    queue.submit(lambda: ahead.append(True), ())  # (the kernel below waits for it)
    monkeypatch.setattr(driver, "_native", _RingFull(driver._native))  # type: ignore[attr-defined]
    prog._by_bufs.clear()  # (the Python hand-over: tests/test_cl_fast.py has the C launch's)
    refused = prog(out)
    monkeypatch.undo()
    assert ahead  # the launch returned once its kernel ran, behind the Python command
    with pytest.raises(DeviceError, match="completion ring"):
        await refused.wait(timeout=30)
    await dev.reset()
    assert (await out.numpy())[0] == 2 and not ran
    await out.free()


class _InterruptedPush(_RingFull):
    """The native library with clq_push interrupted once before it ran (as by a Ctrl-C)."""

    def clq_push(self, ring: object, event: object, tag: int, urgent: int) -> int:
        raise KeyboardInterrupt


async def test_a_hand_over_interrupted_before_the_ring_took_the_event_shifts_no_completion(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The waiter's deque has the command and the ring has not: that entry is dropped, and the
    commands after it get their own events' completions."""
    dev, queue, prog, out = await _on_the_ring()
    driver = queue.driver
    monkeypatch.setattr(driver, "_native", _InterruptedPush(driver._native))  # type: ignore[attr-defined]
    interrupted = prog(out)
    monkeypatch.undo()
    with pytest.raises(DeviceError):
        await interrupted
    await dev.reset()
    sigs = [prog(out) for _ in range(3)]
    for sig in sigs:
        await sig.wait(timeout=30)  # (each got the one before it's completion, the last none)
    assert (await out.numpy())[0] == 4  # (the interrupted launch was enqueued, and ran)
    await out.free()


def _ring_waiting_with(wait: Any) -> tuple[Any, Any, tuple[Any, ...]]:
    """A completion ring whose driver wait is ``wait`` (a cffi callback), and arrays for 4
    results."""
    lib, cl = native.load(), ocl.lib()
    if lib is None:
        pytest.skip("NATIVE_QUEUE=0: no completion ring (the native library is off)")
    entry = [int(ffi.cast("uintptr_t", ffi.addressof(cl, n))) for n in cl_queue._ENTRY_POINTS]
    entry[0] = int(native.ffi.cast("uintptr_t", wait))
    ring = native.ffi.gc(lib.clq_new(*entry), lib.clq_free)
    arrays = (
        native.ffi.new("int32_t[4]"),
        native.ffi.new("double[4]"),
        native.ffi.new("int64_t[4]"),
        native.ffi.new("void *[4]"),
    )
    return lib, ring, arrays


def test_a_wait_that_fails_before_its_event_completed_reports_nothing_until_it_has() -> None:
    """clq_wait with a wait that fails at once (the driver's error), while somebody waits for
    the queue (so the driver's wait is used), returns no completion while the event is still
    queued, sleeping between calls, and reports it once it completed."""
    cl, err = ocl.lib(), ffi.new("cl_int*")
    failing = native.ffi.callback("int(uint32_t, void*)", lambda n, events: -5)
    lib, ring, (status, seconds, tags, objs) = _ring_waiting_with(failing)
    lib.clq_set_wake(ring, 1)
    event = cl.clCreateUserEvent(Device["CL"].context, err)  # type: ignore[attr-defined]
    assert lib.clq_push(ring, event, 7, 0) == 0
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == 0  # (still queued: nothing reported)
    cl.clSetUserEventStatus(event, ocl.COMPLETE)
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == 1
    assert (status[0], tags[0]) == (0, 7)
    lib.clq_close(ring)
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == -1
    cl.clReleaseEvent(event)


def test_while_nobody_waits_the_ring_looks_at_its_oldest_event_instead_of_waiting_in_the_driver() -> None:
    """Nobody waits for the queue: clq_wait looks at the oldest event before it waits for it
    in the driver (a round trip's command is its awaiting thread's to take), and reports it
    without the driver's wait once it completed. Once somebody waits, the driver's wait is
    used at once."""
    cl, err = ocl.lib(), ffi.new("cl_int*")
    calls: list[int] = []

    def counted(n: int, events: Any) -> int:
        calls.append(n)
        return int(cl.clWaitForEvents(n, ffi.cast("cl_event *", events)))

    wait = native.ffi.callback("int(uint32_t, void*)", counted)
    lib, ring, (status, seconds, tags, objs) = _ring_waiting_with(wait)
    context = Device["CL"].context  # type: ignore[attr-defined]
    first, second = cl.clCreateUserEvent(context, err), cl.clCreateUserEvent(context, err)
    assert lib.clq_push(ring, first, 1, 0) == 0
    cl.clSetUserEventStatus(first, ocl.COMPLETE)
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == 1 and tags[0] == 1
    assert calls == []  # (its first look found it done)
    lib.clq_set_wake(ring, 1)  # somebody waits now
    assert lib.clq_push(ring, second, 2, 0) == 0
    cl.clSetUserEventStatus(second, ocl.COMPLETE)
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == 1 and tags[0] == 2
    assert calls == [1]
    lib.clq_close(ring)
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == -1
    for event in (first, second):
        cl.clReleaseEvent(event)


async def test_a_launch_after_one_whose_arguments_failed_sets_its_arguments_again() -> None:
    dev = Device["CL"]
    prog = await dev.program(
        "cp", "__kernel void cp(__global int* d, __global const int* s) { d[0] = s[0]; }"
    )
    x, x2, y = [await Buffer("CL", 64, dtypes.int32).allocate() for _ in range(3)]
    for buf, value in ((x, 0), (x2, 0), (y, 7)):
        await buf.copyin(np.full(64, value, np.int32))
    await prog(x, y)
    with pytest.raises(DeviceError, match="CL_MISALIGNED_SUB_BUFFER_OFFSET"):
        await prog(x2, y.view(1, dtypes.int32, 4))  # x2 is set as argument 0, then the view fails
    await dev.reset()
    await y.copyin(np.full(64, 9, np.int32))
    await prog(x, y)  # the same arguments as the last launch that set them all
    assert (await x.numpy())[0] == 9 and (await x2.numpy())[0] == 0
    for buf in (x, x2, y):
        await buf.free()


def test_a_build_on_a_server_that_died_while_idle_is_run_on_a_fresh_one() -> None:
    pool = cl_build.BuildPool(0, size=1)
    try:
        kernel = "__kernel void w{0}(__global int* a) {{ a[0] = {0}; }}"
        pool.build(kernel.format(0))
        for i in range(1, 4):
            (server,) = pool._idle
            os.kill(server.proc.pid, signal.SIGKILL)  # killed while idle, not reaped yet
            assert pool.build(kernel.format(i))
    finally:
        pool.close()


def test_a_build_sent_to_a_server_already_gone_is_a_compile_error() -> None:
    # the request stays in the pipe's buffer (nobody reads it): closing the pipe must not raise
    server = cl_build.BuildServer(0)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()
    with pytest.raises(CompileError, match="the compile server exited"):
        server.build("__kernel void w(__global int* a) { a[0] = 1; }")


async def test_a_command_whose_wait_list_holds_a_failed_event_fails_as_not_run_because_of_it() -> None:
    dev = Device["CL"]
    cl, err = ocl.lib(), ffi.new("cl_int*")
    prog, out = await _inc_and_zero(dev)
    failing = cl.clCreateUserEvent(dev.context, err)
    failed = dev._compute_queue.submit(_user_event_command(failing), ())
    # the launch on the other queue of the context: the failed event is in its wait list
    fn, args = prog._launcher((out.handle(),), (1, 1, 1), None, ())
    dependent = dev._copy_queue.submit(fn, args, (failed,))
    cl.clSetUserEventStatus(failing, -5)
    with pytest.raises(DeviceError, match=r"not run because a command it depends on failed \(CL/compute@"):
        await dependent
    assert failed.error() is dev._error
    await dev.reset()
    cl.clReleaseEvent(failing)
    await out.free()


@pytest.mark.parametrize("case", CASES, ids=[c.kernel.name for c in CASES])
async def test_every_renderer_kernel_runs_on_cl_and_matches_the_cpu(case: Case) -> None:
    inputs = case.make_inputs()
    cpu = await run_cpu(case.kernel, case.global_size, inputs, case.vals)
    prog = await Device["CL"].program(case.kernel)
    bufs = []
    for param, array in zip(case.kernel.buffers, inputs, strict=True):
        buf = await Buffer("CL", array.size, param.dtype).allocate()
        await buf.copyin(np.ascontiguousarray(array))
        bufs.append(buf)
    await prog(*bufs, vals=case.vals, global_size=case.global_size, local_size=(8, 1, 1))
    for i, (buf, want) in enumerate(zip(bufs, cpu, strict=True)):
        got = np.empty_like(want)
        await buf.copyout(got)
        await buf.free()
        if case.exact:
            assert got.tobytes() == want.tobytes(), f"buffer {i}: {got[:6]} != {want[:6]}"
        else:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"buffer {i}")


async def test_a_command_nobody_awaits_is_seen_done_by_a_caller_polling_it() -> None:
    """The completion ring holds completions back for larger batches only while nobody waits,
    and then for a bounded time: polling ``done()`` sees a launch complete."""
    dev = Device["CL"]
    prog, out = await _inc_and_zero(dev)
    sig = prog(out)
    with anyio.fail_after(30):
        while not sig.done():
            await anyio.sleep(0.005)  # (a poller's own pace; nothing waits for sig)
    assert dev._compute_queue.timeline.pending_waiters() == 0
    assert (await out.numpy())[0] == 1
    await out.free()


def test_an_event_pending_past_a_few_looks_or_behind_a_python_command_is_waited_for_in_the_driver() -> None:
    """Nobody waits: an event still pending after the waiter's few looks (1 ms) is waited for
    in the driver (a long kernel costs no wake-ups); with a Python command's (urgent) event in
    the ring, the driver's wait is used at once."""
    cl, err = ocl.lib(), ffi.new("cl_int*")
    waited = threading.Event()

    def counted(n: int, events: Any) -> int:
        waited.set()
        return int(cl.clWaitForEvents(n, ffi.cast("cl_event *", events)))

    wait = native.ffi.callback("int(uint32_t, void*)", counted)
    lib, ring, (status, seconds, tags, objs) = _ring_waiting_with(wait)
    context = Device["CL"].context  # type: ignore[attr-defined]
    for urgent in (0, 1):
        event = cl.clCreateUserEvent(context, err)
        assert lib.clq_push(ring, event, 5 + urgent, urgent) == 0
        waited.clear()
        taken: list[int] = []
        taker = threading.Thread(
            target=lambda out: out.append(lib.clq_wait(ring, 4, status, seconds, tags, objs)), args=(taken,)
        )
        taker.start()
        try:
            assert waited.wait(30)  # (the driver's wait, while the event is still pending)
        finally:
            cl.clSetUserEventStatus(event, ocl.COMPLETE)
            taker.join(30)
        assert taken == [1] and tags[0] == 5 + urgent
        cl.clReleaseEvent(event)
    lib.clq_close(ring)
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == -1


def test_a_new_event_at_the_address_of_one_the_waiter_gave_up_looking_at_is_looked_at_again() -> None:
    """The waiter's looks belong to one event: once it is taken, the next one, even at the same
    address (PoCL reuses an event's memory at once), is looked at before any driver wait."""
    cl, err = ocl.lib(), ffi.new("cl_int*")
    waited = threading.Event()
    calls: list[int] = []

    def counted(n: int, events: Any) -> int:
        calls.append(n)
        waited.set()
        return int(cl.clWaitForEvents(n, ffi.cast("cl_event *", events)))

    wait = native.ffi.callback("int(uint32_t, void*)", counted)
    lib, ring, (status, seconds, tags, objs) = _ring_waiting_with(wait)
    context = Device["CL"].context  # type: ignore[attr-defined]
    long = cl.clCreateUserEvent(context, err)
    assert lib.clq_push(ring, long, 1, 0) == 0
    taken: list[int] = []
    taker = threading.Thread(
        target=lambda out: out.append(lib.clq_wait(ring, 4, status, seconds, tags, objs)), args=(taken,)
    )
    taker.start()
    try:
        assert waited.wait(30)  # (its looks used up: waited for in the driver)
    finally:
        cl.clSetUserEventStatus(long, ocl.COMPLETE)
        taker.join(30)
    assert taken == [1] and calls == [1]
    cl.clReleaseEvent(long)
    short = cl.clCreateUserEvent(context, err)  # (here: at the released one's address)
    cl.clSetUserEventStatus(short, ocl.COMPLETE)
    assert lib.clq_push(ring, short, 2, 0) == 0
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == 1 and tags[0] == 2
    assert calls == [1]  # (its first look found it done)
    cl.clReleaseEvent(short)
    lib.clq_close(ring)
    assert lib.clq_wait(ring, 4, status, seconds, tags, objs) == -1


FORKED_RING = """
import os, sys
from aiotinyrt import Device, native
from aiotinyrt.backends import opencl as ocl

dev = Device["CL"]
driver = dev._compute_queue.driver
lib, ring = driver._native, driver._ring
driver.gate(60_000_000)  # (an idle queue with gating on: clq_gate opens a batch)
pid = os.fork()
if pid == 0:  # the ring is the parent's: clq_gate does nothing here
    os._exit(0 if lib.clq_gate(ring) == native.ffi.NULL else 3)
_, status = os.waitpid(pid, 0)
gate = lib.clq_gate(ring)  # (the parent's own ring still opens a batch)
print(os.waitstatus_to_exitcode(status), gate != native.ffi.NULL)
lib.clq_open(ring)
ocl.lib().clReleaseEvent(ocl.ffi.cast("cl_event", int(native.ffi.cast("uintptr_t", gate))))
"""


def test_a_forked_child_leaves_the_parents_completion_ring_alone() -> None:
    """The ring knows the process that made it (clq.c keeps this process's id, updated by a
    fork handler, instead of asking the kernel at every enqueue): in a child forked after it,
    clq_gate opens no batch (PoCL's threads are the parent's); in the parent it still does."""
    cl_ring("fork check")
    result = subprocess.run(
        [sys.executable, "-c", FORKED_RING], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "0 True\n", (result.stdout, result.stderr)
