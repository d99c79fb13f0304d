"""The Program base class: a loaded kernel, whose call enqueues a launch.

``prog(*bufs, global_size=..., vals=..., wait_for=...)`` validates its arguments, orders the
launch after other work on the same memory (through the buffers' access records, see
:mod:`aiotinyrt.hazards`) and submits it to the device's compute queue, returning a
:class:`~aiotinyrt.signal.Signal` at once. A repeat launch (same buffers, same memory, last
touched by this queue only) is one C call when the native queue's extension module is there.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from aiotinyrt import hazards, native
from aiotinyrt.buffer import Buffer
from aiotinyrt.helpers import prod
from aiotinyrt.kernel import Kernel
from aiotinyrt.queue import HostQueue, Queue, capturing
from aiotinyrt.registry import DeviceLike
from aiotinyrt.signal import Signal, Timeline

#: The first item of the repeat-launch cache keys of launches passing vals: no argument list
#: (``prog(*bufs)``'s key is the buffers themselves) can be equal to such a key.
_VALS_KEY = object()

_UNIT_SIZE = (1, 1, 1)
_NO_VALS: tuple[int, ...] = ()


class Program:
    """One loaded kernel of a device. Calling it enqueues a launch and returns a :class:`Signal`.

    Backends subclass it and provide :meth:`_launcher`, which turns buffer handles, sizes and
    int values into a ``(function, args)`` pair the device queue runs. The base class owns the
    argument validation and the ordering of launches against other work on the same memory.
    """

    # ``_fast`` is read by the C ``__call__`` (pyext.c) at its slot's offset; subclasses and
    # everything else keep a ``__dict__``.
    __slots__ = ("__dict__", "__weakref__", "_fast")

    #: Most int vals one launch may pass.
    MAX_VALS: ClassVar[int] = 64
    #: Whether a raw (source, not rendered) kernel of this backend is launched over its global
    #: size. Where False (CPU: a raw C function is called once and loops itself), a launch with
    #: a global size of more than one item raises ``ValueError`` instead of ignoring it.
    RAW_USES_GLOBAL_SIZE: ClassVar[bool] = True

    def __init__(
        self,
        device: DeviceLike,
        name: str,
        lib: bytes,
        *,
        src: str | None = None,
        kernel: Kernel | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"kernel name must be a C identifier, got {name!r}")
        if not isinstance(lib, (bytes, bytearray, memoryview)):
            raise TypeError(f"program binary must be bytes, got {type(lib).__name__}")
        if len(lib) == 0:
            raise ValueError(f"program binary for {name!r} is empty")
        self.device = device
        self.name = name
        self.lib = bytes(lib)
        #: Number of buffer and int arguments the kernel takes, when known (from its source).
        self.buf_count: int | None = None
        self.val_count: int | None = None
        #: The portable kernel this program was rendered from, if any: its launches take the
        #: kernel's vals and global size, check buffer dtypes and know which buffers are written.
        self.kernel = kernel
        if kernel is not None:
            self.buf_count, self.val_count = len(kernel.buffers), len(kernel.scalars)
            self._kernel_writes = frozenset(kernel.writes)
        elif src is not None:
            signature = parse_c_signature(src, name)
            if signature is not None:
                self.buf_count, self.val_count = signature
        self._entries: dict[tuple[Any, ...], Any] = {}  # native queue: see _native_entry
        # the fast path of __call__: buffers -> entry, and (_VALS_KEY, buffers, vals) -> entry
        self._by_bufs: dict[tuple[Any, ...], Any] = {}
        queue: Queue | None = getattr(device, "_compute_queue", None)
        native_raw = queue is not None and queue.native and kernel is None
        #: the repeat launch's state: (queue, timeline, _by_bufs, the queue's C address), or a
        #: backend's (see _use_c_call)
        self._fast: tuple[Any, ...] | None = (
            (queue, queue.timeline, self._by_bufs, queue._caddr) if queue is not None and native_raw else None
        )
        self._c_launch: Callable[..., Any] | None = None
        if native_raw:
            self._use_c_call(self._fast)

    def _use_c_call(self, fast: Any) -> None:
        """Make ``fast`` the state of this program's repeat launch in C, where the extension
        module is there: a host-run native queue's ``(queue, timeline, _by_bufs, queue
        address)`` (pyext.c) or a CL queue's 7-tuple (clfast.c); ``__call__`` becomes the C
        function that reads it."""
        self._c_launch = native.launcher()
        if self._c_launch is None:
            return
        self._fast = fast
        if Program.__dict__["__call__"] is Program._call_py:
            # the repeat launch skips this method's Python frame: see native.install_call
            native.install_call(Program, Program._call_py, capturing, _VALS_KEY)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device.name}>"

    def _launcher(
        self,
        handles: tuple[Any, ...],
        global_size: tuple[int, ...],
        local_size: tuple[int, ...] | None,
        vals: tuple[int, ...],
    ) -> tuple[Callable[..., object], tuple[Any, ...]]:
        """Return ``(fn, args)`` such that ``fn(*args)`` runs the kernel once, synchronously, on the
        device queue's worker. Must not run anything itself."""
        raise NotImplementedError

    def _native_call(self, handles: list[Any], global_size: tuple[int, ...], vals: tuple[int, ...]) -> Any:
        """Backend hook for native queues (:mod:`aiotinyrt.native`): ``(fn, nargs, block, keep)``
        where ``fn`` is the address of a C function (0: nothing to run), ``block`` the address of
        a ``uint64_t[]`` of its ``nargs`` arguments and ``keep`` what keeps that block alive; or
        None when this launch must run through :meth:`_launcher`. Called once per distinct
        argument list (the result is cached)."""
        return None

    def _native_entry(self, handles: list[Any], global_size: tuple[int, ...], vals: tuple[int, ...]) -> Any:
        """``(fn, nargs, block, handles, keep, self)`` for the native queue, or None. Cached per
        argument list; the tuple travels with the launch and keeps what it uses alive."""
        if type(self)._native_call is Program._native_call:
            return None  # (a backend without native calls: its handles need not even hash)
        key = (*handles, vals)
        entry = self._entries.get(key)
        if entry is None:
            call = self._native_call(handles, global_size, vals)
            if call is None:
                return None
            if len(self._entries) >= 256:  # queued launches keep their own entries alive
                self._entries.clear()
                self._by_bufs.clear()
            fn, nargs, block, keep = call
            entry = self._entries[key] = (fn, nargs, block, tuple(handles), keep, self)
        return entry

    def _call_py(
        self,
        *bufs: Buffer,
        global_size: Sequence[int] = _UNIT_SIZE,
        local_size: Sequence[int] | None = None,
        vals: Sequence[int] = _NO_VALS,
        wait_for: Sequence[Signal] = (),
        writes: Sequence[int] | None = None,
    ) -> Signal:
        """Enqueue one launch of this kernel and return its Signal at once.

        ``bufs`` are allocated buffers of this program's device (views allowed); ``vals`` are
        32-bit ints passed after the buffers; ``wait_for`` adds explicit dependencies on signals
        of any device; ``writes`` lists the indices of the buffers the kernel writes (default:
        all of them), which orders it against other work on the same memory. Arguments are
        checked before anything is enqueued (``TypeError``/``ValueError``).
        """
        plain = (  # what a repeat launch may be: buffers, and at most vals
            self._c_launch is not None
            and global_size is _UNIT_SIZE
            and local_size is None
            and not wait_for
            and writes is None
            and capturing.get() is None
        )
        sig = self._call(bufs, global_size, local_size, vals, wait_for, writes)
        if plain:  # remember it for the repeat launch (the C __call__ makes it)
            if vals is _NO_VALS:
                self._remember(bufs, (), bufs, sig)
            elif type(vals) is tuple and all(type(v) is int for v in vals):  # (exact ints, as C checks)
                self._remember(bufs, vals, (_VALS_KEY, bufs, vals), sig)
        return sig

    def _remember(self, bufs: tuple[Buffer, ...], vals: tuple[int, ...], key: Any, sig: Signal) -> None:
        """Cache the native entry of a launch just made on the normal path under ``key``, for
        the repeat launch: only whole buffers, and only if it went to this program's queue."""
        fast = self._fast
        if (
            fast is not None
            and all(type(b) is Buffer and b._base is None for b in bufs)
            and sig.timeline is fast[1]
        ):
            entry = self._native_entry([b._handle for b in bufs], _UNIT_SIZE, vals)
            if entry is not None:
                self._by_bufs[key] = entry

    #: With the extension module, replaced by a C function that runs the repeat launch (same
    #: buffers as a launch remembered here, each holding the same memory, each last touched by
    #: this queue only: aiotinyrt/native/pyext.c) and calls ``_call_py`` for everything else.
    #: Without it every launch takes ``_submit_launch``.
    __call__ = _call_py

    def _call(
        self,
        bufs: tuple[Buffer, ...],
        global_size: Sequence[int],
        local_size: Sequence[int] | None,
        vals: Sequence[int],
        wait_for: Sequence[Signal],
        writes: Sequence[int] | None,
    ) -> Signal:
        if self.kernel is not None:
            return self._call_kernel(bufs, global_size, local_size, vals, wait_for, writes)
        gsz = global_size if global_size is _UNIT_SIZE else _check_size("global_size", global_size)
        if not self.RAW_USES_GLOBAL_SIZE and gsz is not _UNIT_SIZE and prod(gsz) != 1:
            raise ValueError(
                f"raw C kernel {self.name!r} runs once per launch and loops itself; "
                f"global_size={tuple(global_size)} would be ignored (launch it without global_size, or "
                "render a Kernel to run over a global size)"
            )
        lsz = None if local_size is None else _check_size("local_size", local_size)
        if vals or type(vals) is not tuple:
            vals = self._check_vals(vals)
        if self.buf_count is not None and len(bufs) != self.buf_count:
            raise TypeError(f"{self.name} takes {self.buf_count} buffers, got {len(bufs)}")
        if self.val_count is not None and len(vals) != self.val_count:
            raise TypeError(f"{self.name} takes {self.val_count} int vals, got {len(vals)}")
        written = None if writes is None else self._check_writes(writes, len(bufs))
        handles = self._launch_handles(bufs)
        deps = _check_wait_for(wait_for) if wait_for else ()
        return self._submit_launch(handles, gsz, lsz, vals, bufs, deps, written)

    def _call_kernel(
        self,
        bufs: tuple[Buffer, ...],
        global_size: Sequence[int],
        local_size: Sequence[int] | None,
        vals: Sequence[int],
        wait_for: Sequence[Signal],
        writes: Sequence[int] | None,
    ) -> Signal:
        """A launch of a rendered Kernel: its dtypes, vals and global size are checked and its
        int arguments become ``vals + (gsz0, gsz1, gsz2)``."""
        kernel = self.kernel
        assert kernel is not None
        handles = self._launch_handles(bufs)
        kernel.check_buffers([b.dtype for b in bufs])
        gsz = kernel.launch_size(None if global_size is _UNIT_SIZE else global_size)
        lsz = None if local_size is None else _check_size("local_size", local_size)
        all_vals = kernel.launch_vals(vals, gsz)
        written = self._kernel_writes if writes is None else self._check_writes(writes, len(bufs))
        deps = _check_wait_for(wait_for) if wait_for else ()
        return self._submit_launch(handles, gsz, lsz, all_vals, bufs, deps, written)

    def _launch_handles(self, bufs: tuple[Buffer, ...]) -> list[Any]:
        """The allocator handles of ``bufs``, checked: allocated Buffers of this program's device."""
        device, kernel = self.device, self.name
        handles = []
        for b in bufs:
            # fast path: an allocated base buffer of this device
            if type(b) is Buffer and b.device == device.name and b._base is None and b._handle is not None:
                handles.append(b._handle)
                continue
            if not isinstance(b, Buffer):
                raise TypeError(f"{kernel}: arguments must be Buffers, got {type(b).__name__}")
            if b.device != device.name:
                raise ValueError(
                    f"{kernel}: buffer {b!r} is on {b.device}, not {device.name}; move it with copy_from"
                )
            handles.append(b.handle())
        return handles

    def _submit_launch(
        self,
        handles: list[Any],
        gsz: tuple[int, ...],
        lsz: tuple[int, ...] | None,
        vals: tuple[int, ...],
        bufs: tuple[Buffer, ...],
        deps: tuple[Signal, ...],
        writes: frozenset[int] | None,
    ) -> Signal:
        """Order the launch after the pending work on its buffers and submit it: the one path
        of every launch but the repeat one (see ``__call__``)."""
        prog = self
        device = self.device
        if device.closed:
            raise device._refusal()
        queue = device._compute_queue
        graph = capturing.get()
        if graph is not None:
            fn, args = prog._launcher(tuple(handles), gsz, lsz, vals)
            flags = [writes is None or i in writes for i in range(len(bufs))]
            return graph._record(queue, fn, args, bufs, flags, deps, prog)
        timeline = queue.timeline
        extra: list[Signal] = []
        for i, b in enumerate(bufs):
            accesses = (b._base or b)._accesses
            # fast path: the only access known is an earlier one on this same queue
            if accesses and (len(accesses) > 1 or accesses[0][2].timeline is not timeline):
                extra.extend(b.dependencies(timeline, writes is None or i in writes))
        if extra:
            deps = deps + tuple(extra)
        waits = queue.native_deps(deps) if deps and queue.native else []
        entry = None if waits is None or not queue.native else prog._native_entry(handles, gsz, vals)
        if entry is not None and waits is not None:  # the worker waits for deps and runs it in C
            sig = queue.submit_native(entry[0], entry[1], entry[2], entry, waits)
        else:
            fn, args = prog._launcher(tuple(handles), gsz, lsz, vals)
            sig = queue.submit(fn, args, deps, (bufs, prog))
        if writes is None:
            for b in bufs:
                if b._base is None:  # a whole-buffer write supersedes every earlier access
                    b._accesses = hazards.whole_write(b.nbytes, sig)
                else:
                    b.record(sig, True)
        else:
            for i, b in enumerate(bufs):
                b.record(sig, i in writes)
        return sig

    def _check_vals(self, vals: Sequence[int]) -> tuple[int, ...]:
        if type(vals) is not tuple:
            if isinstance(vals, (str, bytes)) or not isinstance(vals, Sequence):
                raise TypeError(f"vals must be a sequence of ints, got {type(vals).__name__}")
            vals = tuple(vals)
        for v in vals:
            if type(v) is not int and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{self.name}: vals must be ints, got {v!r} ({type(v).__name__})")
            if not -(2**31) <= v < 2**31:
                raise ValueError(f"{self.name}: val {v} does not fit in a 32-bit int")
        if len(vals) > self.MAX_VALS:
            raise ValueError(f"{self.name}: at most {self.MAX_VALS} vals, got {len(vals)}")
        return vals

    def _check_writes(self, writes: Sequence[int], nbufs: int) -> frozenset[int]:
        if isinstance(writes, (str, bytes)) or not isinstance(writes, (Sequence, set, frozenset)):
            raise TypeError(f"{self.name}: writes= must be a sequence of buffer indices, got {writes!r}")
        for i in writes:
            if type(i) is not int or not 0 <= i < nbufs:
                raise ValueError(f"{self.name}: writes= index {i!r} is not a buffer index (0..{nbufs - 1})")
        return frozenset(writes)


def _check_size(what: str, size: Sequence[int]) -> tuple[int, ...]:
    if type(size) is tuple and len(size) == 3 and all(type(s) is int and s > 0 for s in size):
        return size
    if isinstance(size, int) or not isinstance(size, Sequence):
        raise TypeError(f"{what} must be a sequence of 1 to 3 ints, got {size!r}")
    if not 1 <= len(size) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {len(size)}")
    for s in size:
        if type(s) is not int:
            raise TypeError(f"{what} must hold ints, got {s!r}")
        if s <= 0:
            raise ValueError(f"{what} must be positive in every dimension, got {tuple(size)}")
    return tuple(size) + (1,) * (3 - len(size))


def _check_wait_for(wait_for: Sequence[Signal]) -> tuple[Signal, ...]:
    if not wait_for:
        return ()
    if isinstance(wait_for, Signal):
        return (wait_for,)
    deps = tuple(wait_for)
    for dep in deps:
        if not isinstance(dep, Signal):
            raise TypeError(f"wait_for must hold Signals, got {type(dep).__name__}")
    return deps


_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def parse_c_signature(src: str, name: str) -> tuple[int, int] | None:
    """Count the pointer (buffer) and scalar (int) parameters of C function ``name`` in ``src``.

    Returns None when the definition cannot be found (the launch is then not checked).
    """
    code = _C_COMMENT.sub(" ", src)
    match = re.search(rf"\b{re.escape(name)}\s*\(([^)]*)\)\s*\{{", code)
    if match is None:
        return None
    params = [p.strip() for p in match.group(1).split(",") if p.strip() and p.strip() != "void"]
    bufs = sum(1 for p in params if "*" in p)
    return bufs, len(params) - bufs


native.declare_classes(Signal, Buffer, HostQueue, Timeline, Program)
