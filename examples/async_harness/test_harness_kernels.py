"""Kernel tests in the async harness: each runs on every device and event loop (see conftest.py).

Every test compares a raw C kernel with a pure-Python reference. Buffers are opened with
``async with Buffer(...)`` so they are freed on every path; the ``no_leaks`` fixture fails a test
that forgets one.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import pytest

from aiotinyrt import Buffer, Compiled, CompileError, Device, Program, dtypes

pytestmark = pytest.mark.anyio

Load = Callable[[str, str], Awaitable[Program]]

ADD = """
void add(float* restrict out, const float* restrict a, const float* restrict b, int n) {
  for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
}
"""
SAXPY = """
void saxpy(float* restrict out, const float* restrict x, const float* restrict y, int n, int a) {
  for (int i = 0; i < n; i++) out[i] = (float)a * x[i] + y[i];
}
"""
RELU = """
void relu(float* restrict out, const float* restrict x, int n) {
  for (int i = 0; i < n; i++) out[i] = x[i] > 0.0f ? x[i] : 0.0f;
}
"""
MATMUL = """
void matmul(float* restrict c, const float* restrict a, const float* restrict b, int m, int k, int n) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float acc = 0.0f;
      for (int p = 0; p < k; p++) acc += a[i * k + p] * b[p * n + j];
      c[i * n + j] = acc;
    }
}
"""
SOFTMAX = """
#include <math.h>
void softmax(float* restrict out, const float* restrict x, int rows, int cols) {
  for (int r = 0; r < rows; r++) {
    const float* row = x + r * cols;
    float top = row[0], sum = 0.0f;
    for (int c = 1; c < cols; c++) top = row[c] > top ? row[c] : top;
    for (int c = 0; c < cols; c++) { out[r * cols + c] = expf(row[c] - top); sum += out[r * cols + c]; }
    for (int c = 0; c < cols; c++) out[r * cols + c] /= sum;
  }
}
"""
ARGMAX = """
void argmax(int* restrict out, const float* restrict x, int rows, int cols) {
  for (int r = 0; r < rows; r++) {
    int best = 0;
    for (int c = 1; c < cols; c++) if (x[r * cols + c] > x[r * cols + best]) best = c;
    out[r] = best;
  }
}
"""


# ---- helpers ---------------------------------------------------------------------------------------
def random_floats(n: int, seed: int) -> array[float]:
    rng = random.Random(seed)
    return array("f", [rng.uniform(-4.0, 4.0) for _ in range(n)])


def assert_close(got: Sequence[float], want: Sequence[float], tol: float = 1e-4) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(g, w, rel_tol=tol, abs_tol=tol), f"element {i}: got {g}, want {w}"


async def read(buf: Buffer, typecode: str = "f") -> array[Any]:
    out = array(typecode, bytes(buf.nbytes))
    await buf.copyout(memoryview(out).cast("B"))
    return out


async def run_add(device: Compiled, prog: Program, n: int, seed: int) -> None:
    a, b = random_floats(n, seed), random_floats(n, seed + 1)
    async with (
        Buffer(device.name, n, dtypes.float32) as ba,
        Buffer(device.name, n, dtypes.float32) as bb,
        Buffer(device.name, n, dtypes.float32) as out,
    ):
        await ba.copyin(a)
        await bb.copyin(b)
        await device.run(prog, out, ba, bb, vals=(n,))
        assert_close(await read(out), [x + y for x, y in zip(a, b, strict=True)])


# ---- one kernel per test, every device and loop -----------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 1000])
async def test_add(device: Compiled, program: Load, n: int) -> None:
    await run_add(device, await program("add", ADD), n, seed=n)


async def test_saxpy(device: Compiled, program: Load) -> None:
    prog = await program("saxpy", SAXPY)
    x, y = random_floats(257, 1), random_floats(257, 2)
    async with (
        Buffer(device.name, 257, dtypes.float32) as bx,
        Buffer(device.name, 257, dtypes.float32) as by,
        Buffer(device.name, 257, dtypes.float32) as out,
    ):
        await bx.copyin(x)
        await by.copyin(y)
        await device.run(prog, out, bx, by, vals=(257, -3))
        assert_close(await read(out), [-3 * a + b for a, b in zip(x, y, strict=True)])


async def test_relu_in_place(device: Compiled, program: Load) -> None:
    prog = await program("relu", RELU)
    x = random_floats(100, 3)
    async with Buffer(device.name, 100, dtypes.float32) as buf:
        await buf.copyin(x)
        await device.run(prog, buf, buf, vals=(100,))
        assert_close(await read(buf), [max(v, 0.0) for v in x])


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (3, 5, 2), (16, 64, 10)])
async def test_matmul(device: Compiled, program: Load, m: int, k: int, n: int) -> None:
    prog = await program("matmul", MATMUL)
    a, b = random_floats(m * k, 4), random_floats(k * n, 5)
    want = [sum(a[i * k + p] * b[p * n + j] for p in range(k)) for i in range(m) for j in range(n)]
    async with (
        Buffer(device.name, m * k, dtypes.float32) as ba,
        Buffer(device.name, k * n, dtypes.float32) as bb,
        Buffer(device.name, m * n, dtypes.float32) as bc,
    ):
        await ba.copyin(a)
        await bb.copyin(b)
        await device.run(prog, bc, ba, bb, vals=(m, k, n), writes=(0,))
        assert_close(await read(bc), want, tol=1e-3)


async def test_softmax_then_argmax(device: Compiled, program: Load) -> None:
    """Two kernels in a row, the second reading what the first wrote: ordered by the runtime,
    only the result is awaited."""
    softmax, argmax = await program("softmax", SOFTMAX), await program("argmax", ARGMAX)
    rows, cols = 8, 10
    x = random_floats(rows * cols, 6)
    async with (
        Buffer(device.name, rows * cols, dtypes.float32) as bx,
        Buffer(device.name, rows * cols, dtypes.float32) as probs,
        Buffer(device.name, rows, dtypes.int32) as classes,
    ):
        await bx.copyin(x)
        softmax(probs, bx, vals=(rows, cols), writes=(0,))
        await device.run(argmax, classes, probs, vals=(rows, cols), writes=(0,))
        got_probs, got_classes = await read(probs), await read(classes, "i")
    for r in range(rows):
        row = x[r * cols : (r + 1) * cols]
        exps = [math.exp(v - max(row)) for v in row]
        assert_close(got_probs[r * cols : (r + 1) * cols], [e / sum(exps) for e in exps])
        assert got_classes[r] == max(range(cols), key=row.__getitem__)


async def test_compile_error_names_the_problem(device: Compiled) -> None:
    with pytest.raises(CompileError) as info:
        await device.program("broken", "void broken(float* out) { out[0] = undefined_name; }")
    assert "undefined_name" in str(info.value) + info.value.diagnostics


# ---- many kernels at once on one shared device ----------------------------------------------------
async def test_many_kernels_concurrently(device: Compiled, program: Load) -> None:
    """64 independent checks as concurrent tasks on the same device: their launches and copies
    interleave on its queues, and each still sees only its own data."""
    add, saxpy = await program("add", ADD), await program("saxpy", SAXPY)
    results: list[int] = []

    async def check_saxpy(seed: int) -> None:
        n = 1 + seed * 13 % 300
        x, y = random_floats(n, seed), random_floats(n, seed + 100)
        async with (
            Buffer(device.name, n, dtypes.float32) as bx,
            Buffer(device.name, n, dtypes.float32) as by,
        ):
            await bx.copyin(x)
            await by.copyin(y)
            saxpy(by, bx, by, vals=(n, seed % 5), writes=(0,))  # in place: ordered before the read
            assert_close(await read(by), [(seed % 5) * a + b for a, b in zip(x, y, strict=True)])
        results.append(seed)

    async def check_add(seed: int) -> None:
        await run_add(device, add, 1 + seed % 97, seed)
        results.append(seed)

    async with anyio.create_task_group() as tg:
        for seed in range(64):
            tg.start_soon(check_saxpy if seed % 2 else check_add, seed)
    assert sorted(results) == list(range(64))


# ---- several devices --------------------------------------------------------------------------------
async def test_two_device_pipeline() -> None:
    """relu on CPU, copy to CPU:1, add there: ordering across devices needs no awaits in between."""
    cpu, cpu1 = Device["CPU"], Device["CPU:1"]
    relu, add = await cpu.program("relu", RELU), await cpu1.program("add", ADD)
    x = random_floats(500, 7)
    async with (
        Buffer("CPU", 500, dtypes.float32) as src,
        Buffer("CPU:1", 500, dtypes.float32) as dst,
        Buffer("CPU:1", 500, dtypes.float32) as out,
    ):
        await src.copyin(x)
        relu(src, src, vals=(500,))
        await dst.copy_from(src)
        await cpu1.run(add, out, dst, dst, vals=(500,))
        assert_close(await read(out), [2 * max(v, 0.0) for v in x])


async def test_cancelled_wait_leaves_nothing_behind(device: Compiled, program: Load) -> None:
    """Cancelling an await abandons the wait, not the work; freeing a buffer with work pending
    defers the free. The no_leaks fixture then checks that everything was released."""
    prog = await program("matmul", MATMUL)
    n = 128
    a = await Buffer(device.name, n * n, dtypes.float32).allocate()
    c = await Buffer(device.name, n * n, dtypes.float32).allocate()
    await a.copyin(random_floats(n * n, 8))
    with anyio.CancelScope() as scope:
        scope.cancel()
        await device.run(prog, c, a, a, vals=(n, n, n), writes=(0,))
    assert scope.cancelled_caught
    await a.free()
    await c.free()
