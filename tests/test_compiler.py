"""The compiler base class and the compile cache: hits, single flight, CCACHE, ASSERT_COMPILE, CACHEDB."""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from aiotinyrt import CompileError, Compiler, Device
from aiotinyrt.compiler import cache_path
from aiotinyrt.helpers import find_cc
from aiotinyrt.host.compiler import ClangCompiler
from tests.helpers import assert_cancelled_at_entry

pytestmark = pytest.mark.anyio


def unique_kernel() -> str:
    """C source no cache has seen before."""
    return f"// {uuid.uuid4()}\nvoid k(int* restrict out) {{ out[0] = 1; }}\n"


def clang() -> ClangCompiler:
    """A fresh CPU compiler: empty in-memory cache, counters at zero."""
    cc = find_cc()
    assert cc is not None
    return ClangCompiler(cc)


class GatedCompiler(Compiler):
    """A compiler whose compilations wait until the test opens ``gate``; optionally they fail."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(f"gated-{uuid.uuid4()}")
        self.gate = anyio.Event()
        self.fail = fail
        self.running = 0
        self.entered = 0
        self._entered_event = anyio.Event()

    async def wait_entered(self, count: int) -> None:
        """Wait until ``count`` compilations have started."""
        while self.entered < count:
            self._entered_event = anyio.Event()
            await self._entered_event.wait()

    async def compile(self, src: str) -> bytes:
        self.running += 1
        self.entered += 1
        self._entered_event.set()
        try:
            await self.gate.wait()
        finally:
            self.running -= 1
        if self.fail:
            raise CompileError("gated compiler refused", "error: refused\n", src)
        return b"lib:" + src.encode()


# ---- compiling ------------------------------------------------------------------------------------


async def test_compile_error_carries_the_compilers_diagnostics() -> None:
    compiler = clang()
    src = "void broken(int* out) { out[0] = undeclared_name; }"
    with pytest.raises(CompileError) as info:
        await compiler.compile_cached(src)
    assert "undeclared_name" in info.value.diagnostics
    assert "error" in info.value.diagnostics
    assert "undeclared_name" in str(info.value)
    assert info.value.src == src


async def test_a_failed_compile_is_not_cached() -> None:
    compiler = clang()
    src = f"// {uuid.uuid4()}\nvoid broken(void) {{ syntax error }}"
    for _ in range(2):
        with pytest.raises(CompileError):
            await compiler.compile_cached(src)
    assert compiler.compiles == 2


async def test_device_program_raises_compile_error() -> None:
    with pytest.raises(CompileError, match="error"):
        await Device["CPU"].program("k", "void k( {")


async def test_compile_cached_rejects_non_string_source() -> None:
    with pytest.raises(TypeError, match="str"):
        await clang().compile_cached(b"void k(void) {}")  # type: ignore[arg-type]


# ---- the cache --------------------------------------------------------------------------------------


class CountingCompiler(Compiler):
    """A fast compiler for cache tests: the binary is the source; ``compiles`` counts real runs.
    Instances made with the same ``cachekey`` share persistent cache entries, as two processes
    running the same toolchain would."""

    def __init__(self, cachekey: str) -> None:
        super().__init__(cachekey)

    async def compile(self, src: str) -> bytes:
        await anyio.lowlevel.checkpoint()
        return b"lib:" + src.encode()


async def test_cache_hit_returns_the_same_bytes_without_running_the_compiler() -> None:
    compiler = clang()
    src = unique_kernel()
    lib = await compiler.compile_cached(src)
    assert isinstance(lib, bytes)
    assert lib.startswith(b"\x7fELF")
    assert compiler.compiles == 1
    assert await compiler.compile_cached(src) == lib
    assert compiler.compiles == 1


async def test_persistent_cache_serves_a_fresh_compiler() -> None:
    src = unique_kernel()
    lib = await clang().compile_cached(src)
    fresh = clang()
    assert await fresh.compile_cached(src) == lib
    assert fresh.compiles == 0


async def test_cache_keys_include_the_compiler_identity() -> None:
    src = unique_kernel()
    await CountingCompiler("toolchain-a").compile_cached(src)
    other = CountingCompiler("toolchain-b")
    await other.compile_cached(src)
    assert other.compiles == 1  # another toolchain never gets a stale binary


async def test_ccache_zero_disables_both_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"counting-{uuid.uuid4()}"
    src = unique_kernel()
    await CountingCompiler(key).compile_cached(src)  # in the persistent cache now
    monkeypatch.setenv("CCACHE", "0")
    compiler = CountingCompiler(key)
    assert await compiler.compile_cached(src) == b"lib:" + src.encode()
    await compiler.compile_cached(src)
    assert compiler.compiles == 2


async def test_assert_compile_turns_a_cache_miss_into_compile_error(monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"counting-{uuid.uuid4()}"
    compiler = CountingCompiler(key)
    known = unique_kernel()
    lib = await compiler.compile_cached(known)
    monkeypatch.setenv("ASSERT_COMPILE", "1")
    with pytest.raises(CompileError, match="ASSERT_COMPILE"):
        await compiler.compile_cached(unique_kernel())
    assert await compiler.compile_cached(known) == lib  # in-memory hits are fine
    fresh = CountingCompiler(key)
    assert await fresh.compile_cached(known) == lib  # persistent hits too
    assert compiler.compiles == 1
    assert fresh.compiles == 0


async def test_assert_compile_with_the_cache_off_always_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASSERT_COMPILE", "1")
    monkeypatch.setenv("CCACHE", "0")
    compiler = CountingCompiler(f"counting-{uuid.uuid4()}")
    with pytest.raises(CompileError, match="ASSERT_COMPILE"):
        await compiler.compile_cached(unique_kernel())
    assert compiler.compiles == 0


async def test_cachedb_places_the_persistent_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = f"counting-{uuid.uuid4()}"
    db = tmp_path / "sub" / "my.db"
    monkeypatch.setenv("CACHEDB", str(db))
    src = unique_kernel()
    lib = await CountingCompiler(key).compile_cached(src)
    assert db.exists()
    fresh = CountingCompiler(key)
    assert await fresh.compile_cached(src) == lib
    assert fresh.compiles == 0
    monkeypatch.setenv("CACHEDB", str(tmp_path / "other.db"))
    elsewhere = CountingCompiler(key)
    await elsewhere.compile_cached(src)
    assert elsewhere.compiles == 1  # a different file holds nothing


def test_cachedb_wins_over_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("CACHEDB", str(tmp_path / "explicit.db"))
    assert cache_path() == tmp_path / "explicit.db"
    monkeypatch.delenv("CACHEDB")
    assert cache_path() == tmp_path / "xdg" / "aiotinyrt" / "cache.db"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_path() == Path.home() / ".cache" / "aiotinyrt" / "cache.db"


async def test_corrupt_cache_file_warns_once_and_compiles_anyway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "corrupt.db"
    db.write_bytes(b"this is not a sqlite database" * 100)
    monkeypatch.setenv("CACHEDB", str(db))
    compiler = CountingCompiler(f"counting-{uuid.uuid4()}")
    with pytest.warns(RuntimeWarning, match="corrupt") as record:
        assert await compiler.compile_cached("a") == b"lib:a"
        assert await compiler.compile_cached("b") == b"lib:b"
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    assert compiler.compiles == 2


# ---- single flight ----------------------------------------------------------------------------------


async def test_concurrent_requests_for_one_source_share_one_compilation() -> None:
    compiler = GatedCompiler()
    results: list[bytes] = []

    async def request() -> None:
        results.append(await compiler.compile_cached("src"))

    async with anyio.create_task_group() as tg:
        for _ in range(32):
            tg.start_soon(request)
        await compiler.wait_entered(1)
        await anyio.wait_all_tasks_blocked()
        assert compiler.running == 1
        compiler.gate.set()
    assert results == [b"lib:src"] * 32
    assert compiler.compiles == 1


async def test_32_concurrent_clang_compiles_of_one_source_run_the_compiler_once() -> None:
    compiler = Device["CPU"].compiler
    await compiler.compile_cached("void warm(void) {}")  # the compiler identity is known
    before = compiler.compiles
    src = unique_kernel()
    results: list[bytes] = []

    async def request() -> None:
        results.append(await compiler.compile_cached(src))

    async with anyio.create_task_group() as tg:
        for _ in range(32):
            tg.start_soon(request)
    assert len(results) == 32
    assert len(set(results)) == 1
    assert compiler.compiles == before + 1


async def test_concurrent_requests_for_a_failing_source_share_one_compilation() -> None:
    compiler = GatedCompiler(fail=True)
    failures: list[str] = []

    async def request() -> None:
        try:
            await compiler.compile_cached("bad src")
        except CompileError as exc:
            failures.append(exc.diagnostics)

    async with anyio.create_task_group() as tg:
        for _ in range(32):
            tg.start_soon(request)
        await compiler.wait_entered(1)
        await anyio.wait_all_tasks_blocked()
        compiler.gate.set()
    assert failures == ["error: refused\n"] * 32
    assert compiler.compiles == 1


async def test_cancelled_compiling_caller_hands_the_compilation_to_a_waiter() -> None:
    compiler = GatedCompiler()
    results: list[bytes] = []
    owner_scope = anyio.CancelScope()

    async def owning_request() -> None:
        with owner_scope:
            await compiler.compile_cached("src")

    async def waiting_request() -> None:
        results.append(await compiler.compile_cached("src"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(owning_request)
        await compiler.wait_entered(1)
        tg.start_soon(waiting_request)
        await anyio.wait_all_tasks_blocked()
        assert compiler.entered == 1
        owner_scope.cancel()
        await compiler.wait_entered(2)  # the waiter took over
        assert compiler.running == 1
        compiler.gate.set()
    assert owner_scope.cancelled_caught
    assert results == [b"lib:src"]
    assert compiler.compiles == 2


# ---- the checkpoint rule ------------------------------------------------------------------------


async def test_compile_cached_is_a_checkpoint_on_a_hit() -> None:
    compiler = CountingCompiler(f"counting-{uuid.uuid4()}")
    src = unique_kernel()
    await compiler.compile_cached(src)
    await assert_cancelled_at_entry(lambda: compiler.compile_cached(src))


async def test_compile_cached_cancelled_at_entry_compiles_nothing() -> None:
    compiler = Device["CPU"].compiler
    await compiler.compile_cached("void warm(void) {}")
    before = compiler.compiles
    src = unique_kernel()
    await assert_cancelled_at_entry(lambda: compiler.compile_cached(src))
    assert compiler.compiles == before
    await assert_cancelled_at_entry(lambda: GatedCompiler().compile_cached("x"))


async def test_compile_cached_with_the_cache_off_is_a_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CCACHE", "0")
    compiler = GatedCompiler()
    await assert_cancelled_at_entry(lambda: compiler.compile_cached("x"))
    assert compiler.compiles == 0
