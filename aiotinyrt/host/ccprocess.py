"""A C compiler run as a subprocess, with one started process kept waiting for its source.

Starting clang costs about half of a cold compile of a small kernel on the development machine
(``clang --version``: ~27 ms, most of it the dynamic linker loading libLLVM and libclang-cpp; a
kernel compile: ~57 ms in all). A compiler that reads its source from stdin does all of that
before it reads a byte, so the process can be started before the source exists. For each
command line, one such *standby* process is kept: a compile takes the standby (or starts a
process when there is none) and at once starts the next standby, which loads on another core
while this compile runs, so a later compile finds its compiler loaded and waiting.

Each process writes its object into a memfd it inherits (``-o /proc/self/fd/N``, clang and gcc
alike, with ``-pipe``: no file is created anywhere), runs in a directory removed as soon as it
started (a quoted ``#include`` finds nothing beside the source, as with a source file in an
empty directory), and leads its own process group (a kill reaches what it started: gcc's
``cc1`` and ``as``; the terminal's Ctrl-C reaches only the application). A standby is killed at
exit; one whose parent died without exit hooks reads end-of-input, compiles nothing into its
memfd and exits. A forked child closes its copies of every compiler pipe at once (a compiler
must see end-of-input when the parent closes its stdin) and starts its own processes.

The cost: one idle compiler process per command line once the process has compiled (an idle
clang is ~75 MB resident, mostly shared library pages), and a standby runs the compiler binary
and start-up configuration of the time it started. ``CC_STANDBY=0`` starts one process per
compile. Wrappers that cache by input file (ccache, sccache) cannot cache a source read from
stdin; the runtime's own compile cache does that.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import math
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import anyio.to_thread

from aiotinyrt.helpers import getenv


@dataclass
class Result:
    """What one compiler process did: its exit status, the object (on success), its stderr."""

    returncode: int
    output: bytes
    stderr: bytes
    timed_out: bool = False


@dataclass
class Job:
    """One compile in flight: another thread may :meth:`cancel` it (its process is killed)."""

    proc: subprocess.Popen[bytes] | None = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Kill the compile's process, or make :meth:`CCProcess.run` kill it once it has one."""
        with self.lock:
            self.cancelled = True
            if self.proc is not None:
                _kill(self.proc)


@dataclass
class _Started:
    proc: subprocess.Popen[bytes]
    out: int  # the memfd the object is written to


class CCProcess:
    """Runs ``argv`` (a compiler command line that reads its source from stdin and lacks only
    ``-o``) once per compile, keeping one process started ahead of time."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self._lock = threading.Lock()
        self._standby: _Started | None = None
        self._refilling = False

    async def compile(self, src: bytes, timeout: float) -> Result:
        """:meth:`run` in a worker thread of the compilers' own (so that hung compilers never
        hold the application's ``to_thread`` tokens).

        Cancellation: the compiler process is killed; the thread finishes on its own.
        """
        job = Job()
        try:
            return await anyio.to_thread.run_sync(
                self.run, src, timeout, job, abandon_on_cancel=True, limiter=_thread_limiter()
            )
        except anyio.get_cancelled_exc_class():
            job.cancel()
            raise

    def run(self, src: bytes, timeout: float, job: Job) -> Result:
        """Compile ``src``: hand it to the standby or a fresh process, wait at most ``timeout``
        seconds from the hand-over (then kill it), and start the next standby. Blocks."""
        refill = getenv("CC_STANDBY", 1) != 0
        if job.cancelled:
            return Result(-signal.SIGKILL, b"", b"")
        started = self._take() or self._start()
        try:
            with job.lock:
                job.proc = started.proc
                if job.cancelled:
                    _kill(started.proc)
            limit = None if math.isinf(timeout) else timeout
            if refill and not job.cancelled:
                if _fits(started.proc, src):  # hand it over first: the compiler starts at once
                    assert started.proc.stdin is not None
                    try:
                        src = src[started.proc.stdin.write(src) or 0 :]
                    except BrokenPipeError:  # (died: its status says why)
                        src = b""
                self._refill()  # the next process loads on another core while this one compiles
            try:
                _, err = started.proc.communicate(src or None, timeout=limit)
            except subprocess.TimeoutExpired:
                _kill(started.proc)
                err = _drain(started.proc)
                return Result(started.proc.returncode or -signal.SIGKILL, b"", err, timed_out=True)
            output = _read_all(started.out) if started.proc.returncode == 0 else b""
            return Result(started.proc.returncode, output, err)
        except BaseException:
            _discard(started.proc)
            raise
        finally:
            os.close(started.out)

    def close(self) -> None:
        """Kill the standby (at exit; safe to repeat)."""
        with self._lock:
            standby, self._standby = self._standby, None
        if standby is not None:
            _discard(standby.proc)
            os.close(standby.out)

    def _forget_in_child(self) -> None:
        self._lock = threading.Lock()
        if self._standby is not None:  # (the process is the parent's)
            os.close(self._standby.out)
        self._standby = None
        self._refilling = False

    def _take(self) -> _Started | None:
        with self._lock:
            standby, self._standby = self._standby, None
        if standby is not None and standby.proc.poll() is not None:
            _discard(standby.proc)  # died while idle: not this compile's failure
            os.close(standby.out)
            return None
        return standby

    def _refill(self) -> None:
        with self._lock:  # one thread starts the standby; the others go on compiling
            if self._refilling or self._standby is not None or _closing:
                return
            self._refilling = True
        started: _Started | None = None
        try:
            started = self._start()
        except OSError:
            pass  # the next compile starts its own process and reports why
        finally:
            with self._lock:
                self._refilling = False
                if started is not None:
                    self._standby = started

    def _start(self) -> _Started:
        out = os.memfd_create("aiotinyrt-object", os.MFD_CLOEXEC)
        try:
            with _spawn_lock:  # (a fork waits: it must see every pipe to close it in the child)
                folder = tempfile.mkdtemp(prefix="aiotinyrt-cc-")
                try:
                    proc = subprocess.Popen(
                        [*self.argv, "-pipe", "-o", f"/proc/self/fd/{out}"],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE,
                        bufsize=0,  # raw pipes: no buffer lock a forked child could inherit held
                        pass_fds=(out,),
                        cwd=folder,
                        start_new_session=True,
                    )
                finally:
                    os.rmdir(folder)
                _LIVE.add(proc)
        except BaseException:
            os.close(out)
            raise
        return _Started(proc, out)


def _fits(proc: subprocess.Popen[bytes], src: bytes) -> bool:
    """Whether ``src`` fits the empty stdin pipe, so writing it cannot block."""
    assert proc.stdin is not None
    try:
        capacity = fcntl.fcntl(proc.stdin.fileno(), fcntl.F_GETPIPE_SZ)
    except OSError:
        capacity = 4096
    return len(src) <= capacity


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return os.pread(fd, size, 0) if size else b""


def _drain(proc: subprocess.Popen[bytes]) -> bytes:
    """stderr of a killed compiler, waiting at most a second for the pipes: a helper that left
    the process group may hold them open."""
    try:
        return proc.communicate(timeout=1)[1] or b""
    except subprocess.TimeoutExpired:
        _close_pipes(proc)
        proc.wait()
        return b""


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def _discard(proc: subprocess.Popen[bytes]) -> None:
    """Kill, reap and close the pipes of a process that will not be used."""
    _kill(proc)
    _close_pipes(proc)
    proc.wait()
    _LIVE.discard(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the compiler's process group (nothing once it has been reaped)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


_BY_ARGV: dict[tuple[str, ...], CCProcess] = {}
_registry_lock = threading.Lock()
_spawn_lock = threading.RLock()
#: every compiler process started and not yet discarded (a forked child closes their pipes)
_LIVE: set[subprocess.Popen[bytes]] = set()
_closing = False
_limiter_var: anyio.lowlevel.RunVar[anyio.CapacityLimiter] = anyio.lowlevel.RunVar("aiotinyrt_cc_threads")


def _thread_limiter() -> anyio.CapacityLimiter:
    """The event loop's worker-thread limiter for compiles (``COMPILE_JOBS`` bounds them)."""
    try:
        return _limiter_var.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(math.inf)
        _limiter_var.set(limiter)
        return limiter


def for_argv(argv: Sequence[str]) -> CCProcess:
    """The process-wide :class:`CCProcess` of a command line (devices share its standby)."""
    key = tuple(argv)
    with _registry_lock:
        runner = _BY_ARGV.get(key)
        if runner is None:
            runner = _BY_ARGV[key] = CCProcess(argv)
        return runner


def close_all() -> None:
    """Kill every standby; no new one is started after this (run at exit)."""
    global _closing
    with _registry_lock:
        _closing = True
        runners = list(_BY_ARGV.values())
    for runner in runners:
        runner.close()


def close_compiler(cc: Sequence[str]) -> None:
    """Kill the standby of every command line that runs compiler ``cc`` (for instance one
    about to be deleted)."""
    prefix = tuple(cc)
    with _registry_lock:
        keys = [key for key in _BY_ARGV if key[: len(prefix)] == prefix]
        runners = [_BY_ARGV.pop(key) for key in keys]
    for runner in runners:
        runner.close()


atexit.register(close_all)


def _before_fork() -> None:
    _spawn_lock.acquire()


def _after_fork_in_parent() -> None:
    _spawn_lock.release()


def _after_fork_in_child() -> None:
    global _registry_lock, _spawn_lock
    _registry_lock = threading.Lock()
    _spawn_lock = threading.RLock()
    # The parent's compilers must see end-of-input when the parent closes their stdin: this
    # process's copy of every pipe goes at once (raw pipes, so no lock is involved), and the
    # process objects are marked as not this process's children (never waited for or killed).
    for proc in _LIVE:
        _close_pipes(proc)
        proc.returncode = 0
    _LIVE.clear()
    for runner in _BY_ARGV.values():
        runner._forget_in_child()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
