"""Calls that used to fail with someone else's message, or not at all: a NaN or non-numeric
timeout, a malformed ``WAIT_TIMEOUT_MS``, ``copy_from`` out of a closed device's buffer, and a
global size given to a raw CPU kernel that would ignore it. Each raises a specific error before
anything is enqueued (or, for ``WAIT_TIMEOUT_MS``, behaves as RELIABILITY.md says).
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from aiotinyrt import Buffer, Device, DeviceError, Signal, dtypes

pytestmark = pytest.mark.anyio

INC = "void inc(int* restrict out) { out[0] += 1; }"


def bad(value: object) -> Any:
    """A wrong-typed argument, passed on purpose."""
    return value


@pytest.fixture
async def pending() -> AsyncIterator[Signal]:
    """A NULL command that stays pending until the test ends."""
    queue = Device["NULL"]._compute_queue
    release = threading.Event()
    queue.submit(release.wait, (30,))
    sig = queue.submit(lambda: None, ())
    yield sig
    release.set()
    await sig


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (math.nan, ValueError, "timeout must not be NaN"),
        ("1", TypeError, "timeout must be a number of seconds or None, got str"),
        (True, TypeError, "timeout must be a number of seconds or None, got bool"),
        ([1.0], TypeError, "timeout must be a number of seconds or None, got list"),
    ],
    ids=["nan", "str", "bool", "list"],
)
async def test_a_nan_or_non_numeric_timeout_is_refused_whether_or_not_the_signal_is_done(
    timeout: object, error: type[Exception], message: str, pending: Signal
) -> None:
    with pytest.raises(error, match=message):
        await pending.wait(timeout=bad(timeout))
    assert pending.timeline.pending_waiters() == 0
    done = Device["NULL"]._copy_queue.submit(lambda: None, ())
    await done
    with pytest.raises(error, match=message):
        await done.wait(timeout=bad(timeout))


async def test_an_infinite_timeout_is_no_limit_and_a_negative_one_has_expired(pending: Signal) -> None:
    done = Device["NULL"]._copy_queue.submit(lambda: None, ())
    assert await done.wait(timeout=math.inf) >= 0
    with pytest.raises(TimeoutError, match="after -1 s"):
        await pending.wait(timeout=-1)


@pytest.mark.parametrize("value", ["nan", "abc", "inf", "1ms"])
async def test_a_malformed_wait_timeout_ms_names_the_variable(
    value: str, pending: Signal, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WAIT_TIMEOUT_MS", value)
    with pytest.raises(ValueError, match=r"WAIT_TIMEOUT_MS=.* is not a finite number of milliseconds"):
        await pending
    assert pending.timeline.pending_waiters() == 0


async def test_wait_timeout_ms_takes_fractions_of_a_millisecond(
    pending: Signal, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WAIT_TIMEOUT_MS", "0.5")
    with pytest.raises(TimeoutError, match=r"after 0\.0005 s"):
        await pending
    assert pending.timeline.pending_waiters() == 0


@pytest.mark.parametrize(("src_name", "dst_name"), [("CPU:3", "CPU"), ("NULL:3", "CPU"), ("CPU:4", "NULL")])
async def test_copy_from_out_of_a_closed_devices_buffer_says_the_device_is_closed(
    src_name: str, dst_name: str
) -> None:
    src_dev = Device[src_name]
    src = await Buffer(src_name, 4, dtypes.int32).allocate()
    await src.copyin(np.arange(4, dtype=np.int32))
    await src_dev.aclose()
    dest = await Buffer(dst_name, 4, dtypes.int32).allocate()
    queue = dest.device_obj._copy_queue
    before = queue.timeline.submitted
    for source in (src, src.view(2, dtypes.int32, 4)):
        target = dest if source is src else dest.view(2, dtypes.int32, 0)
        with pytest.raises(DeviceError, match=f"{src_name} is closed"):
            await target.copy_from(source)
    assert queue.timeline.submitted == before  # nothing enqueued
    await dest.free()
    await src.free()


async def test_a_raw_cpu_kernel_refuses_a_global_size_it_would_ignore() -> None:
    dev = Device["CPU"]
    prog = await dev.program("inc", INC)
    out = await Buffer("CPU", 1, dtypes.int32).allocate()
    await out.copyin(np.zeros(1, np.int32))
    before = dev._compute_queue.timeline.submitted
    for size in ((16,), (16, 4, 2), (1, 2)):
        with pytest.raises(ValueError, match=r"raw C kernel 'inc' runs once per launch.*global_size="):
            prog(out, global_size=size)
    async with dev.capture() as graph:
        with pytest.raises(ValueError, match="runs once per launch"):
            prog(out, global_size=(8,))
        prog(out)
    assert dev._compute_queue.timeline.submitted == before
    await prog(out, global_size=(1, 1, 1))  # a unit size is what a raw kernel runs
    await graph.replay()
    assert (await out.numpy()).tolist() == [2]
    await out.free()


async def test_a_raw_null_kernel_takes_any_global_size() -> None:
    dev = Device["NULL"]
    prog = await dev.program("k", "k")
    assert await dev.run(prog, global_size=(1024, 4, 1)) >= 0
