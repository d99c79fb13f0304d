"""The CL compile server: ``clBuildProgram`` in subprocesses, so that builds run side by side.

PoCL builds with LLVM inside the calling process, and two builds in one process take turns on a
lock inside it (docs/architecture.md, "The OpenCL backend": sampled, one of two build threads is
blocked ~95 % of the time, with one context or one each; two server processes both run ~99 %).
So :class:`CLCompiler <aiotinyrt.backends.ops_cl.CLCompiler>` hands each build to a server
process of a small pool per device: ``python -m aiotinyrt.backends.cl_build <index>`` opens
device ``<index>`` (``CL:<index>``, the same discovery order), builds each source it is sent and
replies with the binary or the error. A server lives until its stdin closes (the parent exits).

Protocol (stdin/stdout, little-endian): a request is ``u32 length`` + the UTF-8 source; a reply
is ``b"O"`` + ``u64 length`` + the binary, or ``b"E"`` (build failure) / ``b"X"`` (another
OpenCL error) + ``i32 code`` + ``u32 length`` + the build log / the failed call. The server's
own stdout is its stderr, so nothing the driver prints can corrupt a reply.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import IO

from aiotinyrt.backends import opencl as ocl
from aiotinyrt.compiler import CompileError


class BuildServer:
    """One server process building for device ``index``; one request at a time."""

    def __init__(self, index: int) -> None:
        self.index = index
        argv = [sys.executable, "-m", "aiotinyrt.backends.cl_build", str(index)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)

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
                pipe.close()


def _read(stream: IO[bytes], n: int) -> bytes:
    """Exactly ``n`` bytes; ``EOFError`` when the other side closed first."""
    data = stream.read(n) if n else b""
    if len(data) != n:
        raise EOFError(f"{len(data)} of {n} bytes")
    return data


class BuildPool:
    """At most ``size`` servers for device ``index`` (default: one per CPU), started on
    demand and reused; a build waits for a free one. Thread-safe; a forked child starts its own."""

    def __init__(self, index: int, size: int | None = None) -> None:
        self.index = index
        self.size = size or os.cpu_count() or 1
        self._slots = threading.Semaphore(self.size)
        self._idle: list[BuildServer] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False

    def build(self, src: str) -> bytes:
        """Build ``src`` on a free server (blocking: call it from a worker thread); an idle
        server that has exited meanwhile is replaced by a fresh one."""
        with self._slots:
            with self._lock:
                if self._pid != os.getpid():  # (forked: the servers are the parent's)
                    self._idle, self._pid = [], os.getpid()
                server = self._idle.pop() if self._idle else None
            if server is not None and server.proc.poll() is not None:
                server.close()  # (exited while idle)
                server = None
            reused = server is not None
            if server is None:
                server = BuildServer(self.index)
            while True:
                try:
                    lib = server.build(src)
                except ocl.CLError:  # the build's own failure: the server goes on
                    self._put_back(server)
                    raise
                except CompileError:
                    server.close()
                    if not reused:
                        raise
                    # an idle server that died too recently to show (not reaped yet): the
                    # build was never its; once more on a fresh server
                    reused, server = False, BuildServer(self.index)
                    continue
                except BaseException:
                    server.close()
                    raise
                self._put_back(server)
                return lib

    def _put_back(self, server: BuildServer) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(server)
                return
        server.close()

    def close(self) -> None:
        """End the idle servers; busy ones end when their build returns."""
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for server in idle:
            server.close()


def serve(index: int) -> None:
    """The server's loop: build each source read from stdin, reply on stdout, until EOF."""
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
        replies.write(reply)
        replies.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
