"""Awaitable tinygrad for async services: ``realize``, ``numpy`` and ``call`` of a TinyJit function.

tinygrad's API is synchronous and not thread-safe. Here every tinygrad call runs under one
process-wide lock, and:

* **Scheduling that may compile** (``realize``, ``numpy``, a TinyJit call before its graph is
  captured) runs in a worker thread: tinygrad may lower and compile kernels inside any of these,
  which must not happen on the loop thread.
* **A captured TinyJit call** (the serving path) runs on the loop thread: tinygrad's Python for
  the call and the replay's enqueue, nothing else (the kernels run on aiotinyrt's workers; the
  cost is measured in BENCHMARKS.md). If another thread holds the lock it goes to a worker thread.
* **Completion** is awaited on the loop: every command submitted to the tensors' AIO devices up
  to the end of the call (one in-order compute queue per device, so that is the call's work).
* Copies to the host are aiotinyrt copies (``Buffer.copyout``) on the copy queue.

Bad input raises before anything is enqueued: ``TypeError`` for a non-Tensor, ``ValueError``
for a tensor on a device that is not ``AIO``/``AIO:n``. A failed command raises aiotinyrt's
``DeviceError``.

Cancellation (all three coroutines): cancelling abandons the wait. Scheduling that already
started in a worker thread finishes (tinygrad cannot be interrupted), the launched work runs to
completion and the memory it uses stays alive until then (aiotinyrt's deferred frees).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
from tinygrad.device import Buffer as TinyBuffer
from tinygrad.device import Device as TinyDevice
from tinygrad.dtype import _to_np_dtype, dtypes, strong_dtype
from tinygrad.engine.jit import _TinyJit
from tinygrad.helpers import all_int
from tinygrad.tensor import Tensor

from aiotinyrt.allocator import host_bytes
from aiotinyrt.dtype import dtypes as rt_dtypes
from aiotinyrt.signal import Signal
from aiotinyrt.tinygrad.backend import AIODevice

T = TypeVar("T")

#: One tinygrad caller at a time (tinygrad's global state is not thread-safe).
tinygrad_lock = threading.Lock()


def _locked(fn: Callable[..., T], *args: Any) -> T:
    with tinygrad_lock:
        return fn(*args)


def _tensors_of(args: Sequence[Any]) -> list[Tensor]:
    out: list[Tensor] = []
    for arg in args:
        if isinstance(arg, Tensor):
            out.append(arg)
        elif isinstance(arg, (list, tuple)):
            out.extend(a for a in arg if isinstance(a, Tensor))
        elif isinstance(arg, dict):
            out.extend(a for a in arg.values() if isinstance(a, Tensor))
    return out


def aio_devices(tensors: Sequence[Tensor], what: str = "tensor") -> list[str]:
    """The AIO devices the tensors are on (checked: ``TypeError``/``ValueError``)."""
    devices: list[str] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what} {i} must be a tinygrad Tensor, got {type(t).__name__}")
        for name in t.device if isinstance(t.device, tuple) else (t.device,):
            if name is None or name.split(":")[0] != "AIO":
                raise ValueError(
                    f"{what} {i} is on {name}, not an AIO device; "
                    "create it with device='AIO' or move it with .to('AIO')"
                )
            if name not in devices:
                devices.append(name)
    return devices


async def _completion(devices: Sequence[str]) -> None:
    """Await everything submitted so far to these AIO devices; raise their sticky error."""
    rts = []
    for name in devices:
        dev = TinyDevice[name]
        assert isinstance(dev, AIODevice)
        rts.append(dev.rt)
    signals = [Signal(t, t.submitted) for rt in rts for t in rt.timelines]
    for sig in signals:
        await sig
    if not signals:
        await anyio.lowlevel.checkpoint()
    for rt in rts:
        if rt._error is not None:
            raise rt._error


async def realize(*tensors: Tensor) -> None:
    """Realize tensors on AIO devices and wait until their data is computed.

    tinygrad's scheduling (and any compilation) runs in a worker thread; the kernels on
    aiotinyrt's queues; the loop only awaits.

    Cancellation: cancels the wait; scheduling that already started finishes in its thread and
    the launched work runs to completion.
    """
    devices = aio_devices(tensors)
    if tensors:
        first, *rest = tensors
        await anyio.to_thread.run_sync(_locked, first.realize, *rest)
    await _completion(devices)


def _prepare_copy(tensor: Tensor) -> Tensor:
    """A realized contiguous tensor with the data of ``tensor`` (a worker thread: may compile)."""
    x = tensor.contiguous()
    x.realize()
    return x


def _start_copy(x: Tensor) -> tuple[np.ndarray[Any, Any], Signal]:
    """Enqueue the copy of realized, contiguous ``x`` into a new array (no waiting)."""
    buf = x.uop.buffer
    if not isinstance(buf, TinyBuffer):
        raise ValueError("numpy() of a tensor sharded over several devices: gather it on one device first")
    handle = buf.ensure_allocated()._buf
    out = np.empty(x.shape, dtype=_to_np_dtype(x.dtype))
    data = host_bytes(out, writable=True, what="numpy() destination")
    if handle.nbytes != data.nbytes:
        handle = handle.view(data.nbytes, rt_dtypes.uint8, 0)
    return out, handle._enqueue_copy(data, into=False)


def _host_ready(tensor: Tensor) -> Tensor:
    """``tensor`` in a dtype numpy has, checked (before anything runs)."""
    aio_devices([tensor])
    if isinstance(tensor.device, tuple):
        raise ValueError("numpy() of a tensor sharded over several devices: gather it on one device first")
    if not all_int(tensor.shape):
        raise ValueError(f"numpy() of a tensor of symbolic shape {tensor.shape}")
    if tensor.dtype in dtypes.weaks:
        tensor = tensor.cast(strong_dtype(tensor.dtype))
    if tensor.dtype in {dtypes.bfloat16, *dtypes.fp8s}:
        tensor = tensor.float()
    return tensor


async def numpy(tensor: Tensor) -> np.ndarray[Any, Any]:
    """A numpy copy of an AIO tensor: realized as by :func:`realize`, then copied out by
    aiotinyrt's copy queue (ordered after the kernels writing it).

    ``ValueError`` for a tensor on several devices or of symbolic shape (before anything runs).

    Cancellation: cancels the wait; the work and the copy still complete, into an array nobody
    sees.
    """
    tensor = _host_ready(tensor)
    if 0 in tensor.shape:
        await anyio.lowlevel.checkpoint()
        return np.empty(tensor.shape, dtype=_to_np_dtype(tensor.dtype))
    x = await anyio.to_thread.run_sync(_locked, _prepare_copy, tensor)
    out, sig = _start_copy(x)
    await sig
    return out


async def copyin(tensor: Tensor, data: object) -> None:
    """Copy host data (the buffer protocol, exactly the tensor's bytes) into a realized,
    contiguous AIO tensor, through aiotinyrt's ``Buffer.copyin``: ordered after the pending
    work using the tensor (a jit replay still reading it as input), never on the loop thread
    unless small and nothing pending touches it. The way to refill a jit's input tensor.

    ``ValueError`` for a tensor not on one AIO device, not realized, or not contiguous.

    Cancellation: a queued copy: cancels the wait; the copy completes (``data`` kept alive).
    """
    aio_devices([tensor])
    if isinstance(tensor.device, tuple) or not tensor.uop.is_realized or tensor.uop.contiguous_view() is None:
        raise ValueError(
            "copyin() needs a realized, contiguous tensor on one AIO device (.contiguous().realize())"
        )
    buf = tensor.uop.buffer
    assert isinstance(buf, TinyBuffer)
    await buf.ensure_allocated()._buf.copyin(data)


def _check_call(fn: object, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[list[Tensor], list[str]]:
    if not isinstance(fn, _TinyJit):
        raise TypeError(f"call() needs a TinyJit function, got {type(fn).__name__}")
    inputs = _tensors_of([*args, kwargs])
    return inputs, aio_devices(inputs, "argument")


def _replayable(fn: _TinyJit[Any], plain_output: bool = False) -> bool:
    """Whether a call of ``fn`` is a replay (runs no compiler; with ``plain_output``, returns
    one realized Tensor) and the lock was free: then the caller holds the lock."""
    captured = fn.captured
    if fn.cnt < 2 or captured is None:
        return False
    if plain_output and not (isinstance(captured.ret, Tensor) and captured.ret.uop.is_realized):
        return False
    return tinygrad_lock.acquire(blocking=False)


async def call(fn: _TinyJit[T], *args: Any, **kwargs: Any) -> T:
    """Call a ``TinyJit`` function on AIO tensors and wait until its outputs are computed.

    Once the jit has captured its graph (its third call on), the call runs on the loop thread:
    tinygrad's Python for the call and one aiotinyrt graph replay per device queue, enqueued
    without waiting; before that (tinygrad runs the function, then captures it, compiling), in
    a worker thread. Inputs not yet realized are realized in a worker thread first.

    The outputs are the jit's own buffers: the next call of the same jit overwrites them. Read
    them before calling it again, or use :func:`call_numpy`.

    Cancellation: cancels the wait; the call's work runs to completion.
    """
    inputs, devices = _check_call(fn, args, kwargs)
    pending = [t for t in inputs if not t.uop.is_realized]
    if pending:
        await realize(*pending)
    if _replayable(fn):
        try:
            ret = fn(*args, **kwargs)
        finally:
            tinygrad_lock.release()
    else:
        ret = await anyio.to_thread.run_sync(lambda: _locked(fn, *args, **kwargs))
    outputs = [d for d in aio_devices(_tensors_of([ret]), "output") if d not in devices]
    await _completion([*devices, *outputs])
    return ret


async def call_numpy(fn: _TinyJit[Any], *args: Any, **kwargs: Any) -> np.ndarray[Any, Any]:
    """:func:`call` and a numpy copy of its output (one Tensor), the copy enqueued in the same
    step as the call, so no later call of the same jit can overwrite the output first.

    Cancellation: cancels the wait; the work and the copy still complete.
    """
    inputs, _ = _check_call(fn, args, kwargs)
    pending = [t for t in inputs if not t.uop.is_realized]
    if pending:
        await realize(*pending)

    def run() -> tuple[np.ndarray[Any, Any], Signal]:
        ret = fn(*args, **kwargs)
        if not isinstance(ret, Tensor):
            raise TypeError(f"call_numpy() needs a jit returning one Tensor, got {type(ret).__name__}")
        ready = _host_ready(ret)
        if ready is ret and ret.uop.is_realized and ret.uop.contiguous_view() is not None:
            return _start_copy(ret)
        return _start_copy(_prepare_copy(ready))  # (a kernel: only in a worker thread)

    if _replayable(fn, plain_output=True):
        try:
            out, sig = run()
        finally:
            tinygrad_lock.release()
    else:
        out, sig = await anyio.to_thread.run_sync(_locked, run)
    await sig
    return out
