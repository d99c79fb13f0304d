"""DriverQueue on a driver the test completes by hand: wait lists within one driver context,
completions out of order, failures reported late, events released, callbacks that raise, close."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest

from aiotinyrt import DeviceError, Signal
from aiotinyrt.driverqueue import Done, DriverQueue, report


class Owner:
    """The little a queue needs of its device."""

    def __init__(self, name: str = "MANUAL") -> None:
        self.name = name
        self._error: DeviceError | None = None

    def _fail(self, exc: BaseException, sig: Signal) -> DeviceError:
        error = DeviceError(
            f"{self.name}: command {sig.timeline.label}@{sig.value} failed: {exc!r}", cause=exc
        )
        if self._error is None:
            self._error = error
        return error


class Manual:
    """A driver whose commands run only when the test says so."""

    def __init__(self, early: bool = False) -> None:
        self.commands: list[tuple[Callable[..., object], tuple[Any, ...], list[object], Done]] = []
        self.early = early  # each command completes, on another thread, before enqueue returns

    def enqueue(
        self, fn: Callable[..., object], args: tuple[Any, ...], waits: Sequence[object], done: Done
    ) -> object:
        self.commands.append((fn, args, list(waits), done))
        if self.early:
            thread = threading.Thread(target=self.complete, args=(len(self.commands) - 1,))
            thread.start()
            thread.join()
        return object()

    def complete(self, i: int, error: BaseException | None = None) -> None:
        fn, args, _, done = self.commands[i]
        if error is None:
            fn(*args)
        done(0.001, error)


def nothing() -> None:
    pass


def test_a_dependency_on_a_queue_of_the_same_context_joins_the_wait_list() -> None:
    owner, context = Owner(), object()
    first, second = Manual(), Manual()
    q1 = DriverQueue(owner, "compute", first, context=context)
    q2 = DriverQueue(owner, "copy", second, context=context)
    a = q1.submit(nothing, ())
    b = q2.submit(nothing, (), (a,))
    assert len(second.commands) == 1, "held back although the driver can wait for it"
    assert second.commands[0][2] == [q1._events[a.value]]
    first.complete(0)
    second.complete(0)
    assert a.done() and b.done() and b.error() is None


def test_completions_reported_out_of_order_complete_in_order() -> None:
    driver = Manual()
    queue = DriverQueue(Owner(), "compute", driver)
    sigs = [queue.submit(nothing, ()) for _ in range(3)]
    driver.complete(2)
    driver.complete(1)
    assert queue.timeline.completed == 0 and not any(s.done() for s in sigs)
    driver.complete(0)
    assert queue.timeline.completed == 3 and all(s.error() is None for s in sigs)


def test_a_dependent_reported_before_its_failed_dependency_still_fails() -> None:
    owner, context = Owner(), object()
    first, second = Manual(), Manual()
    q1 = DriverQueue(owner, "compute", first, context=context)
    q2 = DriverQueue(Owner("OTHER"), "copy", second, context=context)
    a = q1.submit(nothing, ())
    b = q2.submit(nothing, (), (a,))
    second.complete(0)  # the dependent's callback comes first
    assert not b.done(), "completed before the command it waits for"
    first.complete(0, ValueError("boom"))
    assert a.failed()
    with pytest.raises(DeviceError, match="depends on failed"):
        b.result()


def test_a_failed_dependency_on_the_same_queue_fails_the_dependent() -> None:
    driver = Manual()
    queue = DriverQueue(Owner(), "compute", driver)
    other = DriverQueue(Owner("OTHER"), "compute", Manual())
    failed = other.submit(nothing, ())
    other.driver.complete(0, ValueError("boom"))  # type: ignore[attr-defined]
    x = queue.submit(nothing, (), (failed,))  # not run: its dependency failed
    y = queue.submit(nothing, (), (x,))
    assert x.failed() and y.failed()
    with pytest.raises(DeviceError, match="depends on failed"):
        y.result()


def test_no_event_is_kept_for_a_command_that_completed_before_enqueue_returned() -> None:
    queue = DriverQueue(Owner(), "compute", Manual(early=True))
    sigs = [queue.submit(nothing, ()) for _ in range(50)]
    assert all(s.done() for s in sigs)
    assert queue._events == {}


def test_a_raising_completion_callback_does_not_wedge_the_queue(capsys: pytest.CaptureFixture[str]) -> None:
    driver = Manual()
    queue = DriverQueue(Owner(), "compute", driver)
    first = queue.submit(nothing, ())

    def boom() -> None:
        raise MemoryError("from a callback")

    queue.timeline.add_waiter(first.value, boom, internal=True, after=True)
    later = [queue.submit(nothing, ()) for _ in range(3)]
    for i in range(4):
        driver.complete(i)
    assert all(s.done() for s in later)
    assert "from a callback" in capsys.readouterr().err


def test_completions_from_another_thread_wake_a_blocked_waiter() -> None:
    driver = Manual()
    queue = DriverQueue(Owner(), "compute", driver)
    sig = queue.submit(nothing, ())
    finished = threading.Event()
    queue.timeline.add_waiter(sig.value, finished.set, internal=True)
    thread = threading.Thread(target=driver.complete, args=(0,))
    thread.start()
    assert finished.wait(10)
    thread.join()


def test_closing_fails_held_back_commands_and_refuses_new_ones() -> None:
    driver = Manual()
    queue = DriverQueue(Owner(), "compute", driver)
    host_dependency = DriverQueue(Owner("HOST"), "compute", Manual(), context=object())
    pending = host_dependency.submit(nothing, ())
    held = queue.submit(nothing, (), (pending,))
    assert driver.commands == []  # held back: another context
    queue.stop(drop_queued=True, join_timeout=None)
    assert held.failed()
    with pytest.raises(DeviceError, match="closed"):
        queue.submit(nothing, ())


def test_a_batch_report_fails_exactly_the_failed_command_and_the_later_ones() -> None:
    owner, driver = Owner(), Manual()
    queue = DriverQueue(owner, "compute", driver)
    sigs = [queue.submit(nothing, ()) for _ in range(4)]
    boom = ValueError("boom")
    report([(d, 0.5, boom if i == 1 else None) for i, (_, _, _, d) in enumerate(driver.commands)])
    assert queue.timeline.completed == 4
    assert sigs[0].error() is None and sigs[0].result() == 0.5
    assert isinstance(sigs[1].error(), DeviceError) and sigs[1].error().__cause__ is boom  # type: ignore[union-attr]
    assert sigs[2].error() is owner._error and sigs[3].error() is owner._error  # sticky


def test_a_batch_reported_out_of_order_over_two_queues_completes_each_in_order() -> None:
    owner, context = Owner(), object()
    first, second = Manual(), Manual()
    q1 = DriverQueue(owner, "compute", first, context=context)
    q2 = DriverQueue(owner, "copy", second, context=context)
    a = [q1.submit(nothing, ()) for _ in range(3)]
    b = q2.submit(nothing, (), (a[2],))
    done = [c[3] for c in first.commands]
    report([(second.commands[0][3], 0.0, None), (done[2], 0.0, None), (done[1], 0.0, None)])
    assert q1.timeline.completed == 0 and not b.done(), "completed before what it waits for"
    report([(done[0], 0.0, None)])
    assert q1.timeline.completed == 3 and b.done() and b.error() is None
    assert q1._events == {} and q2._events == {}


def test_a_batch_may_hold_a_drivers_own_done_wrapper() -> None:
    driver = Manual()
    queue = DriverQueue(Owner(), "compute", driver)
    sigs = [queue.submit(nothing, ()) for _ in range(2)]
    seen: list[float] = []
    inner = driver.commands[0][3]

    def wrapper(seconds: float, error: BaseException | None) -> None:  # as a driver's reply
        seen.append(seconds)
        inner(seconds, error)

    report([(wrapper, 0.25, None), (driver.commands[1][3], 0.5, None)])
    assert seen == [0.25] and [s.result() for s in sigs] == [0.25, 0.5]


def _launched_by_the_driver(queue: DriverQueue) -> Signal:
    """A command the driver launches itself, as the CL repeat launch does in C (clfast.c):
    the next value, taken under the submit lock, and no record in the queue."""
    with queue._submit_lock:
        value = queue._next
        queue._next += 1
        queue.timeline.submitted = value
        return Signal(queue.timeline, value, nothing, (), (), None)


def test_runs_reported_by_the_driver_complete_in_value_order_with_the_others() -> None:
    """A run reported before the command ahead of it completes after it; one reported next
    in line completes at once (the direct path); each succeeds."""
    owner, driver = Owner(), Manual()
    queue = DriverQueue(owner, "compute", driver)
    first = queue.submit(nothing, ())
    run = [_launched_by_the_driver(queue) for _ in range(3)]
    queue._report_run(run)
    assert queue.timeline.completed == 0 and queue._runs  # (behind the first command)
    driver.complete(0)
    assert queue.timeline.completed == 4 and not queue._runs and first.done()
    again = [_launched_by_the_driver(queue) for _ in range(2)]
    queue._report_run(again)  # (next in line: advanced here)
    assert queue.timeline.completed == 6
    assert all(s.error() is None for s in [first, *run, *again])


def test_a_failure_after_a_run_in_the_same_pass_leaves_the_run_successful() -> None:
    """A run and a later command that fails are completed in one pass (another thread was
    advancing when they came in): the run, earlier in value order, stays successful; only the
    failed command and the ones after it fail."""
    owner, driver = Owner(), Manual()
    queue = DriverQueue(owner, "compute", driver)
    queue.submit(nothing, ())
    run = [_launched_by_the_driver(queue) for _ in range(2)]
    failing, after = queue.submit(nothing, ()), _launched_by_the_driver(queue)
    gate, inside = threading.Event(), threading.Event()
    queue.timeline.add_waiter(1, lambda: (inside.set(), gate.wait(60)), internal=True)
    advancing = threading.Thread(target=driver.complete, args=(0,))  # (blocked at value 1)
    advancing.start()
    assert inside.wait(60)
    queue._report_run(run)
    driver.complete(1, RuntimeError("boom"))
    queue._report_run([after])
    gate.set()
    advancing.join(60)
    assert queue.timeline.completed == 5
    assert all(s.error() is None for s in run)
    assert failing.error() is owner._error and after.error() is owner._error
    assert [(a, b) for a, b, _ in queue.timeline._failures] == [(4, 5)]  # (in value order)


class Polling(Manual):
    """A driver that offers ``poll(value, event)`` and no claim (Driver's docstring allows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.polls: list[tuple[int, object]] = []

    def poll(self, value: int, event: object) -> None:
        self.polls.append((value, event))
        self.complete(value - 1)  # (its command completes while it is polled)


@pytest.mark.anyio
async def test_a_driver_with_a_poll_and_no_claim_is_polled_with_two_arguments() -> None:
    """Claims are optional: an await on a queue whose driver polls but does not claim polls it
    with the command's value and event alone, and finds the command done."""
    driver = Polling()
    queue = DriverQueue(Owner(), "polled", driver)
    assert queue.timeline.poll is not None and queue.timeline.claim is None
    sig = queue.submit(nothing, ())
    with anyio.fail_after(30):
        assert await sig == 0.001
    assert [value for value, _ in driver.polls] == [sig.value]
