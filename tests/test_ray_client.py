"""aiotinyrt.ray's client and host logic without a Ray cluster: the host class runs in this
process on a loop of its own, reached through a stand-in actor handle and object store
(tests/ray_stand_in.py), so these run in the fast loop. tests/test_ray.py runs the same
paths on a real local cluster."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

pytest.importorskip("ray")  # (imported, never started)

from aiotinyrt import Buffer, Device, DeviceError, dtypes, get_available_devices
from aiotinyrt.ray import client, shared, staging, stream, wire
from aiotinyrt.ray.host import Host
from tests.helpers import fail_command, filled_buffer, loop_name
from tests.ray_stand_in import Ref, StandIn

pytestmark = pytest.mark.anyio

N = 4096
ADD_SRC = "void add1(int *a) { for (int i = 0; i < 4096; i++) a[i] += 1; }"


@pytest.fixture(scope="module")
def stand_in() -> Iterator[StandIn]:
    """The stand-in store in aiotinyrt.ray.wire for this module, hosts ``s1`` and ``s2``."""
    fake = StandIn()
    old = wire.STORE
    wire.STORE = fake
    fake.start("s1")
    fake.start("s2")
    yield fake
    for dev in Device.opened():
        if dev.name.startswith("RAY:"):
            dev._shutdown(drop_queued=True, join_timeout=1.0)
    client._CONNECTIONS.clear()
    wire.STORE = old
    fake.close()


def _own_host(stand_in: StandIn, anyio_backend: Any, tag: str) -> str:
    """Start a host of this test's own (``tag`` and the event loop name it) and return its name."""
    name = f"{tag}-{loop_name(anyio_backend)}"
    stand_in.start(name)
    return name


def _own_device(stand_in: StandIn, anyio_backend: Any, tag: str) -> tuple[str, client.RAYDevice]:
    """A host of this test's own (see :func:`_own_host`) and the device ``CPU:6`` on it."""
    name = _own_host(stand_in, anyio_backend, tag)
    dev = Device[f"RAY:{name}/CPU:6"]
    assert isinstance(dev, client.RAYDevice)
    return name, dev


async def test_a_loop_turn_of_launches_is_one_call_and_runs_in_order(stand_in: StandIn) -> None:
    dev = Device["RAY:s1/CPU:6"]
    prog = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    await prog(a)
    calls = stand_in.calls.get("run", 0)
    sigs = [prog(a) for _ in range(50)]
    assert not any(s.done() for s in sigs)
    await sigs[-1]
    assert all(s.done() for s in sigs)
    assert stand_in.calls["run"] == calls + 1
    assert ((await a.numpy()) == 51).all()
    await a.free()


async def test_a_batch_without_arrays_is_one_argument_of_its_call(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each argument of an actor call costs Ray roughly 0.05x a bare call: a batch travels as
    # one pickle (client, number and commands in it), with its arrays' buffers as a second
    # argument only when it has arrays
    dev = Device["RAY:s1/CPU:6"]
    prog = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    await prog(a)
    real, args = stand_in.call, []

    def call(host: Host, method: str, arguments: tuple[Any, ...]) -> Any:
        if method == "run":
            args.append(len(arguments))
        return real(host, method, arguments)

    monkeypatch.setattr(stand_in, "call", call)
    await prog(a)
    await a.copyin(np.full(N, 7, np.int32))  # (a small copy: its array rides in the call)
    assert args == [1, 2]
    assert ((await a.numpy()) == 7).all()
    await a.free()


async def test_a_long_turn_sends_a_call_every_batch_limit_commands(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stream, "BATCH_LIMIT", 8)
    dev = Device["RAY:s1/CPU:6"]
    prog = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    calls = stand_in.calls.get("run", 0)
    sigs = [prog(a) for _ in range(20)]
    assert stand_in.calls["run"] == calls + 2  # two full batches sent while submitting
    await sigs[-1]
    assert stand_in.calls["run"] == calls + 3  # the rest at the turn's end
    assert ((await a.numpy()) == 20).all()
    await a.free()


def _store_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hosts fail the copy probes (as a host on another machine does): a connection probing
    from now on copies through the object store."""
    _copies(monkeypatch, staging.STORE)


def _copies(monkeypatch: pytest.MonkeyPatch, mode: str, here: bool = False) -> None:
    """Connections probing from now on copy this way (``staging.DIRECT``: as the host allows;
    ``STAGED``: the host may not read the client's memory, as under Yama's ptrace_scope 1;
    ``STORE``: neither); but for ``DIRECT``, hosts may not write each other's memory either
    (``copy_from`` between them goes through the store). Every copy goes through the host
    unless ``here``: no connection maps the host's memory (:mod:`aiotinyrt.ray.shared`)."""
    if not here:
        monkeypatch.setattr(shared.HostMemory, "known", lambda self, rid: False)
    real = Host.stage

    async def stage(self: Host, client: str, where: Any, token: bytes) -> tuple[bool, int, str]:
        if mode == staging.STORE or (mode == staging.STAGED and isinstance(where, staging.Direct)):
            return (False, *self.process)
        return await real(self, client, where, token)

    async def write_to(self: Host, client: str, ref: Any, there: Any) -> bool:
        return False

    monkeypatch.setattr(Host, "stage", stage)
    if mode != staging.DIRECT:
        monkeypatch.setattr(Host, "write_to", write_to)


async def _probed(
    stand_in: StandIn,
    monkeypatch: pytest.MonkeyPatch,
    anyio_backend: Any,
    mode: str,
    tag: str,
    data: np.ndarray[Any, Any],
) -> tuple[str, client.RAYDevice, Buffer]:
    """A host of this test's own copying the ``mode`` way (:func:`_copies`), its device, and a
    buffer filled with ``data`` (a large copy: the connection has probed its way)."""
    _copies(monkeypatch, mode)
    name, dev = _own_device(stand_in, anyio_backend, f"{tag}-{mode}")
    return name, dev, await filled_buffer(dev.name, data)


@pytest.mark.parametrize("nbytes", [256, 1 << 20])
async def test_copies_are_bit_exact_and_large_ones_go_through_the_store_where_staging_fails(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, nbytes: int
) -> None:
    _store_only(monkeypatch)
    _, dev = _own_device(stand_in, anyio_backend, f"store-{nbytes}")
    x = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    buf = await filled_buffer(dev.name, x)
    puts = stand_in.puts
    out = np.empty(nbytes, np.uint8)
    await buf.copyout(out)
    assert out.tobytes() == x.tobytes()
    assert stand_in.puts == puts + (nbytes > wire.INLINE_BYTES)  # one put on the host, no bytes in the reply
    view = buf.view(16, dtypes.uint8, offset=nbytes - 16)
    await view.copyin(np.arange(16, dtype=np.uint8))
    await buf.copyout(out)
    assert out[-16:].tolist() == list(range(16)) and out[:-16].tobytes() == x[:-16].tobytes()
    await dev.aclose()


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED])
async def test_large_copies_on_one_machine_skip_the_store_ordered_as_any_copy(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    _copies(monkeypatch, mode)
    name, dev = _own_device(stand_in, anyio_backend, f"same-machine-{mode}")
    prog = await dev.program("add1", ADD_SRC)
    nbytes = 1 << 20
    x = np.random.default_rng(11).integers(0, 1000, nbytes // 4, dtype=np.int32)
    probes, puts = stand_in.calls.get("stage", 0), stand_in.puts
    buf = await filled_buffer(dev.name, x)
    prog(buf)  # (the copyout below comes after it on the host: ordered as any copy)
    out = np.empty_like(x)
    await buf.copyout(out)
    assert (out[:N] == x[:N] + 1).all() and (out[N:] == x[N:]).all()  # (add1 adds to N ints)
    await buf.copyin(x)
    await buf.copyout(out)
    assert out.tobytes() == x.tobytes()
    assert stand_in.puts == puts  # (nothing through the store)
    conn = dev.conn
    assert conn.staging.mode == mode
    if mode == staging.DIRECT:
        assert stand_in.calls["stage"] - probes == 1  # (one probe per connection)
        assert conn.staging.made == 0  # (the host copies from and to this process's memory)
    else:
        assert stand_in.calls["stage"] - probes == 2  # (direct refused, then staged)
        assert len(conn.staging._free) == 1  # (one segment, reused by every copy)
        unstage = stand_in.actor(name).unstage.remote(conn.client)
        assert await anyio.to_thread.run_sync(unstage.result, 30) == 1  # (mapped there)
    await dev.aclose()


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STORE])
async def test_copy_from_another_host_moves_the_bytes_host_to_host(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    _copies(monkeypatch, mode)
    one, dev = _own_device(stand_in, anyio_backend, f"h2h-{mode}")
    two = _own_host(stand_in, anyio_backend, f"h2h-other-{mode}")
    x = np.random.default_rng(3).integers(-(2**31), 2**31, 1 << 16, dtype=np.int32)
    src = await filled_buffer(dev.name, x)
    # (reads and writes asked of the source host: one copy, the source host writing the
    # destination's memory; or, once refused that, through the store, and not asked again)
    direct = mode == staging.DIRECT
    steps = [
        (f"RAY:{one}/CPU:7", (0, 0)),  # (the same host: one copy there)
        (f"RAY:{two}/CPU:6", (0, 1) if direct else (1, 1)),
        (f"RAY:{two}/CPU:6", (0, 1) if direct else (1, 0)),
    ]
    for name, asked in steps:
        dst = await Buffer(name, x.size, dtypes.int32).allocate()
        copies = src.device_obj.queues["copy"].timeline.submitted
        calls = [stand_in.calls.get(k, 0) for k in ("read", "write_to")]
        await dst.copy_from(src)
        assert src.device_obj.queues["copy"].timeline.submitted == copies  # never staged here
        after = [stand_in.calls.get(k, 0) for k in ("read", "write_to")]
        assert (after[0] - calls[0], after[1] - calls[1]) == asked
        assert (await dst.numpy()).tobytes() == x.tobytes()
        await dst.device_obj.aclose()
    await dev.aclose()


async def test_a_failing_command_names_the_host_and_is_sticky_until_reset(stand_in: StandIn) -> None:
    dev = Device["RAY:s1/CPU:7"]
    assert isinstance(dev, client.RAYDevice)
    prog = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    unknown = client.RemoteProgram(dev, "add1", prog.lib)
    unknown.key = "nothing"
    dev.conn.loaded.add((dev.remote_name, "nothing"))  # a launch of a program the host never got
    with pytest.raises(DeviceError, match=r"RAY:s1/CPU:7: .*nothing"):
        await unknown(a)
    with pytest.raises(DeviceError, match="nothing"):  # sticky
        await a.numpy()
    await dev.reset()
    await prog(a)
    assert ((await a.numpy()) == 1).all()
    await a.free()


async def test_a_killed_host_fails_pending_work_until_reset_reconnects(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    name, dev = _own_device(stand_in, anyio_backend, "k")
    prog = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    stand_in.hold(name)
    sig = prog(a)
    await anyio.sleep(0)  # (sent: the call is pending on the host)
    stand_in.kill(name)
    with pytest.raises(DeviceError, match=f"host {name}: device lost"):
        await sig
    with pytest.raises(DeviceError, match="device lost"):
        await prog(a)
    stand_in.start(name)
    await dev.reset()
    b = await filled_buffer(dev.name, np.full(N, 2, np.int32))
    await prog(b)
    assert ((await b.numpy()) == 3).all()
    await dev.aclose()


async def test_close_releases_every_buffer_on_the_host(stand_in: StandIn) -> None:
    dev = Device["RAY:s2/CPU:7"]
    assert isinstance(dev, client.RAYDevice)
    before = await dev.statistics()
    bufs = [await filled_buffer(dev.name, np.full(N, i, np.int32)) for i in range(3)]
    assert (await dev.statistics())["bytes_in_use"] == before["bytes_in_use"] + 3 * N * 4
    await bufs[0].free()
    await dev.aclose()
    again = Device["RAY:s2/CPU:7"]
    assert isinstance(again, client.RAYDevice)
    assert (await again.statistics())["bytes_in_use"] == before["bytes_in_use"]


async def test_available_devices_lists_every_hosts_devices(stand_in: StandIn) -> None:
    names = await anyio.to_thread.run_sync(get_available_devices)
    assert {"RAY:s1/CPU", "RAY:s2/CPU"} <= set(names)
    assert not any(n.startswith("RAY:") and n.count("RAY") > 1 for n in names)  # a host lists its own


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # (a host's loop is always asyncio's)
async def test_the_host_takes_a_clients_batches_in_sequence_order() -> None:
    # drives the host class directly: batch 2 arrives first and waits for batch 1
    host = Host("direct")
    order: list[int] = []

    async def send(seq: int, batch: list[Any]) -> None:
        await host.run(*wire.encode("c", seq, batch))
        order.append(seq)

    alloc: list[Any] = [(wire.ALLOC, "CPU:6", 1, 64, False)]
    copy: list[Any] = [(wire.COPYIN, 2, (1, 64, 0), np.ones(64, np.uint8), [])]
    async with anyio.create_task_group() as tg:
        tg.start_soon(send, 2, copy)
        await anyio.wait_all_tasks_blocked()
        assert order == []
        tg.start_soon(send, 1, alloc)
    assert order == [1, 2]
    assert await host.buffers("c") == 1
    assert await host.release("c") == 1


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED, staging.STORE])
async def test_large_copies_move_in_pieces_a_call_each_bit_exact(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    monkeypatch.setattr(wire, "CHUNK_BYTES", 256 * 1024)
    _copies(monkeypatch, mode)
    _, dev = _own_device(stand_in, anyio_backend, f"pieces-{mode}")
    nbytes = 1024 * 1024 + 12_288  # (five pieces, the last a short one)
    x = np.random.default_rng(5).integers(0, 256, nbytes, dtype=np.uint8)
    calls, puts = stand_in.calls.get("run", 0), stand_in.puts
    buf = await Buffer(dev.name, nbytes, dtypes.uint8).allocate()
    await buf.copyin(x)
    assert stand_in.calls["run"] - calls == 1 + 5  # the alloc's, then a call per piece
    assert stand_in.puts - puts == (5 if mode == staging.STORE else 0)  # (each piece put here)
    out = np.empty(nbytes, np.uint8)
    calls = stand_in.calls["run"]
    await buf.copyout(out)
    # (direct, once probed: one command, no object-store memory to bound)
    assert stand_in.calls["run"] - calls == (1 if mode == staging.DIRECT else 5)
    assert out.tobytes() == x.tobytes()
    far_host = _own_host(stand_in, anyio_backend, f"far-{mode}")
    far = await Buffer(f"RAY:{far_host}/CPU", nbytes, dtypes.uint8).allocate()
    reads, writes = stand_in.calls.get("read", 0), stand_in.calls.get("write_to", 0)
    await far.copy_from(buf)
    if mode == staging.DIRECT:  # (the source host writes the destination's memory: one call)
        assert (stand_in.calls.get("read", 0) - reads, stand_in.calls["write_to"] - writes) == (0, 1)
    else:  # (refused once, then a read of each piece)
        assert (stand_in.calls["read"] - reads, stand_in.calls["write_to"] - writes) == (5, 1)
    assert (await far.numpy()).tobytes() == x.tobytes()
    assert len(dev.conn.staging._free) == (2 if mode == staging.STAGED else 0)  # (two in flight at most)
    await buf.free()
    await far.device_obj.aclose()
    await dev.aclose()


async def test_a_callable_failing_on_the_host_keeps_its_cause_and_fails_what_follows_with_it(
    stand_in: StandIn,
) -> None:
    dev = Device["RAY:s2/CPU:6"]
    prog = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    failed = fail_command(dev)  # a Python callable: pickled, run on the host's queue
    behind = [prog(a) for _ in range(3)]  # in the same call, after it
    with pytest.raises(DeviceError) as info:
        await failed
    assert isinstance(info.value.cause, ValueError)
    for sig in behind:
        with pytest.raises(DeviceError) as later:
            await sig
        assert later.value is info.value  # the device's sticky error, as on a local device
    await dev.reset()
    await prog(a)
    assert ((await a.numpy()) == 1).all()
    await a.free()


async def test_a_batch_that_does_not_encode_fails_its_commands_and_the_stream_goes_on(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = Device["RAY:s2/CPU:4"]
    buf = await filled_buffer(dev.name, np.zeros(64, np.uint8))
    real, fail = wire.encode, [True]

    def encode(*args: Any, **kwargs: Any) -> Any:
        if fail[0]:
            fail[0] = False
            raise RuntimeError("cannot serialize")
        return real(*args, **kwargs)

    monkeypatch.setattr(wire, "encode", encode)
    with pytest.raises(DeviceError, match="cannot serialize"):  # its own cause, not "device lost"
        await buf.copyin(np.ones(64, np.uint8))
    await dev.reset()
    with anyio.fail_after(30):  # (the sequence number was sent: later batches run)
        await buf.copyin(np.full(64, 2, np.uint8))
        assert ((await buf.numpy()) == 2).all()
    await buf.free()


async def test_a_reply_that_raises_fails_its_command_and_later_replies_still_arrive(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any
) -> None:
    _store_only(monkeypatch)
    _, dev = _own_device(stand_in, anyio_backend, "raises")
    big = 1 << 20  # (a copyout this large comes back as an object ref the client fetches)
    buf = await filled_buffer(dev.name, np.ones(big, np.uint8))
    real, fail = stand_in.get, [True]

    def get(ref: Any, timeout: float | None = None) -> Any:
        if fail[0] and isinstance(ref, Ref):  # (the copyout's bytes, not a call's result)
            fail[0] = False
            raise RuntimeError("object lost")
        return real(ref, timeout)

    monkeypatch.setattr(stand_in, "get", get)
    with anyio.fail_after(30):
        with pytest.raises(DeviceError, match="object lost"):
            await buf.copyout(np.empty(big, np.uint8))
        await dev.reset()
        await buf.view(16, dtypes.uint8).copyin(np.full(16, 3, np.uint8))
        assert (await buf.numpy())[:16].tolist() == [3] * 16
    assert dev.conn._waiter is not None and dev.conn._waiter.is_alive()
    await dev.aclose()


def _in_a_loop_that_stops(submit: Callable[[], object]) -> None:
    """Run ``submit`` in a callback of a fresh asyncio loop that stops in that turn and is then
    closed: what ``submit`` scheduled on the loop for its next turn never runs there."""
    loop = asyncio.new_event_loop()
    loop.call_soon(submit)
    loop.call_soon(loop.stop)
    loop.run_forever()
    loop.close()


async def test_copyin_pieces_left_when_their_loop_ends_still_reach_the_host(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any
) -> None:
    monkeypatch.setattr(wire, "CHUNK_BYTES", 96 * 1024)
    _, dev = _own_device(stand_in, anyio_backend, "gap")  # (its own host: a gap would stall its stream)
    nbytes = 4 * 96 * 1024 + 100  # (five pieces)
    x = np.random.default_rng(8).integers(0, 256, nbytes, dtype=np.uint8)
    buf = await Buffer(dev.name, nbytes, dtypes.uint8).allocate()
    sigs: list[Any] = []
    copy = lambda: sigs.append(buf._enqueue_copy(memoryview(x), into=True))  # noqa: E731
    await anyio.to_thread.run_sync(_in_a_loop_that_stops, copy)
    with anyio.fail_after(30):  # (a piece never sent: this and every later batch would hang)
        await sigs[0]
        assert (await buf.numpy()).tobytes() == x.tobytes()
    await dev.aclose()


async def test_a_flush_left_when_its_loop_ends_is_still_sent(stand_in: StandIn, anyio_backend: Any) -> None:
    _, dev = _own_device(stand_in, anyio_backend, "flush")
    prog = await dev.program("add1", ADD_SRC)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    sigs: list[Any] = []
    await anyio.to_thread.run_sync(_in_a_loop_that_stops, lambda: sigs.append(prog(a)))
    with anyio.fail_after(30):  # (a flush never run: this launch would never be sent)
        await prog(a)
        await sigs[0]
        assert ((await a.numpy()) == 2).all()
    await dev.aclose()


async def test_an_allocation_failing_on_the_host_fails_its_first_use_with_the_memory_error(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = Device["CPU:3"].allocator  # (the host's CPU:3: this process's)
    monkeypatch.setattr(memory, "limit", memory.statistics().bytes_in_use + 4096)
    dev = Device["RAY:s1/CPU:3"]
    buf = await Buffer(dev.name, 1 << 16, dtypes.uint8).allocate()  # (pipelined: no reply awaited)
    with pytest.raises(DeviceError, match="out of memory") as info:
        await buf.copyin(np.ones(1 << 16, np.uint8))
    assert isinstance(info.value.cause, MemoryError)
    assert "RAY:s1/CPU:3: out of memory allocating 65536 bytes" in str(info.value.cause)
    await buf.free()
    await dev.reset()
    small = await filled_buffer(dev.name, np.full(64, 7, np.uint8))  # (the device goes on)
    assert ((await small.numpy()) == 7).all()
    await dev.aclose()


async def test_a_program_failing_to_load_on_the_host_fails_its_launches_clearly(stand_in: StandIn) -> None:
    dev = Device["RAY:s1/CPU:3"]
    assert isinstance(dev, client.RAYDevice)
    a = await filled_buffer(dev.name, np.zeros(N, np.int32))
    bad = client.RemoteProgram(dev, "add1", b"not a shared object")
    for _ in range(2):
        with pytest.raises(DeviceError, match="program add1 did not load on CPU:3: LoadError") as info:
            await bad(a)
        assert "KeyError" not in str(info.value)
        await dev.reset()
    await dev.aclose()


async def test_statistics_come_after_the_commands_queued_before(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    name, dev = _own_device(stand_in, anyio_backend, "stats")
    before = (await dev.statistics())["bytes_in_use"]
    stand_in.pause(name)  # (batches wait on the host; a direct call would not)
    bufs = [await Buffer(dev.name, N, dtypes.int32).allocate() for _ in range(3)]
    seen: list[int] = []

    async def look() -> None:
        seen.append((await dev.statistics())["bytes_in_use"])

    async with anyio.create_task_group() as tg:
        tg.start_soon(look)
        await anyio.wait_all_tasks_blocked()
        stand_in.resume(name)
    assert seen == [before + 3 * N * 4]
    for buf in bufs:
        await buf.free()
    await dev.aclose()


async def test_close_releases_buffers_whose_allocation_is_still_queued(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    name, dev = _own_device(stand_in, anyio_backend, "close")
    before = (await dev.statistics())["bytes_in_use"]
    stand_in.pause(name)
    await Buffer(dev.name, N, dtypes.int32).allocate()  # (never freed: closing releases it)
    async with anyio.create_task_group() as tg:
        tg.start_soon(dev.aclose)
        await anyio.wait_all_tasks_blocked()
        stand_in.resume(name)
    other = Device[f"RAY:{name}/CPU:7"]
    await filled_buffer(other.name, np.zeros(16, np.uint8))  # (a round trip behind the alloc)
    again = Device[f"RAY:{name}/CPU:6"]
    assert (await again.statistics())["bytes_in_use"] == before
    await other.aclose()
    await again.aclose()


async def test_a_late_failure_of_the_old_host_does_not_fail_the_reconnected_stream(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any
) -> None:
    name = _own_host(stand_in, anyio_backend, "late")
    first, second = Device[f"RAY:{name}/CPU:6"], Device[f"RAY:{name}/CPU:7"]  # (one connection)
    assert isinstance(first, client.RAYDevice) and isinstance(second, client.RAYDevice)
    prog, prog2 = await first.program("add1", ADD_SRC), await second.program("add1", ADD_SRC)
    a = await filled_buffer(first.name, np.zeros(N, np.int32))
    b = await filled_buffer(second.name, np.zeros(N, np.int32))
    stand_in.hold(name)
    sig_a = prog(a)
    first.conn.flush()
    calls: list[Any] = []
    real_call, real_get = stand_in.call, stand_in.get

    def call(*args: Any) -> Any:
        calls.append(real_call(*args))
        return calls[-1]

    monkeypatch.setattr(stand_in, "call", call)
    sig_b = prog2(b)
    second.conn.flush()  # a second batch in flight: its failure is handled late (below)
    monkeypatch.setattr(stand_in, "call", real_call)
    gate = threading.Event()

    def get(ref: Any, timeout: float | None = None) -> Any:
        if ref is calls[0]:
            gate.wait(30)
        return real_get(ref, timeout)

    monkeypatch.setattr(stand_in, "get", get)
    stand_in.kill(name)
    with pytest.raises(DeviceError, match="device lost"):
        await sig_a
    stand_in.start(name)
    await first.reset()  # reconnects the connection both devices share
    gate.set()  # the old host's second failure arrives only now
    with pytest.raises(DeviceError, match="device lost"):
        await sig_b
    with anyio.fail_after(30):
        c = await filled_buffer(first.name, np.full(N, 4, np.int32))
        await prog(c)
        assert ((await c.numpy()) == 5).all()
        await second.reset()
        with pytest.raises(DeviceError, match=f"not on host {name}") as info:  # (the old host's)
            await prog2(b)
        assert "KeyError" not in str(info.value)
    await first.aclose()
    await second.aclose()


class _TwoArgError(RuntimeError):
    """An error whose constructor does not take its message (as OpenCL's ``CLError``)."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} failed ({code})")
        self.call, self.code = call, code


async def test_an_allocation_error_not_built_from_its_message_fails_only_that_buffers_use(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(nbytes: int, options: Any) -> Any:
        raise _TwoArgError("clCreateBuffer", -4)

    monkeypatch.setattr(Device["CPU:2"].allocator, "_alloc", refuse)  # (the host's CPU:2: this process's)
    dev, other = Device["RAY:s1/CPU:2"], Device["RAY:s1/CPU:6"]
    assert isinstance(dev, client.RAYDevice)
    buf = await Buffer(dev.name, 1 << 16, dtypes.uint8).allocate()
    with pytest.raises(DeviceError, match=r"clCreateBuffer failed \(-4\)") as info:
        await buf.copyin(np.ones(1 << 16, np.uint8))
    assert "device lost" not in str(info.value)
    assert dev.conn.lost is None
    ok = await filled_buffer(other.name, np.full(64, 5, np.uint8))  # (the host's other devices go on)
    assert ((await ok.numpy()) == 5).all()
    await ok.free()
    await buf.free()
    await dev.aclose()


async def test_closing_a_device_releases_none_of_a_reopened_devices_buffers(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    name, first = _own_device(stand_in, anyio_backend, "reopen")
    await filled_buffer(first.name, np.ones(64, np.uint8))
    # what aclose does first: shut down and unregister; another task reopens the name meanwhile
    first._shutdown(drop_queued=True, join_timeout=None, free_cache=False)
    again = Device[f"RAY:{name}/CPU:6"]
    assert again is not first and isinstance(again, client.RAYDevice) and again.conn is first.conn
    buf = await Buffer(again.name, 64, dtypes.uint8).allocate()
    await first.aclose()  # (the rest of the first device's close)
    with anyio.fail_after(30):
        await buf.copyin(np.full(64, 7, np.uint8))
        assert ((await buf.numpy()) == 7).all()
    await again.aclose()


async def test_a_reply_raising_on_the_sender_thread_leaves_the_stream_going(stand_in: StandIn) -> None:
    stand_in.start("sender")
    conn = stream.Connection("sender")

    failed = threading.Event()

    def bad(result: Any, error: BaseException | None) -> None:
        failed.set()
        raise RuntimeError("handler bug")

    conn.lost = "host sender: device lost (test)"  # (the part fails on the sender thread)
    conn.send_apart([(lambda: (wire.STATS, "CPU"), bad)], puts=True)
    assert await anyio.to_thread.run_sync(failed.wait, 30)
    conn.lost = None
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
    conn.send_apart([(lambda: (wire.STATS, "CPU"), lambda r, e: answer.set_result((r, e)))], puts=True)
    result, error = await anyio.to_thread.run_sync(answer.result, 30)
    assert error is None and "bytes_in_use" in result[2]


async def test_the_first_reset_after_an_unnoticed_host_death_reconnects(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    name, dev = _own_device(stand_in, anyio_backend, "quiet")
    await filled_buffer(dev.name, np.ones(64, np.uint8))
    stand_in.kill(name)  # (nothing in flight: nothing notices)
    stand_in.start(name)
    await dev.reset()
    buf = await filled_buffer(dev.name, np.full(64, 9, np.uint8))
    assert ((await buf.numpy()) == 9).all()
    await dev.aclose()


async def test_a_dropped_connection_is_freed_with_its_threads(stand_in: StandIn) -> None:
    stand_in.start("dropped")
    conn = stream.connection("dropped")
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
    conn.send_apart([(lambda: (wire.STATS, "CPU"), lambda r, e: answer.set_result(e))], puts=True)
    assert await anyio.to_thread.run_sync(answer.result, 30) is None
    threads = [t for t in (conn._sender, conn._waiter) if t is not None]
    assert threads and all(t.is_alive() for t in threads)
    gone = weakref.ref(conn)
    stream._CONNECTIONS.pop("dropped", None)
    del conn
    gc.collect()
    assert gone() is None
    for thread in threads:
        await anyio.to_thread.run_sync(thread.join, 30)
        assert not thread.is_alive()


async def test_a_connection_whose_last_reply_handler_held_it_is_still_freed(stand_in: StandIn) -> None:
    """A reply handler holds its device, which holds the connection: the waiter thread must keep
    nothing of the last call it handled, or a dropped connection is never freed and its threads
    run on (a device closed after its host was lost sends nothing after its last reply)."""
    stand_in.start("held")
    conn = stream.connection("held")
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
    conn.send_apart([(lambda: (wire.STATS, "CPU"), lambda r, e, held=conn: answer.set_result(e))], puts=True)
    assert await anyio.to_thread.run_sync(answer.result, 30) is None
    threads = [t for t in (conn._sender, conn._waiter) if t is not None]
    gone = weakref.ref(conn)
    stream._CONNECTIONS.pop("held", None)
    del conn

    def freed() -> bool:  # (the waiter may still be returning from the handler: bounded wait)
        deadline = time.monotonic() + 10
        while gone() is not None and time.monotonic() < deadline:
            gc.collect()
            threading.Event().wait(0.01)
        return gone() is None

    assert await anyio.to_thread.run_sync(freed)
    for thread in threads:
        await anyio.to_thread.run_sync(thread.join, 30)
        assert not thread.is_alive()


async def test_two_devices_resetting_at_once_after_an_unnoticed_death_reconnect_once(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    """Both resets find the host lost; one reconnects, the other neither raises nor reconnects
    again (a second swap would send what was submitted between them to an orphaned client)."""
    name = _own_host(stand_in, anyio_backend, "twice")
    a, b = Device[f"RAY:{name}/CPU:6"], Device[f"RAY:{name}/CPU:7"]
    await filled_buffer(a.name, np.ones(64, np.uint8))
    await filled_buffer(b.name, np.ones(64, np.uint8))
    stand_in.kill(name)
    stand_in.start(name)
    before = a.conn.reconnects  # type: ignore[attr-defined]
    async with anyio.create_task_group() as tg:
        tg.start_soon(a.reset)
        tg.start_soon(b.reset)
    assert a.conn.reconnects == before + 1  # type: ignore[attr-defined]
    for dev in (a, b):
        x = await filled_buffer(dev.name, np.full(64, 3, np.uint8))
        assert ((await x.numpy()) == 3).all()
        await dev.aclose()


def test_a_forked_child_does_not_reuse_the_parents_connections() -> None:
    code = """
        import os
        from aiotinyrt.ray import stream, wire
        from tests.ray_stand_in import StandIn
        wire.STORE = StandIn()
        wire.STORE.start("f")
        conn = stream.connection("f")
        child = os.fork()
        if child == 0:
            os._exit(0 if "f" not in stream._CONNECTIONS and stream.connection("f") is not conn else 3)
        _, status = os.waitpid(child, 0)
        print(os.waitstatus_to_exitcode(status), stream.connection("f") is conn)
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0", "True"], result.stdout + result.stderr


@pytest.mark.parametrize("mode", [staging.STAGED, staging.STORE])
@pytest.mark.parametrize("into", [True, False], ids=["copyin", "copyout"])
async def test_a_large_copy_has_at_most_two_pieces_in_flight(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, into: bool, mode: str
) -> None:
    monkeypatch.setattr(wire, "CHUNK_BYTES", 96 * 1024)
    _copies(monkeypatch, mode)
    name, dev = _own_device(stand_in, anyio_backend, f"window-{into}-{mode}")
    nbytes = 6 * 96 * 1024  # (six pieces)
    x = np.random.default_rng(9).integers(0, 256, nbytes, dtype=np.uint8)
    buf = await filled_buffer(dev.name, x if not into else np.zeros(nbytes, np.uint8))
    full = threading.Event()
    real = client._Window.acquire

    def acquire(self: Any, blocking: bool = True, timeout: float | None = None) -> bool:
        if real(self, False):
            return True
        full.set()  # (the next piece waits for room)
        return real(self, blocking, timeout)

    monkeypatch.setattr(client._Window, "acquire", acquire)
    puts, calls = stand_in.puts, stand_in.calls.get("run", 0)
    stand_in.pause(name)  # (no piece replies)
    out = np.empty(nbytes, np.uint8)
    sig = buf._enqueue_copy(memoryview(x) if into else memoryview(out), into=into)
    with anyio.fail_after(30):
        await anyio.to_thread.run_sync(full.wait)
        assert stand_in.calls["run"] - calls == 2  # (a copyout's pieces: put when the host runs them)
        if mode == staging.STAGED:
            assert dev.conn.staging.made == 2 and stand_in.puts == puts  # (a segment each)
        elif into:
            assert stand_in.puts - puts == 2
        stand_in.resume(name)
        await sig
        assert (await buf.numpy()).tobytes() == x.tobytes()
        if not into:
            assert out.tobytes() == x.tobytes()
    await dev.aclose()


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED])
async def test_a_host_lost_during_a_large_copy_fails_it_and_a_reset_probes_the_new_host(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    nbytes = 1 << 20
    name, dev, buf = await _probed(
        stand_in, monkeypatch, anyio_backend, mode, "lost", np.ones(nbytes, np.uint8)
    )
    probes, calls = stand_in.calls["stage"], dev.conn.calls
    stand_in.hold(name)
    out = np.empty(nbytes, np.uint8)
    sig = buf._enqueue_copy(memoryview(out), into=False)
    with anyio.fail_after(30):
        await anyio.to_thread.run_sync(_until, lambda: dev.conn.calls > calls)  # (the piece is sent)
        stand_in.kill(name)
        with pytest.raises(DeviceError, match=f"host {name}: device lost"):
            await sig
    conn = dev.conn
    if mode == staging.STAGED:
        assert len(conn.staging._free) == conn.staging.made  # (the piece's segment came back)
    stand_in.start(name)
    await dev.reset()
    await _copies_again(dev, out, 5)
    assert conn.staging.mode == mode and stand_in.calls["stage"] > probes  # (the new host probed)
    await dev.aclose()


async def _copies_again(dev: client.RAYDevice, out: np.ndarray[Any, Any], value: int) -> None:
    """A buffer filled with ``value`` copies back out into ``out`` exactly (the device works
    again, after a reset)."""
    again = await filled_buffer(dev.name, np.full(out.size, value, out.dtype))
    await again.copyout(out)
    assert (out == value).all()


def _until(ready: Callable[[], bool]) -> None:
    """Wait (on a worker thread) until ``ready()``, 30 s at most."""
    deadline = time.monotonic() + 30
    while not ready() and time.monotonic() < deadline:
        threading.Event().wait(0.001)


async def test_a_direct_copy_is_a_command_of_its_loop_turns_call(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any
) -> None:
    _copies(monkeypatch, staging.DIRECT)
    _, dev = _own_device(stand_in, anyio_backend, "direct-batch")
    prog = await dev.program("add1", ADD_SRC)
    x = np.arange(1 << 18, dtype=np.int32)
    buf = await filled_buffer(dev.name, x)  # (the first large copy probes the host)
    assert dev.conn.staging.mode == staging.DIRECT
    calls, out = dev.conn.calls, np.empty_like(x)
    buf._enqueue_copy(memoryview(x), into=True)
    prog(buf)
    sig = buf._enqueue_copy(memoryview(out), into=False)
    await sig
    assert dev.conn.calls - calls == 1  # (the copyin, the launch and the copyout: one call)
    assert (out[:N] == x[:N] + 1).all() and (out[N:] == x[N:]).all()
    await dev.aclose()


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED, staging.STORE])
async def test_a_cancelled_wait_on_a_large_copyout_leaves_the_copy_to_complete(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    x = np.random.default_rng(14).integers(0, 256, 1 << 20, dtype=np.uint8)
    name, dev, buf = await _probed(stand_in, monkeypatch, anyio_backend, mode, "cancelled", x)
    stand_in.pause(name)  # (the copy waits on the host)
    out = np.zeros(x.size, np.uint8)
    sig = buf._enqueue_copy(memoryview(out), into=False)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await sig
    assert not sig.done()
    stand_in.resume(name)
    with anyio.fail_after(30):
        await dev.synchronize()
    assert out.tobytes() == x.tobytes()  # (the copy went on into the memory it was given)
    await dev.aclose()


async def test_segments_beyond_the_kept_bytes_close_and_the_host_drops_their_mappings(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any
) -> None:
    _copies(monkeypatch, staging.STAGED)
    monkeypatch.setattr(staging, "KEEP_BYTES", 2 << 20)
    name, dev = _own_device(stand_in, anyio_backend, "retire")
    host = stand_in._hosts[name]
    buf = await Buffer(dev.name, 2 << 20, dtypes.uint8).allocate()
    await buf.view(1 << 20, dtypes.uint8).copyin(np.ones(1 << 20, np.uint8))  # (a 1 MiB segment)
    await buf.copyin(np.full(2 << 20, 2, np.uint8))  # (a 2 MiB one: the 1 MiB one closes)
    conn = dev.conn
    assert [s.size for s in conn.staging._free] == [2 << 20] and conn.staging.retired
    assert host._staging.mapped(conn.client) == 2
    await buf.copyin(np.full(2 << 20, 3, np.uint8))  # (its call tells the host)
    assert host._staging.mapped(conn.client) == 1 and not conn.staging.retired
    assert ((await buf.numpy()) == 3).all()
    await dev.aclose()


async def test_a_dropped_connection_closes_its_segments_and_the_host_drops_their_mappings(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    _copies(monkeypatch, staging.STAGED)
    stand_in.start("unstaged")
    host = stand_in._hosts["unstaged"]
    conn = stream.connection("unstaged")
    nbytes = 1 << 20
    conn.submit((wire.ALLOC, "CPU", 1, nbytes, False), None)
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
    window, lease = client._Window(), client._Lease(conn)
    data = np.ones(nbytes, np.uint8)
    make = functools.partial(client._staged_copyin, conn, window, lease, 9, (1, nbytes, 0), data, [])
    conn.send_apart([(make, window.replied(lambda r, e: answer.set_result((r, e)), lease))], puts=True)
    result, error = await anyio.to_thread.run_sync(answer.result, 30)
    assert error is None and result[:2] == (0.0, None)  # (done; the reply names the buffer's memory)
    client_id, segments = conn.client, list(conn.staging._free)
    assert host._staging.mapped(client_id) == 1 and segments
    sender = conn._sender
    assert sender is not None
    stream._CONNECTIONS.pop("unstaged", None)
    del conn, lease, make, window
    gc.collect()
    await anyio.to_thread.run_sync(sender.join, 30)
    assert all(s._map is None for s in segments)  # (closed here)
    ping = stand_in.actor("unstaged").ping.remote()  # (after the unstage call, on the host's loop)
    await anyio.to_thread.run_sync(ping.result, 30)
    assert host._staging.mapped(client_id) == 0
    await host.release(client_id)


def test_a_direct_copy_never_touches_a_process_that_is_not_the_client_it_names() -> None:
    here = np.zeros(16, np.uint8)
    there = np.arange(16, dtype=np.uint8)
    real = staging.Direct.here(staging.address(there), 16)
    staging.direct_copy(real, staging.address(here), 16, write=False)
    assert here.tolist() == list(range(16))
    reused = real._replace(started="0")  # (the pid of a client that ended, now another process's)
    with pytest.raises(OSError, match="gone"):
        staging.direct_copy(reused, staging.address(here), 16, write=True)
    assert there.tolist() == list(range(16))
    with pytest.raises(ValueError, match="16 bytes"):  # (never more than the memory named)
        staging.direct_copy(real, staging.address(np.zeros(32, np.uint8)), 32, write=True)
    assert there.tolist() == list(range(16))


async def _short_copies(device: str, other: str) -> list[bytes]:
    """The allocator's copies with host memory (or a transfer's byte count) smaller than the
    allocation, on ``device`` (a transfer from ``other``): each copies exactly that many bytes
    at the start of the handle's range and touches nothing around it (the bytes that result)."""
    big, small, head = 4 << 20, 1 << 20, 3000  # (large copies, and one small enough to go inline)
    alloc = Device[device].allocator
    handle = await alloc.alloc(big)
    await alloc.copyin(handle, memoryview(np.full(big, 7, np.uint8)))
    part = alloc._offset(handle, 2 * small, small)  # (a handle of the middle 2 MiB)
    backing = np.full(big, 9, np.uint8)  # (the caller's memory, followed by bytes it does not pass)
    backing[:small] = np.arange(small, dtype=np.uint8)
    await alloc.copyin(part, memoryview(backing[:small]))
    await alloc.copyin(handle, memoryview(backing[small - head : small]))
    whole = np.zeros(big, np.uint8)
    await alloc.copyout(memoryview(whole), handle)
    guard = np.full(big, 0xAB, np.uint8)  # (a copyout writes its destination, nothing past it)
    await alloc.copyout(memoryview(guard[:small]), part)
    tiny = np.full(2 * head, 0xCD, np.uint8)
    await alloc.copyout(memoryview(tiny[:head]), part)
    source = Device[other].allocator
    src = await source.alloc(big)
    await source.copyin(src, memoryview(np.arange(big, dtype=np.uint32).view(np.uint8)[:big]))
    dst = await alloc.alloc(big)
    await alloc.copyin(dst, memoryview(np.full(big, 0xEE, np.uint8)))
    await alloc.transfer(alloc._offset(dst, small, small), src, small, Device[other])  # (a part of
    await alloc.transfer(dst, source._offset(src, small, 0), small // 2, Device[other])  # each)
    moved = np.zeros(big, np.uint8)
    await alloc.copyout(memoryview(moved), dst)
    for h, n, owner in ((handle, big, alloc), (dst, big, alloc), (src, big, source)):
        await owner.free(h, n)
    return [whole.tobytes(), guard.tobytes(), tiny.tobytes(), moved.tobytes()]


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED, staging.STORE])
async def test_copies_of_host_memory_smaller_than_the_allocation_move_only_its_bytes(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    # the allocator API copies ``len(host memory)`` bytes (a transfer its ``nbytes``) at the
    # start of the handle's range: as the CPU backend does, every way of a RAY device does
    _copies(monkeypatch, mode)
    _, dev = _own_device(stand_in, anyio_backend, f"short-{mode}")
    other = _own_host(stand_in, anyio_backend, f"short-other-{mode}")
    expected = await _short_copies("CPU", "CPU:1")
    got = await _short_copies(dev.name, f"RAY:{other}/CPU:6")
    assert dev.conn.staging.mode == mode
    names = ("copyin", "copyout", "small copyout", "transfer")
    for name, mine, cpu in zip(names, got, expected, strict=True):
        assert mine == cpu, name
    await Device[f"RAY:{other}/CPU:6"].aclose()
    await dev.aclose()


def _unavailable_once(stand_in: StandIn, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The next call whose result is waited for raises Ray's ActorUnavailableError (the RPC
    broke; the actor may still run it), as a real call's ``ray.get`` may; the list gets it."""
    from ray.exceptions import ActorUnavailableError

    real, calls = stand_in.get, []

    def get(ref: Any, timeout: float | None = None) -> Any:
        if isinstance(ref, concurrent.futures.Future) and not calls:
            calls.append(ref)
            raise ActorUnavailableError("the actor is unavailable for the moment", None)
        return real(ref, timeout)

    monkeypatch.setattr(stand_in, "get", get)
    return calls


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED])
async def test_a_copy_whose_host_is_only_unavailable_fails_once_the_host_is_dead(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    # a host "unavailable for the moment" may still run the call, writing the caller's memory
    # (or a segment) later: the copy is reported lost only once the host is known dead
    nbytes = 1 << 20
    name, dev, buf = await _probed(
        stand_in, monkeypatch, anyio_backend, mode, "unavailable", np.full(nbytes, 0x5A, np.uint8)
    )
    stand_in.pause(name)  # (the copy's call waits on the host: it has not run)
    calls = _unavailable_once(stand_in, monkeypatch)
    out = np.zeros(nbytes, np.uint8)
    with anyio.fail_after(30):
        with pytest.raises(DeviceError, match=f"host {name}: device lost"):
            await buf.copyout(out)
        assert name not in stand_in.hosts()  # (killed before the failure was reported)
        out[:] = 0x11  # (the copy failed: the caller reuses its memory)
        if name in stand_in.hosts():
            stand_in.resume(name)
        await anyio.to_thread.run_sync(concurrent.futures.wait, calls)  # (the call ended)
    assert (out == 0x11).all()  # (nothing of the failed copy wrote it)
    if mode == staging.STAGED:
        assert len(dev.conn.staging._free) == dev.conn.staging.made  # (its segment came back)
    stand_in.start(name)
    await dev.reset()
    await _copies_again(dev, out, 3)
    await dev.aclose()


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED])
async def test_a_copy_whose_host_is_not_known_dead_in_time_keeps_its_memory_from_reuse(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    # the host could not be killed (or not confirmed dead in time): the copy fails, promptly,
    # but the memory the host may still write stays out of reuse (the caller's kept alive,
    # a segment closed, never leased again)
    nbytes = 1 << 20
    name, dev, buf = await _probed(
        stand_in, monkeypatch, anyio_backend, mode, "adrift", np.full(nbytes, 0x5A, np.uint8)
    )
    monkeypatch.setattr(stand_in, "kill_actor", lambda actor: None)
    monkeypatch.setattr(stream, "DEATH_WAIT_S", 0.05)  # (a bound: never a wait that syncs)
    stand_in.pause(name)
    calls = _unavailable_once(stand_in, monkeypatch)
    out = np.zeros(nbytes, np.uint8)
    kept = len(client._QUARANTINED)
    with anyio.fail_after(30):
        with pytest.raises(DeviceError, match=f"host {name}: device lost"):
            await buf.copyout(out)
    conn = dev.conn
    if mode == staging.DIRECT:
        held = client._QUARANTINED[kept:]
        assert len(held) == 1 and np.shares_memory(held[0], out)
    else:
        assert len(conn.staging._free) == conn.staging.made - 1  # (its segment is not reused)
    stand_in.resume(name)
    with anyio.fail_after(30):
        await anyio.to_thread.run_sync(concurrent.futures.wait, calls)  # (the host ran it late)
    stand_in.kill(name)
    stand_in.start(name)
    await dev.reset()
    await dev.aclose()


def _runs_fail_unavailable(stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, count: int) -> list[Any]:
    """Command batches (``run`` calls) fail with Ray's ActorUnavailableError, each once
    ``count`` of them were sent (so that they are all in flight when the first fails); other
    calls (pings) run. The list gets the batches' futures."""
    from ray.exceptions import ActorUnavailableError

    real_call, real_get, runs, sent = stand_in.call, stand_in.get, [], threading.Event()

    def call(host: Host, method: str, args: tuple[Any, ...]) -> Any:
        fut = real_call(host, method, args)
        if method == "run":
            runs.append(fut)
            if len(runs) == count:
                sent.set()
        return fut

    def get(ref: Any, timeout: float | None = None) -> Any:
        if any(ref is run for run in runs):
            sent.wait(30)
            raise ActorUnavailableError("the actor is unavailable for the moment", None)
        return real_get(ref, timeout)

    monkeypatch.setattr(stand_in, "call", call)
    monkeypatch.setattr(stand_in, "get", get)
    return runs


async def test_failed_calls_of_one_host_share_its_kill_and_its_deadline(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any
) -> None:
    # three calls naming the client's memory fail at once, their host unavailable and its kill
    # not taking: the first failure kills it; the others wait for the same verdict (the same
    # deadline), not a DEATH_WAIT_S each in turn
    _copies(monkeypatch, staging.DIRECT)
    name, dev = _own_device(stand_in, anyio_backend, "one-verdict")
    nbytes = 1 << 20
    bufs = [await filled_buffer(dev.name, np.full(nbytes, 7, np.uint8)) for _ in range(3)]  # (probed)
    kills: list[Any] = []
    monkeypatch.setattr(stand_in, "kill_actor", kills.append)
    monkeypatch.setattr(stream, "DEATH_WAIT_S", 1.0)  # (a bound: never a wait that syncs)
    monkeypatch.setattr(stream, "BATCH_LIMIT", 1)  # (each copy a call of its own)
    stand_in.pause(name)
    runs = _runs_fail_unavailable(stand_in, monkeypatch, 3)
    causes: list[Any] = []

    async def copyout(buf: Buffer) -> None:
        with pytest.raises(DeviceError) as failed:
            await buf.copyout(np.zeros(nbytes, np.uint8))
        causes.append(failed.value.cause)

    start = time.monotonic()
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for buf in bufs:
                tg.start_soon(copyout, buf)
    took = time.monotonic() - start
    assert len(runs) == 3 and len(kills) == 1
    assert all(isinstance(cause, wire.HostAdrift) for cause in causes)
    assert took < 2 * stream.DEATH_WAIT_S, took  # (one wait, not three in turn)
    stand_in.resume(name)
    with anyio.fail_after(30):
        await anyio.to_thread.run_sync(concurrent.futures.wait, runs)  # (the host ran them late)
    stand_in.kill(name)
    stand_in.start(name)
    await dev.reset()
    await dev.aclose()


def _pings_fail(stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[Any]:
    """Every call whose result is waited for fails at once: command batches (``run``) with
    Ray's ActorUnavailableError, pings with ``error``. The list gets the batches' futures."""
    from ray.exceptions import ActorUnavailableError

    real_call, real_get, runs = stand_in.call, stand_in.get, []

    def call(host: Host, method: str, args: tuple[Any, ...]) -> Any:
        fut = real_call(host, method, args)
        if method == "run":
            runs.append(fut)
        return fut

    def get(ref: Any, timeout: float | None = None) -> Any:
        if any(ref is run for run in runs):
            raise ActorUnavailableError("the actor is unavailable for the moment", None)
        if isinstance(ref, concurrent.futures.Future):
            raise error
        return real_get(ref, timeout)

    monkeypatch.setattr(stand_in, "call", call)
    monkeypatch.setattr(stand_in, "get", get)
    return runs


async def _copy_fails_while_pings_fail(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, tag: str, error: Exception
) -> tuple[BaseException, int, float]:
    """A direct copy of a host of its own fails (unavailable) while every ping fails with
    ``error`` and the kill does not take: the copy's cause, the pings made, the seconds taken."""
    _copies(monkeypatch, staging.DIRECT)
    name, dev = _own_device(stand_in, anyio_backend, tag)
    nbytes = 1 << 20
    buf = await filled_buffer(dev.name, np.full(nbytes, 7, np.uint8))  # (probed)
    monkeypatch.setattr(stand_in, "kill_actor", lambda actor: None)
    stand_in.pause(name)
    runs = _pings_fail(stand_in, monkeypatch, error)
    pings = stand_in.calls.get("ping", 0)
    start = time.monotonic()
    with anyio.fail_after(30), pytest.raises(DeviceError) as failed:
        await buf.copyout(np.zeros(nbytes, np.uint8))
    took, pings = time.monotonic() - start, stand_in.calls.get("ping", 0) - pings
    monkeypatch.undo()
    stand_in.resume(name)
    with anyio.fail_after(30):
        await anyio.to_thread.run_sync(concurrent.futures.wait, runs)
    stand_in.kill(name)
    stand_in.start(name)
    await dev.reset()
    await dev.aclose()
    return failed.value.cause, pings, took


async def test_pings_of_a_host_waited_for_pause_between_them_when_they_fail(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any
) -> None:
    # the host unreachable: each ping fails at once (unavailable); the wait for its death
    # pauses between pings all the same (it spun, a ping after another, until the deadline)
    from ray.exceptions import ActorUnavailableError

    wait = 0.2
    monkeypatch.setattr(stream, "DEATH_WAIT_S", wait)  # (a bound: never a wait that syncs)
    monkeypatch.setattr(stream, "PING_PAUSE_S", 0.01, raising=False)
    error = ActorUnavailableError("the actor is unavailable for the moment", None)
    cause, pings, _ = await _copy_fails_while_pings_fail(
        stand_in, monkeypatch, anyio_backend, "ping-pause", error
    )
    assert isinstance(cause, wire.HostAdrift)
    assert 1 <= pings <= wait / 0.01 + 2, pings


@pytest.mark.parametrize("kind", ["other", "system"])
async def test_a_ping_failing_with_no_actor_error_ends_the_wait_for_the_death_at_once(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, kind: str
) -> None:
    # a ping that fails with an error that is not an actor's tells nothing of the host, nor
    # will the next: the wait ends at once, the host not known dead (it was taken as dead, or
    # pinged until the deadline)
    from ray.exceptions import RaySystemError

    monkeypatch.setattr(stream, "DEATH_WAIT_S", 10.0)
    error: Exception = RuntimeError("not an actor's error")
    if kind == "system":
        error = RaySystemError(ModuleNotFoundError("No module named 'hostonly'"))
    cause, pings, took = await _copy_fails_while_pings_fail(
        stand_in, monkeypatch, anyio_backend, f"ping-{kind}", error
    )
    assert isinstance(cause, wire.HostAdrift)
    assert pings == 1 and took < 10.0


def _unreadable_errors() -> list[Exception]:
    """Errors of a call that ran to its end on its actor, whose reply could not be read here."""
    from ray.exceptions import ObjectLostError, OwnerDiedError, RaySystemError

    return [
        RaySystemError(ModuleNotFoundError("No module named 'hostonly'")),  # (does not unpickle)
        ObjectLostError("ab" * 14, "", ""),
        OwnerDiedError("ab" * 14, "", ""),
    ]


def test_ray_takes_only_an_actor_error_short_of_death_as_a_call_that_may_still_run() -> None:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

    ray_store = wire.RayStore()
    assert not ray_store.ended(ActorUnavailableError("unavailable", None))
    assert not ray_store.ended(RayActorError())
    assert ray_store.ended(ActorDiedError())
    assert ray_store.died(ActorDiedError()) and not ray_store.died(ActorUnavailableError("u", None))
    raised = RayTaskError("run", "traceback", ActorUnavailableError("u", None))  # (the call raised it)
    assert ray_store.ended(raised) and ray_store.ended(raised.as_instanceof_cause())
    for error in _unreadable_errors():
        assert ray_store.ended(error), error
        assert not ray_store.died(error), error


@pytest.mark.parametrize("which", range(len(_unreadable_errors())))
async def test_a_copy_whose_reply_cannot_be_read_fails_and_leaves_its_host_running(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, which: int
) -> None:
    # the host ran the copy to its end; only reading its reply failed here: the copy fails (the
    # host lost for this connection), but a host shared with others is not killed for it
    _copies(monkeypatch, staging.DIRECT)
    name, dev = _own_device(stand_in, anyio_backend, f"unreadable-{which}")
    nbytes = 1 << 20
    buf = await filled_buffer(dev.name, np.full(nbytes, 7, np.uint8))  # (probed)
    kills: list[Any] = []
    monkeypatch.setattr(stand_in, "kill_actor", kills.append)
    real_call, real_get, runs = stand_in.call, stand_in.get, []

    def call(host: Host, method: str, args: tuple[Any, ...]) -> Any:
        fut = real_call(host, method, args)
        if method == "run":
            runs.append(fut)
        return fut

    def get(ref: Any, timeout: float | None = None) -> Any:
        if any(ref is run for run in runs):
            real_get(ref, timeout)  # (the call ran to its end)
            raise _unreadable_errors()[which]
        return real_get(ref, timeout)

    monkeypatch.setattr(stand_in, "call", call)
    monkeypatch.setattr(stand_in, "get", get)
    with anyio.fail_after(30), pytest.raises(DeviceError, match=f"host {name}: device lost") as failed:
        await buf.copyout(np.zeros(nbytes, np.uint8))
    monkeypatch.undo()
    assert not isinstance(failed.value.cause, wire.HostAdrift)
    assert kills == [] and name in stand_in.hosts()
    await dev.reset()  # (the same host, reconnected)
    await _copies_again(dev, np.zeros(nbytes, np.uint8), 3)
    await dev.aclose()


def test_a_process_is_gone_once_it_ended_and_not_before() -> None:
    child = subprocess.Popen(["sleep", "infinity"])
    process = (child.pid, staging._started(child.pid))
    assert not staging.gone(process, time.monotonic())  # (it runs: not gone by the deadline)
    assert not staging.gone((os.getpid(), staging._started(os.getpid())), time.monotonic())
    assert staging.gone((child.pid, "0"), time.monotonic())  # (another process of that pid)
    child.kill()
    child.wait()
    assert staging.gone(process, time.monotonic())


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED])
async def test_a_copy_whose_host_ray_calls_dead_waits_for_its_process_to_end(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch, anyio_backend: Any, mode: str
) -> None:
    # Ray reports the host dead while its process still runs (it could still write the
    # caller's memory): the copy fails only once that process is gone, else its memory is
    # never reused (HostAdrift)
    nbytes = 1 << 20
    name, dev, buf = await _probed(
        stand_in, monkeypatch, anyio_backend, mode, "lingers", np.full(nbytes, 0x5A, np.uint8)
    )
    monkeypatch.setattr(stream, "DEATH_WAIT_S", 0.05)  # (a bound: never a wait that syncs)
    lingering: list[Host] = []
    monkeypatch.setattr(stand_in, "end_process", lingering.append)  # (the process outlives it)
    real_call, sent = stand_in.call, threading.Event()

    def call(host: Host, method: str, args: tuple[Any, ...]) -> Any:
        fut = real_call(host, method, args)
        if method == "run":
            sent.set()
        return fut

    monkeypatch.setattr(stand_in, "call", call)
    stand_in.pause(name)
    kept = len(client._QUARANTINED)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:

            async def kill() -> None:
                await anyio.to_thread.run_sync(sent.wait)
                stand_in.kill(name)

            tg.start_soon(kill)
            with pytest.raises(DeviceError, match=f"host {name}: device lost") as failed:
                await buf.copyout(np.zeros(nbytes, np.uint8))
    assert isinstance(failed.value.cause, wire.HostAdrift)
    if mode == staging.DIRECT:
        assert len(client._QUARANTINED) == kept + 1
    else:
        assert len(dev.conn.staging._free) == dev.conn.staging.made - 1  # (its segment is not reused)
    monkeypatch.undo()
    for host in lingering:
        stand_in.end_process(host)
    stand_in.start(name)
    await dev.reset()
    await dev.aclose()


async def test_a_probe_overtaken_by_a_reconnection_leaves_the_new_host_to_probe(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    # a probe of the old host that ends after a reconnection began sets no mode: copies to the
    # new host wait for its own probe
    _, dev = _own_device(stand_in, anyio_backend, "probe-overtaken")
    conn = dev.conn

    def probe(where: Any, token: bytes) -> bool:
        conn.reconnect()  # (meanwhile, a reset reconnects)
        return True

    assert await anyio.to_thread.run_sync(conn.staging.probed, probe) == staging.DIRECT
    assert conn.staging.mode is None
    buf = await filled_buffer(dev.name, np.full(1 << 20, 4, np.uint8))  # (probes the new host)
    out = np.empty(1 << 20, np.uint8)
    await buf.copyout(out)
    assert (out == 4).all() and conn.staging.mode == staging.DIRECT
    await dev.aclose()


def test_closing_a_connection_after_ray_shut_down_starts_no_new_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection's sender thread closes its staging at interpreter exit, after Ray shut
    down: a call on the host's actor handle then would initialize a new local Ray."""
    import ray

    calls: list[object] = []

    class Unstage:
        def remote(self, client_id: object) -> None:
            calls.append(client_id)

    class ActorHandle:  # (a Ray actor handle's type, as the staging sees it)
        unstage = Unstage()

    ActorHandle.__module__ = "ray.actor"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    shut = staging.Staging()
    shut.host = (ActorHandle(), b"client")
    shut.close()
    assert calls == []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    running = staging.Staging()
    running.host = (ActorHandle(), b"client")
    running.close()
    assert calls == [b"client"]


# ---- copies made here, into and out of the host's memory (aiotinyrt/ray/shared.py) ------------
def _host_name(dev: client.RAYDevice) -> str:
    """The name of ``dev``'s host (``RAY:<host>/<device>``)."""
    return dev.name.split(":")[1].split("/")[0]


async def _named(
    stand_in: StandIn,
    anyio_backend: Any,
    tag: str,
    monkeypatch: pytest.MonkeyPatch | None = None,
    mode: str = "",
) -> tuple[client.RAYDevice, Buffer, Any]:
    """A device of a host of its own and a buffer of 1 MiB ints on it, filled through the host
    (``arange``, whose reply named the buffer's memory), copying the ``mode`` way if given (as
    :func:`_copies`); and the connection's known host memory."""
    if mode:
        assert monkeypatch is not None
        _copies(monkeypatch, mode, here=True)
    _, dev = _own_device(stand_in, anyio_backend, f"{tag}-{mode}")
    x = np.arange(1 << 18, dtype=np.int32)
    buf = await filled_buffer(dev.name, x)
    memory = dev.conn.staging.memory
    assert memory.known(buf.handle().id) and memory.copies == 0
    return dev, buf, memory


@pytest.mark.parametrize("mode", [staging.DIRECT, staging.STAGED])
async def test_copies_of_an_idle_buffer_are_made_here_once_the_host_named_its_memory(
    stand_in: StandIn, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "here", monkeypatch, mode)
    assert dev.conn.staging.mode == mode
    prog = await dev.program("add1", ADD_SRC)
    calls = dev.conn.calls
    out = np.empty(1 << 18, np.int32)
    await buf.copyout(out)
    assert (out == np.arange(1 << 18)).all()
    y = np.arange(1 << 18, dtype=np.int32)[::-1].copy()
    await buf.copyin(y)
    part = np.empty(1 << 16, np.int32)  # (a view at an offset: bytes [512 KiB, 768 KiB))
    await buf.view(1 << 18, dtypes.uint8, 1 << 19).copyout(part.view(np.uint8))
    assert (part == y[1 << 17 : (1 << 17) + (1 << 16)]).all()
    assert memory.copies == 3 and dev.conn.calls == calls  # (no call to the host)
    await prog(buf)  # (the host's kernel reads what was copied in here)
    await buf.copyout(out)
    assert (out[:N] == y[:N] + 1).all() and (out[N:] == y[N:]).all() and memory.copies == 4
    await dev.aclose()


async def test_a_copy_behind_pending_work_it_can_name_to_the_host_goes_through_the_host(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "behind")
    prog = await dev.program("add1", ADD_SRC)
    out = np.empty(1 << 18, np.int32)
    prog(buf)
    await buf.copyout(out)  # (waits for the launch on the host, in the launch's call)
    assert memory.copies == 0
    assert (out[:N] == np.arange(N) + 1).all() and (out[N:] == np.arange(N, 1 << 18)).all()
    await dev.aclose()


def _held_back(dev: client.RAYDevice, sig: Any) -> bool:
    """Whether the command of ``sig`` is held back: by its queue (a dependency without an event
    on the host) or by its queue's driver (behind a copy made here)."""
    for queue in dev.queues.values():
        if sig in getattr(queue, "_held", ()):
            return True
        held = getattr(getattr(queue, "driver", None), "_held", None) or ()
        if any(cmd[3].value == sig.value and cmd[3].queue.timeline is sig.timeline for cmd in held):
            return True
    return False


@pytest.mark.parametrize("later", ["copyin", "launch"])
async def test_what_writes_the_buffer_after_a_copy_made_here_waits_for_it(
    stand_in: StandIn, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch, later: str
) -> None:
    # the copy made here waits until the later write completed or is held back: were it sent,
    # the host would write the bytes first and the copy would read them
    dev, buf, memory = await _named(stand_in, anyio_backend, f"held-{later}")
    prog = await dev.program("add1", ADD_SRC)
    real, after, made = shared.copy, [], []

    def gated(dst: int, src: int, nbytes: int) -> None:
        if not made:  # (the first copy; a copyin held behind it is made here too, ungated)
            _until(lambda: bool(after) and (after[0].done() or _held_back(dev, after[0])))
        made.append(nbytes)
        real(dst, src, nbytes)

    monkeypatch.setattr(shared, "copy", gated)
    out = np.full(1 << 18, -1, np.int32)
    first = buf._enqueue_copy(memoryview(out), into=False)
    if later == "copyin":  # (the same queue: held by its driver)
        after.append(buf._enqueue_copy(memoryview(np.full(1 << 18, 7, np.int32)), into=True))
    else:  # (the compute queue: held by the queue, the copy has no event on the host)
        after.append(prog(buf))
    await first
    await after[0]
    assert memory.copies == (2 if later == "copyin" else 1) and (out == np.arange(1 << 18)).all()
    final = np.empty(1 << 18, np.int32)
    await buf.copyout(final)
    expected = np.full(1 << 18, 7, np.int32) if later == "copyin" else np.arange(1 << 18, dtype=np.int32)
    if later == "launch":
        expected[:N] += 1
    assert (final == expected).all()
    await dev.aclose()


async def test_a_host_memory_file_that_is_not_the_one_named_sends_copies_through_the_host(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "refused")
    rid = buf.handle().id
    where = memory._where[rid]
    memory._where[rid] = where._replace(ino=where.ino + 1)  # (another file behind that fd)
    calls = dev.conn.calls
    out = np.empty(1 << 18, np.int32)
    await buf.copyout(out)
    assert (out == np.arange(1 << 18)).all()
    assert memory.refused and memory.copies == 0 and dev.conn.calls > calls
    await buf.copyin(np.ones(1 << 18, np.int32))  # (no more tries: the host copies, names nothing)
    assert not memory.known(rid) and ((await buf.numpy()) == 1).all() and memory.copies == 0
    await dev.aclose()


async def test_a_freed_buffer_is_forgotten_and_a_reconnection_forgets_every_one(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "forget")
    other = await filled_buffer(dev.name, np.zeros(1 << 18, np.int32))
    await buf.copyout(np.empty(1 << 18, np.int32))  # (mapped here)
    rid = buf.handle().id
    assert rid in memory._maps and memory.known(other.handle().id)
    await buf.free()
    assert not memory.known(rid) and rid not in memory._maps
    memory.refused = True  # (the old host's files did not open here: the new one's may)
    dev.conn.staging.reconnected()
    assert not memory.known(other.handle().id) and not memory.refused
    await dev.aclose()


async def test_a_close_cut_short_releases_the_buffers_only_after_a_copy_made_here_ended(
    stand_in: StandIn, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # released under the copy, the host's memory would go to its next buffer of that size while
    # this process still writes it
    dev, buf, memory = await _named(stand_in, anyio_backend, "close-cut")
    host = stand_in._hosts[_host_name(dev)]
    real, go = shared.copy, threading.Event()

    def gated(dst: int, src: int, nbytes: int) -> None:
        go.wait(30)
        real(dst, src, nbytes)

    monkeypatch.setattr(shared, "copy", gated)
    sig = buf._enqueue_copy(memoryview(np.full(1 << 18, 7, np.int32)), into=True)
    release, copy_done_then = host._ops[wire.RELEASE], []

    async def watched(*args: Any) -> Any:
        copy_done_then.append(sig.done())
        return await release(*args)

    monkeypatch.setitem(host._ops, wire.RELEASE, watched)
    monkeypatch.setenv("CLOSE_TIMEOUT_S", "0.2")  # (the close stops waiting for the queue)
    drivers = [q.driver for q in dev.queues.values()]
    async with anyio.create_task_group() as tg:
        tg.start_soon(dev.aclose)
        # the gate opens once the close waits for the copy (or, wrongly, released without it)
        await anyio.to_thread.run_sync(
            _until, lambda: bool(copy_done_then) or any(d.waiting for d in drivers)
        )
        go.set()
    assert copy_done_then == [True] and sig.done() and memory.copies == 1


async def test_a_copy_whose_thread_does_not_start_goes_through_the_host(
    stand_in: StandIn, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "no-copier")

    def refused(*args: Any) -> None:  # (as under a thread limit)
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(shared, "start", refused)
    out = np.empty(1 << 18, np.int32)
    await buf.copyout(out)
    await buf.copyin(out[::-1].copy())
    await buf.copyout(out)
    assert (out == np.arange(1 << 18)[::-1]).all() and memory.copies == 0
    await dev.aclose()


async def test_buffers_released_at_close_are_forgotten_here(stand_in: StandIn, anyio_backend: Any) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "released")
    await buf.copyout(np.empty(1 << 18, np.int32))  # (mapped here)
    rid = buf.handle().id
    assert rid in memory._maps
    await dev.aclose()
    assert not memory.known(rid) and rid not in memory._maps


async def test_no_copy_is_made_here_once_the_hosts_process_ended(
    stand_in: StandIn, anyio_backend: Any
) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "ended")
    await buf.copyout(np.empty(1 << 18, np.int32))  # (mapped here)
    stand_in.kill(_host_name(dev))
    with pytest.raises(DeviceError, match="device lost"):
        await buf.copyin(np.ones(1 << 18, np.int32))
    with pytest.raises(DeviceError, match="device lost"):
        await buf.copyout(np.empty(1 << 18, np.int32))
    assert memory.copies == 1
    await dev.aclose()


async def test_a_copy_made_here_that_fails_fails_its_command_and_the_queue_goes_on(
    stand_in: StandIn, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "copy-fails")

    def broken(dst: int, src: int, nbytes: int) -> None:
        raise OSError("the copy broke")

    monkeypatch.setattr(shared, "copy", broken)
    with anyio.fail_after(30), pytest.raises(DeviceError, match="the copy broke"):
        await buf.copyout(np.empty(1 << 18, np.int32))
    monkeypatch.undo()
    await dev.reset()
    out = np.empty(1 << 18, np.int32)
    with anyio.fail_after(30):
        await buf.copyout(out)
    assert (out == np.arange(1 << 18)).all() and memory.copies == 1
    await dev.aclose()


async def test_no_copy_is_made_here_once_the_hosts_process_is_a_zombie(
    stand_in: StandIn, anyio_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "zombie")
    await buf.copyout(np.empty(1 << 18, np.int32))  # (mapped here)
    host = stand_in._hosts[_host_name(dev)]
    child = stand_in._processes[id(host)]
    child.kill()  # (not reaped: a zombie until the stand-in ends it)
    await anyio.to_thread.run_sync(_until, lambda: staging.gone(host.process, time.monotonic()))
    calls = dev.conn.calls
    await buf.copyin(np.ones(1 << 18, np.int32))  # (the host itself still runs here: it copies)
    assert memory.copies == 1 and dev.conn.calls > calls
    await dev.aclose()


async def test_a_cancelled_close_still_releases_the_buffers(stand_in: StandIn, anyio_backend: Any) -> None:
    dev, buf, memory = await _named(stand_in, anyio_backend, "close-cancelled")
    host = stand_in._hosts[_host_name(dev)]
    conn = dev.conn
    with anyio.CancelScope() as scope:
        scope.cancel()
        await dev.aclose()
    assert await host.buffers(conn.client) == 0 and not memory.known(buf.handle().id)
