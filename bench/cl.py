"""The CL backend side by side with pyopencl and tinygrad's CL device, same kernel, same PoCL.

    python bench/cl.py                 # 5 repetitions, 20k pipelined launches, 64 MiB copies
    python bench/cl.py --launches 100000 --reps 3
    python bench/cl.py --only compile   # the compile rows alone

Every figure is the median over the repetitions (the copy rows and the paired rows: over every
copy, burst or block of every repetition); each repetition runs every row once, in the same
order, so slow phases of a noisy machine hit all columns alike; the copies of pyopencl and
aiotinyrt alternate, each side first every other time. A second table checks the issue's three
targets with ratios of paired measurements (``paired_rows``, and the copies): a burst of
pipelined launches, a block of round trips or a copy of one side, then the same of the other at
once, each side first in every other pair; its median is the median of the pairs' ratios, with
their range. The kernel is ``out[0] += 1`` on one int. Also measured: the two completion paths
a driver-run queue can take (a clSetEventCallback per event, or one waiter thread calling
clWaitForEvents in order), on the raw binding, and whether two builds of distinct kernels
overlap: on two threads of one process (they take turns on a lock inside PoCL) or in two
compile-server processes. Process CPU rows count every thread of this process (PoCL's, the
waiters): other processes' load does not inflate them as it does wall time; the submitting
thread's CPU rows count the enqueuing thread alone (pyopencl's loop; aiotinyrt's launches while
the waiter is held). Prints two markdown tables: every row, then the targets. Needs pyopencl
for its rows (``pip install pyopencl``); tinygrad's rows appear when
``tinygrad.runtime.ops_cl`` imports.

Two kinds of row bound the others: "PoCL from C" times the same launches from C with no Python
at all (``cl_floor.c``, built with ``$CC`` or ``cc`` into a temporary library and called in
this process), and the aiotinyrt rows "the driver's enqueue a no-op" time aiotinyrt's own share,
its C launch pointed at a stand-in for ``clEnqueueNDRangeKernel`` that enqueues nothing. The
paced "PoCL from C" rows ("N us of other work per launch") spin N microseconds after each
enqueue, as a runtime's own share of a launch would: the loop's cost per launch at that pace,
the spin included.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import queue
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("CACHEDB", os.path.join(tempfile.mkdtemp(prefix="aiotinyrt-bench-"), "cache.db"))

import anyio
import numpy as np
from _samples import Samples

from aiotinyrt import Buffer, Device, dtypes, native
from aiotinyrt.backends import cl_queue
from aiotinyrt.backends import opencl as ocl
from aiotinyrt.backends.cl_build import BuildPool
from aiotinyrt.backends.ops_cl import CLDevice, cl_command, ffi
from aiotinyrt.driverqueue import Completion, DriverQueue

SRC = "__kernel void inc(__global int* out) { out[0] += 1; }"
MiB = 1 << 20
#: Copies of each direction per repetition and side: a row's median is over all of them. Each
#: side's 64 MiB buffer is written once before they are timed: pyopencl's is new at each
#: repetition, aiotinyrt's comes back from its allocator's cache after the first, and a first
#: copyin into fresh pages took ~5x as long.
COPIES = 5


def pyopencl_rows(s: Samples, n: int, nbytes: int) -> None:
    try:
        import pyopencl as cl  # type: ignore[import-not-found]
    except ImportError:
        s.notes["pyopencl"] = "not installed"
        return
    ctx = cl.Context([cl.get_platforms()[0].get_devices()[0]])
    q = cl.CommandQueue(ctx, properties=cl.command_queue_properties.PROFILING_ENABLE)
    buf = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, 4)
    kernel = cl.Program(ctx, SRC).build().inc
    kernel.set_arg(0, buf)
    g = (1,)
    q.finish()
    t, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(n - 1):
        cl.enqueue_nd_range_kernel(q, kernel, g, None)
    last = cl.enqueue_nd_range_kernel(q, kernel, g, None)
    s.add("pyopencl|pipelined launch (us)", (time.perf_counter() - t) / n * 1e6)
    s.add("pyopencl|pipelined launch, submitting thread's CPU (us)", (time.thread_time() - own) / n * 1e6)
    last.wait()
    s.add("pyopencl|pipelined launch, to the last completed (us)", (time.perf_counter() - t) / n * 1e6)
    q.finish()  # (the CPU row counts the kernels' execution too, as aiotinyrt's does)
    s.add(
        "pyopencl|pipelined launch, process CPU to the last completed (us)",
        (time.process_time() - cpu) / n * 1e6,
    )

    def trips(count: int) -> float:
        """``count`` round trips: seconds per round trip."""
        t = time.perf_counter()
        for _ in range(count):
            cl.enqueue_nd_range_kernel(q, kernel, g, None).wait()
        return (time.perf_counter() - t) / count

    m = max(n // 20, 200)
    s.add("pyopencl|round trip, right after the pipelined launches (us)", trips(m) * 1e6)
    # The "round trip" rows time round trips on an idle device after as many others; each
    # side's first ones after its pipelined launches have a row of their own. After a burst of
    # pipelined launches a round trip may take ~2x as long for the next ~1,000-2,000 of them,
    # on either side (PoCL's two workers then take twice their CPU time per round trip), and
    # pyopencl's alone moved between ~20 and ~30-50 us from one block of 200 to the next in
    # one process (ad hoc): a row of one side against the other's seconds later compares
    # states as much as runtimes, hence the paired ratios (paired_rows).
    trips(m)
    cpu = time.process_time()
    s.add("pyopencl|round trip (us)", trips(m) * 1e6)
    s.add("pyopencl|round trip, process CPU (us)", (time.process_time() - cpu) / m * 1e6)
    host = np.ones(nbytes // 4, np.int32)
    big = cl.Buffer(ctx, cl.mem_flags.READ_WRITE, nbytes)
    cl.enqueue_copy(q, big, host, is_blocking=True)  # (its pages touched: see COPIES)

    def copy(into: bool) -> float:
        """One blocking 64 MiB copy, in or out: its wall seconds."""
        t = time.perf_counter()
        cl.enqueue_copy(q, *((big, host) if into else (host, big)), is_blocking=True)
        return time.perf_counter() - t

    def launches(count: int) -> tuple[float, float]:
        """``count`` pipelined launches: seconds per launch to the last enqueue and to its completion."""
        q.finish()
        t = time.perf_counter()
        for _ in range(count - 1):
            cl.enqueue_nd_range_kernel(q, kernel, g, None)
        last = cl.enqueue_nd_range_kernel(q, kernel, g, None)
        enqueued = time.perf_counter() - t
        last.wait()
        return enqueued / count, (time.perf_counter() - t) / count

    # (buf too: the kernel's argument, which pyopencl's set_arg does not keep alive)
    _pyopencl.update(copy=copy, launches=launches, trips=trips, buf=buf)


#: pyopencl's copy, pipelined launches and round trips of this repetition (pyopencl_rows), which
#: aiotinyrt_rows alternates with its own (paired_rows): on this machine pyopencl's own figures
#: move by 2x from one moment to the next (a pipelined launch loop 2.0-5.2 us within one process, a
#: round trip 19-50 us; PoCL's two workers and the submitting thread share two cores), so
#: each comparison is made between two measurements taken next to each other, in turn.
_pyopencl: dict[str, Any] = {}


def floor_rows(s: Samples, n: int) -> None:
    """PoCL with no Python at all (``cl_floor.c``'s ``floor_run``, in this process): the floor
    under every other row."""
    lib = _floor()
    if lib is None:
        return
    out = (ctypes.c_double * (3 + 2 * len(WORK_US)))()
    m = max(n // 20, 200)
    code = lib.floor_run(n, m, (ctypes.c_double * len(WORK_US))(*WORK_US), len(WORK_US), out)
    if code != 0:
        s.notes["PoCL from C"] = f"floor_run failed: {code}"
        return
    s.add("PoCL from C|pipelined launch (us)", out[0])
    s.add("PoCL from C|pipelined launch, to the last completed (us)", out[1])
    s.add("PoCL from C|round trip (us)", out[2])
    for j, work in enumerate(WORK_US):
        s.add(f"PoCL from C|pipelined launch, {work:g} us of other work per launch (us)", out[3 + 2 * j])
        s.add(
            f"PoCL from C|pipelined launch, {work:g} us of other work, to the last completed (us)",
            out[4 + 2 * j],
        )


#: The other work per launch of the paced "PoCL from C" rows (microseconds): a runtime's own
#: share of a launch, spent between two enqueues (aiotinyrt's: its "no-op" row).
WORK_US = (0.5, 1.0, 1.5)


_floors: list[Any] = []


def _floor() -> Any:
    """``cl_floor.c`` built (``$CC``, else ``cc``) into a temporary shared library and loaded,
    once; None (noted on the table) when it cannot be."""
    if not _floors:
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cl_floor.c")
        target = os.path.join(tempfile.mkdtemp(prefix="aiotinyrt-floor-"), "cl_floor.so")
        cc = os.environ.get("CC", "cc")
        try:
            subprocess.run(
                [cc, "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", target, source, "-ldl"],
                check=True,
                capture_output=True,
                text=True,
            )
            lib = ctypes.CDLL(target)
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            _floors.append(f"cannot build cl_floor.c with {cc}: {detail}")
        else:
            lib.floor_run.argtypes = [
                ctypes.c_int,
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_double),
                ctypes.c_int,
                ctypes.POINTER(ctypes.c_double),
            ]
            _floors.append(lib)
    return _floors[0] if not isinstance(_floors[0], str) else None


async def stub_rows(s: Samples, dev: Any, prog: Any, buf: Buffer, n: int) -> None:
    """aiotinyrt's own share of a repeat launch and of a round trip: the C launch configured
    with ``cl_floor.c``'s ``stub_enqueue``, which enqueues nothing and hands back a user event
    already complete (the ring, the gates, the report and the checkpoint all run as usual)."""
    lib = _floor()
    if lib is None:
        return
    cl, err = ocl.lib(), ffi.new("cl_int*")
    done = cl.clCreateUserEvent(dev.context, err)
    cl.clSetUserEventStatus(done, ocl.COMPLETE)
    ctypes.c_void_p.in_dll(lib, "stub_event").value = int(ffi.cast("uintptr_t", done))
    retain = int(ffi.cast("uintptr_t", ffi.addressof(cl, "clRetainEvent")))
    ctypes.c_void_p.in_dll(lib, "stub_retain").value = retain
    entry = [int(ffi.cast("uintptr_t", ffi.addressof(cl, name))) for name in _LAUNCH_ENTRY_POINTS]
    stub = ctypes.cast(lib.stub_enqueue, ctypes.c_void_p).value
    await prog(buf)  # (the launch is cached: the next ones are the C repeat launch)
    native.cl_launcher(Completion, DriverQueue, stub, *entry[1:])
    try:
        t = time.perf_counter()
        for _ in range(n - 1):
            prog(buf)
        await prog(buf)
        per = (time.perf_counter() - t) / n * 1e6
        s.add("aiotinyrt|pipelined launch, the driver's enqueue a no-op (us)", per)
        m = max(n // 20, 200)
        t = time.perf_counter()
        for _ in range(m):
            await prog(buf)
        s.add("aiotinyrt|round trip, the driver's enqueue a no-op (us)", (time.perf_counter() - t) / m * 1e6)
    finally:
        native.cl_launcher(Completion, DriverQueue, *entry)
    cl.clReleaseEvent(done)


_LAUNCH_ENTRY_POINTS = ("clEnqueueNDRangeKernel", "clReleaseEvent", "clWaitForEvents")
_tiny: list[Any] = []


def tinygrad_rows(s: Samples, n: int) -> None:
    try:
        from tinygrad.device import TinyELF
        from tinygrad.dtype import dtypes as tdtypes
        from tinygrad.runtime.ops_cl import CLDevice as TinyCL
        from tinygrad.runtime.ops_cl import CLProgram as TinyProgram
    except Exception as exc:
        s.notes["tinygrad"] = f"not importable ({exc!r})"
        return
    if not _tiny:
        dev = TinyCL("CL")
        elf = TinyELF(SRC.encode(), "inc", None, (("out", 0, tdtypes.int32, ()),))  # type: ignore[arg-type]
        _tiny.extend([dev, TinyProgram(dev, elf), dev.allocator.alloc(4)])
    dev, prog, buf = _tiny
    dev.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        prog(buf)
    s.add("tinygrad|pipelined launch (us)", (time.perf_counter() - t) / n * 1e6)
    dev.synchronize()
    m = max(n // 20, 200)
    t = time.perf_counter()
    for _ in range(m):
        prog(buf, wait=True)
    s.add("tinygrad|round trip (us)", (time.perf_counter() - t) / m * 1e6)


async def aiotinyrt_rows(s: Samples, n: int, nbytes: int) -> None:
    dev = Device["CL"]
    prog = await dev.program("inc", SRC)
    buf = await Buffer("CL", 1, dtypes.int32).allocate()
    await buf.copyin(np.zeros(1, np.int32))
    await dev.synchronize()
    t, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(n - 1):
        prog(buf)
    last = prog(buf)
    s.add("aiotinyrt|pipelined launch (us)", (time.perf_counter() - t) / n * 1e6)
    s.add("aiotinyrt|pipelined launch, submitting thread's CPU (us)", (time.thread_time() - own) / n * 1e6)
    await last
    s.add("aiotinyrt|pipelined launch, to the last completed (us)", (time.perf_counter() - t) / n * 1e6)
    s.add(
        "aiotinyrt|pipelined launch, process CPU to the last completed (us)",
        (time.process_time() - cpu) / n * 1e6,
    )
    m = max(n // 20, 200)
    s.add("aiotinyrt|round trip, right after the pipelined launches (us)", await _trips(prog, buf, m) * 1e6)
    await _trips(prog, buf, m)  # (as pyopencl_rows: the round trip row comes after as many others)
    cpu = time.process_time()
    s.add("aiotinyrt|round trip (us)", await _trips(prog, buf, m) * 1e6)
    s.add("aiotinyrt|round trip, process CPU (us)", (time.process_time() - cpu) / m * 1e6)
    driver = dev._compute_queue.driver
    budget, driver._poll_ns = driver._poll_ns, 0  # (CL_POLL_US=0: the waiter thread reports)
    try:
        s.add("aiotinyrt|round trip, no poll: the waiter reports (us)", await _trips(prog, buf, m) * 1e6)
    finally:
        driver._poll_ns = budget
    await hop_rows(s, driver, prog, buf, m)
    await batch_rows(s, dev, prog, buf, n)
    await stub_rows(s, dev, prog, buf, n)
    await paired_rows(s, prog, buf, n)
    host = np.ones(nbytes // 4, np.int32)
    big = await Buffer("CL", nbytes // 4, dtypes.int32).allocate()
    await big.copyin(host)  # (see COPIES)

    async def our_copy(into: bool) -> float:
        t = time.perf_counter()
        await (big.copyin(host) if into else big.copyout(host))
        return time.perf_counter() - t

    theirs: float | None = None
    for into, name in ((True, "copyin"), (False, "copyout")):
        for i in range(COPIES):  # (pyopencl's and aiotinyrt's in turn, each first every other time)
            if i % 2 or not _pyopencl:
                ours = await our_copy(into)
                theirs = _pyopencl["copy"](into) if _pyopencl else None
            else:
                theirs, ours = _pyopencl["copy"](into), await our_copy(into)
            s.add(f"aiotinyrt|{name} 64 MiB (GB/s)", nbytes / ours / 1e9)
            if theirs is not None:
                s.add(f"pyopencl|{name} 64 MiB (GB/s)", nbytes / theirs / 1e9)
                s.add(
                    f"target|{name}: aiotinyrt's speed / pyopencl's, paired copies (%)", theirs / ours * 100
                )
    _pyopencl.clear()
    await big.free()
    sig = prog(buf)
    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(1000):
            tg.start_soon(sig.wait)
    s.add("aiotinyrt|1,000 concurrent awaits (ms)", (time.perf_counter() - t) * 1e3)
    await buf.free()


async def _trips(prog: Any, buf: Buffer, count: int) -> float:
    """``count`` launch round trips of ``prog(buf)``: seconds per round trip."""
    t = time.perf_counter()
    for _ in range(count):
        await prog(buf)
    return (time.perf_counter() - t) / count


#: Pairs of pipelined bursts and of round-trip blocks per repetition (paired_rows).
PAIRS = 4


async def paired_rows(s: Samples, prog: Any, buf: Buffer, n: int) -> None:
    """The targets' ratios, each from a pair of measurements taken one after the other:
    PAIRS bursts of ``n`` pipelined launches and 3 * PAIRS blocks of round trips, pyopencl's and
    aiotinyrt's in turn, each side first in every other pair. Every burst timed follows another
    burst (one untimed burst of each side comes first), so these bursts are not the first
    table's, which follow round trips; the blocks of round trips follow 10 untimed blocks on
    each side. One target row per pair (the median is over every pair of every repetition),
    and each side's medians of its paired bursts and blocks in the first table."""
    if not _pyopencl:
        return
    launches, trips, m = _pyopencl["launches"], _pyopencl["trips"], max(n // 100, 200)

    async def our_launches() -> tuple[float, float]:
        t = time.perf_counter()
        for _ in range(n - 1):
            prog(buf)
        last = prog(buf)
        enqueued = time.perf_counter() - t
        await last
        return enqueued / n, (time.perf_counter() - t) / n

    await our_launches()
    launches(n)
    for k in range(PAIRS):
        if k % 2:
            ours, theirs = await our_launches(), launches(n)
        else:
            theirs, ours = launches(n), await our_launches()
        s.add("pyopencl|pipelined launch, paired bursts (us)", theirs[0] * 1e6)
        s.add("aiotinyrt|pipelined launch, paired bursts (us)", ours[0] * 1e6)
        s.add("target|pipelined launch: aiotinyrt / pyopencl, paired bursts (x)", ours[0] / theirs[0])
        s.add("target|to the last completion: aiotinyrt / pyopencl, paired bursts (x)", ours[1] / theirs[1])
    trips(10 * m)  # (the first round trips after pipelined launches: see pyopencl_rows)
    await _trips(prog, buf, 10 * m)
    for k in range(3 * PAIRS):
        if k % 2:
            ours_rt, theirs_rt = await _trips(prog, buf, m), trips(m)
        else:
            theirs_rt, ours_rt = trips(m), await _trips(prog, buf, m)
        s.add("pyopencl|round trip, paired blocks (us)", theirs_rt * 1e6)
        s.add("aiotinyrt|round trip, paired blocks (us)", ours_rt * 1e6)
        s.add("target|round trip: aiotinyrt / pyopencl, paired blocks (x)", ours_rt / theirs_rt)


async def hop_rows(s: Samples, driver: Any, prog: Any, buf: Buffer, m: int) -> None:
    """A round trip in two halves (medians of m): from the launch to the report of its
    completion (the await's checkpoint comes before the report: the claim's), and from the
    report to the awaiting task running again; and how many of the
    reports the awaiting thread made itself (its poll). A repeat launch made in C is reported
    by the timeline's poll in C (clpoll.c's ``cl_poll_for``) or with
    ``DriverQueue._report_run``, any other command with ``report``."""
    reported = [0.0]
    report, run = cl_queue.report, DriverQueue._report_run
    here, by_awaiter = threading.get_ident(), [0]

    def stamp() -> None:
        reported[0] = time.perf_counter()
        by_awaiter[0] += threading.get_ident() == here

    def stamped(batch: Any) -> None:
        stamp()
        report(batch)

    def stamped_run(queue: DriverQueue, sigs: list[Any]) -> None:
        stamp()
        run(queue, sigs)

    timeline = driver.owner.timeline
    poll = timeline.poll
    if isinstance(poll, functools.partial):  # (clpoll.c's cl_poll_for: its fifth item is called
        # at each report it makes in C)
        timeline.poll = functools.partial(poll.func, (*poll.args[0][:4], lambda first, last: stamp()))
    cl_queue.report = stamped  # type: ignore[assignment]
    DriverQueue._report_run = stamped_run  # type: ignore[method-assign]
    try:
        to_report, to_task = [], []
        for _ in range(m):
            t = time.perf_counter()
            await prog(buf)
            to_report.append(reported[0] - t)
            to_task.append(time.perf_counter() - reported[0])
    finally:
        cl_queue.report = report
        DriverQueue._report_run = run  # type: ignore[method-assign]
        timeline.poll = poll
    s.add("aiotinyrt|round trip: launch to the report (us)", statistics.median(to_report) * 1e6)
    s.add("aiotinyrt|round trip: the report to the task running (us)", statistics.median(to_task) * 1e6)
    s.add("aiotinyrt|round trip: reported by the awaiting thread (%)", by_awaiter[0] / m * 100)


async def batch_rows(s: Samples, dev: Any, prog: Any, buf: Buffer, n: int) -> None:
    """The two halves of a pipelined launch apart, in process CPU: n launches submitted while
    the queue's waiter is held (its first command's event is a user event not yet set), the
    device run to the end (clFinish), then the waiter let go: it completes all n in batches."""
    cl, err = ocl.lib(), ffi.new("cl_int*")
    gate = cl.clCreateUserEvent(dev.context, err)

    @cl_command
    def held(queue: Any, n_waits: int, wait_list: Any) -> Any:
        cl.clRetainEvent(gate)  # (the driver releases the command's event)
        return gate

    compute = dev._compute_queue
    compute.submit(held, ())
    cpu, own = time.process_time(), time.thread_time()
    for _ in range(n - 1):
        prog(buf)
    last = prog(buf)
    s.add("aiotinyrt|submission alone, submitting thread's CPU (us)", (time.thread_time() - own) / n * 1e6)
    cl.clFinish(compute.driver.queue)
    s.add("aiotinyrt|submission alone + device, process CPU (us)", (time.process_time() - cpu) / n * 1e6)
    cpu = time.process_time()
    cl.clSetUserEventStatus(gate, ocl.COMPLETE)
    await last
    s.add(
        "aiotinyrt|completion alone (waiter batches), process CPU (us)", (time.process_time() - cpu) / n * 1e6
    )
    cl.clReleaseEvent(gate)


_callbacks: dict[int, Callable[[], None]] = {}


@ffi.callback("void(cl_event, cl_int, void*)")  # type: ignore[untyped-decorator]
def _on_complete(event: Any, status: int, user: Any) -> None:
    _callbacks.pop(int(ffi.cast("uintptr_t", user)))()


def completion_rows(s: Samples, n: int) -> None:
    """Raw binding: n kernels with events; completion by callback vs one waiter thread."""
    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    cl = ocl.lib()
    q = dev.queues["compute"].driver.queue  # type: ignore[attr-defined]
    err = ffi.new("cl_int*")
    built = anyio.run(dev.program, "inc", SRC)
    mem = dev.allocator.alloc_nowait(4)
    kernel = built._kernel  # type: ignore[attr-defined]
    cl.clSetKernelArg(kernel, 0, 8, mem.arg)
    g = ffi.new("size_t[3]", (1, 1, 1))
    assert err is not None

    def launch() -> Any:
        ev = ffi.new("cl_event*")
        ocl.check(cl.clEnqueueNDRangeKernel(q, kernel, 3, ffi.NULL, g, ffi.NULL, 0, ffi.NULL, ev), "launch")
        return ffi.gc(ev[0], cl.clReleaseEvent)

    cl.clFinish(q)
    t = time.perf_counter()
    for _ in range(n):
        cl.clEnqueueNDRangeKernel(q, kernel, 3, ffi.NULL, g, ffi.NULL, 0, ffi.NULL, ffi.NULL)
    s.add("raw cffi|pipelined launch, no event (us)", (time.perf_counter() - t) / n * 1e6)
    cl.clFinish(q)
    finished = threading.Event()
    count = [0]

    def done(_: float, __: BaseException | None) -> None:
        count[0] += 1
        if count[0] == n:
            finished.set()

    events = []
    t = time.perf_counter()
    for i in range(n):
        events.append(launch())
        _callbacks[i] = lambda: done(0.0, None)
        cl.clSetEventCallback(events[-1], ocl.COMPLETE, _on_complete, ffi.cast("void*", i))
    finished.wait()
    s.add("completion|callback per event (us)", (time.perf_counter() - t) / n * 1e6)

    work: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def waiter(report: Callable[[], None]) -> None:
        while (ev := work.get()) is not None:
            cl.clWaitForEvents(1, ffi.new("cl_event[1]", [ev]))
            report()

    finished.clear()
    count[0] = 0
    thread = threading.Thread(target=waiter, args=(lambda: done(0.0, None),))
    thread.start()
    t = time.perf_counter()
    for _ in range(n):
        work.put(launch())
    finished.wait()
    s.add("completion|waiter thread (us)", (time.perf_counter() - t) / n * 1e6)
    m = max(n // 10, 200)  # round trips: waiting in the calling thread, or handed over by one
    t = time.perf_counter()
    for _ in range(m):
        ev = launch()
        cl.clWaitForEvents(1, ffi.new("cl_event[1]", [ev]))
    s.add("completion|round trip, waiting in the calling thread (us)", (time.perf_counter() - t) / m * 1e6)
    finished.clear()
    count[0], n = 0, 1  # (done() now sets finished at every completion)
    t = time.perf_counter()
    for _ in range(m):
        work.put(launch())
        finished.wait()
        finished.clear()
        count[0] = 0
    s.add("completion|round trip, handed over by the waiter thread (us)", (time.perf_counter() - t) / m * 1e6)
    work.put(None)
    thread.join()
    dev.allocator.free_nowait(mem, 4)


def _state(tid: int) -> str:
    """The scheduler state of thread or process ``tid`` (R running/runnable, S/D waiting)."""
    try:
        with open(f"/proc/self/task/{tid}/stat" if tid > 0 else f"/proc/{-tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "-"


def _cpu(pid: int) -> float:
    """CPU seconds of process ``pid`` and its reaped children (PoCL runs ``ld`` per build)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _busy() -> float:
    """CPU seconds every process of the machine has run (``/proc/stat``: all but idle and iowait)."""
    with open("/proc/stat") as f:
        user, nice, system, _, _, irq, softirq, steal = (int(x) for x in f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _two_at_once(start: Callable[[], list[int]], alive: Callable[[], list[bool]]) -> tuple[float, float]:
    """Run two builds at once: ``(seconds, fraction of 2 ms samples, while both run, with one
    waiting and the other not)``. A preempted thread stays R; only a wait (a lock) is S or D, so
    the fraction shows serialization whatever the machine's load. (Sampling every 0.5 ms took
    15 % of a core from the builds themselves.)"""
    t = time.perf_counter()
    ids, one_waits, samples = start(), 0, 0
    while any(running := alive()):
        states = [_state(i) for i in ids]
        if all(running) and "-" not in states:
            samples += 1
            one_waits += sum(x in "SD" for x in states) == 1
        time.sleep(0.002)
    return time.perf_counter() - t, one_waits / max(samples, 1)


def compile_rows(s: Samples) -> None:
    """Builds of distinct kernels of the same size (PoCL's kernel cache off, so each runs LLVM):
    two one after the other in this process and on two threads of this process; then 2 and 8
    one after the other in one compile server and at once in two, with the servers' CPU per
    build each way and the cores other processes took meanwhile (a repetition in which they
    took under QUIET cores in both halves counts as quiet); then a new pool (_fresh_rows)."""
    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    tag = [0]

    def src() -> str:
        tag[0] += 1
        body = " ".join(f"o[{i}] = o[{i}] * 3 + {i + tag[0]};" for i in range(200))
        return f"__kernel void k{tag[0]}_{time.time_ns()}(__global int* o) {{ {body} }}"

    build = dev.compiler.build  # type: ignore[attr-defined]
    t = time.perf_counter()
    build(src())
    build(src())
    s.add("compile|2 builds one after the other, in-process (ms)", (time.perf_counter() - t) * 1e3)

    def threads(target: Callable[[str], bytes]) -> Callable[[], list[int]]:
        def start() -> list[int]:
            ids: queue.SimpleQueue[int] = queue.SimpleQueue()

            def run(text: str) -> None:
                ids.put(threading.get_native_id())
                target(text)

            workers[:] = [threading.Thread(target=run, args=(src(),)) for _ in range(2)]
            for w in workers:
                w.start()
            return [ids.get(), ids.get()]

        return start

    workers: list[threading.Thread] = []
    seconds, waits = _two_at_once(threads(build), lambda: [w.is_alive() for w in workers])
    s.add("compile|2 builds on 2 threads, in-process (ms)", seconds * 1e3)
    s.add("compile|2 builds on 2 threads: one waits (% of samples)", waits * 100)
    pool = _pool()
    servers = list(pool._idle)  # (two warmed servers: two builds at once take one each)
    pids = [srv.proc.pid for srv in servers]
    for n in (2, 8):
        first = [src() for _ in range(n)]
        one = _phase(pids, lambda: [servers[0].build(text) for text in first])  # noqa: B023 (called at once)
        second = [src() for _ in range(n)]

        def serve() -> list[int]:
            workers[:] = [threading.Thread(target=pool.build, args=(text,)) for text in second]  # noqa: B023
            for w in workers:
                w.start()
            return [-pid for pid in pids]

        two = _phase(pids, lambda: _two_at_once(serve, lambda: [w.is_alive() for w in workers])[1])
        _server_rows(s, n, one, two)
    _fresh_rows(s, src)


def _phase(pids: list[int], run: Callable[[], Any]) -> tuple[float, float, float, Any]:
    """``run()``: its wall seconds, the CPU seconds of the servers ``pids`` and the cores other
    processes took meanwhile (the machine's busy time less the servers' and this process's)."""
    cpus, busy, mine, t = [_cpu(pid) for pid in pids], _busy(), time.process_time(), time.perf_counter()
    out = run()
    wall = time.perf_counter() - t
    cpu = sum(_cpu(pid) for pid in pids) - sum(cpus)
    return wall, cpu, max(_busy() - busy - cpu - (time.process_time() - mine), 0) / wall, out


def _server_rows(
    s: Samples, n: int, one: tuple[float, float, float, Any], two: tuple[float, float, float, Any]
) -> None:
    """The rows of ``n`` builds one after the other in one server (``one``) and on two (``two``)."""
    s.add(f"compile|{n} builds one after the other, in 1 compile server (ms)", one[0] * 1e3)
    s.add(f"compile|{n} builds in 2 compile servers (ms)", two[0] * 1e3)
    if n == 2:
        s.add("compile|2 builds in 2 compile servers: one waits (% of samples)", two[3] * 100)
    s.add(f"compile|{n} builds: 2 servers vs 1 (x, this repetition)", one[0] / two[0])
    s.add(f"compile|{n} builds: server CPU per build, 1 server (ms)", one[1] / n * 1e3)
    s.add(f"compile|{n} builds: server CPU per build, 2 servers (ms)", two[1] / n * 1e3)
    s.add(f"compile|{n} builds: cores the 2 servers ran on", two[1] / two[0])
    s.add(f"compile|{n} builds: cores others took, 1 server (other processes, hypervisor steal)", one[2])
    s.add(f"compile|{n} builds: cores others took, 2 servers", two[2])
    key = f"compile|{n} builds: 2 servers vs 1, repetitions others left quiet (x)"
    if max(one[2], two[2]) < QUIET:  # (in both halves: then wall time shows what two cores do)
        s.add(key, one[0] / two[0])
    runs = len(s.values[f"compile|{n} builds in 2 compile servers (ms)"])
    s.notes[f"compile, {n} builds"] = (
        f"{len(s.values.get(key, []))} of {runs} repetitions quiet "
        f"(others took under {QUIET} cores while one server built and while two did)"
    )


def _fresh_rows(s: Samples, src: Callable[[], str]) -> None:
    """A new pool: its first build (a server's start-up), then two builds at once while it holds
    that one server (the second takes it when the first returns; a second server starts)."""
    fresh = BuildPool(0, size=2)  # (a pool of no server: the first build starts one itself)
    t = time.perf_counter()
    fresh.build(src())
    s.add(
        "compile|a new pool's first build: a server's start-up + the build (ms)",
        (time.perf_counter() - t) * 1e3,
    )
    workers = [threading.Thread(target=fresh.build, args=(src(),)) for _ in range(2)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    s.add(
        "compile|then 2 builds at once, the pool holding that 1 server (ms)", (time.perf_counter() - t) * 1e3
    )
    fresh.start()  # (the second server, started meanwhile, warms before the next rows)
    fresh.close()


QUIET = 0.15  # cores: a repetition in which other processes took less counts as quiet
_pools: list[BuildPool] = []


def _pool() -> BuildPool:
    """A pool of two started, warmed servers for CL (their start-up is not part of the rows)."""
    if not _pools:
        pool = BuildPool(0, size=2)
        pool.start()
        _pools.append(pool)
    return _pools[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--launches", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--only", choices=["compile", "launch"], help="only these rows (launch: all but compile)"
    )
    args = parser.parse_args()
    os.environ["POCL_KERNEL_CACHE"] = "0"
    s = Samples()
    nbytes = 64 * MiB
    for _ in range(args.reps):
        if args.only != "compile":
            pyopencl_rows(s, args.launches, nbytes)
            floor_rows(s, args.launches)
            tinygrad_rows(s, args.launches)
            anyio.run(aiotinyrt_rows, s, args.launches, nbytes)
            completion_rows(s, args.launches // 4)
        if args.only != "launch":
            compile_rows(s)
    print(
        f"CL device: {Device['CL'].device_name} ({Device['CL'].driver_version}), "  # type: ignore[attr-defined]
        f"{args.launches} launches, {args.reps} repetitions, medians; {os.cpu_count()} cores"
    )
    print("\n| side | measurement | value |\n|---|---|---|")
    for key in s.values:
        side, what = key.split("|")
        if side != "target":
            print(f"| {side} | {what} | {s.median(key):.2f} |")
    if _floors and isinstance(_floors[0], str):
        s.notes["PoCL from C"] = _floors[0]
    for side, note in s.notes.items():
        print(f"| {side} | - | {note} |")
    targets = {key.split("|")[1]: values for key, values in s.values.items() if key.startswith("target|")}
    if targets:  # (none with --only compile, or without pyopencl)
        print("\n| target | median | range | pairs |\n|---|---|---|---|")
        for what, values in targets.items():
            spread = f"{min(values):.2f}-{max(values):.2f}"
            print(f"| {what} | {statistics.median(values):.2f} | {spread} | {len(values)} |")


if __name__ == "__main__":
    main()
