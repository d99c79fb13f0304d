"""The CPU backend: C kernels through clang and cffi, the calling convention, launch validation."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiotinyrt import Buffer, Device, dtypes
from aiotinyrt.backends.ops_cpu import CPUProgram
from tests.helpers import INC, int_buffer

pytestmark = pytest.mark.anyio

ADD = """
void add(float* restrict out, const float* restrict a, const float* restrict b, int n) {
  for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
}
"""

VALS = """
void vals(int* restrict out, int a, int b, int c, int d) {
  out[0] = a; out[1] = b; out[2] = c; out[3] = d;
}
"""

#: Three buffers, one int: checks buffer order as well as vals.
AXPY = """
void axpy(float* restrict out, const float* restrict x, const float* restrict y, int n, int k) {
  for (int i = 0; i < n; i++) out[i] = (float)k * x[i] + y[i];
}
"""


async def test_add_kernel_runs_on_cpu() -> None:
    dev = Device["CPU"]
    prog = await dev.program("add", ADD)
    a = await Buffer("CPU", 8, dtypes.float32).allocate()
    b = await Buffer("CPU", 8, dtypes.float32).allocate()
    out = await Buffer("CPU", 8, dtypes.float32).allocate()
    await a.copyin(np.arange(8, dtype=np.float32))
    await b.copyin(np.full(8, 2, dtype=np.float32))
    secs = await dev.run(prog, out, a, b, vals=(8,))
    assert isinstance(secs, float) and secs >= 0
    assert (await out.numpy()).tolist() == [float(i + 2) for i in range(8)]
    for buf in (a, b, out):
        await buf.free()


async def test_int_vals_follow_the_buffers_as_32_bit_ints() -> None:
    dev = Device["CPU"]
    prog = await dev.program("vals", VALS)
    out = await int_buffer("CPU", 0, size=4)
    await dev.run(prog, out, vals=(2**31 - 1, -(2**31), -1, 7))
    assert (await out.numpy()).tolist() == [2**31 - 1, -(2**31), -1, 7]
    await dev.run(prog, out, vals=[1, 2, 3, 4])  # any sequence of ints
    assert (await out.numpy()).tolist() == [1, 2, 3, 4]
    await out.free()


async def test_buffers_are_passed_in_order_before_the_vals() -> None:
    dev = Device["CPU"]
    prog = await dev.program("axpy", AXPY)
    x = await Buffer("CPU", 4, dtypes.float32).allocate()
    y = await Buffer("CPU", 4, dtypes.float32).allocate()
    out = await Buffer("CPU", 4, dtypes.float32).allocate()
    await x.copyin(np.array([1, 2, 3, 4], np.float32))
    await y.copyin(np.array([10, 20, 30, 40], np.float32))
    await dev.run(prog, out, x, y, vals=(3, 5))  # n=3: the last element stays untouched
    result = (await out.numpy()).tolist()
    assert result[:3] == [15.0, 30.0, 45.0]
    for buf in (x, y, out):
        await buf.free()


async def test_raw_c_kernel_is_called_once_and_refuses_a_global_size_it_would_ignore() -> None:
    dev = Device["CPU"]
    prog = await dev.program("inc", INC)
    out = await int_buffer("CPU")
    with pytest.raises(ValueError, match="runs once per launch"):
        prog(out, global_size=(16, 4, 2))
    await dev.run(prog, out, global_size=(1, 1, 1), local_size=(4, 1, 1))
    assert (await out.numpy()).tolist() == [1]
    await out.free()


async def test_program_from_a_binary_runs_without_its_source() -> None:
    dev = Device["CPU"]
    lib = await dev.compiler.compile_cached(INC)
    prog = dev.runtime("inc", lib)
    assert isinstance(prog, CPUProgram)
    assert prog.buf_count is None  # unknown without the source: not checked
    out = await int_buffer("CPU")
    await dev.run(prog, out)
    assert (await out.numpy()).tolist() == [1]
    await out.free()


async def test_loading_leaves_no_file_behind_and_maps_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dev = Device["CPU"]
    name = f"k_{uuid.uuid4().hex}"
    prog = await dev.program(name, f"void {name}(int* restrict out) {{ out[0] = 5; }}")
    out = await int_buffer("CPU")
    await dev.run(prog, out)
    assert (await out.numpy()).tolist() == [5]
    assert list(tmp_path.iterdir()) == []  # the compiler's scratch directory is gone
    assert name not in Path("/proc/self/maps").read_text()  # loaded into an anonymous arena
    await out.free()


async def test_two_programs_with_the_same_name_load_their_own_code() -> None:
    dev = Device["CPU"]
    one = await dev.program("same", "void same(int* restrict out) { out[0] = 1; }")
    two = await dev.program("same", "void same(int* restrict out) { out[0] = 2; }")
    out = await int_buffer("CPU")
    await dev.run(one, out)
    assert (await out.numpy()).tolist() == [1]
    await dev.run(two, out)
    assert (await out.numpy()).tolist() == [2]
    await out.free()


def test_program_loading_validates_name_and_binary() -> None:
    dev = Device["CPU"]
    with pytest.raises(ValueError, match="identifier"):
        dev.runtime("not a name", b"\x7fELF")
    with pytest.raises(TypeError, match="bytes"):
        dev.runtime("k", "source text")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        dev.runtime("k", b"")


def test_a_binary_that_fails_to_load_raises_value_error_with_the_loaders_reason() -> None:
    # in a fresh process: the first load failure of a process is the one that matters
    code = (
        "from aiotinyrt import Device\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        Device['CPU'].runtime('k', b'definitely not a shared object')\n"
        "    except ValueError as exc:\n"
        "        print('ValueError:', exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    assert all(line.startswith("ValueError: cannot load 'k': ") for line in lines)
    assert all(len(line) > len("ValueError: cannot load 'k': ") for line in lines)  # a reason


async def test_loading_a_binary_without_the_named_function_raises() -> None:
    dev = Device["CPU"]
    lib = await dev.compiler.compile_cached(INC)
    with pytest.raises(ValueError, match="no function named 'missing'"):
        dev.runtime("missing", lib)


# ---- launch validation: nothing is enqueued ----------------------------------------------------


@pytest.fixture
def submitted() -> Any:
    """Snapshot of CPU's compute-queue submissions, to prove a bad launch enqueued nothing."""
    timeline = Device["CPU"]._compute_queue.timeline
    start = timeline.submitted
    return lambda: timeline.submitted - start


@pytest.mark.parametrize(
    "vals",
    [(1.0, 2, 3, 4), (True, 2, 3, 4), ("1", 2, 3, 4), (np.int32(1), 2, 3, 4), (None, 2, 3, 4)],
    ids=["float", "bool", "str", "numpy-int", "None"],
)
async def test_non_int_vals_raise_type_error(vals: tuple[Any, ...], submitted: Any) -> None:
    prog = await Device["CPU"].program("vals", VALS)
    out = await int_buffer("CPU", 0, size=4)
    with pytest.raises(TypeError, match="int"):
        prog(out, vals=vals)
    assert submitted() == 0
    await out.free()


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**40])
async def test_vals_outside_int32_raise_value_error(bad: int, submitted: Any) -> None:
    prog = await Device["CPU"].program("vals", VALS)
    out = await int_buffer("CPU", 0, size=4)
    with pytest.raises(ValueError, match="32-bit"):
        prog(out, vals=(bad, 0, 0, 0))
    assert submitted() == 0
    await out.free()


async def test_vals_must_be_a_sequence(submitted: Any) -> None:
    prog = await Device["CPU"].program("vals", VALS)
    out = await int_buffer("CPU", 0, size=4)
    with pytest.raises(TypeError, match="sequence"):
        prog(out, vals=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence"):
        prog(out, vals="1234")  # type: ignore[arg-type]
    assert submitted() == 0
    await out.free()


async def test_wrong_number_of_buffers_or_vals_for_a_known_source_raises_type_error(submitted: Any) -> None:
    prog = await Device["CPU"].program("add", ADD)
    bufs = [await Buffer("CPU", 4, dtypes.float32).allocate() for _ in range(4)]
    with pytest.raises(TypeError, match="takes 3 buffers, got 4"):
        prog(*bufs, vals=(4,))
    with pytest.raises(TypeError, match="takes 3 buffers, got 2"):
        prog(*bufs[:2], vals=(4,))
    with pytest.raises(TypeError, match="takes 1 int vals, got 0"):
        prog(*bufs[:3])
    with pytest.raises(TypeError, match="takes 1 int vals, got 2"):
        prog(*bufs[:3], vals=(4, 4))
    assert submitted() == 0
    for b in bufs:
        await b.free()


async def test_buffer_of_another_device_raises_value_error(submitted: Any) -> None:
    prog = await Device["CPU"].program("inc", INC)
    foreign = await int_buffer("CPU:1")
    with pytest.raises(ValueError, match=r"CPU:1.*copy_from"):
        prog(foreign)
    null = await Buffer("NULL", 1, dtypes.int32).allocate()
    with pytest.raises(ValueError, match="NULL"):
        prog(null)
    assert submitted() == 0
    await foreign.free()
    await null.free()


async def test_non_buffer_arguments_raise_type_error(submitted: Any) -> None:
    prog = await Device["CPU"].program("inc", INC)
    with pytest.raises(TypeError, match="Buffer"):
        prog(np.zeros(1, np.int32))  # type: ignore[arg-type]
    assert submitted() == 0


@pytest.mark.parametrize(
    ("global_size", "error"),
    [
        ((0, 1, 1), ValueError),
        ((1, 1, 1, 1), ValueError),
        (4, TypeError),
        ((2.0, 1, 1), TypeError),
        ((), ValueError),
    ],
)
async def test_bad_launch_sizes_raise(global_size: Any, error: type[Exception], submitted: Any) -> None:
    prog = await Device["CPU"].program("inc", INC)
    out = await int_buffer("CPU")
    with pytest.raises(error):
        prog(out, global_size=global_size)
    with pytest.raises(error):
        prog(out, local_size=global_size)
    assert submitted() == 0
    await out.free()


async def test_wait_for_must_hold_signals(submitted: Any) -> None:
    prog = await Device["CPU"].program("inc", INC)
    out = await int_buffer("CPU")
    with pytest.raises(TypeError, match="Signal"):
        prog(out, wait_for=[1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="writes"):
        prog(out, writes=(1,))
    assert submitted() == 0
    await out.free()


def test_cpu_device_reports_one_device_per_core() -> None:
    assert Device["CPU"].count() == (os.cpu_count() or 1)
