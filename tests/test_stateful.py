"""A stateful property test of the runtime: random interleavings of allocate, copyin, launch,
copy_from, free, cancelled waits, timeouts and synchronize across ``CPU``, ``CPU:1`` and ``NULL``.

Hypothesis drives a :class:`~hypothesis.stateful.RuleBasedStateMachine`; every rule runs its
coroutine on an event loop in another thread through an anyio blocking portal, so the same
machine runs under asyncio, trio and uvloop. Launches, copies and frees are *not* awaited to
completion unless the rule says so: work stays pending across steps, so the runtime's ordering
(hazard tracking, ``wait_for``, deferred free) is what keeps the model right.

The model is sequential: every operation updates a numpy copy of each buffer at the moment it
is submitted, in submission order. The runtime promises that the device-side result equals that
order. NULL buffers hold no data; the model tracks only their sizes and lifetimes.

Invariants, after every step: no sticky device error; every allocator's bytes in use lie
between the bytes of live buffers and that plus the bytes freed while work was pending; every
CPU buffer with no pending write reads back equal to the model. At the end of each example:
every buffer reads back equal to the model; after freeing everything and synchronizing, every
allocator is back at its starting bytes in use (cache aside), no queue holds a command and no
timeline holds a waiter.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import aiotinyrt as rt
from aiotinyrt import Buffer, Device, Program, Signal, dtypes

T = TypeVar("T")

DEVICES = ("CPU", "CPU:1", "NULL")
SIZES = (4, 8, 16)  # elements of uint32; few sizes so copy_from pairs are common
MAX_BASES = 8
MAX_SIGNALS = 8
STEP_LIMIT_S = 30.0  # any single step taking longer is a deadlock, reported as a failure

#: ``out[i] = a[i] * 3 + k`` for i < n, after busy-waiting ``spin_us`` microseconds (so waits can
#: be cancelled while the work is really pending). No ``restrict``: out and a may alias (views
#: of one base), and the model replays the same sequential loop.
AXPB = """
#include <time.h>
void axpb(unsigned int* out, const unsigned int* a, int n, int k, int spin_us) {
  if (spin_us > 0) {
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
      clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000000LL + (t.tv_nsec - t0.tv_nsec) / 1000 < spin_us);
  }
  for (int i = 0; i < n; i++) out[i] = a[i] * 3u + (unsigned int)k;
}
"""

TIMEOUT_MESSAGE = re.compile(
    r"^(?P<dev>\S+): timeline (?P<tl>\w+) not set to (?P<want>\d+), but (?P<got>\d+) after "
)

#: What the runs saw, summed over every example of every backend (printed by the test, quoted in
#: RELIABILITY.md).
STATS: Counter[str] = Counter()


@dataclass
class Base:
    """One allocated base buffer and its model contents (None: a NULL buffer holds no data)."""

    buf: Buffer
    model: np.ndarray[Any, Any] | None
    live: bool = True


@dataclass
class Ref:
    """A buffer a rule may use: a base (offset 0, whole size) or a view of one."""

    buf: Buffer
    base: Base
    offset: int  # elements
    size: int  # elements

    @property
    def device(self) -> str:
        return self.buf.device

    @property
    def usable(self) -> bool:
        return self.base.live and not self.buf.freed


def submitted(device: str) -> tuple[int, ...]:
    """Every queue's submitted counter of ``device``: the witness of whether anything was enqueued."""
    return tuple(tl.submitted for tl in Device[device].timelines)


def all_submitted() -> dict[str, tuple[int, ...]]:
    return {d: submitted(d) for d in DEVICES}


def axpb_model(base: np.ndarray[Any, Any], out: Ref, a: Ref, k: int) -> None:
    """Replay the kernel's sequential loop on the model (aliasing included)."""
    src = a.base.model
    assert src is not None
    for i in range(out.size):
        base[out.offset + i] = (int(src[a.offset + i]) * 3 + k) & 0xFFFFFFFF


class RuntimeMachine(RuleBasedStateMachine):
    """The state machine; ``portal`` runs every coroutine on the event loop under test."""

    portal: anyio.from_thread.BlockingPortal

    def __init__(self) -> None:
        super().__init__()
        self.bases: list[Base] = []
        self.refs: list[Ref] = []
        self.dead: list[Ref] = []  # freed buffers and views of freed bases (for use-after-free)
        self.signals: list[Signal] = []
        self.programs: dict[str, Program] = {}
        self.freed_pending: dict[str, int] = dict.fromkeys(DEVICES, 0)
        self.rng = np.random.default_rng(0)
        self.call(self._open)
        STATS["examples"] += 1

    # ---- plumbing -------------------------------------------------------------------------------
    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the loop under test, failing (not hanging) if it takes too long."""

        async def bounded() -> T:
            with anyio.fail_after(STEP_LIMIT_S):
                return await fn()

        return self.portal.call(bounded)

    async def _open(self) -> None:
        for name in DEVICES:
            dev = Device[name]
            await dev.reset()  # drains work left by earlier tests (deferred frees included)
            self.programs[name] = await dev.program("axpb", AXPB)
        self.baseline = {d: Device[d].allocator.statistics().bytes_in_use for d in DEVICES}

    def usable(self) -> list[Ref]:
        return [r for r in self.refs if r.usable]

    def pick(self, refs: list[Ref], index: int) -> Ref:
        return refs[index % len(refs)]

    def remember(self, sig: Signal) -> None:
        self.signals.append(sig)
        del self.signals[:-MAX_SIGNALS]

    def data_for(self, size: int) -> np.ndarray[Any, Any]:
        return self.rng.integers(0, 2**32, size, dtype=np.uint32)

    async def wait(self, sig: Signal, how: str, delay: float) -> None:
        """Wait for ``sig``: fully, not at all, cancelled after ``delay``, or with a timeout."""
        if how == "await":
            assert type(await sig) is float
            STATS["waits"] += 1
        elif how == "cancel":
            with anyio.move_on_after(delay) as scope:
                await sig
            STATS["cancelled waits" if scope.cancelled_caught else "waits"] += 1
        elif how == "timeout":
            try:
                assert type(await sig.wait(timeout=delay)) is float
                STATS["waits"] += 1
            except TimeoutError as exc:
                STATS["timeouts"] += 1
                match = TIMEOUT_MESSAGE.match(str(exc))
                assert match is not None, str(exc)
                assert match["dev"] == sig.timeline.device
                assert match["tl"] == sig.timeline.name
                assert int(match["want"]) == sig.value
                assert int(match["got"]) < sig.value
        else:
            STATS["not awaited"] += 1

    # ---- rules ----------------------------------------------------------------------------------
    @initialize(sizes=st.tuples(*[st.sampled_from(SIZES)] * len(DEVICES)))
    def one_buffer_per_device(self, sizes: tuple[int, ...]) -> None:
        for device, size in zip(DEVICES, sizes, strict=True):
            self.allocate(device, size, True)

    @precondition(lambda self: sum(b.live for b in self.bases) < MAX_BASES)
    @rule(device=st.sampled_from(DEVICES), size=st.sampled_from(SIZES), fill=st.booleans())
    def allocate(self, device: str, size: int, fill: bool) -> None:
        data = self.data_for(size)

        async def go() -> Buffer:
            buf = await Buffer(device, size, dtypes.uint32).allocate()
            if fill or device != "NULL":
                await buf.copyin(data)
            return buf

        buf = self.call(go)
        base = Base(buf, None if device == "NULL" else data.copy())
        self.bases.append(base)
        self.refs.append(Ref(buf, base, 0, size))
        STATS["allocations"] += 1

    @precondition(lambda self: any(r.usable and r.buf.base is r.buf for r in self.refs))
    @rule(index=st.integers(0, 99), data=st.data())
    def make_view(self, index: int, data: st.DataObject) -> None:
        ref = self.pick([r for r in self.usable() if r.buf.base is r.buf], index)
        size = data.draw(st.sampled_from([s for s in SIZES if s <= ref.size]), label="view size")
        offset = data.draw(st.integers(0, ref.size - size), label="view offset")
        view = ref.buf.view(size, dtypes.uint32, offset * 4)
        self.refs.append(Ref(view, ref.base, offset, size))
        STATS["views"] += 1

    @precondition(lambda self: any(r.usable for r in self.refs))
    @rule(index=st.integers(0, 99), cancel=st.booleans(), delay=st.floats(0, 0.003))
    def copyin(self, index: int, cancel: bool, delay: float) -> None:
        ref = self.pick(self.usable(), index)
        data = self.data_for(ref.size)
        copy_queue = Device[ref.device]._copy_queue.timeline
        before = copy_queue.submitted

        async def go() -> bool:
            with anyio.move_on_after(delay if cancel else STEP_LIMIT_S) as scope:
                await ref.buf.copyin(data)
            return scope.cancelled_caught

        cancelled = self.call(go)
        # cancelled before it enqueued (a checkpoint at entry) -> nothing happened; after -> it
        # runs; a small copy into idle memory is not queued at all: done iff not cancelled
        if (copy_queue.submitted != before or not cancelled) and ref.base.model is not None:
            ref.base.model[ref.offset : ref.offset + ref.size] = data
        STATS["copyins"] += 1
        STATS["copyins cancelled"] += cancelled

    @precondition(lambda self: any(r.usable for r in self.refs))
    @rule(
        out_index=st.integers(0, 99),
        data=st.data(),
        k=st.integers(-(2**31), 2**31 - 1),
        spin_us=st.sampled_from([0, 0, 200, 1000]),
        deps=st.lists(st.integers(0, MAX_SIGNALS - 1), max_size=3),
        how=st.sampled_from(["await", "none", "none", "cancel", "timeout"]),
        delay=st.floats(0, 0.002),
    )
    def launch(
        self,
        out_index: int,
        data: st.DataObject,
        k: int,
        spin_us: int,
        deps: list[int],
        how: str,
        delay: float,
    ) -> None:
        out = self.pick(self.usable(), out_index)
        sources = [r for r in self.usable() if r.device == out.device and r.size >= out.size]
        a = data.draw(st.sampled_from(sources), label="source")
        wait_for = [self.signals[i % len(self.signals)] for i in deps] if self.signals else []
        prog = self.programs[out.device]

        async def go() -> None:
            sig = prog(out.buf, a.buf, vals=(out.size, k, spin_us), wait_for=wait_for, writes=(0,))
            self.remember(sig)
            await self.wait(sig, how, delay)

        self.call(go)
        if out.base.model is not None:
            axpb_model(out.base.model, out, a, k)
        STATS["launches"] += 1
        STATS["launches with wait_for"] += bool(wait_for)

    @precondition(lambda self: len(self.usable()) >= 1)
    @rule(dst_index=st.integers(0, 99), data=st.data(), cancel=st.booleans(), delay=st.floats(0, 0.003))
    def copy_from(self, dst_index: int, data: st.DataObject, cancel: bool, delay: float) -> None:
        dst = self.pick(self.usable(), dst_index)
        same_size = [r for r in self.usable() if r.size == dst.size]
        elsewhere = [r for r in same_size if r.device != dst.device]
        across: bool = data.draw(st.booleans(), label="across devices")
        src: Ref = data.draw(st.sampled_from(elsewhere if across and elsewhere else same_size), label="src")
        before = all_submitted()
        expect_refusal = src.device == "NULL" and dst.device != "NULL"

        async def go() -> None:
            with anyio.move_on_after(delay if cancel else STEP_LIMIT_S):
                await dst.buf.copy_from(src.buf)

        if expect_refusal:  # NULL holds no data: documented RuntimeError before anything is enqueued
            with pytest.raises(RuntimeError, match="holds no data to copy out"):
                self.call(lambda: dst.buf.copy_from(src.buf))
            assert all_submitted() == before
            STATS["refused copies"] += 1
            return
        self.call(go)
        if all_submitted() == before:
            return  # cancelled before it enqueued anything
        if dst.base.model is not None:
            assert src.base.model is not None
            dst.base.model[dst.offset : dst.offset + dst.size] = src.base.model[
                src.offset : src.offset + src.size
            ].copy()
        STATS["copies " + ("across devices" if src.device != dst.device else "on one device")] += 1

    @precondition(lambda self: any(r.usable for r in self.refs))
    @rule(index=st.integers(0, 99), cancel_at_entry=st.sampled_from([False, False, False, True]))
    def free(self, index: int, cancel_at_entry: bool) -> None:
        ref = self.pick(self.usable(), index)
        device = Device[ref.device]
        in_use = device.allocator.statistics().bytes_in_use
        is_base = ref.buf.base is ref.buf
        pending = ref.buf.pending() if is_base else []

        async def go() -> None:
            with anyio.CancelScope() as scope:
                if cancel_at_entry:
                    scope.cancel()
                await ref.buf.free()

        self.call(go)
        if cancel_at_entry:  # a checkpoint at entry: cancelled there, nothing happened
            assert not ref.buf.freed
            ref.buf.handle()  # still usable
            if not self.freed_pending[ref.device]:  # (else an earlier deferred free may land now)
                assert device.allocator.statistics().bytes_in_use == in_use
            STATS["frees cancelled at entry"] += 1
            return
        assert ref.buf.freed
        if is_base:
            ref.base.live = False
            if pending:
                self.freed_pending[ref.device] += ref.buf.nbytes
        self.dead.extend(r for r in self.refs if not r.usable)
        self.refs = [r for r in self.refs if r.usable]
        STATS["frees"] += 1
        STATS["frees with work pending"] += bool(pending)

    @precondition(lambda self: any(r.usable and r.buf.base is r.buf for r in self.refs))
    @rule(index=st.integers(0, 99), spin_us=st.sampled_from([0, 300, 2000]))
    def free_while_pending(self, index: int, spin_us: int) -> None:
        """Launch a kernel on a base and free the base at once: the free is deferred until the
        kernel completes, and the memory counts as in use until then."""
        ref = self.pick([r for r in self.usable() if r.buf.base is r.buf], index)
        prog = self.programs[ref.device]

        async def go() -> bool:
            sig = prog(ref.buf, ref.buf, vals=(ref.size, 7, spin_us), writes=(0,))
            self.remember(sig)
            pending = bool(ref.buf.pending())
            await ref.buf.free()
            return pending

        if self.call(go):
            self.freed_pending[ref.device] += ref.buf.nbytes
            STATS["frees with work pending"] += 1
        ref.base.live = False
        self.dead.extend(r for r in self.refs if not r.usable)
        self.refs = [r for r in self.refs if r.usable]
        STATS["launches"] += 1
        STATS["frees"] += 1

    @precondition(lambda self: bool(self.dead))
    @rule(index=st.integers(0, 99), what=st.sampled_from(["launch", "copyin", "copy_from", "view"]))
    def use_after_free(self, index: int, what: str) -> None:
        ref = self.pick(self.dead, index)
        before = all_submitted()
        prog = self.programs[ref.device]

        async def go() -> None:
            if what == "launch":
                prog(ref.buf, ref.buf, vals=(ref.size, 1, 0))
            elif what == "copyin":
                await ref.buf.copyin(self.data_for(ref.size))
            elif what == "copy_from":
                await ref.buf.copy_from(ref.buf)
            else:
                ref.buf.view(1, dtypes.uint32)

        with pytest.raises(RuntimeError, match=r"freed|use after free"):
            self.call(go)
        assert all_submitted() == before
        STATS["use-after-free refused"] += 1

    @precondition(lambda self: bool(self.signals))
    @rule(index=st.integers(0, 99), delay=st.floats(0, 0.003), use_timeout=st.booleans())
    def wait_again(self, index: int, delay: float, use_timeout: bool) -> None:
        """Wait for an earlier signal, often one still pending, and give up after ``delay``."""
        sig = self.signals[index % len(self.signals)]

        async def go() -> None:
            await self.wait(sig, "timeout" if use_timeout else "cancel", delay)

        self.call(go)

    @rule(cancel=st.booleans(), delay=st.floats(0, 0.003))
    def synchronize(self, cancel: bool, delay: float) -> None:
        async def go() -> bool:
            with anyio.move_on_after(delay if cancel else STEP_LIMIT_S) as scope:
                await rt.synchronize(*DEVICES)
            return not scope.cancelled_caught

        if self.call(go):
            self.freed_pending = dict.fromkeys(DEVICES, 0)
            STATS["synchronizes"] += 1
        else:
            STATS["cancelled synchronizes"] += 1

    @precondition(lambda self: any(r.usable and r.base.model is not None for r in self.refs))
    @rule(index=st.integers(0, 99))
    def read_back(self, index: int) -> None:
        """Read a buffer whose writes may still be pending: the read waits for them."""
        ref = self.pick([r for r in self.usable() if r.base.model is not None], index)
        got = self.call(ref.buf.numpy)
        assert ref.base.model is not None
        np.testing.assert_array_equal(got, ref.base.model[ref.offset : ref.offset + ref.size])

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def no_sticky_error(self) -> None:
        STATS["states checked"] += 1  # invariants run after every step
        for name in DEVICES:
            assert Device[name]._error is None, Device[name]._error

    @invariant()
    def memory_accounted(self) -> None:
        for name in DEVICES:
            in_use = Device[name].allocator.statistics().bytes_in_use - self.baseline[name]
            live = sum(b.buf.nbytes for b in self.bases if b.live and b.buf.device == name)
            assert live <= in_use <= live + self.freed_pending[name], (name, in_use, live)

    @invariant()
    def settled_buffers_match_model(self) -> None:
        settled = [b for b in self.bases if b.live and b.model is not None and not b.buf.pending_writes()]
        if not settled:
            return

        async def read() -> list[np.ndarray[Any, Any]]:
            return [await b.buf.numpy() for b in settled]

        for base, got in zip(settled, self.call(read), strict=True):
            np.testing.assert_array_equal(got, base.model)

    @invariant()
    def timelines_consistent(self) -> None:
        for name in DEVICES:
            for q in Device[name].queues.values():
                # Workers may complete commands between the reads: `completed` only grows and
                # nothing is submitted meanwhile (this runs on the loop thread), so reading it
                # first bounds what queued() can see.
                completed = q.timeline.completed
                queued = q.queued()
                submitted = q.timeline.submitted
                assert 0 <= queued <= submitted - completed
                assert q.timeline.completed <= submitted

    # ---- the end of an example ----------------------------------------------------------------------
    def teardown(self) -> None:
        async def finish() -> list[np.ndarray[Any, Any]]:
            out = [await b.buf.numpy() for b in self.bases if b.live and b.model is not None]
            for b in self.bases:
                if b.live:
                    await b.buf.free()
            await rt.synchronize(*DEVICES)
            return out

        checked = [b for b in self.bases if b.live and b.model is not None]
        for base, got in zip(checked, self.call(finish), strict=True):
            np.testing.assert_array_equal(got, base.model)
        for name in DEVICES:
            dev = Device[name]
            stats = dev.allocator.statistics()
            assert stats.bytes_in_use == self.baseline[name], (name, stats)
            for q in dev.queues.values():
                assert q.queued() == 0, q
                assert q.timeline.pending_waiters() == 0, q.timeline


def _portal_params() -> Iterator[Any]:
    yield pytest.param("asyncio", {}, id="asyncio")
    yield pytest.param("trio", {}, id="trio")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return
    yield pytest.param("asyncio", {"use_uvloop": True}, id="uvloop")


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "options"), list(_portal_params()))
def test_random_interleavings_keep_data_memory_and_queues_consistent(
    backend: str, options: dict[str, Any]
) -> None:
    before = STATS.copy()
    with anyio.from_thread.start_blocking_portal(backend, options) as portal:

        class Machine(RuntimeMachine):
            pass

        Machine.portal = portal
        run_state_machine_as_test(  # type: ignore[no-untyped-call]
            Machine,
            settings=settings(
                max_examples=40,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    ran = STATS - before
    print(
        f"\n[{backend}{'+uvloop' if options else ''}] "
        + ", ".join(f"{k}: {v}" for k, v in sorted(ran.items()))
    )
    assert ran["examples"] >= 40
    assert ran["launches"] > 0 and ran["frees"] > 0
