"""The CL compile-server pool (aiotinyrt/backends/cl_build.py): which server a build runs on,
servers warmed before they take a build, a server that cannot start. Fake servers stand in for
the processes where the test steers their timing; the last test runs real ones."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from aiotinyrt import CompileError
from aiotinyrt.backends import cl_build


class FakeProc:
    """What the pool reads of a server's process."""

    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


class FakeServer:
    """A server whose builds (all but the warm-up) wait for ``gate`` when one is given."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.proc = FakeProc()
        self.built: list[str] = []
        self.gate = gate
        self.entered = threading.Event()  # set when a build other than the warm-up began
        self.closed = False

    def build(self, src: str) -> bytes:
        self.built.append(src)
        if src != cl_build.WARM:
            self.entered.set()
            if self.gate is not None:
                assert self.gate.wait(60)
        return src.encode()

    def close(self) -> None:
        self.closed = True


def _run(pool: cl_build.BuildPool, src: str, out: dict[str, bytes | BaseException]) -> threading.Thread:
    def target() -> None:
        try:
            out[src] = pool.build(src)
        except BaseException as exc:
            out[src] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_a_build_that_finds_every_server_busy_takes_the_first_one_freed_while_a_new_one_starts() -> None:
    pool = cl_build.BuildPool(0, size=2)
    free_first, let_second_start, second_starting = threading.Event(), threading.Event(), threading.Event()
    first, made = FakeServer(gate=free_first), []

    def new_server() -> FakeServer:
        if made:  # the second start is slow: a cold server is ~4 builds of CPU (LLVM's start-up)
            second_starting.set()
            assert let_second_start.wait(60)
        made.append(first if not made else FakeServer())
        return made[-1]

    pool._new_server = new_server  # type: ignore[method-assign]
    out: dict[str, bytes | BaseException] = {}
    try:
        a = _run(pool, "a", out)
        assert first.entered.wait(60)  # "a" holds the only server
        b = _run(pool, "b", out)
        assert second_starting.wait(60)  # "b" found no idle server: a second one starts
        free_first.set()
        b.join(60)
        assert not b.is_alive(), "the build waited for the new server, not the one freed first"
        a.join(60)
        assert out == {"a": b"a", "b": b"b"} and first.built == ["a", "b"]
    finally:
        free_first.set()
        let_second_start.set()
    pool.start()  # the second server, started while the first was busy, comes up warmed
    assert len(made) == 2 and made[1].built == [cl_build.WARM]
    assert sorted(map(id, pool._idle)) == sorted(map(id, made))
    pool.close()
    assert all(server.closed for server in made)


def test_a_build_with_no_server_to_wait_for_starts_one_itself_without_the_warm_up() -> None:
    pool = cl_build.BuildPool(0, size=2)
    made: list[FakeServer] = []
    pool._new_server = lambda: made.append(FakeServer()) or made[-1]  # type: ignore[method-assign]
    assert pool.build("k") == b"k" and pool.build("l") == b"l"  # one server, reused
    assert len(made) == 1 and made[0].built == ["k", "l"]
    pool.close()


def test_a_server_that_cannot_start_fails_the_build_with_a_compile_error_and_a_later_build_retries() -> None:
    pool = cl_build.BuildPool(0, size=2)
    starts = []

    def new_server() -> FakeServer:
        starts.append(1)
        if len(starts) == 1:
            raise OSError("no such interpreter")
        return FakeServer()

    pool._new_server = new_server  # type: ignore[method-assign]
    with pytest.raises(CompileError, match=r"CL:0: a compile server could not start: no such interpreter"):
        pool.build("k")
    assert pool.build("k") == b"k"  # the next build starts a server again
    pool.close()


def test_a_build_after_close_still_runs_on_a_server_of_its_own_that_is_then_closed() -> None:
    pool = cl_build.BuildPool(0, size=1)
    made: list[FakeServer] = []
    pool._new_server = lambda: made.append(FakeServer()) or made[-1]  # type: ignore[method-assign]
    pool.close()
    assert pool.build("k") == b"k"
    assert len(made) == 1 and made[0].closed and pool._idle == []


def test_start_readies_real_servers_and_two_builds_at_once_run_in_two_processes() -> None:
    pool = cl_build.BuildPool(0, size=2)
    try:
        pool.start()
        servers = list(pool._idle)
        assert len(servers) == 2 and len({s.proc.pid for s in servers} | {os.getpid()}) == 3
        kernel = "__kernel void k{0}(__global int* a) {{ a[0] = {0}; }}"
        out: dict[str, bytes | BaseException] = {}
        threads = [_run(pool, kernel.format(i), out) for i in range(2)]
        for thread in threads:
            thread.join(120)
        assert all(isinstance(lib, bytes) and lib for lib in out.values()) and len(out) == 2
        assert sorted(map(id, pool._idle)) == sorted(map(id, servers))  # no third server
    finally:
        pool.close()
    assert all(s.proc.poll() is not None for s in servers)


class CountedCondition(threading.Condition):
    """A condition that sets ``waited[n]`` when ``wait`` is called for the n-th time."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = [threading.Event() for _ in range(8)]
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.waited[min(self.waits, 7)].set()
        return super().wait(timeout)


def test_a_server_that_fails_to_start_while_another_is_busy_leaves_the_build_to_the_busy_one() -> None:
    pool = cl_build.BuildPool(0, size=2)
    pool._cond = cond = CountedCondition()
    free_first, calls = threading.Event(), []
    first = FakeServer(gate=free_first)

    def new_server() -> FakeServer:
        calls.append(1)
        if len(calls) == 1:
            return first
        raise OSError("out of processes")

    pool._new_server = new_server  # type: ignore[method-assign]
    out: dict[str, bytes | BaseException] = {}
    a = _run(pool, "a", out)  # (the first server is the build's own: no wait)
    assert first.entered.wait(60)
    b = _run(pool, "b", out)
    assert cond.waited[2].wait(60)  # "b" waited, woke to the failed start, and waits again
    for thread in threading.enumerate():
        if thread.name == "CL:0 compile server start":
            thread.join(60)
    assert len(calls) == 2  # the failed start is not retried while a server can take the build
    free_first.set()
    a.join(60)
    b.join(60)
    assert out == {"a": b"a", "b": b"b"} and first.built == ["a", "b"]
    with pytest.raises(CompileError, match="could not start: out of processes"):
        pool.start()  # (start() reports it)
    pool.close()


def test_a_server_whose_parent_stopped_reading_exits_quietly() -> None:
    proc = subprocess.Popen(
        cl_build.server_argv(0), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    data = cl_build.WARM.encode()
    proc.stdout.close()  # (a parent gone while its build ran: the reply has no reader)
    proc.stdin.write(len(data).to_bytes(4, "little") + data)
    proc.stdin.close()
    assert proc.wait(120) == 0
    assert proc.stderr.read() == b""
    proc.stderr.close()


class WarmedServer(FakeServer):
    """A fake server that sets ``warmed`` once its warm-up build ran."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__(gate)
        self.warmed = threading.Event()

    def build(self, src: str) -> bytes:
        if src == cl_build.WARM:
            self.warmed.set()
        return super().build(src)


def test_start_replaces_a_server_that_died_while_it_waited() -> None:
    """start() waits for the pool to hold n idle servers: one dying meanwhile is replaced (it
    waited forever for an idle server that could no longer come)."""
    pool = cl_build.BuildPool(0, size=2)
    die, made, second_made = threading.Event(), [], threading.Event()

    class Dying(FakeServer):
        def build(self, src: str) -> bytes:
            super().build(src)
            raise CompileError("the server exited during the build")

    dying = Dying(gate=die)

    def new_server() -> FakeServer:
        made.append(dying if not made else WarmedServer())
        if len(made) == 2:
            second_made.set()
        return made[-1]

    pool._new_server = new_server  # type: ignore[method-assign]
    out: dict[str, bytes | BaseException] = {}
    a = _run(pool, "a", out)  # (on a server of its own, which dies when let go)
    assert dying.entered.wait(60)
    starting = threading.Thread(target=pool.start, daemon=True)
    starting.start()
    assert second_made.wait(60) and made[1].warmed.wait(60)  # type: ignore[attr-defined]
    die.set()
    a.join(60)
    starting.join(30)
    assert not starting.is_alive() and len(pool._idle) == 2
    assert out == {"a": b"a"} and len(made) == 3
    pool.close()


def test_a_failed_background_start_does_not_stop_the_pool_from_growing_for_good() -> None:
    """After a start that failed once, a later build may start a server again (retry_s later;
    0 here): builds do not all queue on the one server left for the life of the pool."""
    pool = cl_build.BuildPool(0, size=4)
    pool.retry_s = 0.0
    free, made = threading.Event(), []

    def new_server() -> FakeServer:
        made.append(1)
        if len(made) == 1:
            return FakeServer(gate=free)  # busy until the end of the test
        if len(made) == 2:
            raise OSError("fork: EAGAIN")  # once
        return FakeServer()

    pool._new_server = new_server  # type: ignore[method-assign]
    out: dict[str, bytes | BaseException] = {}
    a = _run(pool, "a", out)
    b = _run(pool, "b", out)
    b.join(30)
    assert out.get("b") == b"b" and "a" not in out  # b ran beside a, on a server started again
    free.set()
    a.join(60)
    pool.close()


def test_builds_waiting_when_the_pool_closes_fail_and_start_no_servers() -> None:
    pool = cl_build.BuildPool(0, size=1)
    free, made = threading.Event(), []
    first = FakeServer(gate=free)
    pool._new_server = lambda: made.append(first if not made else FakeServer()) or made[-1]  # type: ignore[method-assign]
    pool._cond = cond = CountedCondition()
    out: dict[str, bytes | BaseException] = {}
    a = _run(pool, "a", out)
    assert first.entered.wait(60)
    waiting = [_run(pool, f"w{i}", out) for i in range(3)]
    assert cond.waited[3].wait(60)  # (all three wait for the one server)
    pool.close()
    for thread in waiting:
        thread.join(30)
    assert all(isinstance(out[f"w{i}"], CompileError) for i in range(3)) and len(made) == 1
    free.set()
    a.join(60)
    assert out["a"] == b"a" and made[0].closed


def test_start_on_a_closed_pool_starts_nothing() -> None:
    pool = cl_build.BuildPool(0, size=2)
    made: list[FakeServer] = []
    pool._new_server = lambda: made.append(FakeServer()) or made[-1]  # type: ignore[method-assign]
    pool.close()
    pool.start()
    assert made == [] and pool._count == 0


def _package_copy(root: Path) -> Path:
    """``root`` holding a copy of the aiotinyrt package (its built extension too)."""
    shutil.copytree(
        os.path.join(cl_build.PACKAGE_ROOT, "aiotinyrt"),
        root / "aiotinyrt",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return root


def test_a_server_runs_the_parent_s_copy_of_the_package_wherever_it_came_from(tmp_path: Path) -> None:
    """A parent that imported aiotinyrt from a directory put on ``sys.path`` at run time (no
    install, nothing on PYTHONPATH, run from elsewhere) gets servers running that same copy:
    each prints its process id from the copy's ``serve``, and the build succeeds."""
    root = _package_copy(tmp_path / "copy")
    module = root / "aiotinyrt" / "backends" / "cl_build.py"
    text = module.read_text()
    marker = 'def serve(index: int) -> None:\n    """'
    assert marker in text
    text = text.replace(
        marker,
        'def serve(index: int) -> None:\n    print("copy serves", os.getpid(), file=sys.stderr)\n    """',
    )
    module.write_text(text)
    parent = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); "
        "from aiotinyrt.backends import cl_build; pool = cl_build.BuildPool(0, size=1); "
        "print(cl_build.__file__, len(pool.build(cl_build.WARM)) > 0, os.getpid()); pool.close()"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", parent, str(root)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    where, built, pid = done.stdout.split()
    assert where == str(module) and built == "True"
    served = [line.split()[2] for line in done.stderr.splitlines() if line.startswith("copy serves ")]
    assert len(served) == 1 and served[0] != pid, done.stderr


def test_a_server_takes_nothing_but_the_package_from_the_package_s_directory(tmp_path: Path) -> None:
    """The package's directory may hold other modules (``site-packages`` does), some named as
    the standard library's (an old backport): the server imports aiotinyrt from there by its
    location and everything else from its usual path, so a ``dataclasses.py`` beside the package
    is never imported and the build succeeds."""
    root = _package_copy(tmp_path / "site")
    (root / "dataclasses.py").write_text('raise ImportError("the stale backport was imported")\n')
    proc = subprocess.Popen(
        cl_build.server_argv(0, str(root)),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    data = cl_build.WARM.encode()
    out, err = proc.communicate(len(data).to_bytes(4, "little") + data, timeout=120)
    assert proc.returncode == 0 and out[:1] == b"O", err.decode(errors="replace")
