"""What a client and a device host share: the command stream's encoding, the errors, and the
:class:`Store` through which both reach Ray (actors by name, the object store).

A command is a tuple whose first item is one of the operation codes below; a batch is a list of
them, sent in one actor call (``Host.run``) whose one argument is the pickle of the client's id,
the batch's number and the batch (:func:`encode`; a batch with arrays or object refs adds
their buffers and refs as further arguments), and the host's reply holds one entry per command: a float (the
command ran, in that many device seconds) or a tuple ``(seconds, error message or None,
payload, cause)`` (``cause``: the exception the command failed with, where it pickles;
``payload``: a copyout's bytes, the statistics asked for, the count a release freed). Bulk
bytes never ride inside a call or a reply: a large copy names a staging segment of the client's
(:mod:`aiotinyrt.ray.staging`, a host on the same machine), or else travels through the object
store: a copyin as the ref of the client's put, a copyout as a payload that is a list holding
one object ref, which the host ``put`` straight from its buffer and the client reads zero-copy.

The store is a module attribute (:data:`STORE`, looked up at each use) so that the client and
the host can be driven in one process without Ray (tests put a stand-in there).
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import ray

#: Ray actor names of device hosts: ``aiotinyrt-host:<name>``.
ACTOR_PREFIX = "aiotinyrt-host:"
#: The Ray namespace of every device host, so that any job of the cluster finds them by name
#: (Ray's default namespace is one per job).
NAMESPACE = "aiotinyrt"

#: One command on the wire: a tuple whose first item is its operation code.
Command = tuple[Any, ...]

# operation codes (the first item of a command)
ALLOC, FREE, LOAD, LAUNCH, COPYIN, COPYOUT, TRANSFER, FETCH, CALL, RELEASE, STATS, RESET, UNSTAGE = range(13)

#: Copies up to this size travel inside the call or reply (Ray sends small values with the
#: call itself); larger ones go through the object store, ``put`` by the side that has them.
INLINE_BYTES = 64 * 1024

#: Copies over this size move in pieces of this size, one actor call (or one read of another
#: host) each; with :data:`PIECES_IN_FLIGHT`, what bounds the object-store memory one copy holds
#: at once. Pieces could overlap
#: one side's copy with the other's, but Ray's put copies with several threads and an actor call
#: submitted meanwhile is dispatched only once the put is done, so on a small machine they do not
#: (BENCHMARKS.md, Ray: 64 MiB copies ran faster in one piece than in four).
CHUNK_BYTES = 64 << 20

#: Pieces of one copy in the object store at once at most: a piece is put (or asked for) only
#: once the piece this many before it was copied out of the store.
PIECES_IN_FLIGHT = 2


def encode(client: str, seq: int, batch: list[Command], refs: bool = False) -> tuple[Any, ...]:
    """The arguments of the actor call (``Host.run``) carrying batch number ``seq`` of
    ``client``: one pickle of ``(client, seq, batch)``, then, only where there are any, the
    buffers of its arrays (out of band) and (``refs``: the batch may hold object refs) its
    object refs. Ray then serializes one bytes object, puts each array zero-copy, and passes the
    refs as refs (their owner known), instead of serializing each command; each argument of an
    actor call costs Ray roughly 0.05× a bare call (BENCHMARKS.md, Ray), so a batch of no arrays
    and no refs is one argument. (Looking for refs costs a call per pickled object: only small
    batches do.)"""
    buffers: list[pickle.PickleBuffer] = []
    found: list[Any] = []
    out = io.BytesIO()
    if refs:
        pickler: pickle.Pickler = _RefPickler(out, found, buffer_callback=buffers.append)
    else:
        pickler = pickle.Pickler(out, 5, buffer_callback=buffers.append)
    pickler.dump((client, seq, batch))
    blob = out.getvalue()
    if found:
        return blob, [np.frombuffer(b.raw(), np.uint8) for b in buffers], found
    if buffers:
        return blob, [np.frombuffer(b.raw(), np.uint8) for b in buffers]
    return (blob,)


#: What :func:`decode` returns: the client's id, the batch's number, its commands.
Batch = tuple[str, int, list[Command]]


def decode(blob: bytes, buffers: Sequence[Any] = (), refs: Sequence[Any] = ()) -> Batch:
    """``(client, seq, batch)`` of :func:`encode`'s arguments (the batch's arrays read the
    buffers given: zero-copy)."""
    if not refs:
        decoded: Batch = pickle.loads(blob, buffers=buffers)
        return decoded
    unpickler = _RefUnpickler(io.BytesIO(blob), refs, buffers=buffers)
    decoded = unpickler.load()
    return decoded


class _RefPickler(pickle.Pickler):
    """Pickles Ray object refs as their index in ``found``."""

    def __init__(self, out: io.BytesIO, found: list[Any], **kwargs: Any) -> None:
        super().__init__(out, 5, **kwargs)
        self._found = found

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, ray.ObjectRef):
            self._found.append(obj)
            return len(self._found) - 1
        return None


class _RefUnpickler(pickle.Unpickler):
    """Reads what :class:`_RefPickler` wrote, the refs taken from ``refs``."""

    def __init__(self, src: io.BytesIO, refs: Sequence[Any], **kwargs: Any) -> None:
        super().__init__(src, **kwargs)
        self._refs = refs

    def persistent_load(self, pid: Any) -> Any:
        return self._refs[pid]


class HostLost(RuntimeError):
    """The device host's actor is gone (killed, its node lost)."""


class HostAdrift(HostLost):
    """The host's call failed without the host being known dead (Ray reported the actor
    unavailable, and killing it was not confirmed in time): it may still run the call, so the
    memory the call names (the caller's, a staging segment) is never reused."""


class RemoteError(RuntimeError):
    """A command failed on the host; the message is the host's error."""


class Store(Protocol):
    """How the client and the host reach Ray: actors by name, object refs, the object store."""

    def actor(self, host: str) -> Any:
        """The handle of device host ``host``; ``ValueError`` when none runs."""
        ...

    def hosts(self) -> list[str]:
        """Names of the device hosts of the connected cluster (none when not connected)."""
        ...

    def put(self, value: Any) -> Any:
        """Put ``value`` into the object store; its ref."""
        ...

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        """The value of ``ref`` (blocks the calling thread)."""
        ...

    async def wait(self, ref: Any) -> Any:
        """The value of ``ref``, awaited on a host's (asyncio) event loop."""
        ...

    def kill_actor(self, actor: Any) -> None:
        """Kill the actor ``actor`` (its calls fail as its death's; it is not restarted)."""
        ...

    def died(self, error: BaseException) -> bool:
        """Whether a call that raised ``error`` says its actor is dead."""
        ...

    def ended(self, error: BaseException) -> bool:
        """Whether a call whose result raised ``error`` runs no more: its actor is dead, the
        call itself raised, or only its reply could not be read (the call ran to its end); not
        when the actor is only unreachable for the moment (Ray's ``ActorUnavailableError``, a
        lost connection: the call may still run, and the actor is killed before its memory is
        reused)."""
        ...


class RayStore:
    """The :class:`Store` on Ray itself."""

    def actor(self, host: str) -> Any:
        """``ray.get_actor`` of the host's actor name, in the hosts' namespace."""
        return ray.get_actor(ACTOR_PREFIX + host, namespace=NAMESPACE)

    def hosts(self) -> list[str]:
        """The host names among the cluster's named actors (the hosts' namespace)."""
        if not ray.is_initialized():
            return []
        actors = ray.util.list_named_actors(all_namespaces=True)
        names = [a["name"] for a in actors if a["namespace"] == NAMESPACE]
        return sorted(n[len(ACTOR_PREFIX) :] for n in names if n.startswith(ACTOR_PREFIX))

    def put(self, value: Any) -> Any:
        """``ray.put``: one copy into the object store (numpy arrays are read back zero-copy)."""
        return ray.put(value)

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        """``ray.get``."""
        return ray.get(ref, timeout=timeout)

    async def wait(self, ref: Any) -> Any:
        """``await ref`` (Ray refs are awaitable on asyncio)."""
        return await ref

    def kill_actor(self, actor: Any) -> None:
        """``ray.kill(actor, no_restart=True)``."""
        ray.kill(actor, no_restart=True)

    def died(self, error: BaseException) -> bool:
        """``ActorDiedError``."""
        return isinstance(error, ray.exceptions.ActorDiedError)

    def ended(self, error: BaseException) -> bool:
        """All but a ``RayActorError`` other than ``ActorDiedError`` (``ActorUnavailableError``:
        the actor may still run the call): the actor died, the call raised (``RayTaskError``,
        whatever its cause), or only reading its reply failed (``RaySystemError`` for a value
        that does not unpickle, ``ObjectLostError``)."""
        if isinstance(error, ray.exceptions.RayTaskError):
            return True
        actor = isinstance(error, ray.exceptions.RayActorError)
        return not actor or isinstance(error, ray.exceptions.ActorDiedError)


def failure(host: str, exc: BaseException) -> tuple[float, str, None, BaseException | None]:
    """The reply entry of a command that failed on ``host`` with ``exc``: the message names the
    host; the cause (a host ``DeviceError``'s own cause) travels too where it pickles and
    unpickles (an exception whose constructor does not take its message pickles, then fails to
    unpickle: the client could not read the reply)."""
    cause = getattr(exc, "cause", None) or exc
    try:
        pickle.loads(pickle.dumps(cause))
    except Exception:
        cause = None
    return (0.0, f"{host}: {exc}", None, cause)


#: The store in use (a stand-in may replace it; read at each use).
STORE: Store = RayStore()

#: ``listing.active``: this thread is listing a host's own devices (so the RAY backend lists none).
listing = threading.local()
