"""Faults: a command raising in a worker, a compiler that hangs or dies, a corrupt compile cache,
interpreter exit with work queued, and interruption (KeyboardInterrupt, task-group failure) while
many awaits are pending.

Each fault must end in a documented error (``DeviceError`` with its cause, ``CompileError``, one
``RuntimeWarning``), leave other devices untouched, and leave nothing behind: no worker thread,
no memory in use, no waiter.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, CompileError, Device, DeviceError, dtypes
from aiotinyrt.compiler import DiskCache
from aiotinyrt.host import ccprocess
from tests.helpers import FAULTY, INC, SPIN, gate_on, inject_failure, int_buffer

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent


def worker_threads(device: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"aiotinyrt-{device}/") and t.is_alive()]


# ---- a command raising in the worker --------------------------------------------------------------


async def test_worker_fault_fails_the_signal_with_its_cause_and_everything_queued_behind_it() -> None:
    async with rt.open_device(FAULTY) as dev, gate_on(FAULTY) as gate:
        inc = await dev.program("inc", INC)
        out = await int_buffer(FAULTY)
        before = [inc(out) for _ in range(3)]
        await before[-1]
        held = gate.launch(out, 100)  # the queue is held: the fault and 50 launches queue behind it
        fault = inject_failure(dev)
        after = [inc(out) for _ in range(50)]
        gate.open()
        with pytest.raises(DeviceError, match="injected device fault") as info:
            await fault
        assert isinstance(info.value.cause, OSError)
        assert info.value.__cause__ is info.value.cause
        assert info.value.device == FAULTY
        for sig in after:  # sticky: nothing after the fault ran, every signal says why
            with pytest.raises(DeviceError, match="injected device fault"):
                await sig
        assert all(not s.failed() for s in [*before, held])  # earlier signals stay successful
        with pytest.raises(DeviceError, match="injected device fault"):
            await out.copyin(np.zeros(1, np.int32))  # the copy queue refuses too
        with pytest.raises(DeviceError, match="injected device fault"):
            await dev.synchronize()
        await dev.reset()
        assert (await out.numpy()).tolist() == [100]  # the gate ran, the 50 launches did not
        await dev.run(inc, out)
        assert (await out.numpy()).tolist() == [101]
        await out.free()


async def test_worker_fault_on_the_copy_queue_is_sticky_for_launches_too() -> None:
    async with rt.open_device(FAULTY) as dev:
        inc = await dev.program("inc", INC)
        out = await int_buffer(FAULTY)
        with pytest.raises(DeviceError, match="injected device fault"):
            await inject_failure(dev, "copy")
        with pytest.raises(DeviceError, match="injected device fault"):
            await inc(out)
        await dev.reset()
        await dev.run(inc, out)
        assert (await out.numpy()).tolist() == [1]
        await out.free()


async def test_worker_fault_leaves_other_devices_running_and_correct() -> None:
    cpu, null = Device["CPU"], Device["NULL"]
    inc_cpu = await cpu.program("inc", INC)
    null_prog = await null.program("k", "k")
    out = await int_buffer("CPU")
    null_buf = await Buffer("NULL", 4, dtypes.int32).allocate()
    async with rt.open_device(FAULTY) as dev:
        fault = inject_failure(dev)
        sigs = [inc_cpu(out) for _ in range(100)] + [null_prog(null_buf) for _ in range(100)]
        with pytest.raises(DeviceError):
            await fault
        for sig in sigs:
            assert type(await sig) is float
        await rt.synchronize(cpu, null)  # the other devices carry no error
        assert cpu._error is None and null._error is None
        assert (await out.numpy()).tolist() == [100]
        await dev.reset()
    await out.free()
    await null_buf.free()


async def test_fault_propagates_along_a_cross_device_chain_without_poisoning_it() -> None:
    inc_cpu = await Device["CPU"].program("inc", INC)
    null_prog = await Device["NULL"].program("k", "k")
    out = await int_buffer("CPU")
    async with rt.open_device(FAULTY) as dev:
        fault = inject_failure(dev)
        on_cpu = inc_cpu(out, wait_for=[fault])
        on_null = null_prog(wait_for=[on_cpu])
        with pytest.raises(DeviceError, match="depends on failed"):
            await on_null
        with pytest.raises(DeviceError, match="depends on failed"):
            await on_cpu
        await Device["CPU"].synchronize()  # neither CPU nor NULL is poisoned
        await Device["NULL"].synchronize()
        assert (await out.numpy()).tolist() == [0]  # the dependent launch did not run
        await dev.reset()
    await out.free()


async def test_memory_freed_around_a_fault_is_released_and_reset_is_complete() -> None:
    async with rt.open_device(FAULTY) as dev, gate_on(FAULTY) as gate:
        inc = await dev.program("inc", INC)
        start = dev.allocator.statistics().bytes_in_use
        bufs = [await int_buffer(FAULTY, size=1024) for _ in range(8)]
        gate.launch(bufs[0], 1)
        inject_failure(dev)
        for buf in bufs:
            inc(buf)  # will fail: queued behind the fault
            await buf.free()  # deferred until those failed launches complete
        assert dev.allocator.statistics().bytes_in_use == start + 8 * 4096
        gate.open()
        await dev.reset()
        assert dev.allocator.statistics().bytes_in_use == start
        assert all(q.queued() == 0 for q in dev.queues.values())


# ---- the compiler hanging or dying --------------------------------------------------------------

FAKE_CC = """#!/bin/sh
# A C compiler that does what the control file says: ok (run clang), hang, or kill itself. It
# reads the mode once it has been given a source, as a compiler started ahead of time would.
case "$1" in --version) exec clang --version ;; esac
head="$FAKE_CC_MODE.$$"
head -c 1000 > "$head"  # (a process started ahead of its compile waits here)
mode=$(cat "$FAKE_CC_MODE")
case "$mode" in
  hang) rm -f "$head"; echo $$ > "$FAKE_CC_PID"; exec sleep 60 ;;
  kill) rm -f "$head"; kill -9 $$ ;;  # dies after reading (some of) its stdin
  *) { cat "$head"; cat; } | clang "$@"; status=$?; rm -f "$head"; exit $status ;;
esac
"""


@pytest.fixture
def fake_cc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point ``CC`` at a script whose behaviour the test switches; returns the control file."""
    script = tmp_path / "fake-cc"
    script.write_text(FAKE_CC)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    mode = tmp_path / "mode"
    mode.write_text("ok")
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("FAKE_CC_MODE", str(mode))
    monkeypatch.setenv("FAKE_CC_PID", str(tmp_path / "pid"))
    monkeypatch.setenv("COMPILE_TIMEOUT_S", "0.5")
    yield mode
    ccprocess.close_compiler([str(script)])  # its process started ahead of a next compile


def fresh_inc() -> str:
    """INC with a comment no cache has seen."""
    return f"// {uuid.uuid4()}\n{INC}\n"


@pytest.mark.slow
async def test_hanging_compiler_times_out_with_compile_error_and_the_next_compile_works(
    fake_cc: Path, tmp_path: Path
) -> None:
    src = fresh_inc()
    inc_cpu = await Device["CPU"].program("inc", INC)
    out = await int_buffer("CPU")
    async with rt.open_device(FAULTY) as dev:
        fake_cc.write_text("hang")
        launches: list[float] = []

        async def meanwhile() -> None:  # other devices keep working during the hang
            for _ in range(20):
                launches.append(await inc_cpu(out))

        async with anyio.create_task_group() as tg:
            tg.start_soon(meanwhile)
            with pytest.raises(CompileError, match=r"did not finish within 0\.5 s"):
                await dev.program("inc", src)
        assert len(launches) == 20
        pid = int((tmp_path / "pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # the hung compiler was killed and reaped, not left running
        fake_cc.write_text("ok")
        prog = await dev.program("inc", src)  # the failure was not cached
        buf = await int_buffer(FAULTY)
        await dev.run(prog, buf)
        assert (await buf.numpy()).tolist() == [1]
        await buf.free()
    assert (await out.numpy()).tolist() == [20]
    await out.free()


async def test_killed_compiler_gives_compile_error_and_the_next_compile_works(fake_cc: Path) -> None:
    # a source bigger than a pipe buffer: the compiler dies while the runtime is still writing it
    src = fresh_inc() + "// " + "x" * 200_000 + "\n"
    async with rt.open_device(FAULTY) as dev:
        fake_cc.write_text("kill")
        with pytest.raises(CompileError, match="killed by signal 9"):
            await dev.program("inc", src)
        fake_cc.write_text("ok")
        prog = await dev.program("inc", src)
        buf = await int_buffer(FAULTY)
        await dev.run(prog, buf)
        assert (await buf.numpy()).tolist() == [1]
        await buf.free()


async def test_killed_compiler_with_a_small_source_gives_compile_error(fake_cc: Path) -> None:
    async with rt.open_device(FAULTY) as dev:
        fake_cc.write_text("kill")
        for _ in range(5):
            with pytest.raises(CompileError, match="killed by signal 9"):
                await dev.compiler.compile_cached(fresh_inc())


# ---- a corrupt compile cache ---------------------------------------------------------------------


def cache_with_entries(path: Path) -> None:
    cache = DiskCache(path)
    for i in range(40):
        cache.put(f"key{i}", os.urandom(4000))
    cache.close()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated", "garbage", "zeroed header"])
async def test_damaged_cache_file_warns_once_compiles_anyway_and_is_rebuilt(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / f"{damage.replace(' ', '-')}.db"
    cache_with_entries(path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(data)))
    else:
        path.write_bytes(bytes(100) + data[100:])
    monkeypatch.setenv("CACHEDB", str(path))
    async with rt.open_device(FAULTY) as dev:
        srcs = [fresh_inc() for _ in range(3)]
        with pytest.warns(RuntimeWarning, match="compile cache") as record:
            progs = [await dev.program("inc", src) for src in srcs]
        assert len(record) == 1, [str(w.message) for w in record]
        buf = await int_buffer(FAULTY)
        for prog in progs:
            await dev.run(prog, buf)
        assert (await buf.numpy()).tolist() == [3]
        await buf.free()
    # the next process finds a working cache (rebuilt), not the same damage and another warning
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        fresh = DiskCache(path)
        fresh.put("after", b"lib")
        stored = fresh.get("after")
        fresh.close()
    assert [str(w.message) for w in later] == [], "the damaged cache file was not rebuilt"
    assert stored == b"lib"


# ---- interpreter exit with work queued -------------------------------------------------------------

EXIT_SCRIPT = """
import sys, anyio
from aiotinyrt import Buffer, Device, dtypes

SPIN = {spin!r}

async def main() -> None:
    sigs = []
    for name in ("CPU", "CPU:1", "NULL"):
        dev = Device[name]
        prog = await dev.program("spin", SPIN)
        out = await Buffer(name, 1, dtypes.int32).allocate()
        sigs += [prog(out, vals=(int(sys.argv[2]),)) for _ in range(int(sys.argv[3]))]
        await out.free()  # freed with work pending
    async with anyio.create_task_group() as tg:
        for sig in sigs[::10]:
            tg.start_soon(sig.wait)
        await anyio.wait_all_tasks_blocked()
        print("queued", len(sigs), "pending", sum(not s.done() for s in sigs), flush=True)
        tg.cancel_scope.cancel()  # give up while 10 %% of the launches are being awaited
    sys.exit(0)  # and leave with the work still queued

kind, _, opt = sys.argv[1].partition("+")
anyio.run(main, backend=kind, backend_options={{"use_uvloop": True}} if opt else {{}})
"""


def exit_params() -> list[str]:
    params = ["asyncio", "trio"]
    try:
        import uvloop  # noqa: F401

        params.append("asyncio+uvloop")
    except ImportError:
        pass
    return params


@pytest.mark.slow
@pytest.mark.parametrize("loop", exit_params())
@pytest.mark.parametrize(("ms", "launches"), [(20, 100), (60_000, 2)], ids=["queued", "stuck"])
def test_exit_with_awaits_pending_and_launches_queued_on_every_device_is_bounded_and_quiet(
    loop: str, ms: int, launches: int
) -> None:
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT.format(spin=SPIN), loop, str(ms), str(launches)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "EXIT_JOIN_S": "0.5", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"queued {3 * launches} pending "), result.stdout
    assert int(result.stdout.split()[3]) > 0  # work really was pending at exit
    if ms < 1000:
        assert result.stderr == ""
    else:  # a kernel still running on each CPU device is abandoned, its memory kept, one line each
        lines = result.stderr.splitlines()
        assert sorted(line.split()[2] for line in lines) == ["CPU/compute@1", "CPU:1/compute@1"], lines
        assert all("(spin)" in line and "abandoned" in line for line in lines), lines
    assert elapsed < 15, f"exit took {elapsed:.1f} s"


# ---- interruption while many awaits are pending ------------------------------------------------------


async def test_task_group_failure_with_many_awaits_pending_leaves_nothing_after_aclose() -> None:
    dev = Device[FAULTY]
    async with gate_on(FAULTY) as gate:
        prog = await dev.program("spin", SPIN)
        started = 0

        async def worker() -> None:
            nonlocal started
            async with Buffer(FAULTY, 256, dtypes.int32) as buf:
                started += 1
                gate.launch(buf)
                await prog(buf, vals=(1,))  # queued behind the gate: never done before the failure

        async def failing() -> None:
            await anyio.wait_all_tasks_blocked()
            raise ValueError("one request failed")

        with pytest.raises(ExceptionGroup) as info:
            async with anyio.create_task_group() as tg:
                for _ in range(100):
                    tg.start_soon(worker)
                tg.start_soon(failing)
        assert info.group_contains(ValueError, match="one request failed")
        assert started == 100
        assert dev.allocator.statistics().bytes_in_use >= 100 * 1024  # deferred: work is queued
        gate.open()
    await dev.aclose()
    assert worker_threads(FAULTY) == []
    stats = dev.allocator.statistics()
    assert (stats.bytes_in_use, stats.allocations, stats.bytes_cached) == (0, 0, 0), stats
    assert all(q.queued() == 0 and q.timeline.pending_waiters() == 0 for q in dev.queues.values())


INTERRUPT_SCRIPT = """
import json, signal, sys, threading, anyio
from aiotinyrt import Buffer, Device, dtypes

SPIN = {spin!r}
NAMES = ("CPU:1", "CPU:2", "NULL")

async def worker(name: str, prog) -> None:
    async with Buffer(name, 256, dtypes.int32) as buf:
        for _ in range(1000):
            await prog(buf, vals=(2,))

async def main() -> None:
    progs = {{name: await Device[name].program("spin", SPIN) for name in NAMES}}
    async with anyio.create_task_group() as tg:
        for i in range(60):
            tg.start_soon(worker, NAMES[i % 3], progs[NAMES[i % 3]])
        await anyio.wait_all_tasks_blocked()
        signal.raise_signal(signal.SIGINT)  # Ctrl-C while 60 awaits are pending
        await anyio.sleep_forever()

kind, _, opt = sys.argv[1].partition("+")
interrupted = False
try:
    anyio.run(main, backend=kind, backend_options={{"use_uvloop": True}} if opt else {{}})
except* KeyboardInterrupt:  # bare on asyncio, inside a group when raised in a trio nursery
    interrupted = True
if not interrupted:
    sys.exit("no KeyboardInterrupt")

async def close() -> None:
    for name in NAMES:
        await Device[name].aclose()

devices = [Device[name] for name in NAMES]
anyio.run(close, backend=kind)
report = {{
    "threads": [t.name for t in threading.enumerate() if t.name.startswith("aiotinyrt-")],
    "stats": [[d.allocator.statistics().bytes_in_use, d.allocator.statistics().allocations,
               d.allocator.statistics().bytes_cached] for d in devices],
    "queued": [q.queued() for d in devices for q in d.queues.values()],
}}
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.parametrize("loop", exit_params())
def test_keyboard_interrupt_with_many_awaits_pending_leaves_nothing_after_aclose(loop: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPT_SCRIPT.format(spin=SPIN), loop],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    report = json.loads(result.stdout)
    assert report["threads"] == []
    assert report["stats"] == [[0, 0, 0]] * 3
    assert report["queued"] == [0] * 6
