"""A stand-in for Ray, so aiotinyrt.ray's client and host run in one process without a cluster.

:class:`StandIn` plays :class:`aiotinyrt.ray.wire.Store`: each host is a real
:class:`aiotinyrt.ray.host.Host` on one asyncio loop in a thread of its own (as an async actor's
loop is), an actor call pickles its arguments and its result (as Ray serializes them) and
returns a ``concurrent.futures.Future``, and ``put`` keeps a copy under a ref. ``kill`` fails
a host's pending and later calls, as a dead actor's do. Each host reports a child process of
its own (``sleep``) as its process, which ends when the host is killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import itertools
import pickle
import subprocess
import threading
from typing import Any

from ray.exceptions import ActorDiedError, RayActorError

from aiotinyrt.ray.host import Host
from aiotinyrt.ray.staging import _started


class ActorDied(RuntimeError):
    """What a call of a killed stand-in host raises."""


class Ref:
    """An object of the stand-in store, named by a number (picklable, as a Ray ref is)."""

    def __init__(self, key: int) -> None:
        self.key = key


def _copy(value: Any) -> Any:
    return pickle.loads(pickle.dumps(value, protocol=5))


class Handle:
    """A stand-in actor handle: ``handle.method.remote(*args)`` returns a future."""

    def __init__(self, stand_in: StandIn, host: Host) -> None:
        self._stand_in = stand_in
        self._host = host
        self._actor_id = id(host)  # (as a Ray handle's: the same for every handle of the host)

    def __getattr__(self, method: str) -> Any:
        stand_in, host = self._stand_in, self._host

        class Method:
            @staticmethod
            def remote(*args: Any) -> concurrent.futures.Future[Any]:
                return stand_in.call(host, method, _copy(args))

        return Method


class StandIn:
    """The stand-in cluster and store (see the module docstring)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="stand-in host", daemon=True)
        self._thread.start()
        self._hosts: dict[str, Host] = {}
        self._dead: set[int] = set()
        self._killed: list[Host] = []
        self._pending: dict[int, set[concurrent.futures.Future[Any]]] = {}
        self._objects: dict[int, Any] = {}
        self._keys = itertools.count()
        self._held: dict[int, asyncio.Event] = {}
        self._paused: dict[int, asyncio.Event] = {}
        #: a call's future is settled by exactly one side: the kill of its host, which takes
        #: every future registered before it (under this lock), or the call's run, which
        #: unregisters its future under this lock while the host is alive; a run never starts
        #: the host's method once the host is dead
        self._calling = threading.Lock()
        self._processes: dict[int, subprocess.Popen[bytes]] = {}  # each host's process, by id(host)
        self.calls: dict[str, int] = {}  #: actor calls per method name
        self.puts = 0  #: objects put

    def start(self, name: str) -> Handle:
        """Start (or replace) the host ``name``."""
        if name in self._hosts:
            self._killed.append(self._hosts[name])  # (kept: no later host may reuse its id)
        host = self._hosts[name] = Host(name)
        # (the host's process, as its probe reports it: a child of its own, ended with it)
        child = self._processes[id(host)] = subprocess.Popen(
            ["sleep", "infinity"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        host.process = (child.pid, _started(child.pid))
        return Handle(self, host)

    def end_process(self, host: Host) -> None:
        """The process of ``host`` ends (and is reaped): when it is killed, or at :meth:`close`."""
        child = self._processes.pop(id(host), None)
        if child is not None:
            child.kill()
            child.wait()

    def hold(self, name: str) -> None:
        """Calls of host ``name`` wait (pending, not started) until it is killed."""
        self._held[id(self._hosts[name])] = asyncio.Event()

    def pause(self, name: str) -> None:
        """The ``run`` calls (command batches) of host ``name`` wait until :meth:`resume`; its
        other methods run at once, as a Ray actor starts a direct call while a batch waits."""
        self._paused[id(self._hosts[name])] = asyncio.Event()

    def resume(self, name: str) -> None:
        """The paused ``run`` calls of host ``name`` go on."""
        event = self._paused.pop(id(self._hosts[name]))
        self.loop.call_soon_threadsafe(event.set)

    def kill(self, name: str) -> None:
        """The host ``name`` dies: its pending calls fail, and so does every later one."""
        with self._calling:
            host = self._hosts.pop(name)
            self._dead.add(id(host))
            self._killed.append(host)  # (kept: no later host may reuse its id)
            for waiting in (self._held, self._paused):  # (their calls end: the futures fail below)
                event = waiting.pop(id(host), None)
                if event is not None:
                    self.loop.call_soon_threadsafe(event.set)
            pending = list(self._pending.pop(id(host), ()))  # (these are the kill's to fail)
        self.end_process(host)
        for fut in pending:
            fut.set_exception(ActorDied(f"the actor {name} died"))

    def call(self, host: Host, method: str, args: tuple[Any, ...]) -> concurrent.futures.Future[Any]:
        """Run ``host.method(*args)`` on the hosts' loop; its future (the result copied)."""
        self.calls[method] = self.calls.get(method, 0) + 1
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._calling:
            dead = id(host) in self._dead
            if not dead:
                pending = self._pending.setdefault(id(host), set())
                pending.add(fut)
        if dead:
            fut.set_exception(ActorDied("the actor died"))
            return fut

        async def run() -> None:
            # (a host found dead here was killed after the call registered: the kill fails it)
            held = self._held.get(id(host))
            if id(host) in self._dead or held is not None:
                if held is not None:
                    await held.wait()  # (set only by the kill)
                return
            paused = self._paused.get(id(host))
            if paused is not None and method == "run":
                await paused.wait()
                if id(host) in self._dead:
                    return
            try:
                result = _copy(await getattr(host, method)(*args))
            except Exception as exc:
                error: Exception | None = exc
            else:
                error = None
            with self._calling:
                killed = id(host) in self._dead  # (then the kill took this future)
                if not killed:
                    pending.discard(fut)
            if killed:
                return
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

        # (a fresh context: not the caller's, whose event loop library sniffio would report)
        coro = run()
        try:
            self.loop.call_soon_threadsafe(self.loop.create_task, coro, context=contextvars.Context())
        except RuntimeError:  # (the stand-in is closed: the call never runs, as a dead actor's)
            coro.close()
            fut.set_exception(ActorDied("the stand-in is closed"))
        return fut

    def close(self) -> None:
        """Cancel the calls still running (a batch behind one never sent, a killed host's),
        then stop the hosts' loop and close it."""

        async def cancel() -> None:
            calls = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel(), self.loop).result(5)
        for host in [*self._hosts.values(), *self._killed]:
            self.end_process(host)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()

    # ---- the Store protocol -------------------------------------------------------------------
    def actor(self, host: str) -> Handle:
        """The handle of a running host; ValueError if none runs (as ``ray.get_actor``)."""
        if host not in self._hosts:
            raise ValueError(f"no actor named {host!r}")
        return Handle(self, self._hosts[host])

    def kill_actor(self, actor: Handle) -> None:
        """Kill the host of ``actor`` (nothing if it is dead already, or was replaced)."""
        host = actor._host
        if self._hosts.get(host.name) is host:
            self.kill(host.name)

    def died(self, error: BaseException) -> bool:
        """Whether ``error`` is a killed host's (a call of it fails so)."""
        return isinstance(error, (ActorDied, ActorDiedError))

    def ended(self, error: BaseException) -> bool:
        """Whether a call that failed with ``error`` is over: as Ray's store, all but an actor
        error that says the actor may still run (one a test raises, ``ActorUnavailableError``)."""
        return self.died(error) or not isinstance(error, RayActorError)

    def hosts(self) -> list[str]:
        """The running hosts' names."""
        return sorted(self._hosts)

    def put(self, value: Any) -> Ref:
        """Keep a copy of ``value``."""
        self.puts += 1
        key = next(self._keys)
        self._objects[key] = _copy(value)
        return Ref(key)

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        """A put object's value, or a call's result (blocks)."""
        if isinstance(ref, Ref):
            return self._objects[ref.key]
        return ref.result(timeout)

    async def wait(self, ref: Any) -> Any:
        """As :meth:`get`, awaited on the hosts' loop."""
        if isinstance(ref, Ref):
            return self._objects[ref.key]
        return await asyncio.wrap_future(ref)
