"""Interpreter exit never hangs and never prints a traceback, whatever work is still queued."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import SPIN

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys
import time

import anyio
import numpy as np

from aiotinyrt import Buffer, Device, dtypes

SPIN = {spin!r}


async def main(launches: int, ms: int) -> None:
    dev = Device["CPU"]
    prog = await dev.program("spin_flagged", SPIN)
    out = await Buffer("CPU", 2, dtypes.int32).allocate()
    await out.copyin(np.zeros(2, np.int32))
    window = (await out.as_memoryview()).cast("i")  # (taken while nothing is pending)
    sigs = [prog(out, vals=(ms,)) for _ in range(launches)]
    deadline = time.monotonic() + 30
    while window[1] == 0 and time.monotonic() < deadline:
        pass  # until the worker runs the first spin: the exit below meets a running kernel
    done = sum(s.done() for s in sigs)
    print("queued", len(sigs), "done", done, "started", window[1], flush=True)


anyio.run(main, int(sys.argv[2]), int(sys.argv[3]), backend=sys.argv[1])
"""

#: SPIN that first sets out[1], so the script knows the kernel is running.
SPIN_FLAGGED = SPIN.replace("void spin(", "void spin_flagged(").replace(
    "  struct timespec t0, t;", "  __atomic_store_n(&out[1], 1, __ATOMIC_SEQ_CST);\n  struct timespec t0, t;"
)


def run_and_exit(backend: str, launches: int, ms: int) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the script (queue ``launches`` spins of ``ms`` ms, return without awaiting them)."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(spin=SPIN_FLAGGED), backend, str(launches), str(ms)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return result, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_exit_with_many_slow_launches_queued_is_prompt_and_quiet(backend: str) -> None:
    result, elapsed = run_and_exit(backend, launches=200, ms=200)  # 40 s of queued work
    assert result.returncode == 0, (
        f"exit status {result.returncode} (< 0: killed by that signal) {result.stderr}"
    )
    assert result.stdout.startswith("queued 200 done 0 started 1"), result.stdout
    assert result.stderr == ""
    assert elapsed < 20, f"exit took {elapsed:.1f} s"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_exit_while_a_long_kernel_runs_is_bounded(backend: str) -> None:
    result, elapsed = run_and_exit(backend, launches=1, ms=60_000)
    assert result.returncode == 0, (
        f"exit status {result.returncode} (< 0: killed by that signal) {result.stderr}"
    )
    assert result.stdout.startswith("queued 1 done 0 started 1"), result.stdout
    # the kernel is abandoned with its memory kept, and says so in one line
    assert result.stderr.count("\n") == 1 and "CPU/compute@1 (spin_flagged)" in result.stderr, result.stderr
    assert elapsed < 20, f"exit took {elapsed:.1f} s"
