"""The native host queue (aiotinyrt/native.py): the C command ring, its worker loop, the C repeat-
launch path, and the pure-Python worker it falls back to.

The rest of the suite runs on the native queue (CI has a C compiler); the last test here runs the
queue-heavy test modules again with ``NATIVE_QUEUE=0``, so both workers keep the same semantics.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, Device, DeviceError, Signal, native
from aiotinyrt.queue import HostQueue
from tests.helpers import (
    GATE,
    INC,
    SPIN,
    STAMP,
    assert_cancelled_at_entry,
    assert_stays_pending,
    c_replay_or_skip,
    gate_on,
    inject_failure,
    int_buffer,
)

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent
DEV = "CPU:6"  # a device of its own: these tests hold and fail its queues


async def test_cpu_and_null_queues_are_native_and_launches_take_the_c_path() -> None:
    assert native.load() is not None, "the native queue library did not build (is a C compiler installed?)"
    for name in ("CPU", "NULL"):
        dev = Device[name]
        assert all(q.native for q in dev.queues.values())
    prog = await Device["CPU"].program("inc", INC)
    assert prog._c_launch is not None  # the library doubles as the extension module
    out = await int_buffer("CPU")
    first = prog(out)  # Python path: builds the argument block, caches the entry
    second = prog(out)  # C path
    assert prog._by_bufs and type(second) is type(first)
    assert await second >= 0.0 and first.done()
    assert (await out.numpy()).tolist() == [2]
    await out.free()


async def test_the_c_call_path_launches_repeats_and_hands_everything_else_to_python() -> None:
    """``Program.__call__`` is the extension module's C function: a repeat launch never enters
    Python; keywords, new buffers and bad arguments take the Python implementation, with its
    checks and messages; access records nobody else holds are updated in place, others are not
    touched."""
    from aiotinyrt.program import Program

    prog = await Device["CPU"].program("inc", INC)
    assert type(Program.__dict__["__call__"]).__name__ == "method_descriptor"
    out = await int_buffer("CPU")
    first = prog(out)  # Python: new buffers
    second = prog(out)  # C
    third = prog(out)  # C; the record (the buffer's alone) is updated in place
    assert out._accesses == [(0, 4, third, True)]
    held = out._accesses  # now someone else holds the record: it is left as it was
    fourth = prog(out)
    assert held == [(0, 4, third, True)] and out._accesses == [(0, 4, fourth, True)]
    fifth = prog(out, wait_for=[fourth])  # a keyword: the Python implementation
    with pytest.raises(TypeError, match="takes 1 buffers, got 2"):
        prog(out, out)
    with pytest.raises(TypeError):
        prog(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        prog(out, bogus=1)  # type: ignore[call-arg]
    await fifth
    assert all(s.done() and not s.failed() for s in (first, second, third, fourth))
    assert (await out.numpy()).tolist() == [5]
    await out.free()


ADD = "void add(int* restrict out, int v) { out[0] += v; }"


async def test_launches_passing_only_vals_repeat_in_c_and_bad_vals_are_still_refused() -> None:
    """``prog(buf, vals=(3,))`` again takes the C path (its entry is cached under the buffers and
    the vals); vals that only compare equal to cached ones (floats, bools) or are not a tuple go
    to the Python implementation, which refuses or accepts them as before."""
    prog = await Device["CPU"].program("add", ADD)
    out = await int_buffer("CPU")
    sigs = [prog(out, vals=(3,)) for _ in range(5)]
    sigs.append(prog(out, vals=(4,)))
    sigs.append(prog(out, vals=[1]))  # a list: accepted by the Python path, never cached
    from aiotinyrt.program import _VALS_KEY

    assert (_VALS_KEY, (out,), (3,)) in prog._by_bufs and (_VALS_KEY, (out,), (4,)) in prog._by_bufs
    with pytest.raises(TypeError, match="takes 1 buffers, got 2"):  # shaped like (buffers, vals)
        prog((out,), (3,))  # type: ignore[arg-type]
    slow: list[object] = []
    python_call = prog._call
    prog._call = lambda *a: slow.append(a) or python_call(*a)  # type: ignore[method-assign]
    for _ in range(3):  # the C path, alternating entries too: the Python one is not entered
        sigs += [prog(out, vals=(3,)), prog(out, vals=(4,))]
    assert slow == []
    del prog._call
    with pytest.raises(TypeError, match="vals must be ints"):
        prog(out, vals=(3.0,))
    with pytest.raises(TypeError, match="vals must be ints"):
        prog(out, vals=(True,))
    with pytest.raises(ValueError, match="32-bit"):
        prog(out, vals=(2**40,))
    with pytest.raises(TypeError, match="takes 1 int vals"):
        prog(out, vals=(3, 3))
    await sigs[-1]
    assert all(s.done() and not s.failed() for s in sigs)
    assert (await out.numpy()).tolist() == [8 * 3 + 4 * 4 + 1]
    await out.free()


async def test_thousands_of_launches_across_ring_chunks_with_python_commands_between_stay_in_order() -> None:
    """Native launches, launches made Python commands by a dependency, and copies on the other
    queue interleave over several ring chunks; every increment lands, in order."""
    async with rt.open_device(DEV) as dev:
        inc = await dev.program("inc", INC)
        out = await int_buffer(DEV)
        n = 3 * native.CHUNK + 17
        sigs = []
        for i in range(n):
            if i % 997 == 0 and sigs:
                sigs.append(inc(out, wait_for=[sigs[-1]]))  # a dependency: a Python command
            else:
                sigs.append(inc(out))
        await sigs[-1]
        assert all(s.done() and not s.failed() for s in sigs)
        assert (await out.numpy()).tolist() == [n]
        await out.free()


async def test_native_signal_reports_the_kernel_time_and_polls_without_blocking() -> None:
    async with rt.open_device(DEV) as dev:
        spin = await dev.program("spin", SPIN)
        out = await int_buffer(DEV)
        sigs = [spin(out, vals=(20,)), spin(out, vals=(20,))]  # the second is the C path
        assert not sigs[1].done()
        with pytest.raises(RuntimeError, match="has not completed"):
            sigs[1].result()
        for sig in sigs:
            assert 0.015 < await sig < 5.0
        assert (await out.numpy()).tolist() == [2]
        await out.free()


async def test_a_fault_fails_the_native_launches_queued_behind_it_and_reset_runs_later_ones() -> None:
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        inc = await dev.program("inc", INC)
        out = await int_buffer(DEV)
        ok = [inc(out) for _ in range(10)]
        gate.launch(out, 5)
        fault = inject_failure(dev)
        after = [inc(out) for _ in range(100)]
        gate.open()
        with pytest.raises(DeviceError, match="injected"):
            await fault
        for sig in after:
            with pytest.raises(DeviceError, match="injected"):
                await sig
            assert sig.failed()
            assert isinstance(sig.error(), DeviceError)
            with pytest.raises(DeviceError, match="injected"):
                sig.result()
        assert not any(s.failed() for s in ok)
        await dev.reset()
        again = [inc(out) for _ in range(3)]
        await again[-1]
        assert not any(s.failed() for s in again)
        assert (await out.numpy()).tolist() == [8]  # the gate wrote 5; the 100 never ran
        await out.free()


OTHER = "CPU:9"  # the second device of the cross-device tests


def count_python_commands(monkeypatch: pytest.MonkeyPatch, queues: list[HostQueue]) -> list[str]:
    """Record, by queue label, every Python command submitted to ``queues`` from now on."""
    submitted: list[str] = []
    for queue in queues:
        original = queue.submit

        def counting(*args: Any, _orig: Any = original, _q: str = queue.timeline.label, **kw: Any) -> Signal:
            submitted.append(_q)
            return _orig(*args, **kw)  # type: ignore[no-any-return]

        monkeypatch.setattr(queue, "submit", counting)
    return submitted


async def test_a_launch_waiting_for_another_device_waits_in_c_and_starts_after_it() -> None:
    """A dependency on another device's command no longer makes a launch a Python command: the
    worker waits for the other queue in C, and the launch starts only after that command ran."""
    async with rt.open_device(DEV), rt.open_device(OTHER) as other, gate_on(DEV) as gate:
        stamp = await other.program("stamp", STAMP)
        out = await int_buffer(DEV)
        when = await Buffer(OTHER, 1, rt.dtypes.float64).allocate()
        held = gate.launch(out, 7)
        queue = other.queues["compute"]
        after = stamp(when, wait_for=[held])
        assert not queue._commands  # not handed to the Python worker
        assert not after.done()
        opened = time.monotonic()  # the clock the stamp kernel reads
        gate.open()
        assert await after >= 0.0 and held.done() and not held.failed()
        assert (await when.numpy())[0] >= opened
        assert (await out.numpy()).tolist() == [7]
        await out.free()
        await when.free()


async def test_copies_between_devices_and_host_run_natively_and_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """copyin, copy_from between CPU devices and copyout are native commands (no Python command
    is submitted on either copy queue), ordered after the kernels that write their sources."""
    async with rt.open_device(DEV) as dev, rt.open_device(OTHER) as other, gate_on(DEV) as gate:
        python_submits = count_python_commands(monkeypatch, [d.queues["copy"] for d in (dev, other)])
        inc = await dev.program("inc", INC)
        src = await int_buffer(DEV)
        dst = await int_buffer(OTHER)
        await src.copyin(np.array([100], np.int32))
        gate.launch(src, 5)  # holds the compute queue, then writes 5
        bumped = inc(src)  # 6, behind the gate
        async with anyio.create_task_group() as tg:
            tg.start_soon(dst.copy_from, src)  # waits for the increment, on CPU:9's copy worker
            await anyio.wait_all_tasks_blocked()  # the copy is queued behind the gate
            assert not bumped.done()
            gate.open()
        assert bumped.done()
        assert (await dst.numpy()).tolist() == [6]
        assert python_submits == []
        await src.free()
        await dst.free()


async def test_a_graph_spanning_two_devices_replays_without_a_python_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Captured launch on one device, transfer to another, launch there: each run of the replay
    (the small transfer folded into the first device's run, a memmove after its kernel) is a
    native command, the second waiting for the first in C; substituted buffers give the same
    results as eager execution. (A large transfer keeps its own native run: test_graph.py.)"""
    async with rt.open_device(DEV) as dev, rt.open_device(OTHER) as other:
        inc_a = await dev.program("inc", INC)
        inc_b = await other.program("inc", INC)
        x, y = await int_buffer(DEV), await int_buffer(OTHER)
        x2, y2 = await int_buffer(DEV), await int_buffer(OTHER)
        await x2.copyin(np.array([40], np.int32))
        async with dev.capture(x=x, y=y) as graph:
            inc_a(x)
            await y.copy_from(x)
            inc_b(y)
        assert [run.queue for run in graph._runs] == [dev.queues["compute"], other.queues["compute"]]
        assert all(run.native is not None for run in graph._runs)
        queues = [q for d in (dev, other) for q in d.queues.values()]
        python_submits = count_python_commands(monkeypatch, queues)
        first = graph.replay()
        second = graph.replay(x=x2, y=y2)
        await first
        await second
        assert python_submits == []
        assert (await y.numpy()).tolist() == [2] and (await x.numpy()).tolist() == [1]
        assert (await y2.numpy()).tolist() == [42] and (await x2.numpy()).tolist() == [41]
        for buf in (x, y, x2, y2):
            await buf.free()


async def test_a_failure_holding_a_pushed_command_keeps_what_it_reads_and_it_still_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``queue._hold`` raising (an interrupt arriving there) after C pushed a command, for a
    repeat launch and for a graph replay: the error reaches the caller, what the command reads
    stays on the queue's hold list (appended from C), and the command runs all the same."""
    c_replay_or_skip()
    async with rt.open_device(DEV) as dev, rt.open_device(OTHER) as other:
        inc = await dev.program("inc", INC)
        inc_b = await other.program("inc", INC)
        a, b = await int_buffer(DEV), await int_buffer(DEV)
        x, y = await int_buffer(DEV), await int_buffer(OTHER)
        async with dev.capture() as graph:
            inc(x)
            await y.copy_from(x)
            inc_b(y)
        inc(a)
        await inc(b)  # (both cached: the next launch of `a` is a repeat launch, held anew)
        queue = dev.queues["compute"]
        real = HostQueue._hold

        def interrupted(self: HostQueue, value: int, keep: object) -> None:
            monkeypatch.setattr(HostQueue, "_hold", real)
            raise RuntimeError("interrupted while holding")

        for submit, queues in ((lambda: inc(a), [queue]), (graph.replay, [queue, other.queues["compute"]])):
            monkeypatch.setattr(HostQueue, "_hold", interrupted)
            before = [q.timeline.submitted for q in queues]
            with pytest.raises(RuntimeError, match="interrupted while holding"):
                submit()
            held = [q for q in queues if q._held and q._held[-1][0] == q.timeline.submitted]
            assert [q.timeline.submitted for q in queues] != before and held, "the pushed command is not held"
        await rt.synchronize(dev, other)
        assert (await a.numpy()).tolist() == [2]
        assert (await x.numpy()).tolist() == [1]
        await graph.replay()  # the interrupted replay left everything usable
        assert (await y.numpy()).tolist() == [3] and (await x.numpy()).tolist() == [2]
        for buf in (a, b, x, y):
            await buf.free()


@pytest.mark.slow
async def test_a_command_of_a_halted_queue_completes_only_after_its_dependencies() -> None:
    """A device with a sticky error fails its queued native commands, but each only once the
    commands it depends on (another device's, held by a gate) completed: completing early would
    let later work on the memory they share run while the dependency still does."""
    async with rt.open_device(DEV) as dev, gate_on(OTHER) as gate:
        inc = await dev.program("inc", INC)
        out = await int_buffer(DEV)
        fault = inject_failure(dev)
        with pytest.raises(DeviceError):
            await fault  # (the device is halted now)
        held = gate.launch(await int_buffer(OTHER), 1)
        dependent = inc(out, wait_for=[held])
        await assert_stays_pending(dependent, "a halted queue's command waiting for another device")
        gate.open()
        with pytest.raises(DeviceError):
            await dependent
        await dev.reset()


async def test_a_failed_dependency_on_another_device_fails_the_native_launch_only() -> None:
    """The dependency fails after the dependent was queued (the C worker waited for it): the
    dependent fails naming it, runs nothing, and its own device stays usable."""
    async with rt.open_device(DEV) as dev, rt.open_device(OTHER) as other, gate_on(DEV) as gate:
        inc = await other.program("inc", INC)
        out = await int_buffer(OTHER)
        gate.launch(await int_buffer(DEV), 1)
        fault = inject_failure(dev)
        dependent = inc(out, wait_for=[fault])
        chained = inc(out, wait_for=[dependent])  # on its own queue: it must see the failure too
        assert not other.queues["compute"]._commands  # both queued as native commands
        gate.open()
        with pytest.raises(DeviceError, match="depends on failed"):
            await dependent
        with pytest.raises(DeviceError, match="depends on failed"):
            await chained
        assert dependent.failed() and chained.failed()
        await inc(out)  # CPU:9 is not poisoned
        assert (await out.numpy()).tolist() == [1]
        await dev.reset()
        await out.free()


@pytest.mark.slow
async def test_a_program_dropped_with_launches_queued_stays_loaded_until_they_ran() -> None:
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        gate.launch(out, 0)
        for i in range(5):  # five distinct libraries, each dropped right after its launches
            prog = await dev.program("inc", INC + f"\n// variant {i}")
            for _ in range(3):
                last = prog(out)
            del prog
        gc.collect()
        gate.open()
        await last
        assert (await out.numpy()).tolist() == [15]
        await out.free()


async def test_a_buffer_dropped_without_free_stays_mapped_until_its_launches_ran() -> None:
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        inc = await dev.program("inc", INC)
        keep = await int_buffer(DEV)
        gate.launch(keep, 0)
        for _ in range(4):
            tmp = await int_buffer(DEV)
            inc(tmp)
            last = inc(tmp)  # C path: the entry holds the memory
            del tmp
        gc.collect()
        gate.open()
        await last
        await dev.synchronize()
        await keep.free()


def test_launches_from_many_threads_each_with_its_own_loop_all_land() -> None:
    """Producers in several threads push into one ring concurrently (the push takes a lock and
    hands out values in slot order)."""
    n_threads, per_thread = 4, 2000
    out_holder: list[Buffer] = []

    async def setup() -> None:
        out_holder.append(await int_buffer("CPU"))

    anyio.run(setup)
    out = out_holder[0]
    errors: list[BaseException] = []

    def worker() -> None:
        async def launches() -> None:
            inc = await Device["CPU"].program("inc", INC)
            sig = None
            for _ in range(per_thread):
                sig = inc(out)
            assert sig is not None
            await sig

        try:
            anyio.run(launches)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors

    async def check() -> None:
        await Device["CPU"].synchronize()
        assert (await out.numpy()).tolist() == [n_threads * per_thread]
        await out.free()

    anyio.run(check)


async def test_closing_a_device_fails_the_native_launches_it_did_not_run() -> None:
    dev = Device["CPU:7"]
    inc = await dev.program("inc", INC)
    gate_prog = await dev.program("gate", GATE)
    flag = await int_buffer("CPU:7")
    out = await int_buffer("CPU:7")
    view = (await flag.as_memoryview()).cast("i")
    held = gate_prog(flag, out, vals=(0,), writes=(1,))
    queued = [inc(out) for _ in range(50)]
    dev._shutdown(drop_queued=True, join_timeout=None, free_cache=False)
    view[0] = 1  # open the gate: the worker finishes it (if it had started it), then fails the rest
    try:
        await held
    except DeviceError as exc:  # the worker had not picked it up yet: dropped as well
        assert "closed" in str(exc)
    for sig in queued:
        with pytest.raises(DeviceError, match="closed"):
            await sig
    with pytest.raises(DeviceError, match="closed"):
        inc(out)


@pytest.mark.slow
def test_the_python_worker_passes_the_queue_tests_too() -> None:
    """NATIVE_QUEUE=0: the pure-Python worker (the fallback without a C compiler) runs the test
    modules that exercise queues, signals, ordering and faults, and the CL backend (whose waiter
    then runs in Python), in a fresh interpreter."""
    env = dict(os.environ, NATIVE_QUEUE="0")
    modules = [f"tests/test_{name}.py" for name in ("signals", "ordering", "faults", "null", "cl")]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *modules],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


async def test_prepare_builds_the_library_off_the_event_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    loop_thread = threading.get_ident()
    built_in: list[int] = []
    real_build = native._build

    def recording_build() -> object:
        built_in.append(threading.get_ident())
        return real_build()

    monkeypatch.setattr(native, "_build", recording_build)
    monkeypatch.setattr(native, "_loaded", [])  # as in a fresh process
    await native.prepare()
    assert len(built_in) == 1 and built_in[0] != loop_thread
    assert native.load() is not None
    await native.prepare()  # loaded: no second build
    assert len(built_in) == 1


async def test_prepare_and_open_device_are_checkpoints() -> None:
    await assert_cancelled_at_entry(native.prepare)

    async def open_and_use() -> None:
        async with rt.open_device("CPU:6"):
            pass

    await assert_cancelled_at_entry(open_and_use)


def _native_lock() -> Any:
    lock = native.rlock()
    if isinstance(lock, type(threading.RLock())):
        pytest.skip("NATIVE_QUEUE=0: no extension module, so threading.RLock")
    return lock


def test_the_native_lock_is_reentrant_and_owned_by_one_thread() -> None:
    """lock.c's Lock behaves as threading.RLock: reentrant for its holder, refused (or waited
    for) by another thread, released only by its holder, as many times as it was taken."""
    lock = _native_lock()
    with lock:
        assert lock.acquire() and lock._is_owned()
        got: list[bool] = []
        other = threading.Thread(target=lambda: got.extend([lock.acquire(False), lock.acquire(timeout=0.01)]))
        other.start()
        other.join()
        assert got == [False, False]
        lock.release()
        assert lock._is_owned()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError, match="un-acquired"):
        lock.release()
    with pytest.raises(ValueError, match="timeout"):
        lock.acquire(False, 1.0)
    with pytest.raises(OverflowError, match="too large"):  # (as RLock's)
        lock.acquire(timeout=1e300)
    with pytest.raises(ValueError, match="NaN"):  # (as RLock's)
        lock.acquire(timeout=float("nan"))


def test_a_blocking_acquire_of_the_native_lock_lets_the_gil_go_until_it_is_released() -> None:
    """A thread blocked on the Lock does not hold the GIL: the holder runs Python meanwhile,
    then releases it, and the waiter gets it."""
    lock = _native_lock()
    events: list[str] = []
    lock.acquire()
    trying = threading.Event()
    waiter = threading.Thread(
        target=lambda: (trying.set(), lock.acquire(), events.append("got"), lock.release())
    )
    waiter.start()
    assert trying.wait(30)
    waiter.join(0.05)  # (returns: this thread runs Python while the waiter blocks; a lock that
    assert waiter.is_alive() and events == []  # did not block would have let it finish by now)
    events.append("held")
    lock.release()
    waiter.join(30)
    assert events == ["held", "got"] and not waiter.is_alive()
