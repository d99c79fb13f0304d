"""The device registry, Device.DEFAULT, open_device, synchronize, and Compiled's coroutines."""

from __future__ import annotations

import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, Compiled, Device, DeviceError, dtypes
from aiotinyrt.registry import _DeviceRegistry
from tests.helpers import INC, SPIN, assert_cancelled_at_entry, gate_on, int_buffer

pytestmark = pytest.mark.anyio

# ---- registry (synchronous) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("cpu", "CPU"),
        ("CPU", "CPU"),
        ("CPU:0", "CPU"),
        ("cpu:0", "CPU"),
        ("cpu:1", "CPU:1"),
        ("Cpu:12", "CPU:12"),
        ("null", "NULL"),
        ("disk:/Path/To/File", "DISK:/Path/To/File"),
    ],
)
def test_canonicalize_upper_cases_the_backend_and_drops_index_zero(name: str, canonical: str) -> None:
    assert Device.canonicalize(name) == canonical


def test_canonicalize_rejects_non_strings() -> None:
    with pytest.raises(TypeError, match="str"):
        Device.canonicalize(0)  # type: ignore[arg-type]


def test_device_lookup_returns_one_instance_per_canonical_name() -> None:
    cpu = Device["CPU"]
    assert isinstance(cpu, Compiled)
    assert cpu.name == "CPU"
    assert Device["cpu"] is cpu
    assert Device["CPU:0"] is cpu
    assert Device["CPU:1"] is not cpu
    assert Device["cpu:1"] is Device["CPU:1"]
    assert "cpu" in Device


def test_unknown_backend_error_lists_the_available_backends() -> None:
    with pytest.raises(ValueError, match="unknown device backend 'NOPE'") as info:
        Device["nope"]
    assert "CPU" in str(info.value)
    assert "NULL" in str(info.value)


@pytest.mark.parametrize("name", ["CPU:x", "CPU:-1", ":1", ""])
def test_malformed_device_names_raise_value_error(name: str) -> None:
    with pytest.raises(ValueError):
        Device[name]


def test_default_device_honours_env_dev(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEV", "cpu:1")
    assert Device.DEFAULT == "CPU:1"
    monkeypatch.setenv("DEV", "null")
    assert Device.DEFAULT == "NULL"  # explicitly asked for


def test_default_device_without_env_is_cpu_never_null(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEV", raising=False)
    assert Device.DEFAULT == "CPU"


def test_default_device_never_falls_back_to_null(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEV", raising=False)
    monkeypatch.setattr(_DeviceRegistry, "backends", property(lambda self: ["NULL"]))
    with pytest.raises(RuntimeError, match="no device opens here"):
        Device.DEFAULT  # noqa: B018


def test_get_available_devices_lists_the_backends_that_open() -> None:
    available = rt.get_available_devices()
    assert "CPU" in available
    assert "NULL" in available
    assert available == sorted(available)
    assert all(Device.canonicalize(name) == name for name in available)


def test_backends_are_found_by_scanning_ops_modules() -> None:
    assert {"CPU", "NULL"} <= set(Device.backends)


# ---- open_device and closing --------------------------------------------------------------------


async def test_open_device_closes_it_and_a_later_lookup_opens_a_new_instance() -> None:
    async with rt.open_device("cpu:2") as dev:
        assert dev.name == "CPU:2"
        assert Device["CPU:2"] is dev
        assert not dev.closed
    assert dev.closed
    assert "CPU:2" not in Device
    fresh = Device["CPU:2"]
    assert fresh is not dev
    assert not fresh.closed
    await fresh.aclose()


async def test_open_device_waits_for_queued_work_on_exit() -> None:
    async with rt.open_device("CPU:2") as dev:
        prog = await dev.program("spin", SPIN)
        out = await int_buffer("CPU:2")
        sigs = [prog(out, vals=(5,)) for _ in range(10)]
    assert all(s.done() and not s.failed() for s in sigs)


async def test_open_device_closes_the_device_when_the_body_raises() -> None:
    with pytest.raises(KeyError):
        async with rt.open_device("CPU:2") as dev:
            raise KeyError("body failed")
    assert dev.closed


async def test_closed_device_refuses_new_work_with_device_error() -> None:
    dev = Device["CPU:2"]
    prog = await dev.program("inc", INC)
    lib = prog.lib
    out = await int_buffer("CPU:2")
    await dev.aclose()
    with pytest.raises(DeviceError, match="closed"):
        prog(out)
    with pytest.raises(DeviceError, match="closed"):
        dev.runtime("inc", lib)
    with pytest.raises(DeviceError, match="closed"):
        await dev.program("inc", INC)
    await dev.aclose()  # closing twice is harmless


async def test_buffer_of_a_closed_device_raises_device_error_and_does_not_reopen_it() -> None:
    async with rt.open_device("CPU:6") as dev:
        buf = await int_buffer("CPU:6", 1, size=1024)
    assert dev.closed
    with pytest.raises(DeviceError, match="closed"):
        await buf.copyin(np.zeros(1024, np.int32))
    with pytest.raises(DeviceError, match="closed"):
        await buf.numpy()
    assert "CPU:6" not in Device  # a stale buffer must not silently open a new device
    await buf.free()  # cleanup paths still work
    assert "CPU:6" not in Device


# ---- synchronize ----------------------------------------------------------------------------------


async def test_device_synchronize_waits_for_everything_submitted() -> None:
    dev = Device["CPU"]
    prog = await dev.program("spin", SPIN)
    out = await int_buffer("CPU")
    sigs = [prog(out, vals=(2,)) for _ in range(5)]
    await dev.synchronize()
    assert all(s.done() for s in sigs)
    assert (await out.numpy()).tolist() == [5]
    await out.free()


async def test_rt_synchronize_waits_for_several_devices() -> None:
    spin = await Device["CPU"].program("spin", SPIN)
    spin1 = await Device["CPU:1"].program("spin", SPIN)
    null = await Device["NULL"].program("k", "k")
    a, b = await int_buffer("CPU"), await int_buffer("CPU:1")
    sigs = [spin(a, vals=(20,)), spin1(b, vals=(20,)), null()]
    await rt.synchronize("CPU", Device["CPU:1"], "null")
    assert all(s.done() for s in sigs)
    sigs = [spin(a, vals=(20,)), spin1(b, vals=(20,)), null()]
    await rt.synchronize()  # default: every opened device
    assert all(s.done() for s in sigs)
    await a.free()
    await b.free()


async def test_rt_synchronize_default_covers_every_opened_device() -> None:
    async with gate_on("CPU:1") as gate:
        out = await int_buffer("CPU:1")
        sig = gate.launch(out)
        gate.open()
        await rt.synchronize()
        assert sig.done()
        await out.free()


# ---- run and program ------------------------------------------------------------------------------


async def test_run_launches_and_returns_device_seconds() -> None:
    dev = Device["CPU"]
    prog = await dev.program("inc", INC)
    out = await int_buffer("CPU")
    secs = await dev.run(prog, out)
    assert type(secs) is float
    assert (await out.numpy()).tolist() == [1]
    await out.free()


async def test_run_rejects_a_non_program_and_another_devices_program() -> None:
    prog1 = await Device["CPU:1"].program("inc", INC)
    out = await int_buffer("CPU")
    with pytest.raises(TypeError, match="Program"):
        await Device["CPU"].run("inc", out)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPU:1"):
        await Device["CPU"].run(prog1, out)
    assert (await out.numpy()).tolist() == [0]
    await out.free()


async def test_program_compiles_through_the_cache_and_loads() -> None:
    dev = Device["CPU"]
    await dev.program("inc", INC)
    before = dev.compiler.compiles
    prog = await dev.program("inc", INC)
    assert dev.compiler.compiles == before
    assert prog.device is dev
    assert prog.name == "inc"
    assert (prog.buf_count, prog.val_count) == (1, 0)


# ---- the checkpoint rule ------------------------------------------------------------------------


async def test_synchronize_is_a_checkpoint() -> None:
    dev = Device["CPU"]
    await dev.synchronize()
    await assert_cancelled_at_entry(dev.synchronize)


async def test_rt_synchronize_is_a_checkpoint() -> None:
    Device["CPU"]
    await assert_cancelled_at_entry(rt.synchronize)
    await assert_cancelled_at_entry(lambda: rt.synchronize("CPU", "NULL"))


async def test_program_is_a_checkpoint_on_a_cache_hit_and_compiles_nothing_on_a_miss() -> None:
    dev = Device["CPU"]
    await dev.program("inc", INC)
    await assert_cancelled_at_entry(lambda: dev.program("inc", INC))
    before = dev.compiler.compiles
    await assert_cancelled_at_entry(lambda: dev.program("inc", INC + "\n// never compiled\n"))
    assert dev.compiler.compiles == before


async def test_run_is_a_checkpoint_and_launches_nothing_when_cancelled() -> None:
    dev = Device["CPU"]
    prog = await dev.program("inc", INC)
    out = await int_buffer("CPU")
    submitted = dev._compute_queue.timeline.submitted
    await assert_cancelled_at_entry(lambda: dev.run(prog, out))
    await dev.synchronize()
    assert dev._compute_queue.timeline.submitted == submitted
    assert (await out.numpy()).tolist() == [0]
    await out.free()


async def test_buffers_of_the_default_device_work() -> None:
    buf = await Buffer(Device.DEFAULT, 4, dtypes.float32).allocate()
    await buf.copyin(np.arange(4, dtype=np.float32))
    assert (await buf.numpy()).tolist() == [0.0, 1.0, 2.0, 3.0]
    await buf.free()
