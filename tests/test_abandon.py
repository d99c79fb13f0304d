"""Work that never finishes: closing and exiting with a command still running.

A kernel that never returns keeps writing into its buffer. Freeing that buffer (explicitly, by
leaving ``async with Buffer``, or by dropping it at interpreter exit), closing its device, exiting
the interpreter and pressing Ctrl-C must neither crash (the memory stays mapped: the command is
abandoned with its memory kept) nor hang (closing is bounded). Each case runs in a subprocess
with a bounded timeout (a hang is a failure, not a stuck suite), on asyncio, trio and uvloop and
on both workers (the C ring and the pure-Python one, ``NATIVE_QUEUE=0``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import LOOPS, WORKERS

pytestmark = pytest.mark.slow  # subprocesses waiting out bounded closes

ROOT = Path(__file__).resolve().parent.parent


#: Sets ``started[0]``, then writes every 1024th int of ``out[0..n)`` over and over for ``ms``
#: milliseconds: memory unmapped while it runs is a SIGSEGV within microseconds.
SCRIBBLE = """
#include <time.h>
void scribble(volatile int* restrict out, volatile int* restrict started, int n, int ms) {
  struct timespec t0, t;
  started[0] = 1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do {
    for (int i = 0; i < n; i += 1024) out[i] += 1;
    clock_gettime(CLOCK_MONOTONIC, &t);
  } while ((t.tv_sec - t0.tv_sec) * 1000LL + (t.tv_nsec - t0.tv_nsec) / 1000000LL < ms);
}
"""

SCRIPT = """
import sys

import anyio
import anyio.lowlevel

import aiotinyrt as rt
from aiotinyrt import Buffer, Device, dtypes

SCRIBBLE = {scribble!r}
N = 1 << 22  # 16 MiB: past the cache's reach of nothing, a real mapping
FOREVER = 600_000  # ms
kept = []


async def launch(prog, buf):
    # launch the scribbler on buf; return once it runs (a flag it sets, polled)
    flag = await Buffer(buf.device, 1, dtypes.int32).allocate()
    started = (await flag.as_memoryview()).cast("i")
    started[0] = 0
    prog(buf, flag, vals=(N, FOREVER), writes=(0,))
    while not started[0]:
        await anyio.lowlevel.checkpoint()
    kept.append((flag, started))


async def stuck(dev):
    prog = await dev.program("scribble", SCRIBBLE)
    buf = await Buffer(dev.name, N, dtypes.int32).allocate()
    await launch(prog, buf)
    return prog, buf


async def main(case):
    if case == "exit_after_free":
        prog, buf = await stuck(Device["CPU"])
        await buf.free()
    elif case == "exit_after_async_with":
        dev = Device["CPU"]
        prog = await dev.program("scribble", SCRIBBLE)
        async with Buffer("CPU", N, dtypes.int32) as buf:
            await launch(prog, buf)
    elif case == "exit_never_freed":
        kept.append(await stuck(Device["CPU"]))
    elif case == "open_device":
        async with rt.open_device("CPU:1") as dev:
            prog, buf = await stuck(dev)
            await buf.free()
        print("closed", dev.closed, flush=True)
        del prog, buf
    elif case == "free_after_close":
        async with rt.open_device("CPU:1") as dev:
            prog, buf = await stuck(dev)
        await buf.free()  # after the close that abandoned its kernel
        del prog, buf
        print("closed", dev.closed, flush=True)
    elif case == "aclose_cancelled":
        dev = Device["CPU:1"]
        prog, buf = await stuck(dev)
        with anyio.move_on_after(0.2):
            await dev.aclose()
        print("closed", dev.closed, flush=True)
        await buf.free()
    elif case == "sigint":
        dev = Device["CPU:1"]
        prog, buf = await stuck(dev)
        await buf.free()
        print("closing", flush=True)
        await dev.aclose()
        print("closed", dev.closed, flush=True)
    print("done", flush=True)


backend = sys.argv[1]
options = {{"use_uvloop": True}} if backend == "uvloop" else {{}}
anyio.run(main, sys.argv[2], backend="asyncio" if backend == "uvloop" else backend, backend_options=options)
"""


def start(loop: str, worker: str, case: str, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT.format(scribble=SCRIBBLE), loop, case],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONDONTWRITEBYTECODE": "1",
            "EXIT_JOIN_S": "0.2",
            "NATIVE_QUEUE": "1" if worker == "native" else "0",
            **env,
        },
    )


def run(loop: str, worker: str, case: str, **env: str) -> tuple[int, str, str]:
    proc = start(loop, worker, case, **env)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{case} hung (killed after 60 s); stdout {out!r} stderr {err!r}")
    return proc.returncode, out, err


def assert_one_warning_naming_the_kernel(err: str) -> None:
    lines = [line for line in err.splitlines() if "aiotinyrt" in line]
    assert len(lines) == 1, err
    assert "CPU" in lines[0] and "scribble" in lines[0] and "abandoned" in lines[0], err
    assert "Traceback" not in err, err


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("case", ["exit_after_free", "exit_after_async_with", "exit_never_freed"])
def test_exit_with_a_kernel_writing_its_memory_keeps_the_memory_and_exits_cleanly(
    case: str, loop: str, worker: str
) -> None:
    code, out, err = run(loop, worker, case)
    assert code == 0, f"exit status {code} (< 0: killed by that signal); stderr {err!r}"
    assert out == "done\n"
    assert_one_warning_naming_the_kernel(err)


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("case", ["open_device", "free_after_close"])
def test_leaving_open_device_with_a_kernel_that_never_returns_is_bounded(
    loop: str, worker: str, case: str
) -> None:
    code, out, err = run(loop, worker, case, CLOSE_TIMEOUT_S="0.3")
    assert code == 0, f"exit status {code} (< 0: killed by that signal); stderr {err!r}"
    assert out == "closed True\ndone\n"
    assert_one_warning_naming_the_kernel(err)


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("loop", LOOPS)
def test_cancelling_aclose_closes_at_once(loop: str, worker: str) -> None:
    code, out, err = run(loop, worker, "aclose_cancelled", CLOSE_TIMEOUT_S="600")
    assert code == 0, f"exit status {code} (< 0: killed by that signal); stderr {err!r}"
    assert out == "closed True\ndone\n"
    assert_one_warning_naming_the_kernel(err)


@pytest.mark.parametrize("worker", WORKERS)
@pytest.mark.parametrize("loop", LOOPS)
def test_one_ctrl_c_ends_a_program_closing_a_device_with_a_stuck_kernel(loop: str, worker: str) -> None:
    proc = start(loop, worker, "sigint", CLOSE_TIMEOUT_S="600")
    assert proc.stdout is not None
    assert proc.stdout.readline() == "closing\n"
    proc.send_signal(signal.SIGINT)  # once
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"one Ctrl-C did not end the program; stderr {err!r}")
    # the interrupt ends it as an interrupt: KeyboardInterrupt's exit status, not a crash
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT, 1), (
        f"exit status {proc.returncode}: {err}"
    )
    assert out == ""
    assert err.count("abandoned") == 1 and "scribble" in err, err
    assert "KeyboardInterrupt" in err, err
    assert "Segmentation" not in err and "Fatal Python error" not in err, err
