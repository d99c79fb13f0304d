"""The cache location is code: where it is unusable a device still opens, where another user could
have written it nothing is loaded from it, and a damaged entry is rebuilt.

Compiled kernels (the sqlite compile cache) and the native queue library are loaded from the
cache location and run in this process. These tests put that location in the ways it goes wrong
(``/proc``, a file in the way, group-writable, owned by another uid, a damaged entry) and check
that NULL and CPU still open and compute the right result, with exactly one warning. The
location checks run once per process (the native library is loaded once), so most tests run a
fresh interpreter per case, on asyncio, trio and uvloop.
"""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys
import tempfile
import uuid
import warnings
from pathlib import Path

import anyio
import numpy as np
import pytest

from aiotinyrt import Buffer, Device, cachedir, dtypes, native
from aiotinyrt.compiler import DiskCache
from aiotinyrt.helpers import find_cc
from aiotinyrt.host.compiler import ClangCompiler

ROOT = Path(__file__).resolve().parent.parent
INC = "void inc(int* restrict out) { out[0] += 1; }"
#: What a planted compile-cache entry does instead (same name, same arguments).
EVIL = "void inc(int* restrict out) { out[0] = 666; }"
#: A planted native queue library: announces itself the moment it is loaded.
PWNED_SO = (
    '#include <unistd.h>\n__attribute__((constructor)) static void pwned(void) { write(2, "PWNED\\n", 6); }\n'
)
OTHER_UID = 65534  # nobody

SCRIPT = """
import os, sys, anyio, numpy as np
import aiotinyrt as rt
from aiotinyrt import Buffer, dtypes, native

native._installed = lambda: None  # an install-time build would bypass the cache location

if os.environ.get("TEST_UMASK"):
    os.umask(int(os.environ["TEST_UMASK"], 8))

async def main() -> None:
    async with rt.open_device("NULL") as null, rt.open_device("CPU") as cpu:
        await null.run(await null.program("k", "k"))
        prog = await cpu.program("inc", sys.argv[2])
        buf = await Buffer("CPU", 1, dtypes.int32).allocate()
        await buf.copyin(np.zeros(1, np.int32))
        await cpu.run(prog, buf)
        print("result", int((await buf.numpy())[0]), "native", cpu._compute_queue.native, flush=True)
        await buf.free()

kind, _, opt = sys.argv[1].partition("+")
anyio.run(main, backend=kind, backend_options={"use_uvloop": True} if opt else {})
"""


def loops() -> list[str]:
    params = ["asyncio", "trio"]
    try:
        import uvloop  # noqa: F401

        params.append("asyncio+uvloop")
    except ImportError:
        pass
    return params


def run_script(
    loop: str, cachedb: Path | str, tmpdir: Path, src: str = INC, **env: str
) -> subprocess.CompletedProcess[str]:
    """The script in a fresh interpreter with ``CACHEDB=cachedb`` and ``TMPDIR=tmpdir``."""
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, loop, src],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={
            **os.environ,
            "CACHEDB": str(cachedb),
            "TMPDIR": str(tmpdir),
            "PYTHONDONTWRITEBYTECODE": "1",
            **env,
        },
    )


def warning_lines(stderr: str) -> list[str]:
    """The warnings on stderr (a warning is its message line plus an indented source line)."""
    return [line for line in stderr.splitlines() if line and not line[0].isspace()]


@pytest.fixture(scope="module")
def tmpdir_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TMPDIR shared by this module's interpreters, so the fallback location is built once."""
    return tmp_path_factory.mktemp("tmpdir")


def fresh_inc() -> str:
    return f"// {uuid.uuid4()}\n{INC}\n"


# ---- an unusable location ------------------------------------------------------------------------


@pytest.mark.parametrize("loop", loops())
@pytest.mark.parametrize("where", ["proc", "file in the way"])
@pytest.mark.slow
def test_an_unusable_cache_location_still_opens_null_and_cpu_with_one_warning(
    where: str, loop: str, tmp_path: Path, tmpdir_base: Path
) -> None:
    if where == "proc":
        cachedb = Path("/proc/aiotinyrt/cache.db")
    else:
        (tmp_path / "file").write_text("not a directory")
        cachedb = tmp_path / "file" / "aiotinyrt" / "cache.db"
    result = run_script(loop, cachedb, tmpdir_base)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["result", "1", "native", "True"], result.stdout
    lines = warning_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert "RuntimeWarning" in lines[0] and str(cachedb.parent) in lines[0], lines


@pytest.mark.anyio
async def test_without_any_private_location_compiling_goes_on_uncached_and_queues_fall_back_to_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cachedir, "fallback_dir", lambda: None)  # no private temp directory either
    monkeypatch.setattr(native, "_installed", lambda: None)  # the build that uses the location
    monkeypatch.setenv("CACHEDB", f"/proc/aiotinyrt-{uuid.uuid4()}/cache.db")
    cc = find_cc()
    assert cc is not None
    with pytest.warns(RuntimeWarning, match="cache location") as record:
        lib = await ClangCompiler(cc).compile_cached(fresh_inc())
        assert native._build() is None  # the Python worker runs the queues
    assert len(record) == 1, [str(w.message) for w in record]
    assert lib.startswith(b"\x7fELF")


# ---- created private, whatever the umask ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("loop", loops())
@pytest.mark.parametrize("umask", ["000", "277"])
def test_the_cache_location_is_created_private_whatever_the_umask(
    umask: str, loop: str, tmp_path: Path, tmpdir_base: Path
) -> None:
    where = tmp_path / "new" / "aiotinyrt"
    result = run_script(loop, where / "cache.db", tmpdir_base, TEST_UMASK=umask)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.split() == ["result", "1", "native", "True"], result.stdout
    for d in (tmp_path / "new", where):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    files = sorted(p.name for p in where.iterdir())
    assert "cache.db" in files and any(name.startswith("hostq-") for name in files), files
    for p in where.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, (p, oct(p.stat().st_mode))


# ---- a location someone else could write is not loaded from --------------------------------------


@pytest.fixture(scope="module")
def native_names(tmp_path_factory: pytest.TempPathFactory, tmpdir_base: Path) -> list[str]:
    """The file names the first-use build of the native library has (built once, here)."""
    where = tmp_path_factory.mktemp("names")
    result = run_script("asyncio", where / "cache.db", tmpdir_base)
    assert result.returncode == 0, result.stderr
    names = [p.name for p in where.glob("hostq-*.so")]
    assert names, "the native library was not built"
    return names


def plant(where: Path, native_names: list[str]) -> str:
    """Plant, in directory ``where``, a compile-cache entry for a fresh INC that holds EVIL's
    binary and, under every native library name, a library that prints PWNED when loaded.
    Returns the source whose entry was poisoned."""
    src = fresh_inc()
    cc = find_cc()
    assert cc is not None
    compiler = ClangCompiler(cc)
    key = anyio.run(compiler._key, src)
    evil = anyio.run(compiler.compile, EVIL)
    cache = DiskCache(where / "cache.db")
    cache.put(key, evil)
    cache.close()
    for name in native_names:
        subprocess.run(
            [cc[0], "-shared", "-fPIC", "-x", "c", "-", "-o", str(where / name)],
            input=PWNED_SO.encode(),
            check=True,
        )
    return src


@pytest.mark.slow
@pytest.mark.parametrize("loop", loops())
@pytest.mark.parametrize(
    "how",
    [
        "private (control)",
        "group-writable dir",
        "group-writable files",
        "dir of another uid",
        "files of another uid",
    ],
)
def test_a_cache_location_another_user_could_write_is_not_loaded_from(
    how: str, loop: str, tmp_path: Path, tmpdir_base: Path, native_names: list[str]
) -> None:
    where = tmp_path / "cache"
    where.mkdir(mode=0o700)
    src = plant(where, native_names)
    files = list(where.iterdir())
    if how == "group-writable dir":
        where.chmod(0o770)
    elif how == "group-writable files":
        for p in files:
            p.chmod(0o660)
    elif how == "dir of another uid":
        os.chown(where, OTHER_UID, OTHER_UID)
    elif how == "files of another uid":
        for p in files:
            os.chown(p, OTHER_UID, OTHER_UID)
    result = run_script(loop, where / "cache.db", tmpdir_base, src)
    if how == "private (control)":  # the planting works: a trusted location is loaded from
        assert "PWNED" in result.stderr, result.stderr
        assert "result 666" in result.stdout, result.stdout
        return
    assert result.returncode == 0, result.stderr
    assert "PWNED" not in result.stderr + result.stdout
    assert result.stdout.split() == ["result", "1", "native", "True"], result.stdout
    lines = warning_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert "RuntimeWarning" in lines[0] and str(where) in lines[0], lines


# ---- a damaged entry -----------------------------------------------------------------------------


def damage_every_entry(path: Path, damage: str) -> int:
    """Truncate or empty every compile-cache blob in the sqlite file ``path``; the count."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        tables = [
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'compile_v%'"
            )
        ]
        count = 0
        for table in tables:
            new = "substr(lib, 1, length(lib) / 2)" if damage == "truncated" else "x''"
            count += conn.execute(f"UPDATE {table} SET lib = {new}").rowcount
        return count
    finally:
        conn.close()


@pytest.mark.anyio
@pytest.mark.parametrize("damage", ["truncated", "empty"])
async def test_a_damaged_compile_cache_entry_is_recompiled_with_one_warning(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "cache.db"
    monkeypatch.setenv("CACHEDB", str(path))
    cc = find_cc()
    assert cc is not None
    src = fresh_inc()
    good = await ClangCompiler(cc).compile_cached(src)  # (another process) stores the entry
    assert damage_every_entry(path, damage) == 1
    later = ClangCompiler(cc)  # a later process: nothing in memory
    with pytest.warns(RuntimeWarning, match="damaged") as record:
        lib = await later.compile_cached(src)
    assert len(record) == 1, [str(w.message) for w in record]
    assert later.compiles == 1 and lib == good
    dev = Device["CPU"]
    buf = await Buffer("CPU", 1, dtypes.int32).allocate()
    await buf.copyin(np.zeros(1, np.int32))
    await dev.run(dev.runtime("inc", lib), buf)
    assert int((await buf.numpy())[0]) == 1
    await buf.free()
    # the entry was rebuilt: the next process loads it, without a compile and without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = ClangCompiler(cc)
        assert await again.compile_cached(src) == good
        assert again.compiles == 0


@pytest.mark.slow
@pytest.mark.parametrize("loop", loops())
def test_a_damaged_entry_costs_the_next_process_one_warning_and_the_one_after_none(
    loop: str, tmp_path: Path, tmpdir_base: Path
) -> None:
    where = tmp_path / "cache"
    src = fresh_inc()
    first = run_script(loop, where / "cache.db", tmpdir_base, src)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    assert damage_every_entry(where / "cache.db", "truncated") == 1
    second = run_script(loop, where / "cache.db", tmpdir_base, src)
    assert second.returncode == 0, second.stderr
    assert second.stdout.split() == ["result", "1", "native", "True"], second.stdout
    lines = warning_lines(second.stderr)
    assert len(lines) == 1 and "damaged" in lines[0], second.stderr
    third = run_script(loop, where / "cache.db", tmpdir_base, src)
    assert third.returncode == 0 and third.stderr == "", third.stderr
    assert third.stdout.split() == ["result", "1", "native", "True"], third.stdout


# ---- the fallback location is checked too -------------------------------------------------------


@pytest.mark.parametrize("planted", ["dir of another uid", "symlink to a dir of ours", "group-writable dir"])
def test_a_planted_fallback_directory_is_not_used(
    planted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"aiotinyrt-{os.geteuid()}"
    if planted == "dir of another uid":
        shared.mkdir(mode=0o700)
        os.chown(shared, OTHER_UID, OTHER_UID)
    elif planted == "symlink to a dir of ours":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        shared.symlink_to(tmp_path / "elsewhere")
    else:
        shared.mkdir()
        shared.chmod(0o777)
    chosen = cachedir.fallback_dir()
    assert chosen is not None and chosen != shared and chosen.resolve() != (tmp_path / "elsewhere")
    assert stat.S_IMODE(chosen.stat().st_mode) == 0o700 and chosen.stat().st_uid == os.geteuid()


def test_a_directory_others_can_write_is_refused_even_when_sticky(tmp_path: Path) -> None:
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)  # like /tmp: fine above a cache directory, not as one
    assert cachedir.directory_refusal(sticky / "private") is None
    assert stat.S_IMODE((sticky / "private").stat().st_mode) == 0o700
    assert "writable by group or others" in (cachedir.directory_refusal(sticky) or "")
