from __future__ import annotations

import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, Device, dtypes

pytestmark = pytest.mark.anyio

ADD = """
void add(float* restrict out, const float* restrict a, const float* restrict b, int n) {
  for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
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
    await rt.synchronize()
