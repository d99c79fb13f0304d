"""The C compiler process started ahead of time (aiotinyrt/host/ccprocess.py): the next compile
is given to it, gcc works the same way and leaves no file, a kill reaches what the compiler
started and a detached helper cannot hold the caller, cancellation kills the compile (standby
or not), compiles keep to their own worker threads, a quoted include finds nothing beside the
source, and neither exit nor fork leaves a compiler behind, takes the parent's, or hangs it."""

from __future__ import annotations

import os
import select
import shutil
import stat
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from aiotinyrt import CompileError
from aiotinyrt.host import ccprocess, elf
from aiotinyrt.host.compiler import ClangCompiler
from tests.helpers import INC

pytestmark = pytest.mark.anyio

#: A compiler that does what its mode file says once it has its source (as a process started
#: ahead of its compile must): ``ok`` logs its pid and runs clang, ``hang`` reports its pid into
#: the fifo and sleeps.
FAKE = """#!/bin/sh
case "$1" in --version) exec clang --version ;; esac
src=$(cat)
case "$(cat "{dir}/mode")" in
  hang) echo $$ > "{dir}/fifo"; exec sleep 60 ;;
  *) echo $$ >> "{dir}/log"; printf '%s\\n' "$src" | clang "$@" ;;
esac
"""


def fresh_inc() -> str:
    """INC with a comment no cache has seen."""
    return f"// {uuid.uuid4()}\n{INC}\n"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def gone(pid: int, timeout: float = 10) -> bool:
    """Whether process ``pid`` exits within ``timeout`` seconds (woken by its pidfd, no polling)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = await anyio.to_thread.run_sync(select.select, [fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


def script(tmp_path: Path, body: str) -> str:
    """A fake compiler: ``--version`` as clang's, anything else runs ``body``."""
    path = tmp_path / f"cc-{uuid.uuid4().hex[:8]}"
    path.write_text(f'#!/bin/sh\ncase "$1" in --version) exec clang --version ;; esac\n{body}\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[ClangCompiler]:
    """A ClangCompiler over FAKE (mode ``ok``); its standby is killed afterwards."""
    path = tmp_path / "fake-cc"
    path.write_text(FAKE.format(dir=tmp_path))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "mode").write_text("ok")
    os.mkfifo(tmp_path / "fifo")
    compiler = ClangCompiler([str(path)])
    yield compiler
    ccprocess.close_compiler(compiler.cc)


def standby_pid(compiler: ClangCompiler) -> int | None:
    started = compiler._process._standby
    return None if started is None else started.proc.pid


async def test_the_next_compile_is_given_to_the_process_started_ahead_of_it(
    fake: ClangCompiler, tmp_path: Path
) -> None:
    first = await fake.compile(fresh_inc())
    waiting = standby_pid(fake)
    assert waiting is not None and alive(waiting)
    second = await fake.compile(fresh_inc())
    assert elf.parse(first) and elf.parse(second)
    assert int((tmp_path / "log").read_text().split()[-1]) == waiting  # it compiled the second
    assert standby_pid(fake) not in (None, waiting)  # and the next one is waiting


async def test_with_cc_standby_0_nothing_is_started_ahead(
    fake: ClangCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC_STANDBY", "0")
    await fake.compile(fresh_inc())
    assert standby_pid(fake) is None


async def test_cancelling_a_compile_kills_the_standby_it_was_given(
    fake: ClangCompiler, tmp_path: Path
) -> None:
    await fake.compile(fresh_inc())
    waiting = standby_pid(fake)
    (tmp_path / "mode").write_text("hang")
    async with anyio.create_task_group() as tg:
        tg.start_soon(fake.compile, fresh_inc())
        pid = int(await anyio.to_thread.run_sync((tmp_path / "fifo").read_text))  # it has its source
        tg.cancel_scope.cancel()
    assert pid == waiting
    assert await gone(pid)


def test_a_compile_cancelled_before_it_started_starts_no_process() -> None:
    runner = ccprocess.CCProcess(["clang", "-c", "-x", "c", "-"])
    job = ccprocess.Job()
    job.cancel()
    live = set(ccprocess._LIVE)
    result = runner.run(b"void k(int *o) { o[0] = 1; }", 60, job)
    assert result.returncode < 0 and set(ccprocess._LIVE) == live and runner._standby is None


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc (apt-get install -y gcc)")
async def test_gcc_compiles_the_same_way_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # where gcc would put its own temporary files
    compiler = ClangCompiler(["gcc"])
    try:
        for _ in range(3):
            lib = await compiler.compile(fresh_inc())
            assert lib[:4] == b"\x7fELF" and elf.parse(lib)
        with pytest.raises(CompileError, match="exited with status 1") as info:
            await compiler.compile("this is not C")
        assert "error" in info.value.diagnostics
    finally:
        ccprocess.close_compiler(compiler.cc)
    assert list(temp.iterdir()) == []


async def test_a_quoted_include_finds_nothing_beside_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "x.h").write_text("#define SEVEN 7\n")
    monkeypatch.chdir(tmp_path)  # the application's working directory holds x.h
    with pytest.raises(CompileError, match=r"x\.h"):
        await ClangCompiler(["clang"]).compile(
            f'// {uuid.uuid4()}\n#include "x.h"\nint k(void) {{ return SEVEN; }}\n'
        )


async def test_compiles_keep_off_the_applications_worker_threads() -> None:
    limiter = anyio.to_thread.current_default_thread_limiter()
    total, limiter.total_tokens = limiter.total_tokens, 1
    busy = object()
    await limiter.acquire_on_behalf_of(busy)  # the application's only worker thread is taken
    try:
        with anyio.fail_after(30):
            lib = await ClangCompiler(["clang"]).compile(fresh_inc())
        assert lib[:4] == b"\x7fELF"
    finally:
        limiter.release_on_behalf_of(busy)
        limiter.total_tokens = total


async def test_an_infinite_timeout_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COMPILE_TIMEOUT_S", "inf")
    assert (await ClangCompiler(["clang"]).compile(fresh_inc()))[:4] == b"\x7fELF"


async def test_a_bad_cc_standby_value_leaks_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC_STANDBY", "false")
    live = set(ccprocess._LIVE)
    with pytest.raises(ValueError, match="CC_STANDBY"):
        await ClangCompiler(["clang"]).compile(fresh_inc())
    assert set(ccprocess._LIVE) == live


@pytest.mark.slow
async def test_a_timeout_kills_everything_the_compiler_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    cc = script(tmp_path, f'sleep 60 & echo $! > "{pids}"; cat > /dev/null; wait')
    monkeypatch.setenv("COMPILE_TIMEOUT_S", "2")
    monkeypatch.setenv("CC_STANDBY", "0")
    with pytest.raises(CompileError, match=r"did not finish within 2 s"):
        await ClangCompiler([cc]).compile(fresh_inc())
    assert await gone(int(pids.read_text()))  # the compiler's own child, killed with its group


@pytest.mark.slow
async def test_a_helper_that_left_the_process_group_cannot_hold_a_timed_out_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    # the helper keeps the compiler's stdout and stderr open for 60 s after the compiler died
    cc = script(tmp_path, f'cat > /dev/null; setsid sleep 60 & echo $! > "{pids}"; exec sleep 60')
    monkeypatch.setenv("COMPILE_TIMEOUT_S", "1")
    monkeypatch.setenv("CC_STANDBY", "0")
    try:
        with anyio.fail_after(30), pytest.raises(CompileError, match=r"did not finish within 1 s"):
            await ClangCompiler([cc]).compile(fresh_inc())
    finally:
        os.kill(int(pids.read_text()), 9)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    return subprocess.run(
        [sys.executable, "-X", "dev", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.slow
def test_exit_kills_the_waiting_compiler() -> None:
    result = run_python(
        """
        import anyio
        from aiotinyrt.host.compiler import ClangCompiler
        c = ClangCompiler(["clang"])
        anyio.run(c.compile, "void k(int *o) { o[0] = 1; }")
        print(c._process._standby.proc.pid)
        """
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    with pytest.raises(ProcessLookupError):  # killed and reaped before the interpreter went
        os.kill(int(result.stdout), 0)


@pytest.mark.slow
def test_a_forked_child_starts_its_own_compiler_and_leaves_the_parents_alone(tmp_path: Path) -> None:
    fake = tmp_path / "fake-cc"
    fake.write_text(FAKE.format(dir=tmp_path))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "mode").write_text("ok")
    result = run_python(
        f"""
        import os, anyio
        from aiotinyrt.host.compiler import ClangCompiler
        c = ClangCompiler([{str(fake)!r}])
        anyio.run(c.compile, "void k(int *o) {{ o[0] = 1; }}")
        parents = c._process._standby.proc.pid
        child = os.fork()
        if child == 0:
            lib = anyio.run(c.compile, "void k(int *o) {{ o[0] = 2; }}")
            ok = lib[:4] == b"\\x7fELF" and c._process._standby.proc.pid != parents
            raise SystemExit(0 if ok else 3)  # a normal exit: its exit hooks run
        _, status = os.waitpid(child, 0)
        lib = anyio.run(c.compile, "void k(int *o) {{ o[0] = 3; }}")
        print(os.waitstatus_to_exitcode(status), lib[:4] == b"\\x7fELF", parents)
        """
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    status, ok, parents = result.stdout.split()
    assert status == "0" and ok == "True"
    log = [int(pid) for pid in (tmp_path / "log").read_text().split()]
    assert log[-1] == int(parents)  # the parent's third compile ran on its own standby
    assert int(parents) not in log[:-1]  # which the child neither used nor killed


@pytest.mark.slow
def test_a_fork_while_a_compile_writes_its_source_does_not_hold_that_compile(tmp_path: Path) -> None:
    started, go = tmp_path / "started", tmp_path / "go"
    os.mkfifo(started)
    os.mkfifo(go)
    cc = script(tmp_path, f'echo up > "{started}"; read x < "{go}"; exec clang "$@"')
    result = run_python(
        f"""
        import os, threading
        from aiotinyrt.host import ccprocess
        runner = ccprocess.CCProcess([{cc!r}, "-c", "-x", "c", "-"])
        src = b"// " + b"x" * 300_000 + b"\\nvoid k(int *o) {{ o[0] = 1; }}\\n"  # more than a pipe holds
        results = []
        os.environ["CC_STANDBY"] = "0"
        worker = threading.Thread(target=lambda: results.append(runner.run(src, 30, ccprocess.Job())))
        worker.start()
        open({str(started)!r}).read()  # the compiler is up; the worker is writing its stdin
        hold_r, hold_w = os.pipe()
        child = os.fork()
        if child == 0:  # lives until the parent's compile is over
            os.close(hold_w)
            os.read(hold_r, 1)
            os._exit(0)
        with open({str(go)!r}, "w") as f:
            f.write("go\\n")
        worker.join()
        os.write(hold_w, b"x")
        os.waitpid(child, 0)
        print(results[0].timed_out, results[0].returncode, results[0].output[:4] == b"\\x7fELF")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "0", "True"], result.stdout


def test_a_process_that_died_while_waiting_is_not_blamed_on_the_next_compile() -> None:
    runner = ccprocess.CCProcess(["clang", "-c", "-x", "c", "-"])
    try:
        runner._refill()
        started = runner._standby
        assert started is not None
        started.proc.kill()
        started.proc.wait()
        result = runner.run(b"void k(int *o) { o[0] = 1; }", 60, ccprocess.Job())
        assert result.returncode == 0 and result.output[:4] == b"\x7fELF"
    finally:
        runner.close()
