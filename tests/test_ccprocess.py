"""The C compiler process started ahead of time (aiotinyrt/host/ccprocess.py): the next compile
uses it, gcc (which writes its object to a file) works the same way, a kill reaches what the
compiler started, cancellation kills the compile, and neither exit nor fork leaves a compiler
behind or takes the parent's."""

from __future__ import annotations

import os
import select
import shutil
import stat
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import anyio
import pytest

from aiotinyrt import CompileError
from aiotinyrt.backends.ops_cpu import ClangCompiler
from aiotinyrt.host import ccprocess, elf
from tests.helpers import INC

pytestmark = pytest.mark.anyio


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


def standby_pid(compiler: ClangCompiler) -> int | None:
    started = compiler._process._standby
    return None if started is None else started.proc.pid


async def test_the_next_compile_takes_the_process_started_ahead_of_it() -> None:
    compiler = ClangCompiler(["clang"])
    first = await compiler.compile(fresh_inc())
    waiting = standby_pid(compiler)
    assert waiting is not None and alive(waiting)
    second = await compiler.compile(fresh_inc())
    assert elf.parse(first) and elf.parse(second)
    with pytest.raises(ChildProcessError):
        os.waitpid(waiting, os.WNOHANG)  # it ran this compile and was reaped
    assert standby_pid(compiler) not in (None, waiting)  # and the next one is waiting


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
async def test_gcc_writes_its_object_to_a_file_and_leaves_none_behind() -> None:
    compiler = ClangCompiler(["gcc"])
    assert not compiler._process.to_stdout
    for _ in range(3):
        lib = await compiler.compile(fresh_inc())
        assert lib[:4] == b"\x7fELF" and elf.parse(lib)
    folder = compiler._process._dir
    assert folder is not None
    assert os.listdir(folder) == []  # each object read and removed; the waiting gcc wrote none yet
    with pytest.raises(CompileError, match="exited with status 1") as info:
        await compiler.compile("this is not C")
    assert "error" in info.value.diagnostics


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


async def test_a_cancelled_compile_kills_its_compiler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fifo = tmp_path / "pid"
    os.mkfifo(fifo)
    cc = script(tmp_path, f'cat > /dev/null; echo $$ > "{fifo}"; exec sleep 60')
    monkeypatch.setenv("CC_STANDBY", "0")
    compiler = ClangCompiler([cc])
    async with anyio.create_task_group() as tg:
        tg.start_soon(compiler.compile, fresh_inc())
        pid = int(await anyio.to_thread.run_sync(fifo.read_text))  # it has its source
        tg.cancel_scope.cancel()
    assert await gone(pid)


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )


def test_exit_kills_the_waiting_compiler() -> None:
    result = run_python(
        """
        import anyio
        from aiotinyrt.backends.ops_cpu import ClangCompiler
        c = ClangCompiler(["clang"])
        anyio.run(c.compile, "void k(int *o) { o[0] = 1; }")
        print(c._process._standby.proc.pid)
        """
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    pid = int(result.stdout)
    assert not alive(pid)  # killed and reaped before the interpreter went


def test_a_forked_child_starts_its_own_compiler_and_leaves_the_parents_alone() -> None:
    result = run_python(
        """
        import os, anyio
        from aiotinyrt.backends.ops_cpu import ClangCompiler
        c = ClangCompiler(["clang"])
        anyio.run(c.compile, "void k(int *o) { o[0] = 1; }")
        parents = c._process._standby.proc.pid
        child = os.fork()
        if child == 0:
            lib = anyio.run(c.compile, "void k(int *o) { o[0] = 2; }")
            mine = c._process._standby.proc.pid
            os._exit(0 if lib[:4] == b"\\x7fELF" and mine != parents else 3)
        _, status = os.waitpid(child, 0)
        os.kill(parents, 0)  # still there: the child neither used nor killed it
        assert c._process._standby.proc.pid == parents
        lib = anyio.run(c.compile, "void k(int *o) { o[0] = 3; }")
        print(os.waitstatus_to_exitcode(status), lib[:4] == b"\\x7fELF")
        """
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.split() == ["0", "True"]


def test_a_process_that_died_while_waiting_is_not_blamed_on_the_next_compile() -> None:
    runner = ccprocess.CCProcess(["clang", "-c", "-x", "c", "-"], to_stdout=True)
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
