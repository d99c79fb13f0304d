"""A C compiler run as a subprocess, with one started process kept waiting for its source.

Starting clang costs about half of a cold compile of a small kernel on the development machine
(``clang --version``: ~27 ms, most of it the dynamic linker loading libLLVM and libclang-cpp; a
kernel compile: ~57 ms in all). A compiler that reads its source from stdin does all of that
before it reads a byte, so the process can be started before the source exists. For each
command line, one such *standby* process is kept: a compile hands its source to the standby (or
to a fresh process when there is none) and the next standby is started once the compile is done,
so a later compile finds its compiler loaded and waiting.

The cost: one idle compiler process per command line, started only after a first compile in
this process, killed at exit (or reading end-of-input and exiting when this process dies without
running its exit hooks). A standby was started with the environment of its time: a compiler
that reads configuration at start-up sees the configuration of then, not of the compile.

clang writes the object to stdout (``-o -``); compilers whose assembler cannot (gcc) write it to
a file named when the process is started, in a private temporary directory. Everything here
blocks: call :meth:`CCProcess.run` from a worker thread.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiotinyrt.helpers import getenv


@dataclass
class Job:
    """One compile in flight: another thread may :meth:`cancel` it (the process is killed)."""

    proc: subprocess.Popen[bytes] | None = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Kill the compile's process, or make :meth:`CCProcess.run` kill it once started."""
        with self.lock:
            self.cancelled = True
            if self.proc is not None:
                _kill(self.proc)


@dataclass
class Result:
    """What one compiler process did: its exit status, the object (on success), its stderr."""

    returncode: int
    output: bytes
    stderr: bytes
    timed_out: bool = False


@dataclass
class _Started:
    proc: subprocess.Popen[bytes]
    out: str | None  # the object file, where the compiler cannot write to stdout


class CCProcess:
    """Runs ``argv`` (a compiler command line that reads its source from stdin and lacks only
    the output) once per compile, keeping one process started ahead of time."""

    def __init__(self, argv: Sequence[str], *, to_stdout: bool) -> None:
        self.argv = list(argv)
        self.to_stdout = to_stdout
        self._forget()

    def _forget(self) -> None:
        """No standby, no directory (also in a forked child: those are its parent's)."""
        self._lock = threading.Lock()
        self._standby: _Started | None = None
        self._dir: str | None = None
        self._serial = 0
        self._refilling = False

    def run(self, src: bytes, timeout: float, job: Job) -> Result:
        """Compile ``src``: hand it to the standby or a fresh process, wait at most ``timeout``
        seconds (then kill it), and start the next standby. Blocks."""
        started = self._take() or self._start()
        if getenv("CC_STANDBY", 1):
            self._refill()  # loads on another core while this one compiles
        with job.lock:
            job.proc = started.proc
            if job.cancelled:
                _kill(started.proc)
        try:
            try:
                out, err = started.proc.communicate(src, timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill(started.proc)
                out, err = started.proc.communicate()
                return Result(started.proc.returncode, b"", err, timed_out=True)
            if started.out is not None:
                out = Path(started.out).read_bytes() if started.proc.returncode == 0 else b""
            return Result(started.proc.returncode, out, err)
        finally:
            if started.out is not None:
                Path(started.out).unlink(missing_ok=True)

    def close(self) -> None:
        """Kill the standby and remove the temporary directory (at exit; safe to repeat)."""
        with self._lock:
            standby, self._standby = self._standby, None
            folder, self._dir = self._dir, None
        if standby is not None:
            _discard(standby.proc)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _take(self) -> _Started | None:
        with self._lock:
            standby, self._standby = self._standby, None
        if standby is None:
            return None
        if standby.proc.poll() is not None:  # died while idle: not this compile's failure
            _discard(standby.proc)
            return None
        return standby

    def _refill(self) -> None:
        with self._lock:  # one thread starts the standby; the others go on compiling
            if self._refilling or self._standby is not None:
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
        out: str | None = None
        if self.to_stdout:
            argv = [*self.argv, "-o", "-"]
        else:
            with self._lock:
                if self._dir is None:
                    self._dir = tempfile.mkdtemp(prefix="aiotinyrt-cc-")
                self._serial += 1
                out = os.path.join(self._dir, f"{self._serial}.o")
            argv = [*self.argv, "-o", out]
        # its own process group: killing it kills what it started (gcc's cc1 and as), and the
        # terminal's Ctrl-C goes to this process alone, which then kills the compiler
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        return _Started(proc, out)


def _discard(proc: subprocess.Popen[bytes]) -> None:
    """Kill, reap and close the pipes of a process that will not be used."""
    _kill(proc)
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the compiler's process group (a no-op once it has been reaped)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


_BY_ARGV: dict[tuple[str, ...], CCProcess] = {}
_registry_lock = threading.Lock()


def for_argv(argv: Sequence[str], *, to_stdout: bool) -> CCProcess:
    """The process-wide :class:`CCProcess` of a command line (devices share its standby)."""
    key = (*argv, str(to_stdout))
    with _registry_lock:
        runner = _BY_ARGV.get(key)
        if runner is None:
            runner = _BY_ARGV[key] = CCProcess(argv, to_stdout=to_stdout)
        return runner


@atexit.register
def _close_all() -> None:
    with _registry_lock:
        runners = list(_BY_ARGV.values())
    for runner in runners:
        runner.close()


def _after_fork_in_child() -> None:
    global _registry_lock
    _registry_lock = threading.Lock()
    for runner in _BY_ARGV.values():
        runner._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
