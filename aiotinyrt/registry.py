"""The device registry: ``Device["CPU"]`` opens a backend and returns its one instance.

Backends are found by scanning ``aiotinyrt/backends/ops_*.py`` (the module ``ops_cpu`` provides
``CPUDevice``) and imported when first opened. Every opened device is finalized at interpreter
exit: queued work is dropped (its signals fail) and workers are given a bounded time to finish
the command they are running, so exit never hangs.

:class:`DeviceLike` is what the layers below ``device.py`` (buffers, programs, graphs) know of a
device; :class:`~aiotinyrt.device.Compiled` is the one implementation.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import pkgutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from aiotinyrt import recorder
from aiotinyrt.allocator import Allocator
from aiotinyrt.helpers import getenv_str
from aiotinyrt.lifetime import exit_join_s, on_fork_in_child
from aiotinyrt.queue import Queue
from aiotinyrt.signal import DeviceError, Signal

#: Where backends live (scanned, not imported: a backend module is imported when first opened).
_BACKENDS = Path(__file__).parent / "backends"
# Preferred order when choosing Device.DEFAULT; backends not listed come after, alphabetically.
_DEFAULT_PRIORITY = ("CUDA", "OPENCL", "CPU")
_NEVER_DEFAULT = ("NULL",)


class DeviceLike(Protocol):
    """A device as buffers, programs and graphs use it (implemented by ``Compiled``)."""

    name: str
    queues: dict[str, Queue]
    _compute_queue: Queue
    _copy_queue: Queue
    _error: DeviceError | None

    @property
    def allocator(self) -> Allocator[Any]: ...
    @property
    def closed(self) -> bool: ...
    def _healthy(self) -> bool: ...
    def _check_open(self) -> None: ...
    def _barrier(self) -> tuple[Signal, ...]: ...
    def _fail(self, exc: BaseException, sig: Signal) -> DeviceError: ...
    def _refusal(self) -> DeviceError: ...
    def _forked(self) -> None: ...
    def _shutdown(
        self, *, drop_queued: bool, join_timeout: float | None, free_cache: bool = True
    ) -> None: ...


D = TypeVar("D", bound=DeviceLike)


class _DeviceRegistry(Generic[D]):
    """``Device[name]``: one opened device per canonical device name. (``aiotinyrt.Device`` is
    this same object, typed as a registry of :class:`~aiotinyrt.device.Compiled`.)"""

    def __init__(self) -> None:
        self._opened: dict[str, D] = {}
        self._lock = threading.RLock()
        self._atexit_registered = False
        self._registered: dict[str, Callable[[str], D]] = {}

    @property
    def backends(self) -> list[str]:
        """Backend names found in ``aiotinyrt/backends/ops_*.py`` and those registered with
        :meth:`register` (upper-case)."""
        found = {
            m.name[len("ops_") :].upper()
            for m in pkgutil.iter_modules([str(_BACKENDS)])
            if m.name.startswith("ops_")
        }
        return sorted(found | set(self._registered))

    def register(self, backend: str, device_class: Callable[[str], D]) -> None:
        """Make ``Device["<backend>"]`` (and ``<backend>:1``, ...) open ``device_class(name)``: a
        backend that lives outside ``aiotinyrt/backends`` (a plugin, a test double). Devices
        already open are not affected; registering a name again replaces the class."""
        if not isinstance(backend, str) or not backend.isidentifier() or backend != backend.upper():
            raise ValueError(f"backend names are upper-case identifiers, got {backend!r}")
        if not callable(device_class):
            raise TypeError(f"register({backend!r}, ...) needs a device class, got {device_class!r}")
        self._registered[backend] = device_class

    @staticmethod
    def canonicalize(name: str) -> str:
        """``cpu`` -> ``CPU``, ``CPU:0`` -> ``CPU``, ``cpu:1`` -> ``CPU:1``; anything after the
        first colon keeps its case (``DISK:/Path``)."""
        if not isinstance(name, str):
            raise TypeError(f"device name must be a str, got {type(name).__name__}")
        backend, sep, rest = name.partition(":")
        out = backend.upper() + sep + rest
        return out[:-2] if out.endswith(":0") else out

    def _backend_class(self, backend: str) -> Callable[[str], D]:
        if backend not in self.backends:
            raise ValueError(
                f"unknown device backend {backend!r}; available backends: {', '.join(self.backends)}"
            )
        registered = self._registered.get(backend)
        if registered is not None:
            return registered
        module = importlib.import_module(f"aiotinyrt.backends.ops_{backend.lower()}")
        cls: Callable[[str], D] = getattr(module, f"{backend}Device")
        return cls

    def __getitem__(self, name: str) -> D:
        canonical = self.canonicalize(name)
        device = self._opened.get(canonical)
        if device is not None:
            return device
        backend, _, suffix = canonical.partition(":")
        if not backend:
            raise ValueError(f"empty device name {name!r}")
        with self._lock:
            device = self._opened.get(canonical)
            if device is not None:
                return device
            cls = self._backend_class(backend)
            if suffix and not getattr(cls, "accepts_path", False) and not suffix.isdigit():
                raise ValueError(f"bad device name {name!r}: the part after ':' must be a device index")
            device = cls(canonical)
            self._opened[canonical] = device
            if not self._atexit_registered:
                atexit.register(self._finalize_all)
                self._atexit_registered = True
            return device

    def __contains__(self, name: str) -> bool:
        return self.canonicalize(name) in self._opened

    def opened(self) -> list[D]:
        """Devices currently open, in the order they were opened."""
        return list(self._opened.values())

    def _forget(self, device: D) -> None:
        with self._lock:
            if self._opened.get(device.name) is device:
                del self._opened[device.name]

    @property
    def DEFAULT(self) -> str:
        """Env ``DEV`` if set, else the first backend that opens here (never NULL)."""
        env = getenv_str("DEV")
        if env:
            return self.canonicalize(env)
        order = [b for b in _DEFAULT_PRIORITY if b in self.backends]
        order += [b for b in self.backends if b not in order and b not in _NEVER_DEFAULT]
        for backend in order:
            try:
                self[backend]
            except Exception:
                continue
            return backend
        raise RuntimeError(f"no device opens here (backends tried: {', '.join(order)})")

    def _after_fork(self) -> None:
        """In a forked child (no worker threads there): every device the parent opened refuses
        use from now on; ``Device[name]`` opens fresh ones (see :mod:`aiotinyrt.lifetime`)."""
        inherited = list(self._opened.values())
        self._opened = {}
        self._lock = threading.RLock()
        for device in inherited:
            device._forked()

    def _finalize_all(self) -> None:
        """Interpreter exit: drop queued work and stop workers, with a bounded wait; write the
        PROFILE trace if asked for."""
        write_profile(self.opened())
        for device in self.opened():
            with contextlib.suppress(Exception):
                device._shutdown(drop_queued=True, join_timeout=exit_join_s())


Device: _DeviceRegistry[DeviceLike] = _DeviceRegistry()
on_fork_in_child(Device._after_fork)


def write_profile(devices: Sequence[DeviceLike], path: str | None = None) -> str | None:
    """Write every queue's recorded commands as a Chrome-trace/Perfetto JSON file (env
    ``PROFILE``: a path, or ``1`` for ``aiotinyrt_profile.json``; see :mod:`aiotinyrt.recorder`)
    and say where on stderr. Returns the path written."""
    return recorder.write(devices, path)
