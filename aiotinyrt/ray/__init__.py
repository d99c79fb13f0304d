"""Remote devices on Ray actors, driven through the ordinary Device/Buffer/Program/Signal API.

A *device host* is a Ray async actor (:data:`HostActor`) holding real aiotinyrt devices on its
own event loop; :func:`start_host` starts one (placed by the Ray options given: resources, node
affinity). Importing this package registers the ``RAY`` backend: ``Device["RAY:<host>/CPU:1"]``
opens the host's ``CPU:1`` as a :class:`RAYDevice`, a ``Compiled`` whose four components are
remote (:mod:`aiotinyrt.ray.client`).

Order and hazards are resolved on the host (:mod:`aiotinyrt.ray.host`); the command stream's
encoding and the way both sides reach Ray are in :mod:`aiotinyrt.ray.wire`, the client's
sending of it in :mod:`aiotinyrt.ray.stream`.
"""

from __future__ import annotations

from aiotinyrt.ray import wire
from aiotinyrt.ray.client import (
    _CONNECTIONS,
    BATCH_LIMIT,
    RAYDevice,
    RemoteAllocator,
    RemoteCompiler,
    RemoteHandle,
    RemoteProgram,
)
from aiotinyrt.ray.host import HostActor, start_host
from aiotinyrt.ray.wire import ACTOR_PREFIX, NAMESPACE, HostAdrift, HostLost, RemoteError


def running_hosts() -> list[str]:
    """Names of the device hosts running on the connected Ray cluster (none when Ray is not
    initialized). Blocks for one call to Ray's control store."""
    return wire.STORE.hosts()


__all__ = [
    "ACTOR_PREFIX",
    "BATCH_LIMIT",
    "NAMESPACE",
    "_CONNECTIONS",
    "HostActor",
    "HostAdrift",
    "HostLost",
    "RAYDevice",
    "RemoteAllocator",
    "RemoteCompiler",
    "RemoteError",
    "RemoteHandle",
    "RemoteProgram",
    "running_hosts",
    "start_host",
]
