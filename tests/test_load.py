"""Load: many concurrent tasks, each a long dependency chain alternating between two devices, with
10 % of the waits cancelled at random. Every result must be right, nothing may be retained
afterwards (memory, signals, waiters, queued commands), and nothing may deadlock.

The issue's full size is 200 tasks x 500 launches on every event loop. On the CI machine (2 noisy
cores, three loops) the suite runs 200 tasks x 50 launches; ``LOAD_FULL=1`` runs the full size
here, and ``python bench/load.py`` runs it on every loop and prints time and peak RSS.

How a chain proves cross-device ordering: each task owns one word of host memory and wraps it in
a buffer on ``CPU`` and another on ``CPU:1`` (``BufferSpec(external_ptr=...)``). The runtime
cannot see that they alias, so the only thing ordering the launches is ``wait_for``. Launch j
computes ``t = t * 3 + j`` on CPU (even j) or ``t = t * 5 + j`` on CPU:1 (odd j); the final
word equals the sequential model only if every launch ran after the one before it.
"""

from __future__ import annotations

import gc
import os
import random
import resource
import time
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from aiotinyrt import Device, Signal
from tests.helpers import CHAIN_DEVICES, STEP_CPU, STEP_CPU1, chain

pytestmark = pytest.mark.anyio


@dataclass
class LoadReport:
    """What one run did."""

    tasks: int
    launches: int
    waits: int
    armed_waits: int  # waits given a random cancel deadline
    cancelled_waits: int  # of those, the ones the deadline actually cancelled
    seconds: float
    peak_rss_mib: float
    rss_growth_mib: float
    signals_retained: int

    def row(self) -> str:
        rate = self.launches / self.seconds
        return (
            f"{self.tasks:>5} x {self.launches // self.tasks:<4} {self.launches:>8} {self.waits:>7} "
            f"{self.armed_waits:>6} {self.cancelled_waits:>9} {self.seconds:>8.2f} {rate:>10.0f} "
            f"{self.peak_rss_mib:>9.1f} {self.rss_growth_mib:>9.1f}"
        )


HEADER = (
    f"{'tasks x launches':<16} {'total':>6} {'waits':>7} {'armed':>6} {'cancelled':>9} {'seconds':>8} "
    f"{'launch/s':>10} {'peak RSS':>9} {'RSS grew':>9}"
)


def rss_mib() -> float:
    """Current resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_signals() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, Signal))


async def run_load(
    tasks: int = 200, launches: int = 500, wait_every: int = 5, cancel_fraction: float = 0.1, seed: int = 0
) -> LoadReport:
    """Run the load once on the current event loop and check everything it promises."""
    devices = [Device[d] for d in CHAIN_DEVICES]
    for dev in devices:
        await dev.synchronize()
    progs = (await devices[0].program("step3", STEP_CPU), await devices[1].program("step5", STEP_CPU1))
    in_use = [d.allocator.statistics().bytes_in_use for d in devices]
    signals_before = live_signals()
    rss_before = rss_mib()
    counts = {"waits": 0, "armed": 0, "cancelled": 0}
    rng = random.Random(seed)
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(tasks):
            tg.start_soon(
                chain, progs, launches, wait_every, cancel_fraction, random.Random(rng.random()), counts
            )
    seconds = time.perf_counter() - start
    for dev in devices:
        await dev.synchronize()
    report = LoadReport(
        tasks=tasks,
        launches=tasks * launches,
        waits=counts["waits"],
        armed_waits=counts["armed"],
        cancelled_waits=counts["cancelled"],
        seconds=seconds,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        rss_growth_mib=rss_mib() - rss_before,
        signals_retained=live_signals() - signals_before,
    )
    # nothing is retained: memory, signals, waiters, queued commands
    assert [d.allocator.statistics().bytes_in_use for d in devices] == in_use
    for dev in devices:
        for q in dev.queues.values():
            assert q.queued() == 0, q
            assert q.timeline.pending_waiters() == 0, q.timeline
            assert q.timeline._heap == [], "abandoned waiters are still held after their value passed"
    assert report.signals_retained < tasks, f"{report.signals_retained} signals outlived the run"
    return report


FULL = os.environ.get("LOAD_FULL", "") not in ("", "0")
TASKS, LAUNCHES = (200, 500) if FULL else (200, 50)


@pytest.mark.slow
async def test_concurrent_cross_device_chains_with_cancelled_waits_are_correct_and_leave_nothing(
    anyio_backend: Any,
) -> None:
    with anyio.fail_after(600 if FULL else 60):  # a deadlock fails the test instead of hanging it
        report = await run_load(TASKS, LAUNCHES)
    name, options = anyio_backend
    label = (
        f"{name}{'+uvloop' if options.get('use_uvloop') else ''}{' (debug)' if options.get('debug') else ''}"
    )
    print(f"\n{'loop':<16} {HEADER}\n{label:<16} {report.row()}")
    assert report.launches == TASKS * LAUNCHES
    assert report.cancelled_waits > 0  # the cancellation path was really taken
    assert report.rss_growth_mib < 256, f"RSS grew by {report.rss_growth_mib:.0f} MiB"
