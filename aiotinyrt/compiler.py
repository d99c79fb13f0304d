"""Compiler base class and the compile cache.

``await compiler.compile(src)`` turns source into a device binary without touching the event loop
thread (backends run their toolchain as a subprocess through anyio). ``compile_cached`` puts three
layers in front of it:

1. an in-memory dict (a hit costs one hash and one dict lookup, plus the checkpoint);
2. single flight: concurrent calls for the same source share one compilation;
3. a persistent sqlite cache shared by processes (WAL mode), read and written from worker
   threads. A corrupt, locked or read-only cache file produces one warning and the compiler
   carries on without it; it never fails a compile. Each entry stores the SHA-256 of its binary:
   an entry that fails it (truncated, emptied) is dropped and recompiled with one warning. The
   file lives in a private, checked directory (:mod:`aiotinyrt.cachedir`).

Keys include the compiler's identity (path, version banner, flags, target), so a toolchain
upgrade never returns a stale binary. ``CCACHE=0`` disables both caches, ``ASSERT_COMPILE=1``
turns a miss into a ``CompileError``, ``CACHEDB`` (else ``$XDG_CACHE_HOME/aiotinyrt/cache.db``,
else ``~/.cache/aiotinyrt/cache.db``) places the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sqlite3
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread

from aiotinyrt import cachedir
from aiotinyrt.helpers import cache_path, getenv

T = TypeVar("T")


class CompileError(RuntimeError):
    """Compilation failed. ``diagnostics`` holds the compiler's output."""

    def __init__(self, message: str, diagnostics: str = "", src: str = "") -> None:
        full = f"{message}\n{diagnostics.rstrip()}" if diagnostics else message
        super().__init__(full)
        self.diagnostics = diagnostics
        self.src = src


class _NoPrivateLocation(Exception):
    """:func:`cachedir.resolve` found no private place for the file (it warned already)."""


class DiskCache:
    """The sqlite compile cache. Every method blocks, so call it from a worker thread.

    A corrupt file is replaced by an empty one; any other error (locked, read-only, disk full)
    turns the cache off for the rest of the process. Either way it warns once. The file actually
    used (``file``) is ``path`` unless :mod:`aiotinyrt.cachedir` refused that location.
    """

    VERSION = 2  # (key, lib, sha256 of lib)
    #: Files sqlite keeps next to the database.
    COMPANIONS = ("-wal", "-shm", "-journal")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._warned = False
        self.disabled = False

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            file = cachedir.resolve(self.path, self.COMPANIONS)
            if file is None:
                raise _NoPrivateLocation
            self.file = file
            cachedir.create_private_file(file)  # 0600; sqlite gives -wal and -shm the same mode
            conn = sqlite3.connect(file, timeout=5.0, check_same_thread=False, isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(
                    f"CREATE TABLE IF NOT EXISTS compile_v{self.VERSION} "
                    "(key TEXT PRIMARY KEY, lib BLOB, sha256 BLOB)"
                )
                # a truncated or garbled file often opens fine and fails only here
                conn.execute(f"SELECT count(*) FROM compile_v{self.VERSION} WHERE key = ''").fetchone()
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"aiotinyrt: compile cache {self.file} {message}", RuntimeWarning, stacklevel=4)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None

    def _rebuild(self, exc: BaseException) -> bool:
        """Replace a corrupt cache file with an empty one; False if that is impossible."""
        self._drop_connection()
        try:
            for suffix in ("", *self.COMPANIONS):
                Path(f"{self.file}{suffix}").unlink(missing_ok=True)
            self._connect()
        except (sqlite3.Error, OSError, _NoPrivateLocation):
            return False
        self._warn(f"was corrupt ({exc}); rebuilt it empty")
        return True

    def _attempt(self, op: Callable[[sqlite3.Connection], T]) -> T | None:
        """Run ``op`` on the connection. A corrupt file is rebuilt once and ``op`` retried; any
        other error (locked, read-only, disk full) turns the cache off with one warning, and no
        private location at all turns it off silently (:mod:`aiotinyrt.cachedir` warned)."""
        with self._lock:
            if self.disabled:
                return None
            try:
                return op(self._connect())
            except _NoPrivateLocation:
                self.disabled = True
                return None
            except (sqlite3.Error, OSError) as exc:
                corrupt = isinstance(exc, sqlite3.DatabaseError) and not isinstance(
                    exc, sqlite3.OperationalError
                )
                if corrupt and self._rebuild(exc):
                    try:
                        return op(self._connect())
                    except (sqlite3.Error, OSError) as again:
                        exc = again
                self.disabled = True
                self._drop_connection()
                self._warn(f"is unusable ({exc!r}); compiling without it")
                return None

    def get(self, key: str) -> bytes | None:
        """The binary stored under ``key``, or None. An entry whose binary fails its checksum
        (truncated, emptied, overwritten) is deleted, with one warning, and reads as a miss."""
        damaged: list[int] = []

        def read(conn: sqlite3.Connection) -> bytes | None:
            table = f"compile_v{self.VERSION}"
            row = conn.execute(f"SELECT lib, sha256 FROM {table} WHERE key = ?", (key,)).fetchone()
            if row is None:
                return None
            lib = bytes(row[0] or b"")
            if row[1] is not None and hashlib.sha256(lib).digest() == bytes(row[1]):
                return lib
            conn.execute(f"DELETE FROM {table} WHERE key = ?", (key,))
            damaged.append(len(lib))
            return None

        lib = self._attempt(read)
        if damaged:
            warnings.warn(
                f"aiotinyrt: compile cache {self.file}: the entry {key[:16]} was damaged "
                f"({damaged[0]} bytes that fail their checksum); recompiling it",
                RuntimeWarning,
                stacklevel=2,
            )
        return lib

    def put(self, key: str, lib: bytes) -> None:
        """Store ``lib`` under ``key`` with its checksum."""
        digest = hashlib.sha256(lib).digest()
        self._attempt(
            lambda conn: conn.execute(
                f"INSERT OR REPLACE INTO compile_v{self.VERSION} (key, lib, sha256) VALUES (?, ?, ?)",
                (key, lib, digest),
            )
        )

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


_disk_caches: dict[Path, DiskCache] = {}
_disk_lock = threading.Lock()


def disk_cache() -> DiskCache:
    """The process-wide DiskCache for the current cache path."""
    path = cache_path()
    with _disk_lock:
        cache = _disk_caches.get(path)
        if cache is None:
            cache = _disk_caches[path] = DiskCache(path)
        return cache


class Compiler:
    """Source to device binary. Backends override :meth:`compile` (and :meth:`identity`).

    ``cachekey`` names the backend in cache keys; None disables caching for this compiler.
    """

    def __init__(self, cachekey: str | None = None) -> None:
        self.cachekey = cachekey
        self._memory: dict[str, bytes] = {}  # cache key -> binary
        self._by_src: dict[str, bytes] = {}  # source -> binary, the in-memory front
        # single flight is per event loop: an anyio.Event cannot be awaited from another loop
        self._inflight_var: anyio.lowlevel.RunVar[dict[str, anyio.Event]] = anyio.lowlevel.RunVar(
            f"aiotinyrt_inflight_{id(self)}"
        )
        self._identity: str | None = None
        self._identity_lock = _LoopLock()
        self._failed: dict[str, BaseException] = {}  # the failure of an in-flight compile
        self.compiles = 0  # compilations actually run by this compiler

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.cachekey}>"

    async def compile(self, src: str) -> bytes:
        """Compile ``src`` to a binary, off the event loop thread. Raises ``CompileError``.

        Cancellation: the compiler process is killed; nothing is cached.
        """
        raise NotImplementedError

    async def identity(self) -> str:
        """A string that changes whenever the binaries this compiler produces could change
        (toolchain path and version, flags, target). Part of every cache key.

        Cancellation: any probe process is killed; the identity is asked for again next time.
        """
        return self.cachekey or type(self).__name__

    def disassemble(self, lib: bytes) -> str:
        """Human-readable disassembly of a binary, where the backend has a disassembler."""
        raise NotImplementedError(f"{type(self).__name__} has no disassembler")

    async def _key(self, src: str) -> str:
        if self._identity is None:
            async with self._identity_lock:  # one `cc --version` even for many first callers
                if self._identity is None:
                    self._identity = await self.identity()
        digest = hashlib.sha256()
        digest.update(self._identity.encode())
        digest.update(b"\0")
        digest.update(src.encode())
        return digest.hexdigest()

    async def compile_cached(self, src: str) -> bytes:
        """``compile`` through the in-memory and persistent caches, one compilation per source
        even when many tasks ask at once.

        Cancellation: cancels this caller's wait. If this caller was the one running the
        compiler, the process is killed and the next caller waiting for the same source runs it
        again.
        """
        lib = self._by_src.get(src)  # hot path: str hashes are cached by Python
        if lib is not None and getenv("CCACHE", 1) != 0:
            await anyio.lowlevel.checkpoint()
            return lib
        if not isinstance(src, str):
            raise TypeError(f"source must be a str, got {type(src).__name__}")
        if self.cachekey is None or getenv("CCACHE", 1) == 0:
            await anyio.lowlevel.checkpoint()
            if getenv("ASSERT_COMPILE"):
                raise CompileError("ASSERT_COMPILE=1 and the compile cache is off", src=src)
            return await self._compile_counted(src)
        key = await self._key(src)
        lib = self._memory.get(key)
        if lib is not None:
            self._by_src[src] = lib
            await anyio.lowlevel.checkpoint()
            return lib
        try:
            inflight = self._inflight_var.get()
        except LookupError:
            inflight = {}
            self._inflight_var.set(inflight)
        while (event := inflight.get(key)) is not None:
            await event.wait()
            lib = self._memory.get(key)
            if lib is not None:
                return lib
            failure = self._failed.get(key)
            if failure is not None:  # the compile we waited for failed: so does this call
                raise failure
        done = inflight[key] = anyio.Event()
        self._failed.pop(key, None)
        try:
            cache = disk_cache()
            lib = await anyio.to_thread.run_sync(cache.get, key)
            if lib is None:
                if getenv("ASSERT_COMPILE"):
                    raise CompileError(f"ASSERT_COMPILE=1 and a compile cache miss ({cache.path})", src=src)
                lib = await self._compile_counted(src)
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(cache.put, key, lib)
            self._memory[key] = self._by_src[src] = lib
            return lib
        except CompileError as exc:
            self._failed[key] = exc  # waiters share it; the next call after them compiles again
            raise
        finally:
            del inflight[key]
            done.set()

    async def _compile_counted(self, src: str) -> bytes:
        self.compiles += 1
        async with compile_limiter():
            return await self.compile(src)


class _LoopLock:
    """An anyio.Lock per event loop (a compiler may be used from several loops in turn)."""

    def __init__(self) -> None:
        self._var: anyio.lowlevel.RunVar[anyio.Lock] = anyio.lowlevel.RunVar(f"aiotinyrt_lock_{id(self)}")

    async def __aenter__(self) -> None:
        try:
            lock = self._var.get()
        except LookupError:
            lock = anyio.Lock()
            self._var.set(lock)
        await lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._var.get().release()


_limiter: anyio.lowlevel.RunVar[anyio.CapacityLimiter] = anyio.lowlevel.RunVar("aiotinyrt_compile_limiter")


def compile_limiter() -> anyio.CapacityLimiter:
    """The event loop's limit on concurrent compiler processes: one per core (env
    ``COMPILE_JOBS`` overrides)."""
    try:
        return _limiter.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(getenv("COMPILE_JOBS", os.cpu_count() or 1))
        _limiter.set(limiter)
        return limiter


def compile_timeout() -> float:
    """Seconds a compiler process may run (env ``COMPILE_TIMEOUT_S``, default 120)."""
    return float(os.environ.get("COMPILE_TIMEOUT_S", "") or 120)
