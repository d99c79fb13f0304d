"""``graph.replay_with(vals=...)``: a replay replaces the int vals of recorded raw launches (as
tinygrad's JIT replaces symbolic variables), on the native C run and on the Python run alike."""

from __future__ import annotations

import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, Device, dtypes

pytestmark = pytest.mark.anyio

DEV = "CPU:7"
FILL = "void fill(int* restrict out, int n, int v) { for (int i = 0; i < n; i++) out[i] = v; }"
ADD = "void add(int* restrict out, int v) { out[0] += v; }"


@pytest.fixture(params=["native", "python"])
def queue_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each test on a native queue and on the pure-Python worker (NATIVE_QUEUE=0)."""
    if request.param == "python":
        monkeypatch.setenv("NATIVE_QUEUE", "0")
    return str(request.param)


async def test_replay_with_vals_replaces_the_vals_of_the_named_launches(queue_kind: str) -> None:
    name = DEV if queue_kind == "native" else "CPU:8"
    async with rt.open_device(name) as dev:
        assert dev._compute_queue.native is (queue_kind == "native")
        fill, add = await dev.program("fill", FILL), await dev.program("add", ADD)
        out = await Buffer(name, 4, dtypes.int32).allocate()
        async with dev.capture() as graph:
            fill(out, vals=(4, 1))
            add(out, vals=(10,))
        await graph.replay()
        assert (await out.numpy()).tolist() == [11, 1, 1, 1]
        await graph.replay_with(vals={(0, 1): 5, (1, 0): 100})
        assert (await out.numpy()).tolist() == [105, 5, 5, 5]
        await graph.replay_with(vals={(0, 0): 2})  # only the first two elements
        assert (await out.numpy()).tolist() == [11, 1, 5, 5]
        other = await Buffer(name, 4, dtypes.int32).allocate()
        await other.copyin(np.zeros(4, np.int32))
        await graph.replay_with({}, {(1, 0): -3})
        assert (await out.numpy()).tolist() == [-2, 1, 1, 1]
        await out.free()
        await other.free()


async def test_replay_with_bad_vals_raises_before_anything_is_enqueued() -> None:
    dev = Device[DEV]
    fill = await dev.program("fill", FILL)
    out = await Buffer(DEV, 4, dtypes.int32).allocate()
    src = await Buffer(DEV, 4, dtypes.int32).allocate()
    async with dev.capture() as graph:
        fill(out, vals=(4, 1))
        await out.copy_from(src)
    submitted = [q.timeline.submitted for q in dev.queues.values()]
    with pytest.raises(IndexError, match="command 5"):
        graph.replay_with(vals={(5, 0): 1})
    with pytest.raises(IndexError, match="val 2"):
        graph.replay_with(vals={(0, 2): 1})
    with pytest.raises(ValueError, match=r"command 1 .* no vals"):
        graph.replay_with(vals={(1, 0): 1})
    with pytest.raises(TypeError, match="int"):
        graph.replay_with(vals={(0, 0): 1.5})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="int"):
        graph.replay_with(vals={(0, 0): True})
    with pytest.raises(ValueError, match="32-bit"):
        graph.replay_with(vals={(0, 0): 2**31})
    assert [q.timeline.submitted for q in dev.queues.values()] == submitted
    await dev.synchronize()
    await out.free()
    await src.free()
