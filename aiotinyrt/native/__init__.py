"""The native half of the host worker queue: a command ring and its run loop, in C.

Why it exists
=============
A launch of a tiny kernel is about a microsecond of work. Run by a Python worker thread, each
command also costs several microseconds of Python *and* the GIL, which the event loop thread
needs to submit the next launch: the two threads take turns instead of running side by side.
Here the worker's inner loop is C. Python only writes a command into the ring (one cffi call,
which also wakes a sleeping worker) and the worker runs every native command without the GIL:
a kernel call through a function pointer, with its pointer and int arguments from an argument
block the program prepared once. The Python worker thread sits in :func:`hq_run` (GIL
released) and comes back to Python only when it must:

* ``R_PY``: the next command is a Python one (copies, transfers, split kernels, graph replays,
  anything with cross-queue dependencies); it runs exactly as before;
* ``R_WAKE``: the command just run reached the smallest value a waiter registered on the
  timeline (``wake_at``); Python advances the timeline itself, so internal callbacks (deferred
  frees) run before ``completed`` moves, then wakes the waiting tasks;
* ``R_HALTED``: the device holds a sticky error (or is closing); Python fails the command.

Memory ordering: the worker's "check ``wake_at``, then store ``completed``" and a waiter's "store
``wake_at``, then read ``completed``" (:func:`hq_set_wake`) run under one tiny spinlock, so a
waiter registered concurrently is either seen before ``completed`` moves (and its callback runs
first) or sees the new value and fires itself: a poller never sees a value whose deferred frees
have not run, and a wake-up cannot be lost. The worker's sleep (``sleeping`` vs. the slot's
sequence number) is a store-then-load handshake with sequentially consistent atomics.

The ring is a linked list of fixed-size chunks, allocated on demand and recycled once the worker
passed them, so any number of commands may be in flight without blocking the submitter.

Calling convention: every argument travels as a 64-bit integer. On x86-64 and AArch64 (SysV /
AAPCS64, Linux) a pointer or a 32-bit int passed in a 64-bit slot lands where the callee reads
it, so ``fn(a0, ..., an)`` with ``uint64_t`` parameters calls a kernel declared with pointers
and ``int`` vals correctly. Other platforms use the Python worker (:func:`load` returns None).

The library is built once per machine with the C compiler the CPU backend uses and kept next to
the compile cache (``CACHEDB``'s directory, else ``$XDG_CACHE_HOME/aiotinyrt``), in a location
checked like the compile cache (:mod:`aiotinyrt.cachedir`: private to the user, else a private
fallback, with one warning); without a compiler, without any private location, with a library
that does not load, or with ``NATIVE_QUEUE=0``, every queue runs on the pure-Python worker, which
has the same semantics. Built with Python's headers (when present) the library is also a CPython
extension module with two hot paths: ``push()`` and ``launch()``, the repeat launch of
``Program.__call__``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import platform
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import cffi

from aiotinyrt import cachedir
from aiotinyrt.helpers import cache_path, debug_level, find_cc, get_logger, getenv, getenv_str

_DIR = Path(__file__).parent
#: The files of the library: the ring and run loop, a CL queue's completion ring (clq.c and its
#: poller's side, clq_poll.c, used by aiotinyrt/backends/cl_queue.py), and the extension
#: module's files.
_RING_SOURCES = ("hostq.c", "clq.c", "clq_poll.c")
_PY_SOURCES = ("hostq.c", "clq.c", "clq_poll.c", "pyext.c", "replay.c", "clfast.c", "clpoll.c", "lock.c")
_HEADERS = ("hostq.h", "hostq_internal.h", "pyext.h", "clq.h", "clq_internal.h")
#: The C flags of every build (setup.py's and the first-use one).
CFLAGS = ("-O2", "-pthread", "-Wall", "-Wextra", "-Werror")
SANITIZE_FLAGS = (
    "-fsanitize=address,undefined",
    "-fno-omit-frame-pointer",
    "-fno-sanitize-recover=undefined",
    "-g",
)


def _header() -> tuple[dict[str, int], str]:
    """hostq.h's integer constants, and its declarations for cffi (every other line)."""
    constants: dict[str, int] = {}
    decls = ["typedef struct hq_view hq_t;"]
    for line in (_DIR / "hostq.h").read_text().splitlines():
        match = re.match(r"#define (\w+) (\d+)", line)
        if match:
            constants[match.group(1)] = int(match.group(2))
        elif not line.startswith("#"):
            decls.append(line)
    decls.append((_DIR / "clq.h").read_text())
    return constants, "\n".join(decls)


_CONSTANTS, CDEF = _header()
#: Most arguments a native command may take; longer calls run on the Python path.
MAX_ARGS = _CONSTANTS["HQ_MAX_ARGS"]
#: Slots per ring chunk.
CHUNK = _CONSTANTS["HQ_CHUNK"]
#: Device times are kept for this many latest commands of each queue (a power of two).
ELAPSED_SLOTS = _CONSTANTS["HQ_ELAPSED_SLOTS"]
K_PY, K_NATIVE = _CONSTANTS["K_PY"], _CONSTANTS["K_NATIVE"]
R_PY, R_WAKE, R_HALTED, R_DEPS = (_CONSTANTS[k] for k in ("R_PY", "R_WAKE", "R_HALTED", "R_DEPS"))
NO_WAKE = (1 << 63) - 1


def source_digest() -> str:
    """A digest of the C sources: setup.py bakes it into the installed build, and a build whose
    digest differs from the files beside it (an edited checkout) is not used."""
    h = hashlib.sha256()
    for name in (*_PY_SOURCES, *_HEADERS):
        h.update(name.encode() + b"\0" + (_DIR / name).read_bytes())
    return h.hexdigest()[:16]


ffi = cffi.FFI()
ffi.cdef(CDEF)

_lock = threading.Lock()
_log = get_logger("native")
_loaded: list[Any] = []  # [lib or None] once load() ran


def _cache_dir() -> Path:
    """Next to the compile cache (``CACHEDB``, else ``$XDG_CACHE_HOME/aiotinyrt``)."""
    return cache_path().parent


def supported() -> bool:
    """True where the uniform 64-bit argument convention holds (see the module docstring)."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64")


def _python_include() -> str | None:
    include = sysconfig.get_paths().get("include")
    return include if include and os.path.exists(os.path.join(include, "Python.h")) else None


def _compile(cc: list[str], sources: tuple[str, ...], flags: list[str], tag: str) -> Path | None:
    """Build ``sources`` with ``flags`` into the cache directory (once per machine and source
    digest); None on failure. The directory and the library are checked
    (:mod:`aiotinyrt.cachedir`) before anything is built or loaded; a refused location moves the
    library to the private fallback directory."""
    key = "\0".join([source_digest(), *cc, platform.machine(), *flags])
    name = f"hostq-{tag}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    target = cachedir.resolve(_cache_dir() / name)
    if target is None:
        return None
    if target.exists():
        return target
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".hostq-", suffix=".so")
        os.close(fd)
        subprocess.run(
            [*cc, *CFLAGS, "-fPIC", "-shared", *flags, *(str(_DIR / f) for f in sources), "-o", tmp],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.chmod(tmp, 0o600)  # the compiler wrote a new file under the process's umask
        os.replace(tmp, target)  # atomic: concurrent processes each install a whole file
    except (OSError, subprocess.SubprocessError) as exc:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if debug_level() >= 1:
            stderr = getattr(exc, "stderr", b"") or b""
            _log.debug("native queue (%s) not built: %s\n%s", tag, exc, stderr.decode(errors="replace"))
        return None
    return target


def _open_built(path: Path, extension: bool) -> tuple[Any, Any] | None:
    """The library built at ``path``: its C functions (cffi) and, with ``extension``, the
    extension module it also is. None, with one warning per process, when it does not load or
    lacks the queue's functions (the queues then run on the Python worker)."""
    try:
        module = None
        if extension:
            spec = importlib.util.spec_from_file_location("_hostq", path)
            if spec is None or spec.loader is None:
                raise ImportError(f"no loader for {path}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        lib = ffi.dlopen(str(path))
        lib.hq_run  # noqa: B018 - fails here, not at the first launch, if the library is foreign
        return lib, module
    except (OSError, ImportError, AttributeError) as exc:
        if not _open_warned:
            _open_warned.append(True)
            warnings.warn(
                f"aiotinyrt: native queue library {path} cannot be loaded ({exc}); "
                "queues run on the Python worker",
                RuntimeWarning,
                stacklevel=2,
            )
        return None


_open_warned: list[bool] = []


def _installed() -> tuple[Any, Any] | None:
    """The extension module built at install time (setup.py), if it is there and was built from
    the sources beside it."""
    spec = importlib.util.find_spec("aiotinyrt.native._hostq")
    if spec is None or spec.origin is None:
        return None
    try:
        module = importlib.import_module("aiotinyrt.native._hostq")
    except ImportError:
        return None
    if getattr(module, "SOURCE_DIGEST", None) != source_digest():
        if debug_level() >= 1:
            _log.debug("the installed native queue was built from other sources; building anew")
        return None
    return ffi.dlopen(spec.origin), module


def _build() -> tuple[Any, Any] | None:
    """The installed build, else (or with ``NATIVE_SANITIZE=1``) one built now with the C compiler."""
    sanitize = getenv("NATIVE_SANITIZE") == 1
    if not sanitize:
        installed = _installed()
        if installed is not None:
            return installed
    native_cc = getenv_str("NATIVE_CC")
    cc = shlex.split(native_cc) if native_cc else find_cc()
    if not cc:
        return None
    flags = list(SANITIZE_FLAGS) if sanitize else []
    include = _python_include()
    if include is not None:  # the library doubles as an extension module with a fast push()
        tag = ("asan-" if sanitize else "") + (sys.implementation.cache_tag or "py")
        digest = f'-DHQ_SOURCE_DIGEST="{source_digest()}"'
        path = _compile(cc, _PY_SOURCES, [*flags, digest, f"-I{include}"], tag)
        built = None if path is None else _open_built(path, extension=True)
        if built is not None:
            return built
    path = _compile(cc, _RING_SOURCES, flags, "asan-c" if sanitize else "c")
    return None if path is None else _open_built(path, extension=False)


def load() -> Any:
    """The native queue library (built and cached on first use), or None where it is unavailable
    or disabled by ``NATIVE_QUEUE=0``."""
    built = _load()
    return None if built is None else built[0]


def _hot(name: str, cffi_form: Callable[[Any], Callable[..., Any]]) -> Any:
    """The extension module's function ``name`` (no libffi, no GIL release), or where the library
    was built without Python's headers ``cffi_form(lib)``. Call only after :func:`load` succeeded."""
    built = _load()
    assert built is not None
    lib, module = built
    return getattr(module, name) if module is not None else cffi_form(lib)


def _push_cffi(lib: Any) -> Callable[..., int]:
    cast = ffi.cast

    def push(q: int, kind: int, fn: int, nargs: int, args: int, ndeps: int = 0, deps: int = 0) -> int:
        value = int(lib.hq_push_deps(cast("hq_t *", q), kind, fn, nargs, args, ndeps, deps))
        if value < 0:
            raise MemoryError("out of memory for the command queue")
        return value

    return push


def pusher() -> Callable[..., int]:
    """``push(queue_address, kind, fn, nargs, args[, ndeps, deps]) -> value``. With ``ndeps``, the
    command runs once every ``(queue address, value)`` pair of the ``int64_t[2 * ndeps]`` at
    ``deps`` is complete (waited for by the worker, in C). Raises ``MemoryError`` when no ring
    chunk can be allocated."""
    return _hot("push", _push_cffi)  # type: ignore[no-any-return]


def completer() -> Callable[[int, int], None]:
    """``complete(queue_address, value)``: store ``completed`` from Python and wake workers of
    other queues waiting for it."""

    def complete_cffi(lib: Any) -> Callable[[int, int], None]:
        return lambda q, value: lib.hq_complete(ffi.cast("hq_t *", q), value)

    return _hot("complete", complete_cffi)  # type: ignore[no-any-return]


#: The classes whose __slots__ the extension module reads and writes, declared by program.py
#: (Signal, Buffer, HostQueue, Timeline, Program), and whether configure() has seen them.
_classes: list[type] = []
_configured: list[bool] = []


def declare_classes(*classes: type) -> None:
    """Name the classes whose state the extension module uses (see ``configure`` in pyext.c);
    nothing is loaded until :func:`launcher` or :func:`replayer` is asked for."""
    with _lock:
        _classes[:] = classes
        _configured.clear()


def _module() -> Any:
    """The configured extension module, or None without it."""
    built = _load()
    if built is None or built[1] is None or not _classes:
        return None
    module = built[1]
    if not _configured:
        with _lock:
            if not _configured:
                module.configure(*_classes)
                _configured.append(True)
    return module


def launcher() -> Callable[..., Any] | None:
    """The C ``launch(bufs, by_bufs, timeline, queue)`` of the extension module (pyext.c), or None
    without the extension module."""
    module = _module()
    return None if module is None else module.launch


def replayer() -> Callable[[tuple[Any, ...]], Any] | None:
    """The C ``replay(runs)`` of the extension module (Graph.replay's submission, replay.c), or
    None without the extension module."""
    module = _module()
    return None if module is None else module.replay


def cl_launcher(completion_type: type, queue_type: type, enqueue: int, release: int, wait: int) -> bool:
    """Ready the CL repeat launch of the extension module (clfast.c) with the ``Completion``
    and ``DriverQueue`` classes (C reads and writes the latter's ``__slots__``) and the OpenCL
    entry points ``clEnqueueNDRangeKernel``, ``clReleaseEvent`` and ``clWaitForEvents``
    (addresses); False without the extension module."""
    module = _module()
    if module is None:
        return False
    with _lock:
        module.cl_configure(completion_type, queue_type, enqueue, release, wait)
    return True


def cl_reporter() -> Callable[..., tuple[int, list[Any], bool]] | None:
    """The extension module's ``cl_done(objs, tags, status, seconds, i, n)`` (clfast.c): the
    completed repeat launches among a batch a CL queue's ring returned; None without the
    extension module."""
    module = _module()
    return None if module is None else module.cl_done


def cl_poller() -> Callable[..., tuple[int, int, int]] | None:
    """The extension module's ``cl_poll(settle, event, tag, ns, claim) -> (n, first, last)``
    (clpoll.c): a CL queue's poll and, in a round trip's common case, its report in one call;
    None without the module (``NATIVE_QUEUE=0`` set meanwhile, too)."""
    module = _module()
    return None if module is None else module.cl_poll


def cl_hooks() -> tuple[Callable[..., int], Callable[..., float | None]] | None:
    """The extension module's ``cl_claim(hooks, value)`` and ``cl_poll_for(hooks, value,
    claim=0)`` (clpoll.c): a CL queue's ``Timeline.claim`` and ``Timeline.poll`` in one C call
    each, once bound to the queue's ``hooks`` (``CLQueue.attach``); None without the module."""
    module = _module()
    return None if module is None else (module.cl_claim, module.cl_poll_for)


def rlock() -> Any:
    """A reentrant lock, as ``threading.RLock``: the extension module's ``Lock`` (lock.c), which
    the CL repeat launch takes from C without calling Python, else ``threading.RLock``."""
    built = _load()
    if built is None or built[1] is None:
        return threading.RLock()
    return built[1].Lock()


_track: list[Callable[[list[Any]], None]] = []  # [the extension module's track] once it is there


def track(objs: list[Any]) -> None:
    """Hand each of ``objs`` back to the cyclic garbage collector, if the extension module's
    repeat launch made it untracked (its Signals, once they completed); nothing otherwise.
    Called per batch of completions: the module's function is looked up once."""
    if _track:
        _track[0](objs)
        return
    module = _module()  # (None: no repeat launch in C made anything untracked)
    if module is not None:
        _track.append(module.track)
        module.track(objs)


def install_call(program_type: type, call_py: Callable[..., Any], capturing: Any, vals_key: object) -> bool:
    """Make ``program_type.__call__`` the extension module's C function, which runs the repeat
    launch itself and hands every other call to ``call_py`` unchanged; False (nothing done)
    without the extension module. Idempotent."""
    built = _load()
    if built is None or built[1] is None:
        return False
    with _lock:
        if program_type.__dict__.get("__call__") is not call_py:
            return True  # installed already
        built[1].install(program_type, call_py, capturing, vals_key)
    return True


async def prepare() -> None:
    """Build (first use on this machine: ~0.7 s of compiler here) or load the library in a worker
    thread, so that opening a device afterwards does not do it on the event loop thread.
    ``open_device()`` and the demo call it; code that opens devices with ``Device[name]`` on a
    loop can await it first.

    Cancellation: cancels the wait; a build already running finishes in its thread and is used
    by the next device opened.
    """
    if _loaded:
        await anyio.lowlevel.checkpoint()
        return
    await anyio.to_thread.run_sync(load, abandon_on_cancel=True)


def _load() -> tuple[Any, Any] | None:
    if getenv("NATIVE_QUEUE", 1) == 0 or not supported():
        return None
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_build())
    return _loaded[0]  # type: ignore[no-any-return]
