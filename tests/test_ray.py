"""Remote devices on Ray actors (aiotinyrt/ray/), on the test run's local Ray cluster
(tests/ray_cluster.py: started once, shut down at the end); every async test runs on asyncio,
trio and uvloop. Host actors ask for no CPU, so several fit on the small cluster."""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from aiotinyrt import Buffer, Device, DeviceError, dtypes, get_available_devices  # noqa: E402
from aiotinyrt import ray as airay  # noqa: E402
from aiotinyrt.ray import staging, wire  # noqa: E402
from tests.helpers import filled_buffer, loop_name  # noqa: E402
from tests.ray_cluster import STORE_BYTES  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]  # (they need the local Ray cluster)

N = 4096
FLOAT_SRC = """
void poly(float *a, float *b, int n) {
  for (int i = 0; i < n; i++) b[i] = a[i] * a[i] * 1.37f - a[i] / 3.0f + 0.1f;
}
"""
ADD_SRC = "void add1(int *a) { for (int i = 0; i < 4096; i++) a[i] += 1; }"
SPIN_SRC = "void spin(volatile int *a) { while (a[0] == 0) { } }"
# (a second of work or so: still running when the client is long done submitting)
SLOW_SRC = """
void slow(int *a, int *b) {
  unsigned x = (unsigned)a[0];
  for (int i = 0; i < 100000000; i++) x = x * 1664525u + 1013904223u;
  b[0] = (int)(x & 1) + a[0];
}
"""


@pytest.fixture
def host(ray_host: str) -> str:
    """The test run's shared device host (tests/ray_cluster.py)."""
    return ray_host


async def test_bit_exact_against_local_cpu(host: str) -> None:
    x = np.random.default_rng(7).standard_normal(N).astype(np.float32)
    outs = []
    for name in ("CPU", f"RAY:{host}/CPU"):
        dev = Device[name]
        prog = await dev.program("poly", FLOAT_SRC)
        a = await filled_buffer(name, x)
        b = await Buffer(name, N, dtypes.float32).allocate()
        await prog(a, b, vals=(N,))
        out = np.empty(N, np.float32)
        await b.copyout(out)
        outs.append(out)
        await a.free()
        await b.free()
    assert outs[0].tobytes() == outs[1].tobytes()
    assert not np.array_equal(outs[1], x)


async def test_one_actor_call_per_loop_turn(host: str) -> None:
    dev = Device[f"RAY:{host}/CPU"]
    prog = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    await prog(a)  # (the program is on the host now)
    calls = dev.conn.calls
    sigs = [prog(a) for _ in range(50)]
    assert not any(s.done() for s in sigs)  # returned at once, nothing sent yet
    await sigs[-1]
    assert all(s.done() for s in sigs)
    assert dev.conn.calls == calls + 1  # fifty launches, one actor call
    out = np.empty(N, np.int32)
    await a.copyout(out)
    assert (out == 51).all()  # in order, each after the one before (ordered on the host)
    await a.free()


async def test_views_and_wait_for_local_device(host: str) -> None:
    dev = Device[f"RAY:{host}/CPU:1"]
    prog = await dev.program("add1", ADD_SRC)
    base = await filled_buffer(dev.name, np.arange(2 * N, dtype=np.int32))
    view = base.view(N, dtypes.int32, offset=N * 4)
    local = Device["CPU"]
    lprog = await local.program("add1", ADD_SRC)
    lbuf = await filled_buffer("CPU", np.zeros(N, np.int32))
    first = lprog(lbuf)
    sig = prog(view, wait_for=[first])  # a local dependency: held back, not waited for here
    await sig
    assert first.done()
    out = np.empty(2 * N, np.int32)
    await base.copyout(out)
    expect = np.arange(2 * N, dtype=np.int32)
    expect[N:] += 1
    assert np.array_equal(out, expect)
    await base.free()
    await lbuf.free()


async def test_cancelled_wait_leaves_remote_work_running(host: str) -> None:
    dev = Device[f"RAY:{host}/CPU"]
    prog = await dev.program("slow", SLOW_SRC)
    a = await filled_buffer(dev.name, np.full(1, 40, np.int32))
    b = await Buffer(dev.name, 1, dtypes.int32).allocate()
    sig = prog(a, b)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await sig
    assert scope.cancelled_caught
    assert not sig.done()  # (not even sent: the flush comes at the next loop turn)
    a.free_nowait()  # its memory stays alive (here and on the host) until the launch is done
    await sig
    out = np.empty(1, np.int32)
    await b.copyout(out)
    assert out[0] in (40, 41)
    await b.free()


async def test_close_releases_every_remote_buffer(host: str) -> None:
    name = f"RAY:{host}/CPU:2"
    dev = Device[name]
    before = await dev.statistics()
    bufs = [await filled_buffer(name, np.full(N, i, np.int32)) for i in range(4)]
    during = await dev.statistics()
    assert during["bytes_in_use"] == before["bytes_in_use"] + 4 * N * 4
    await bufs[0].free()  # freed by the user; the other three only by closing
    await dev.aclose()
    after = await Device[name].statistics()
    assert after["bytes_in_use"] == before["bytes_in_use"]
    assert after["allocations"] == before["allocations"]


async def test_killed_host_fails_pending_work_until_reset(host: str, anyio_backend: Any) -> None:
    victim = f"victim-{loop_name(anyio_backend)}"
    actor = airay.start_host(victim)
    await anyio.to_thread.run_sync(ray.get, actor.ping.remote())
    dev = Device[f"RAY:{victim}/CPU"]
    prog = await dev.program("spin", SPIN_SRC)
    flag = await filled_buffer(dev.name, np.zeros(1, np.int32))
    sig = prog(flag)  # never completes on its own
    await anyio.sleep(0)  # (sent)
    ray.kill(actor)
    with pytest.raises(DeviceError, match=f"host {victim}: device lost"):
        await sig
    with pytest.raises(DeviceError, match="device lost"):  # sticky
        await prog(flag)
    actor = airay.start_host(victim)  # a new host of the same name; reset reconnects
    await anyio.to_thread.run_sync(ray.get, actor.ping.remote())
    await dev.reset()
    add = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.full(N, 2, np.int32))
    await add(a)
    out = np.empty(N, np.int32)
    await a.copyout(out)
    assert (out == 3).all()
    await dev.aclose()
    ray.kill(actor)


async def test_bad_names(host: str) -> None:
    with pytest.raises(ValueError, match="RAY:<host>/<device>"):
        Device["RAY:nohostpart"]
    with pytest.raises(DeviceError, match="no device host 'nobody'"):
        Device["RAY:nobody/CPU"]
    with pytest.raises(ValueError, match="host names"):
        airay.start_host("a/b")
    dev = Device[f"RAY:{host}/CPU"]
    with pytest.raises(NotImplementedError, match="graph capture"):
        dev.capture()
    prog = await dev.program("add1", ADD_SRC)
    a = await Buffer(dev.name, N, dtypes.int32).allocate()
    submitted = dev.queues["compute"].timeline.submitted
    with pytest.raises(ValueError, match="loops itself"):  # as on the host's CPU, before enqueueing
        prog(a, global_size=(4,))
    assert dev.queues["compute"].timeline.submitted == submitted
    await prog(a)  # (the device is not failed)
    await a.free()


async def _second_host() -> str:
    """The name of a second device host, ``t2``, started if not running yet."""
    if "t2" not in airay.running_hosts():
        actor = airay.start_host("t2")
        await anyio.to_thread.run_sync(ray.get, actor.ping.remote())
    return "t2"


async def test_copy_from_host_to_host(host: str) -> None:
    other = await _second_host()
    x = np.random.default_rng(3).integers(-(2**31), 2**31, N, dtype=np.int32)
    src = await filled_buffer(f"RAY:{host}/CPU", x)
    for name in (f"RAY:{host}/CPU:1", f"RAY:{other}/CPU"):  # same host, then another host
        dst = await Buffer(name, N, dtypes.int32).allocate()
        src_copies = src.device_obj.queues["copy"].timeline.submitted
        await dst.copy_from(src)
        assert src.device_obj.queues["copy"].timeline.submitted == src_copies  # never staged here
        out = np.empty(N, np.int32)
        await dst.copyout(out)
        assert np.array_equal(out, x)
        await dst.free()
    await src.free()


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED, staging.STORE])
async def test_large_copies_are_bit_exact_every_way_between_processes(
    host: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wire, "CHUNK_BYTES", 1 << 20)  # (staged and store copies: four pieces)
    nbytes = (3 << 20) + 12_345
    dev = Device[f"RAY:{host}/CPU"]
    conn = dev.conn  # type: ignore[attr-defined]
    probe = await filled_buffer(dev.name, np.zeros(1 << 20, np.uint8))  # (the connection probes)
    assert conn.staging.mode in (staging.DIRECT, staging.STAGED)  # (the host is on this machine)
    if mode == staging.DIRECT and conn.staging.mode != staging.DIRECT:
        pytest.skip("the host may not read this process's memory here (ptrace access)")
    probed, conn.staging.mode = conn.staging.mode, mode
    try:
        x = np.random.default_rng(12).integers(0, 256, nbytes, dtype=np.uint8)
        buf = await filled_buffer(dev.name, x)
        out = np.zeros(nbytes, np.uint8)
        await buf.copyout(out)
        assert out.tobytes() == x.tobytes()
        await buf.free()
    finally:
        conn.staging.mode = probed
        await probe.free()


async def test_a_large_copy_from_another_host_is_bit_exact(host: str) -> None:
    other = await _second_host()
    x = np.random.default_rng(13).integers(0, 256, (2 << 20) + 7, dtype=np.uint8)
    src = await filled_buffer(f"RAY:{host}/CPU", x)
    dst = await Buffer(f"RAY:{other}/CPU", x.size, dtypes.uint8).allocate()
    await dst.copy_from(src)
    assert (await dst.numpy()).tobytes() == x.tobytes()
    await dst.free()
    await src.free()


async def test_available_devices_lists_remote_devices(host: str) -> None:
    names = await anyio.to_thread.run_sync(get_available_devices)
    assert "CPU" in names
    assert f"RAY:{host}/CPU" in names and f"RAY:{host}/CPU:1" in names
    assert all(not n.startswith("RAY:") or n.count("/") == 1 for n in names)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # (one node start; the loops are covered above)
async def test_copy_from_between_hosts_on_two_nodes_is_bit_exact(ray_cluster: Any) -> None:
    # (on this thread: Ray starts a node only from the main thread)
    node = ray_cluster.add_node(num_cpus=1, object_store_memory=STORE_BYTES, resources={"second": 1})
    hosts = []
    try:
        ray_cluster.wait_for_nodes()
        head = airay.start_host("n1", resources={"second": 0}, scheduling_strategy=_on(ray_cluster.head_node))
        far = airay.start_host("n2", resources={"second": 0.01})
        hosts = [head, far]
        nodes = await anyio.to_thread.run_sync(ray.get, [head.node.remote(), far.node.remote()])
        assert nodes[0] != nodes[1] and nodes[1] == node.node_id  # a host on each node
        x = np.random.default_rng(11).integers(-(2**31), 2**31, 1 << 18, dtype=np.int32)  # 1 MiB
        a = await filled_buffer("RAY:n1/CPU", x)
        b = await Buffer("RAY:n2/CPU", x.size, dtypes.int32).allocate()
        back = await Buffer("RAY:n1/CPU:1", x.size, dtypes.int32).allocate()
        await b.copy_from(a)  # head node to the second node
        add = await Device["RAY:n2/CPU"].program("add1", ADD_SRC)
        await add(b.view(N, dtypes.int32))
        await back.copy_from(b)  # and back
        out = np.empty(x.size, np.int32)
        await back.copyout(out)
        expect = x.copy()
        expect[:N] += 1
        assert out.tobytes() == expect.tobytes()
        for name in ("RAY:n1/CPU", "RAY:n1/CPU:1", "RAY:n2/CPU"):
            await Device[name].aclose()
    finally:
        for actor in hosts:
            ray.kill(actor)
        ray_cluster.remove_node(node)


def _on(node: Any) -> Any:
    """A scheduling strategy placing an actor on ``node`` (a cluster_utils node)."""
    return NodeAffinitySchedulingStrategy(node.node_id, soft=False)
