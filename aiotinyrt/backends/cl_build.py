"""The CL compile server: ``clBuildProgram`` in subprocesses, so that builds run side by side.

PoCL builds with LLVM inside the calling process, and two builds in one process take turns on a
lock inside it (docs/architecture.md, "The OpenCL backend": sampled, one of two build threads
waits in ~92 % of the samples, with one context or one each; of two server processes, in 2-8 %).
So :class:`CLCompiler <aiotinyrt.backends.ops_cl.CLCompiler>` hands each build to a server
process of a small pool per device. A server (:func:`server_argv`: this file's :func:`serve`,
imported from the parent's own copy of the package) opens device ``<index>`` (``CL:<index>``,
the same discovery order), builds each source it is sent and replies with the binary or the
error. A server lives until its stdin closes (the parent exits).
Each build is one thread of CPU in its server (PoCL neither spawns threads for it nor takes a
lock across processes), so two servers build two kernels side by side on two cores.

Protocol (stdin/stdout, little-endian): a request is ``u32 length`` + the UTF-8 source; a reply
is ``b"O"`` + ``u64 length`` + the binary, or ``b"E"`` (build failure) / ``b"X"`` (another
OpenCL error) + ``i32 code`` + ``u32 length`` + the build log / the failed call. The server's
own stdout is its stderr, so nothing the driver prints can corrupt a reply.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from typing import IO

from aiotinyrt.backends import opencl as ocl
from aiotinyrt.compiler import CompileError

#: The build a new server runs first: LLVM's start-up, before a build of the caller waits on it.
WARM = "__kernel void aiotinyrt_warm(__global int* o) { o[0] = 1; }"
_FORK_LOCK = threading.Lock()  # (a forked child's pools reset once each)


#: The directory this process's aiotinyrt package lies in. A server imports the package from
#: there by its location (the same code as its parent, whether or not its own path would find
#: aiotinyrt: a package put on ``sys.path`` at run time, a checkout run from elsewhere, another
#: copy installed), and everything else from its usual path: the package's directory is not put
#: on ``sys.path``, where anything beside the package (``site-packages``' other modules) would
#: come before the standard library.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SERVE = (
    "import importlib.util, os, sys; package = os.path.join(sys.argv[1], 'aiotinyrt'); "
    "spec = importlib.util.spec_from_file_location('aiotinyrt', os.path.join(package, '__init__.py'), "
    "submodule_search_locations=[package]); "
    "sys.modules['aiotinyrt'] = importlib.util.module_from_spec(spec); "
    "spec.loader.exec_module(sys.modules['aiotinyrt']); "
    "from aiotinyrt.backends.cl_build import serve; serve(int(sys.argv[2]))"
)


def server_argv(index: int, root: str = PACKAGE_ROOT) -> list[str]:
    """The command line of a server for device ``index``, running the package in ``root``."""
    return [sys.executable, "-c", _SERVE, root, str(index)]


class BuildServer:
    """One server process building for device ``index``; one request at a time."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc = subprocess.Popen(server_argv(index), stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def build(self, src: str) -> bytes:
        """The binary of ``src`` (blocking); ``ocl.BuildError``/``ocl.CLError`` as the build
        raised them; ``CompileError`` when the server exited while building."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = src.encode()
        try:
            self.proc.stdin.write(len(data).to_bytes(4, "little") + data)
            self.proc.stdin.flush()
        except OSError as exc:
            raise self._gone() from exc
        out = self.proc.stdout
        try:
            kind = _read(out, 1)
            if kind == b"O":
                return _read(out, int.from_bytes(_read(out, 8), "little"))
            code = int.from_bytes(_read(out, 4), "little", signed=True)
            text = _read(out, int.from_bytes(_read(out, 4), "little")).decode(errors="replace")
        except EOFError as exc:
            raise self._gone() from exc
        raise ocl.BuildError(code, text) if kind == b"E" else ocl.CLError(text, code)

    def _gone(self) -> CompileError:
        self.close()
        status = self.proc.returncode
        return CompileError(f"CL:{self.index}: the compile server exited (status {status}) while building")

    def close(self) -> None:
        """End the server: killed (a build it runs is of no use any more) and reaped."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()  # (a killed process is gone within milliseconds)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):  # (a request no server will read: dropped)
                    pipe.close()


def _read(stream: IO[bytes], n: int) -> bytes:
    """Exactly ``n`` bytes; ``EOFError`` when the other side closed first."""
    data = stream.read(n) if n else b""
    if len(data) != n:
        raise EOFError(f"{len(data)} of {n} bytes")
    return data


class BuildPool:
    """At most ``size`` servers for device ``index`` (default: one per CPU), reused; a build
    takes an idle server, else the first one to become idle. Thread-safe; a forked child starts
    its own.

    A cold server pays Python's and PoCL's start-up and LLVM's first build: ~1.4 s of CPU here,
    four builds' worth. So a build that finds every server busy, with room in the pool, starts
    one more on a thread of its own, which runs the warm-up build :data:`WARM` before it is
    idle, and the build takes whichever server becomes idle first: the busy one when its build
    ends sooner than the start-up, never a server still starting. A build with no server at all
    to wait for starts one itself (no warm-up: it is that server's first build). After a start
    that failed, no other starts in the background for :attr:`retry_s` seconds (the builds take
    the servers there are); a build still waiting when the pool closes fails."""

    #: After a background start failed, none for this long (seconds).
    retry_s = 1.0

    def __init__(self, index: int, size: int | None = None) -> None:
        self.index = index
        self.size = size or os.cpu_count() or 1
        self._closed = False
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._idle: list[BuildServer] = []
        self._count = 0  # servers idle, busy or starting
        self._failure: BaseException | None = None  # the last background start that failed
        self._failures = 0  # background starts that failed (start() reports those of its call)
        self._retry_at = 0.0  # (time.monotonic) no background start before this

    def _check_fork(self) -> None:
        """In a forked child the servers, threads and lock are the parent's: start anew."""
        if self._pid != os.getpid():
            with _FORK_LOCK:
                if self._pid != os.getpid():
                    self._reset()

    def build(self, src: str) -> bytes:
        """Build ``src`` on a server (blocking: call it from a worker thread). A server that
        exited while idle is replaced; ``CompileError`` when one exits during the build (after
        one retry on another: it may have died idle, unseen) or none could start."""
        retried = False
        while True:
            server = self._take()
            try:
                lib = server.build(src)
            except ocl.CLError:  # the build's own failure: the server goes on
                self._put_back(server)
                raise
            except CompileError:
                self._drop(server)
                if retried:
                    raise
                retried = True  # (an idle server that died too recently to show)
                continue
            except BaseException:
                self._drop(server)
                raise
            self._put_back(server)
            return lib

    def start(self, n: int | None = None) -> None:
        """Start servers until the pool holds ``n`` (default and at most: ``size``) and wait
        until each is idle and warmed (blocking); ``CompileError`` when one could not start."""
        self._check_fork()
        n = min(self.size if n is None else n, self.size)
        with self._cond:
            failures = self._failures
            while len(self._idle) < n and not self._closed:
                if self._failures != failures:  # (a start of this call, or one beside it)
                    raise CompileError(f"CL:{self.index}: a compile server could not start: {self._failure}")
                if self._count < n:  # (also when one died meanwhile)
                    self._launch()
                else:
                    self._cond.wait()

    def _take(self) -> BuildServer:
        self._check_fork()
        with self._cond:
            while not self._closed:
                while self._idle:
                    server = self._idle.pop()
                    if server.proc.poll() is None:
                        return server
                    self._count -= 1
                    server.close()  # (exited while idle: reaped already, closes at once)
                if self._count == 0:  # nothing to wait for: a server of this build's own, below
                    break
                if self._count < self.size and time.monotonic() >= self._retry_at:
                    self._launch()
                self._cond.wait()
                if self._closed:  # (closed while this build waited: no server of its own)
                    raise CompileError(f"CL:{self.index}: the compile servers closed while this build waited")
            self._count += 1
        try:  # (no warm-up: this build is its first, and once closed, its only one)
            return self._new_server()
        except Exception as exc:
            self._drop_count()
            raise CompileError(f"CL:{self.index}: a compile server could not start: {exc}") from exc

    def _launch(self) -> None:
        self._count += 1
        threading.Thread(
            target=self._start, name=f"CL:{self.index} compile server start", daemon=True
        ).start()

    def _start(self) -> None:
        """A server started while others are busy or starting: it runs the warm-up build
        before it is idle, so a build that takes it pays no start-up."""
        try:
            server = self._new_server()
            try:
                server.build(WARM)
            except BaseException:
                server.close()
                raise
        except Exception as exc:
            with self._cond:
                self._count -= 1
                self._failure, self._failures = exc, self._failures + 1
                self._retry_at = time.monotonic() + self.retry_s  # (not one start per wake-up)
                self._cond.notify_all()
            return
        self._put_back(server)

    def _new_server(self) -> BuildServer:
        return BuildServer(self.index)

    def _put_back(self, server: BuildServer) -> None:
        with self._cond:
            if not self._closed:
                self._idle.append(server)
                self._cond.notify_all()
                return
        self._drop(server)

    def _drop(self, server: BuildServer) -> None:
        server.close()
        self._drop_count()

    def _drop_count(self) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify_all()  # (a waiting build may start the replacement)

    def close(self) -> None:
        """End the idle servers; busy and starting ones end when their build returns."""
        self._check_fork()
        with self._cond:
            self._closed, idle, self._idle = True, self._idle, []
            self._cond.notify_all()
        for server in idle:
            self._drop(server)


def serve(index: int) -> None:
    """The server's loop: build each source read from stdin, reply on stdout, until EOF or
    until the reply has no reader (the parent exited or closed the pool while this built)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # (the driver's own output goes to stderr, never into a reply)
    _, device = ocl.devices()[index]
    ids = ocl.ffi.new("cl_device_id[1]", [device])
    context = ocl.create_context(ids)
    requests = sys.stdin.buffer
    while len(header := requests.read(4)) == 4:  # (EOF: the parent is gone)
        src = _read(requests, int.from_bytes(header, "little")).decode()
        try:
            binary = ocl.build(context, ids, src)
            reply = b"O" + len(binary).to_bytes(8, "little") + binary
        except ocl.CLError as exc:
            kind, text = (b"E", exc.log) if isinstance(exc, ocl.BuildError) else (b"X", exc.call)
            data = text.encode()
            reply = (
                kind + exc.code.to_bytes(4, "little", signed=True) + len(data).to_bytes(4, "little") + data
            )
        try:
            replies.write(reply)
            replies.flush()
        except BrokenPipeError:
            os._exit(0)  # (quietly: the buffered reply must not be flushed again at exit)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
