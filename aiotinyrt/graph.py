"""Captured graphs: record a fixed sequence of launches and copies once, replay it for almost nothing.

``async with dev.capture(x=buf_x) as graph:`` records, instead of running, every launch and
``copy_from`` made by the current task (and tasks it starts) on any device. On exit the
recording is split into *runs*: maximal stretches of consecutive commands for the same device
queue. Each run is replayed as **one** queue command:

* on CPU, a run of raw C kernels becomes a generated C function that calls every kernel with its
  fixed arguments from an argument array, so a replay costs one queue command plus one direct C
  call per kernel;
* anything else (NULL, copies, other backends) replays as one command that calls each recorded
  function in turn.

Buffers named at capture (``dev.capture(x=buf)``, or ``graph.name("x", buf)``) can be replaced
at replay (``graph.replay(x=other)``), as tinygrad's JIT replaces its input buffers: the
replacement must be allocated, on the same device, with the same size in bytes. Replays are
ordered against other work on the buffers they touch exactly like single launches (the runs
depend on each other through the same hazard tracking), so runs on different devices overlap
where the data allows.

Launches recorded in a capture return a Signal that is already failed: awaiting it raises
``RuntimeError`` saying the launch was captured, not run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

from aiotinyrt import native
from aiotinyrt.buffer import Buffer
from aiotinyrt.queue import Queue, capturing
from aiotinyrt.registry import DeviceLike
from aiotinyrt.signal import Signal, Timeline


@dataclass
class _Entry:
    """One recorded command: ``fn(*args)`` on ``queue``. ``bufs[i]`` appears in ``args`` at the
    positions ``slots[i]``, each ``(position, is_ptr)``: its handle, or the pointer object the
    handle carries (CPU kernels); ``after`` lists the indices of earlier entries this one waits
    for (``wait_for`` on captured signals)."""

    queue: Queue
    fn: Callable[..., object]
    args: list[Any]
    bufs: list[Buffer]
    writes: list[bool]
    slots: list[list[tuple[int, bool]]]
    after: list[int]
    program: Any = None  # the Program, for native CPU runs and keep-alive


#: How one run is submitted at replay: ``(fn, args, accesses, keep, command)`` (see Graph._plan).
_Command = tuple[int, int, int, Any]
_Plan = tuple[Callable[..., object], tuple[Any, ...], list[tuple["Buffer", bool]], object, _Command | None]


#: How many substitution sets a graph remembers the replay plans of (see Graph._plans_for).
_PLAN_CACHE = 64
#: The C replay's limit (REPLAY_MAX_RUNS in native.SOURCE); larger graphs replay in Python.
_FAST_MAX_RUNS = 32
#: ``(replay, runs)``: the C replay and its argument (see Graph._fast_plan).
_Fast = tuple[Callable[[tuple[Any, ...]], Any], tuple[Any, ...]]
#: A plan cache entry: the plans, the buffers they use, the C replay's form (see Graph._plans_for).
_Cached = tuple[list[_Plan], tuple["Buffer", ...], _Fast | None]


@dataclass
class NativeRun:
    """A run compiled into one C function: ``cfunc(fns, args)`` calls every kernel.

    ``args`` is the flat argument array; ``positions[(entry, buffer)]`` are the slots in it that
    hold that buffer's address; ``copy_args`` makes a private copy for a replay with
    substitutions (a queued replay keeps its own array)."""

    cfunc: Any
    fns: Any
    args: Any
    positions: dict[tuple[int, int], list[int]]
    copy_args: Callable[[Any], Any]
    keep: Any
    #: per entry, the index in ``args`` of its first argument (its vals follow its buffers)
    starts: list[int] = field(default_factory=list)

    def command(self, args: Any) -> _Command:
        """``(fn, nargs, block, keep)``: this replay as one command of a native queue."""
        ffi = native.ffi

        def address(cdata: Any) -> int:
            return int(ffi.cast("uintptr_t", cdata))

        block = ffi.new("uint64_t[]", [address(self.fns), address(args)])
        return address(self.cfunc), 2, address(block), (block, args)


@dataclass
class _Run:
    queue: Queue
    first: int  # index of its first entry
    entries: list[_Entry] = field(default_factory=list)
    native: NativeRun | None = None
    accesses: list[tuple[Buffer, bool]] = field(default_factory=list)  # distinct buffers, written?
    calls: list[tuple[Callable[..., object], tuple[Any, ...]]] = field(default_factory=list)
    after: list[int] = field(default_factory=list)  # earlier runs it waits for (wait_for)
    # a run of one transfer whose allocator has a native form (CPU memmove): that allocator
    transfer: Any = None


class Graph:
    """A recorded sequence of launches and copies, replayed as one command per device queue."""

    def __init__(self, named: dict[str, Buffer]) -> None:
        self._entries: list[_Entry] = []
        self._runs: list[_Run] = []
        #: every device a replay runs on or touches memory of (a folded transfer writes another
        #: device's buffer from this device's worker): each must be open to replay
        self._devices: list[DeviceLike] = []
        self._names: dict[str, Buffer] = {}
        self._sealed = False
        self._timeline = Timeline("capture", "graph")
        #: replay plans by substitution set (see _plans_for)
        self._plan_cache: dict[tuple[tuple[str, int], ...], _Cached] = {}
        for name, buf in named.items():
            self.name(name, buf)

    def __repr__(self) -> str:
        return f"<Graph {len(self._entries)} commands in {len(self._runs)} runs>"

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def devices(self) -> list[str]:
        """Devices this graph runs on, in first-use order."""
        out: list[str] = []
        for entry in self._entries:
            if entry.queue.device.name not in out:
                out.append(entry.queue.device.name)
        return out

    def name(self, name: str, buf: Buffer) -> None:
        """Make ``buf`` substitutable at replay as ``name``."""
        if not name.isidentifier():
            raise ValueError(f"graph input name must be an identifier, got {name!r}")
        if not isinstance(buf, Buffer):
            raise TypeError(f"graph input {name!r} must be a Buffer, got {type(buf).__name__}")
        if self._sealed:
            raise RuntimeError("name inputs while capturing, before the capture block ends")
        self._names[name] = buf

    # ---- recording (launches and copies come here while this graph captures) -------------------------------
    def _captured_signal(self) -> Signal:
        timeline = self._timeline
        timeline.submitted += 1
        sig = Signal(timeline, timeline.submitted)
        sig._error = RuntimeError("this launch was captured into a graph, not run; await graph.replay()")
        timeline.completed = timeline.submitted
        return sig

    def _record(
        self,
        queue: Queue,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        bufs: tuple[Buffer, ...],
        writes: list[bool],
        wait_for: tuple[Signal, ...] = (),
        program: Any = None,
    ) -> Signal:
        if self._sealed:
            raise RuntimeError("this graph's capture has ended")
        after = []
        for dep in wait_for:
            if dep.timeline is not self._timeline:
                raise ValueError(
                    "while capturing, wait_for may only name signals captured in the same graph; "
                    "wait for outside work before the capture block"
                )
            after.append(dep.value - 1)
        slots = [_slots_of(args, buf, len(bufs)) for buf in bufs]
        self._entries.append(_Entry(queue, fn, list(args), list(bufs), writes, slots, after, program))
        return self._captured_signal()

    async def _seal(self) -> None:
        """Split into runs and build native replays (compiles on CPU)."""
        self._sealed = True
        self._fold_transfers()
        runs: list[_Run] = []
        for index, entry in enumerate(self._entries):
            if not runs or runs[-1].queue is not entry.queue:
                runs.append(_Run(entry.queue, index))
            runs[-1].entries.append(entry)
        for run in runs:
            touched: dict[int, tuple[Buffer, bool]] = {}
            for entry in run.entries:
                for buf, write in zip(entry.bufs, entry.writes, strict=True):
                    previous = touched.get(id(buf))
                    touched[id(buf)] = (buf, write or (previous is not None and previous[1]))
            run.accesses = list(touched.values())
            run.calls = [(entry.fn, tuple(entry.args)) for entry in run.entries]
            run.after = sorted(
                {
                    r
                    for entry in run.entries
                    for i in entry.after
                    for r, other in enumerate(runs)
                    if other is not run and other.first <= i < other.first + len(other.entries)
                }
            )
            builder = getattr(run.queue.device, "_native_graph", None)
            if builder is not None:  # (None when it cannot: the run replays through Python)
                run.native = await builder(run.entries)
            if len(run.entries) == 1 and run.queue.native:
                run.transfer = _transfer_owner(run.entries[0].fn)
        self._runs = runs
        for entry in self._entries:
            for dev in (_device_of(entry.queue), *(buf.device_obj for buf in entry.bufs)):
                if dev not in self._devices:
                    self._devices.append(dev)

    def _fold_transfers(self) -> None:
        """Move a captured transfer that *drains* the kernel recorded just before it (that kernel
        wrote the transfer's source) into that kernel's compute run: it would wait for that
        kernel anyway, and the two then form one run, one queue command per replay (on CPU the run
        stays native, the transfer a memmove in its C function), without a hand-over between
        queues or a worker to wake.

        * The kernel is on the transfer's own device (a copy of its result): always.
        * The kernel is on the source's device (a hand-over to the next device in a pipeline):
          when that device's worker can run the transfer (the same allocator class, so host
          memory on CPU and CPU:N) and it is small (at most the destination's
          ``inline_copy_bytes``). A large one keeps the destination's copy queue, where it
          overlaps the source device's next kernel instead of delaying it.

        Everything else keeps its queue: a transfer beside unrelated work still overlaps compute.
        Measured on examples/pipeline.py (two devices against one, group 16, micro-batches of
        16 KB, medians of 8 alternating in one process; three runs): the hand-over folded into
        stage 1's run 1.84/1.80/1.81x, on CPU:1's copy queue 1.81/1.76/1.79x. Session 5 measured
        folding it into stage 2's run instead: slower (stage 1 of the micro-batch after next then
        waited for that whole run to reuse its source)."""
        entries = self._entries
        for k, entry in enumerate(entries):
            owner = _transfer_owner(entry.fn)
            if k == 0 or owner is None:
                continue
            before = entries[k - 1]
            dest, src = entry.bufs[0], entry.bufs[1]
            if not any(w and b.base is src.base for b, w in zip(before.bufs, before.writes, strict=True)):
                continue
            compute = _device_of(entry.queue)._compute_queue
            source = src.device_obj
            if before.queue is compute:
                entry.queue = compute
            elif (
                before.queue is source._compute_queue
                and type(source.allocator) is type(owner)
                and dest.nbytes <= owner.inline_copy_bytes
            ):
                entry.queue = before.queue

    # ---- replay -------------------------------------------------------------------------------
    def _substitutions(self, subs: dict[str, Buffer]) -> dict[int, Buffer]:
        """Map id(original buffer) -> replacement, after checking every replacement. Views of a
        named buffer map to the same view of its replacement (see :func:`_swapped`)."""
        out: dict[int, Buffer] = {}
        for name, new in subs.items():
            old = self._names.get(name)
            if old is None:
                known = ", ".join(self._names) or "none"
                raise KeyError(f"graph has no input named {name!r} (inputs: {known})")
            if not hasattr(new, "nbytes") or type(new).__name__ != "Buffer":
                raise TypeError(f"graph input {name!r} must be a Buffer, got {type(new).__name__}")
            if new.device != old.device:
                raise ValueError(f"graph input {name!r} must be on {old.device}, got {new.device}")
            if new.nbytes != old.nbytes:
                raise ValueError(f"graph input {name!r} must have {old.nbytes} bytes, got {new.nbytes}")
            new.handle()  # raises if unallocated or freed
            out[id(old)] = new
        return out

    def replay(self, **subs: Buffer) -> Signal:
        """Enqueue the whole graph (one command per run) and return a Signal for all of it.

        Keyword arguments replace named input buffers. Everything is checked before anything is
        enqueued.
        """
        return self.replay_with(subs)

    def replay_with(
        self, buffers: Mapping[str, Buffer] | None = None, vals: Mapping[tuple[int, int], int] | None = None
    ) -> Signal:
        """:meth:`replay` with the substitutions as mappings: ``buffers`` replaces named inputs,
        ``vals`` maps ``(command, val)`` to a new value for the int val at index ``val`` of the
        raw launch recorded ``command``-th (capture order, from 0; as tinygrad's JIT substitutes
        symbolic variables). Unnamed vals keep their captured values. ``IndexError``,
        ``TypeError`` or ``ValueError`` before anything is enqueued for a bad one.
        """
        subs = dict(buffers or {})
        valsubs = self._check_val_subs(vals) if vals else {}
        if not self._sealed:
            raise RuntimeError("replay after the capture block has ended")
        if not self._runs:
            raise RuntimeError("the graph is empty: nothing was launched while capturing")
        for dev in self._devices:
            dev._check_open()
        plans, fast = self._plans_for(subs, valsubs)
        if fast is not None:
            # in C when every run is a native command and every access it waits for can be
            # waited for there (see native.replayer): the same steps as below, in the same order
            out = fast[0](fast[1])
            if isinstance(out, Signal):
                return out  # (the last run's signal stands for the replay, see below)
            if out is not None:
                return self._joined(out)
        signals: list[Signal] = []
        #: per run, the indices of this replay's runs it waits for, directly or through others
        waited: list[set[int]] = []
        #: id -> index of this replay's signals (all alive in `signals`, so ids are unique; an
        #: outside dependency, alive in `deps` while it is looked up, cannot share one)
        index_of: dict[int, int] = {}
        for run, (fn, args, touched, keep, command) in zip(self._runs, plans, strict=True):
            queue = run.queue
            timeline = queue.timeline
            deps = [signals[r] for r in run.after]  # earlier runs (same queue: already ordered)
            for buf, write in touched:
                accesses = (buf._base or buf)._accesses
                # fast path, as for launches: the only access known is on this same queue
                if accesses and (len(accesses) > 1 or accesses[0][2].timeline is not timeline):
                    deps.extend(buf.dependencies(timeline, write))
            # native when it can be: C waits for the deps and runs it without the GIL
            sig = queue.submit_either(command, fn, args, tuple(deps), keep)
            for buf, write in touched:
                buf.record(sig, write)
            covered: set[int] = set()
            for dep in deps:
                r = index_of.get(id(dep))
                if r is not None:
                    covered.add(r)
                    covered |= waited[r]
            waited.append(covered)
            index_of[id(sig)] = len(signals)
            signals.append(sig)
        if len(signals) == 1:
            return signals[0]
        last = self._runs[-1].queue
        others = [r for r, s in enumerate(signals[:-1]) if s.timeline is not last.timeline]
        if all(r in waited[-1] for r in others):
            # The last run waits for every other one (through the data it reads, e.g. stage 1 ->
            # transfer -> stage 2 -> copy out), and a dependency's failure fails its dependents:
            # its signal already stands for the whole replay, no joining command is needed.
            return signals[-1]
        return self._joined(signals)

    def _joined(self, signals: Sequence[Signal]) -> Signal:
        """A command on the last run's queue that completes once every run on other queues did
        (natively: one that runs nothing), standing for the whole replay."""
        last = self._runs[-1].queue
        others = tuple(sig for sig in signals[:-1] if sig.timeline is not last.timeline)
        return last.submit_either((0, 0, 0, None), _join, (), others, None)

    __call__ = replay

    def _check_val_subs(self, vals: Mapping[tuple[int, int], int]) -> dict[tuple[int, int], int]:
        """Check ``replay_with``'s vals: the commands exist and are raw launches with that many
        vals, the values are 32-bit ints."""
        out: dict[tuple[int, int], int] = {}
        for (command, index), value in vals.items():
            if not 0 <= command < len(self._entries):
                raise IndexError(f"vals: command {command} out of range (the graph has {len(self._entries)})")
            entry = self._entries[command]
            program = entry.program
            count = len(entry.args) - len(entry.bufs) if program is not None and program.kernel is None else 0
            if count == 0:
                raise ValueError(f"vals: command {command} ({_describe_entry(entry)}) has no vals to replace")
            if not 0 <= index < count:
                raise IndexError(f"vals: val {index} out of range (command {command} has {count})")
            if type(value) is not int:
                raise TypeError(f"vals: ({command}, {index}) must be an int, got {value!r}")
            if not -(2**31) <= value < 2**31:
                raise ValueError(f"vals: ({command}, {index}) = {value} does not fit a 32-bit int")
            out[(command, index)] = value
        return out

    def _plans_for(
        self, subs: dict[str, Buffer], vals: dict[tuple[int, int], int] | None = None
    ) -> tuple[list[_Plan], _Fast | None]:
        """Every run's plan for these substitutions (see :meth:`_plan`), and the same for the
        C replay when it applies (see :meth:`_fast_plan`).

        Plans for a set of substitute buffers are remembered (up to ``_PLAN_CACHE`` sets, keyed
        by the buffers' identities, in keyword order): a pipeline cycling through its slots then
        only checks that none of them was freed. Building a plan copies the argument array and
        makes the native command blocks, several times the cost of submitting it. The cache
        holds the Buffer objects, not their memory: ``free()`` releases memory as always, and a
        freed buffer makes its plans be rebuilt, which raises the use-after-free error.
        """
        # (ids are safe as a key: the entry holds the buffers, so no other object has their id)
        key: tuple[Any, ...] = tuple((name, id(buf)) for name, buf in subs.items())
        if vals:
            key += (tuple(sorted(vals.items())),)  # (a tuple: no name equals it)
        cached = self._plan_cache.get(key)
        if cached is not None:
            plans, kept, fast = cached
            for buf in kept:
                if buf._freed or (buf._base is not None and buf._base._freed):
                    break
            else:
                return plans, fast
            del self._plan_cache[key]
        swap = self._substitutions(subs) if subs else {}
        plans = [self._plan(run, swap, vals or {}) for run in self._runs]
        if len(self._plan_cache) >= _PLAN_CACHE:
            self._plan_cache.clear()
        used = {id(buf): buf for buf in subs.values()}
        for plan in plans:
            for buf, _ in plan[2]:
                used[id(buf)] = buf
        fast = self._fast_plan(plans)
        self._plan_cache[key] = (plans, tuple(used.values()), fast)
        return plans, fast

    def _fast_plan(self, plans: list[_Plan]) -> _Fast | None:
        """``(replay, runs)`` for the extension module's C replay (``native.replayer``): every
        run's queue, command, what it holds and the bytes it touches, in the form C reads; None
        when a run has no native command, a queue is not native, or there is no extension
        module. C still declines (and the Python path runs) when an access it would wait for
        cannot be waited for there."""
        if len(plans) > _FAST_MAX_RUNS or any(command is None for *_, command in plans):
            return None
        if not all(run.queue.native for run in self._runs):
            return None
        replay = native.replayer()
        if replay is None:
            return None
        runs = []
        for run, (_, _, touched, keep, command) in zip(self._runs, plans, strict=True):
            assert command is not None
            queue = run.queue
            uses = tuple(
                (buf, buf._base or buf, buf.offset, buf.offset + buf.nbytes, write, buf._base is None)
                for buf, write in touched
            )
            hold = (command[3], keep)  # (one object per plan: consecutive replays extend its hold)
            fn, nargs, block, _ = command
            runs.append((queue, queue.timeline, queue._caddr, fn, nargs, block, hold, uses, tuple(run.after)))
        return replay, tuple(runs)

    def _plan(self, run: _Run, swap: dict[int, Buffer], vals: dict[tuple[int, int], int]) -> _Plan:
        """``(fn, args, accesses, keep, command)``: ``fn(*args)`` runs the run on its queue's
        worker, ``command`` (native runs; transfers with a native form) is the same as a native
        queue command. Built once per substitution set (see :meth:`_plans_for`)."""
        accesses = run.accesses
        if swap:
            merged: dict[int, tuple[Buffer, bool]] = {}
            for buf, write in run.accesses:
                actual = _swapped(buf, swap) or buf
                previous = merged.get(id(actual))
                merged[id(actual)] = (actual, write or (previous is not None and previous[1]))
            accesses = list(merged.values())
        for actual, _ in accesses:
            base = actual._base or actual
            if actual._freed or base._freed or base._handle is None:
                actual.handle()  # raises the use-after-free / unallocated error
        first, last = run.first, run.first + len(run.entries)
        own = [(c - first, i, v) for (c, i), v in vals.items() if first <= c < last]
        native = run.native
        if native is not None:
            args = native.args
            if swap or own:
                args = native.copy_args(args)
                for e, i, v in own:
                    args[native.starts[e] + len(run.entries[e].bufs) + i] = v & 0xFFFF_FFFF_FFFF_FFFF
                for (e, b), slots in native.positions.items():
                    new = _swapped(run.entries[e].bufs[b], swap)
                    if new is not None:
                        addr = new.handle().addr
                        for slot in slots:
                            args[slot] = addr
            keep = (run, native, args, accesses)
            return native.cfunc, (native.fns, args), accesses, keep, native.command(args)
        calls = run.calls
        if swap or own:
            calls = []
            for e, entry in enumerate(run.entries):
                call_args = list(entry.args)
                for e_own, i, v in own:
                    if e_own == e:
                        call_args[len(entry.bufs) + i] = v
                for b, buf in enumerate(entry.bufs):
                    new = _swapped(buf, swap)
                    if new is not None:
                        new_handle = new.handle()
                        for slot, is_ptr in entry.slots[b]:
                            call_args[slot] = new_handle.ptr if is_ptr else new_handle
                calls.append((entry.fn, tuple(call_args)))
        return _run_calls, (calls,), accesses, (run, accesses), _transfer_command(run, calls)


def _device_of(queue: Queue) -> DeviceLike:
    """The device of a queue that launches and copies were captured on (their queues belong to
    devices; a queue alone knows only the little it needs of its owner)."""
    return cast(DeviceLike, queue.device)


def _describe_entry(entry: _Entry) -> str:
    program = entry.program
    if program is not None:
        return f"a launch of {program.name}"
    return "a copy" if _transfer_owner(entry.fn) is not None else getattr(entry.fn, "__name__", "a command")


def _transfer_owner(fn: Callable[..., object]) -> Any:
    """The allocator whose ``_transfer`` ``fn`` is (a captured ``copy_from``), or None."""
    owner = getattr(fn, "__self__", None)
    return owner if owner is not None and fn == getattr(owner, "_transfer", None) else None


def _slots_of(args: tuple[Any, ...], buf: Buffer, nbufs: int) -> list[tuple[int, bool]]:
    """Positions of ``buf`` in a command's arguments, each with whether it is the pointer object
    the handle carries (CPU kernels) rather than the handle itself."""
    handle = buf.handle()
    ptr = getattr(handle, "ptr", None)
    return [(j, a is not handle) for j, a in enumerate(args) if a is handle or (ptr is not None and a is ptr)]


def _swapped(buf: Buffer, swap: dict[int, Buffer]) -> Buffer | None:
    """The replacement for ``buf`` in a replay: the substitute itself, or for a view of a
    substituted buffer the same view of the substitute; None when ``buf`` is not replaced."""
    new = swap.get(id(buf))
    if new is None and buf._base is not None:
        new_base = swap.get(id(buf._base))
        if new_base is not None:
            new = swap[id(buf)] = new_base.view(buf.size, buf.dtype, buf.offset)
    return new


def _transfer_command(
    run: _Run, calls: list[tuple[Callable[..., object], tuple[Any, ...]]]
) -> _Command | None:
    """A transfer run as a native command (``(fn, nargs, block, keep)``), or None."""
    if run.transfer is None:
        return None
    dest, src, nbytes, _ = calls[0][1]
    call = run.transfer._native_transfer(dest, src, nbytes)
    return None if call is None else (call[0], call[1], call[2], (call[3], dest, src))


def _run_calls(calls: list[tuple[Callable[..., object], tuple[Any, ...]]]) -> None:
    for fn, args in calls:
        fn(*args)


def _join() -> None:
    pass


@asynccontextmanager
async def capture(device: DeviceLike, named: dict[str, Buffer]) -> AsyncIterator[Graph]:
    """Implementation of ``Compiled.capture``.

    Cancellation: cancelled while the block's exit seals the graph (compiling native replays),
    the graph stays unsealed and cannot be replayed; nothing was run.
    """
    graph = Graph(named)
    token = capturing.set(graph)
    try:
        yield graph
    finally:
        capturing.reset(token)
    await graph._seal()
