"""The CL repeat launch made in C (aiotinyrt/native/clfast.c): which launches take it, that
their signals and access records are a Python launch's while the DriverQueue keeps no record of
them, how their completion and failure are reported, and that it steps aside whenever the
Python path would do anything but enqueue (arguments to set, commands held back, a sticky error,
a completion ring that refuses the event)."""

from __future__ import annotations

import gc
import threading
from typing import Any

import numpy as np
import pytest

from aiotinyrt import Device, DeviceError, native
from aiotinyrt.backends import cl_queue
from aiotinyrt.backends import opencl as ocl
from aiotinyrt.backends.cl_queue import CLQueue
from aiotinyrt.backends.ops_cl import CLDevice, ffi
from aiotinyrt.device import Compiled
from aiotinyrt.driverqueue import DriverQueue
from aiotinyrt.program import Program
from tests.helpers import int_buffer

pytestmark = pytest.mark.anyio

INC = "__kernel void inc(__global int* out) { out[0] += 1; }"
ADD = "__kernel void add(__global int* out, int v) { out[0] += v; }"
SET5 = "__kernel void set5(__global int* out) { out[0] = 5; }"


def _c_device() -> CLDevice:
    """CL, skipped where its repeat launch cannot be in C (no extension module or no ring)."""
    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    if not dev._compute_queue.driver._ring or native.launcher() is None:  # type: ignore[attr-defined]
        pytest.skip("NATIVE_QUEUE=0: no extension module and no completion ring, so no C launch")
    return dev


class _PythonCalls:
    """Counts the launches that enter the Python implementation (``Program._call``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        call = Program._call

        def counted(prog: Program, *args: Any) -> Any:
            self.n += 1
            return call(prog, *args)

        monkeypatch.setattr(Program, "_call", counted)


async def test_repeat_launches_are_made_in_c_and_leave_no_record_but_their_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only the first launch enters Python; the others' signals and access records are those
    of a Python launch, while the DriverQueue keeps no record of them (the ring holds their
    events and signals): a read on the copy queue, submitted while they are still queued
    (behind a Python command), finds the last one's event for its wait list."""
    dev = _c_device()
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    queue, copy = dev._compute_queue, dev.queues["copy"]
    go = threading.Event()
    ahead = queue.submit(lambda: go.wait(60), ())  # (the queue's later commands wait for it)
    try:
        calls = _PythonCalls(monkeypatch)
        sigs = [prog(out) for _ in range(200)]
        assert calls.n == 1 and len(prog._fast or ()) == 11
        assert not any(gc.is_tracked(s) for s in sigs[1:])  # (pending: the collector skips them)
        last = sigs[-1]
        kept = last._keep  # (nor their tuples of buffers, which would outlive young collections)
        assert kept == (out,) and not any(gc.is_tracked(s._keep) for s in sigs[1:])
        assert out._accesses == [(0, 4, last, True)] and last.timeline is queue.timeline
        assert [s.value for s in sigs] == list(range(ahead.value + 1, ahead.value + 201))
        assert last.value not in queue._events and last.value not in queue._commands
        assert queue._event(last.value) is not None  # (found in the ring)
        host = np.zeros(1, np.int32)
        read = out._enqueue_copy(memoryview(host), into=False)
        assert not copy._held  # (handed over with the launch's event in its wait list)
    finally:
        go.set()
    await read
    assert host[0] == 200 and all(s.done() and not s.failed() for s in sigs) and await last >= 0.0
    assert queue._commands == {} and queue._events == {} and queue._runs == {}
    assert queue._event(last.value) is None  # (reported: the ring let it go)
    assert all(gc.is_tracked(s) for s in sigs)  # (completed: a frame or an error may hold them)
    assert gc.is_tracked(kept)  # (a tuple still held elsewhere is the collector's again)
    assert all(s._keep is None and s._args is None for s in sigs)  # (what they held is dropped)
    await out.free()


async def test_a_repeat_launch_whose_event_failed_fails_alone_and_the_later_ones_with_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A repeat launch whose event reports a failed execution status fails with it (the
    device's sticky error), the launches before it in the same batch succeed, and those after
    it fail with the sticky error. (The status is rewritten as the batch is reported.)"""
    dev = _c_device()
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await prog(out)
    queue, real = dev._compute_queue, CLQueue._report_taken
    go = threading.Event()
    ahead = queue.submit(lambda: go.wait(60), ())  # (the launches below complete in one batch)
    try:
        sigs = [prog(out) for _ in range(5)]
        doomed = sigs[2].value

        def failing(driver: CLQueue, n: int, taken: Any) -> None:
            status, _, tags, _ = taken.arrays
            for i in range(n):
                if tags[i] == -doomed:
                    status[i] = -5  # CL_OUT_OF_RESOURCES
            real(driver, n, taken)

        monkeypatch.setattr(CLQueue, "_report_taken", failing)
        # (a poll's report in C never fails one: the polls report in Python)
        monkeypatch.setattr(queue.driver, "_settle", ())
        monkeypatch.setattr(queue.timeline, "claim", queue._claim)
        monkeypatch.setattr(queue.timeline, "poll", queue._poll)
    finally:
        go.set()
    await ahead
    with pytest.raises(DeviceError, match="CL_OUT_OF_RESOURCES"):
        await sigs[2].wait(timeout=30)
    with pytest.raises(DeviceError, match="CL_OUT_OF_RESOURCES"):
        await sigs[-1].wait(timeout=30)
    assert sigs[0].error() is None and sigs[1].error() is None
    assert sigs[2].error() is dev._error and all(s.error() is dev._error for s in sigs[3:])
    assert queue._commands == {} and queue._runs == {}
    monkeypatch.setattr(CLQueue, "_report_taken", real)
    await dev.reset()
    await prog(out)
    assert (await out.numpy())[0] == 7
    await out.free()


def test_a_closed_queue_drops_the_items_whose_events_never_reached_its_ring() -> None:
    """A command whose hand-over failed after its item was queued leaves the item behind (and
    with it the queue, through its Completion); closing the queue drops it."""
    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    driver = CLQueue("stale", dev.context, dev.device_id)
    if driver._ring is None:
        pytest.skip("NATIVE_QUEUE=0: no completion ring, so no items")
    driver._items.append((1, lambda seconds, error: None, None))  # (its event never came)
    driver.close()
    driver._waiter.join(30)
    assert not driver._waiter.is_alive() and not driver._items


async def test_a_launch_with_other_arguments_goes_to_python_and_sets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel's arguments are state: launches alternating between buffers, or between
    vals, each set them in Python; the same ones again repeat in C."""
    dev = _c_device()
    add = await dev.program("add", ADD)
    a, b = await int_buffer(dev.name), await int_buffer(dev.name)
    calls = _PythonCalls(monkeypatch)
    for _ in range(5):
        add(a, vals=(1,))
        add(b, vals=(10,))
    assert calls.n == 10
    for _ in range(5):
        add(a, vals=(2,))
    assert calls.n == 11  # the first one sets the new vals
    assert (await a.numpy())[0] == 5 + 10 and (await b.numpy())[0] == 50
    await a.free()
    await b.free()


async def test_a_repeat_launch_behind_a_held_back_command_waits_its_turn() -> None:
    """A command held back for another device's pending work keeps every later one of its
    queue back: the repeat launch must not reach the driver first (it would run first)."""
    dev = _c_device()
    inc, set5 = await dev.program("inc", INC), await dev.program("set5", SET5)
    out = await int_buffer(dev.name)
    await inc(out)  # (remembered: the next one repeats)
    gate = threading.Event()
    blocker = Device["CPU"]._compute_queue.submit(lambda: gate.wait(60), ())
    held = set5(out, wait_for=[blocker])
    after = inc(out)
    assert not held.done() and dev._compute_queue._held
    gate.set()
    await after
    assert held.done() and (await out.numpy())[0] == 6  # 5, then + 1
    await out.free()


async def test_a_repeat_launch_on_a_device_holding_its_error_fails_unrun() -> None:
    """A repeat launch after a failure takes the Python path, which fails it with the sticky
    error; after reset() they repeat in C again."""
    dev = _c_device()
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await prog(out)

    def boom() -> None:
        raise RuntimeError("boom")

    failed = dev._compute_queue.submit(boom, ())
    with pytest.raises(DeviceError, match="boom"):
        await failed
    with pytest.raises(DeviceError, match="boom"):
        await prog(out)
    await dev.reset()
    await prog(out)
    assert (await out.numpy())[0] == 2
    await out.free()


_SLOT_NAMES = frozenset({"_error", "_closed", "_bufs", "_vals"})


def _spying(cls: type, reads: list[str]) -> type:
    """A subclass of ``cls`` (same layout) that logs every read of a slot the C launch needs."""

    def __getattribute__(self: Any, name: str) -> Any:
        if name in _SLOT_NAMES:
            reads.append(name)
        return cls.__getattribute__(self, name)

    return type(f"Spied{cls.__name__}", (cls,), {"__getattribute__": __getattribute__})


async def test_a_repeat_launch_reads_the_device_and_program_state_by_slot_offsets() -> None:
    """The device's ``_error``/``_closed`` and the program's ``_bufs``/``_vals`` are read from
    their slots, not looked up by name: no read reaches ``__getattribute__`` (each generic
    look-up cost ~50-100 ns of the launch)."""
    dev = _c_device()
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await prog(out)
    reads: list[str] = []
    dev_class, prog_class = type(dev), type(prog)
    try:
        dev.__class__ = _spying(dev_class, reads)
        prog.__class__ = _spying(prog_class, reads)
        sigs = [prog(out) for _ in range(20)]
        assert prog._fast is not None  # (the repeat launch stayed in C: nothing was reset)
        assert not reads
    finally:
        dev.__class__, prog.__class__ = dev_class, prog_class
    for sig in sigs:
        await sig
    assert (await out.numpy())[0] == 21
    await out.free()


async def test_a_device_class_that_shadows_the_error_slot_is_read_by_name() -> None:
    """A subclass with a class attribute ``_error`` keeps the sticky error in the instance
    ``__dict__`` (the slot is never set): the C launch reads it by name there and declines, so
    the launch fails with the error instead of running."""
    dev = _c_device()
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await prog(out)
    dev_class = type(dev)
    shadow = type("Shadowing", (dev_class,), {"_error": None})
    try:
        dev.__class__ = shadow
        dev._error = DeviceError(
            "held", device=dev.name
        )  # (into __dict__: the class attribute hides the slot)
        assert Compiled.__dict__["_error"].__get__(dev) is None  # (the slot itself)
        with pytest.raises(DeviceError, match="held"):
            await prog(out)
    finally:
        dev.__dict__.pop("_error", None)
        dev.__class__ = dev_class
    await dev.reset()
    await prog(out)
    assert (await out.numpy())[0] == 2
    await out.free()


async def test_a_repeat_launch_the_completion_ring_refuses_fails_once_the_kernel_ran() -> None:
    """A launch made in C whose event the completion ring refuses (here: a closed ring put in
    the program's C state) was enqueued: its signal fails with the ring's MemoryError only once
    the kernel ran. Here the kernel waits behind a Python command, which the waiter thread runs
    with the GIL: the launch must let go of it while it waits. The queue goes on after reset()."""
    dev = _c_device()
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await prog(out)
    lib, cl, fast, queue = native.load(), ocl.lib(), prog._fast, dev._compute_queue
    assert fast is not None
    entry = [int(ffi.cast("uintptr_t", ffi.addressof(cl, n))) for n in cl_queue._ENTRY_POINTS]
    closed = native.ffi.gc(lib.clq_new(*entry), lib.clq_free)
    lib.clq_close(closed)
    ran: list[bool] = []
    ahead = queue.submit(lambda: ran.append(True), ())  # (the queue's later commands wait for it)
    prog._fast = (*fast[:3], int(native.ffi.cast("uintptr_t", closed)), *fast[4:])
    try:
        refused = prog(out)
    finally:
        prog._fast = fast
    assert ran and refused.value == ahead.value + 1  # (returned once its kernel ran)
    with pytest.raises(DeviceError, match="no memory for the completion ring"):
        await refused.wait(timeout=30)
    assert gc.is_tracked(refused)  # (its error's traceback may lead back to it)
    await dev.reset()
    await prog(out)  # (the waiter drops the refused command's item)
    assert (await out.numpy())[0] == 3
    await out.free()


async def test_a_queue_made_with_the_native_library_turned_off_later_still_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NATIVE_QUEUE=0 set after the repeat launch in C was readied: a CL queue made then has
    no ring and reports through its Python waiter; the device's own launches go on in C."""
    dev = _c_device()
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await prog(out)
    monkeypatch.setenv("NATIVE_QUEUE", "0")
    driver = CLQueue("late", dev.context, dev.device_id)
    queue = DriverQueue(dev, "late", driver, context=dev.context)
    try:
        assert driver._ring is None
        await queue.submit(lambda: None, ())
    finally:
        driver.close()
        queue.stop(drop_queued=True, join_timeout=30)
    monkeypatch.delenv("NATIVE_QUEUE")
    calls = _PythonCalls(monkeypatch)
    await prog(out)
    assert calls.n == 0 and (await out.numpy())[0] == 2
    await out.free()
