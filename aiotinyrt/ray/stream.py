"""A client's command stream to one device host: batches, pieces sent apart, the waiter
thread that hands each reply to its command (see :class:`Connection`).

Every RAY device of one host in this process shares the host's connection (:func:`connection`):
the driver context of their queues.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import os
import queue as _queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread
import sniffio

try:
    import trio
except ImportError:  # (trio is optional)
    trio = None  # type: ignore[assignment]

from aiotinyrt.ray import wire
from aiotinyrt.ray.staging import Direct, Segment, Staged, Staging, gone
from aiotinyrt.ray.wire import Command, HostAdrift, HostLost, RemoteError
from aiotinyrt.signal import DeviceError

#: What a command's reply is handed to: ``(reply entry, error)``.
Reply = Callable[[Any, BaseException | None], None]
#: A command sent in an actor call of its own: the function making it, and its reply.
Part = tuple[Callable[[], Command], Reply]

#: A program's load: ``((device, content hash), its load command)``.
Load = tuple[tuple[str, str], Command]

#: Commands per actor call at most: a loop turn submitting more sends a call every this many.
BATCH_LIMIT = 1024

#: Seconds a failed call that names this process's memory (a direct or staged copy) waits for
#: the host, killed, to be known dead before its commands fail anyway (see ``_hand_replies``).
DEATH_WAIT_S = 10.0

#: Seconds between two pings of a host waited for to be dead (see ``_dies``).
PING_PAUSE_S = 0.01


class Connection:
    """One client's link to one host, shared by every RAY device of that host (the driver
    context of their queues): the ordered command stream, its batches and the waiter thread.

    Sending. Commands gather in the open batch until the submitting loop's turn ends (a flush
    scheduled on it) or :data:`BATCH_LIMIT` is reached; closed batches and the pieces of large
    copies wait in the *outbox* in stream order and are sent from it by one thread at a time
    (the drainer), which numbers them as it sends, so no number is taken that is not sent. A
    piece that first puts bytes into the object store (or waits until the store has room for
    its copy's next piece) is sent by the connection's sender thread (the put is a copy of up
    to ``CHUNK_BYTES``: it stays off the event loop), which then sends whatever queued behind
    it. Nothing waits for a loop: a flush scheduled on a loop
    that ended without running it is done by the next submission (or when the scheduled
    callback is dropped unrun), and pieces never depend on a loop.

    Reconnecting (``reset()`` after the host was lost) is an item of the outbox too: what was
    queued before it goes to the old host (and fails as lost), what follows to the new one; a
    reply of the old host that arrives late marks nothing lost (each call is tagged with the
    connection's epoch).

    Threads: the sender and the waiter start at the first hand-off that needs them and hold
    the connection only weakly; once it is dropped (its devices gone, :data:`_CONNECTIONS` holds
    it weakly) a sentinel stops both. A reply handler that raises fails its own command only:
    neither thread dies of it, and the outbox is never left owned by a thread that stopped."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._batch: list[Command] = []
        self._replies: list[Reply | None] = []
        self._scheduled: Any = None  # the event loop (or trio token) that will flush, if any
        self._outbox: collections.deque[_Item] = collections.deque()
        self._draining = False  # a thread is sending the outbox
        # True: drain, False: flush, None: stop (the connection was dropped)
        self._wake: _queue.SimpleQueue[bool | None] = _queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._waiter: threading.Thread | None = None
        self._inflight: _queue.SimpleQueue[_InFlight | None] = _queue.SimpleQueue()
        #: the staging segments of large copies (:mod:`aiotinyrt.ray.staging`)
        self.staging = Staging()
        weakref.finalize(self, _stop, self._wake, self._inflight)
        self.calls = 0  #: actor calls made (tests look)
        self._epoch = 0
        self.reconnects = 0  #: reconnections queued (a reset that finds one newer does none)
        self.actor = self._lookup()
        self.client = uuid.uuid4().hex
        self.loaded: set[tuple[str, str]] = set()
        self.lost: str | None = None
        self._seq = 0
        #: the host process (pid, start time) of an actor, as its probe reported it
        self._process: tuple[Any, tuple[int, str]] | None = None

    def _lookup(self) -> Any:
        try:
            return wire.STORE.actor(self.host)
        except ValueError as exc:
            raise DeviceError(f"no device host {self.host!r} is running", device=f"RAY:{self.host}") from exc

    def reconnect(self, after: int | None = None) -> None:
        """Connect to the host of this name anew (blocks for the lookup): a new client id,
        nothing loaded there; applied in stream order (see the class docstring). With ``after``
        (a count of :attr:`reconnects`), nothing is done if another reconnection was queued
        since: two devices of one host resetting at once reconnect once."""
        actor, client = self._lookup(), uuid.uuid4().hex
        with self._lock:
            if after is not None and self.reconnects != after:
                return
            self.reconnects += 1
            self.staging.forget_mode()  # (copies submitted from now on wait for the new host's probe)
            self._close_batch()
            self.loaded = set()  # (what is submitted from now on goes to the new host)
            self._outbox.append(_Item(swap=(actor, client)))
        self._pump()

    def copy_mode(self) -> str:
        """How this connection's large copies travel (``staging.DIRECT``, ``STAGED`` or
        ``STORE``); the first call per host probes it, a round trip or two. The sender thread
        only."""
        return self.staging.probed(self._probe)

    def lease(self, nbytes: int) -> Segment | None:
        """A staging segment for one piece of ``nbytes`` (the sender thread only), or None."""
        return self.staging.lease(nbytes)

    def _probe(self, where: Any, expected: bytes) -> bool:
        """Whether the host reads ``expected`` through ``where`` (:mod:`aiotinyrt.ray.staging`)."""
        actor, client = self.actor, self.client
        try:
            usable, pid, started = wire.STORE.get(actor.stage.remote(client, where, expected), timeout=60)
        except Exception:  # (the host is gone or old: the copy itself reports a loss)
            return False
        if usable:
            self.staging.host = (actor, client)
            self._process = (actor, (int(pid), str(started)))
        return bool(usable)

    def new_id(self) -> int:
        """A fresh id (buffers, commands)."""
        return next(self._ids)

    def submit(self, cmd: Command, reply: Reply | None, load: Load | None = None) -> None:
        """Queue ``cmd`` for the next batch (after ``load``'s command, unless the program it
        names was sent to this host already); the first command of a batch schedules its flush
        on the submitting thread's event loop (or flushes at once outside one)."""
        with self._lock:
            if load is not None and load[0] not in self.loaded:
                self.loaded.add(load[0])
                self._batch.append(load[1])
                self._replies.append(None)
            self._batch.append(cmd)
            self._replies.append(reply)
            if len(self._batch) >= BATCH_LIMIT:  # (a flush scheduled for the turn's end sends
                self._close_batch()  # whatever follows)
                loop = None
            else:
                if self._scheduled is not None and _alive(self._scheduled):
                    return
                loop = self._scheduled = _scheduler()
                if loop is None:  # (outside an event loop: at once)
                    self._scheduled = None
                    self._close_batch()
                elif self._sender is None:  # (a flush dropped unrun is the sender's to do)
                    self._start_sender()
        if loop is None:
            self._pump()
        elif not _call_soon(loop, _Flush(self)):
            self.flush()

    def flush(self) -> None:
        """Send the queued commands in one actor call (any thread)."""
        with self._lock:
            self._scheduled = None
            self._close_batch()
        self._pump()

    def send_apart(self, parts: list[Part], puts: bool) -> None:
        """Send what is queued, then each part (a function making its command, and its reply)
        in an actor call of its own, in order; ``puts``: making a command puts bytes into the
        object store or waits for room there, so the sender thread makes and sends them (one
        piece's put overlapping the host's copy of the one before), not the submitting
        thread."""
        with self._lock:
            self._close_batch()
            self._outbox.extend(_Item(part=part, puts=puts) for part in parts)
        self._pump()

    def _close_batch(self) -> None:
        """The open batch joins the outbox. Caller holds ``_lock``."""
        if self._batch:
            self._outbox.append(_Item(batch=self._batch, replies=self._replies))
            self._batch, self._replies = [], []

    def _pump(self) -> None:
        """Send the outbox unless another thread is sending it (it sends what was added)."""
        with self._lock:
            if self._draining:
                return
            self._draining = True
        self._drain(on_sender=False)

    def _drain(self, on_sender: bool) -> None:
        """Send the outbox's items in order; one thread at a time (``_draining``). An item that
        puts bytes is left to the sender thread, which then owns the outbox until it is empty."""
        while True:
            with self._lock:
                if not self._outbox:
                    self._draining = False
                    return
                item = self._outbox[0]
                if item.puts and not on_sender:
                    if self._sender is None:
                        self._start_sender()
                    self._wake.put(True)
                    return  # (``_draining`` stays set: the sender thread has the outbox now)
                self._outbox.popleft()
            try:
                self._send_item(item)
            except Exception as exc:  # (not expected: reply handlers are guarded) its commands
                part = [item.part[1]] if item.part is not None else []  # fail; the rest goes on
                _fail(item.replies or part, exc)
            except BaseException:  # (an interrupt on the loop thread: the outbox is not left owned)
                with self._lock:
                    self._draining = False
                raise

    def _start_sender(self) -> None:
        """Start the sender thread (holding the connection weakly). Caller holds ``_lock``."""
        self._sender = threading.Thread(
            target=_send_loop,
            args=(self._wake, weakref.ref(self), self.staging),
            name=f"ray-send-{self.host}",
            daemon=True,
        )
        self._sender.start()

    def _send_item(self, item: _Item) -> None:
        """Make and send one item (the drainer's thread only: it alone numbers calls)."""
        if item.swap is not None:
            self.actor, self.client = item.swap
            self.staging.reconnected()
            self._epoch += 1
            self._seq = 0
            self.lost = None
            return
        if item.part is not None:
            make, reply = item.part
            replies: list[Reply | None] = [reply]
            if self.lost is not None:
                _fail(replies, HostLost(self.lost))
                return
            seq = self._seq + 1
            cmds: list[Command] = []
            try:
                cmds = [make()]
                retired = self.staging.take_retired()
                if retired:  # (the host drops its mappings of segments closed here)
                    cmds.insert(0, (wire.UNSTAGE, retired))
                    replies.insert(0, None)
                args = wire.encode(self.client, seq, cmds, refs=True)
            except Exception as exc:  # (the put failed: this part fails; its number still goes)
                _fail(replies, exc)
                cmds, replies, args = [], [], wire.encode(self.client, seq, [])
        else:
            assert item.batch is not None and item.replies is not None
            replies = item.replies
            if self.lost is not None:
                _fail(replies, HostLost(self.lost))
                return
            seq = self._seq + 1
            cmds = item.batch
            try:
                args = wire.encode(self.client, seq, item.batch)
            except Exception as exc:  # (the commands fail as they are; the number still goes)
                _fail(replies, exc)
                cmds, replies, args = [], [], wire.encode(self.client, seq, [])
        self._seq = seq
        exposed = None
        if any(_names_memory(cmd) for cmd in cmds):
            known = self._process
            exposed = (self.actor, known[1] if known is not None and known[0] is self.actor else None)
        try:
            ref: Any = self.actor.run.remote(*args)
        except Exception as exc:  # the number never reached the host: nothing later can run
            self.lost = f"host {self.host}: device lost ({exc!r})"
            _fail(replies, HostLost(self.lost))
            return
        self.calls += 1
        if self._waiter is None:
            waits = (self._inflight, weakref.ref(self), self.host)
            name = f"ray-{self.host}"
            self._waiter = threading.Thread(target=_wait_loop, args=waits, name=name, daemon=True)
            self._waiter.start()
        self._inflight.put((ref, self._epoch, replies, exposed))

    async def request(self, cmd: Command, device: str) -> Any:
        """Send ``cmd`` in the stream (after everything queued before it) and return its reply's
        payload; a failure raises ``DeviceError`` naming ``device``. Cancellation: cancels the
        wait; the command runs on."""
        answer: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def reply(result: Any, error: BaseException | None) -> None:
            if error is None and result.__class__ is not float and result[1] is not None:
                error = result[3] if result[3] is not None else RemoteError(result[1])
            if error is not None:
                answer.set_exception(DeviceError(f"{device}: {error}", device=device, cause=error))
            else:
                answer.set_result(None if result.__class__ is float else result[2])

        self.submit(cmd, reply)
        return await anyio.to_thread.run_sync(answer.result, abandon_on_cancel=True)

    def call(self, method: str, *args: Any) -> Any:
        """A ref of one direct actor call (not part of the command stream: unordered)."""
        return getattr(self.actor, method).remote(*args)


#: A call in flight: its ref, the connection's epoch when sent, the replies of its commands,
#: and, where one of them names this process's memory, the actor it went to and that actor's
#: process (pid, start time; None if not known) (else None).
_InFlight = tuple[Any, int, list[Reply | None], Any]


def _names_memory(cmd: Command) -> bool:
    """Whether the host writes or reads this process's memory for ``cmd``: a direct or staged
    copy (the host's run may go on writing it until the host is dead)."""
    op = cmd[0]
    if op == wire.COPYIN:
        return isinstance(cmd[3], (Direct, Staged))
    return op == wire.COPYOUT and len(cmd) > 4


def _send_loop(wake: _queue.SimpleQueue[bool | None], ref: weakref.ref[Connection], staging: Staging) -> None:
    """The sender thread of a connection: drains or flushes when woken; ends at the sentinel,
    closing the connection's staging segments. Holds the connection only while it works (a
    dropped connection is collected)."""
    while True:
        drain = wake.get()
        conn = ref()
        if drain is None or conn is None:
            staging.close()
            return
        try:
            if drain:
                conn._drain(on_sender=True)
            else:
                conn.flush()
        except Exception:  # (not expected; the thread must not die: the next hand-off drains)
            with conn._lock:
                conn._draining = False
        del conn


def _wait_loop(
    inflight: _queue.SimpleQueue[_InFlight | None], ref: weakref.ref[Connection], host: str
) -> None:
    """The waiter thread of a connection: hands each call's reply to its commands, in order;
    ends at the sentinel. A reply handler that raises fails its own command only. Each call is
    handled in a function of its own, so that between calls this frame holds nothing of the
    last one (its handlers hold devices, which hold the connection: it could never be dropped)."""
    while True:
        item = inflight.get()
        if item is None:
            return
        _hand_replies(*item, ref, host)
        del item


def _hand_replies(
    call: Any, epoch: int, replies: list[Reply | None], exposed: Any, ref: weakref.ref[Connection], host: str
) -> None:
    """Wait for one call's reply and hand each command its result (or the host's loss).

    A call that names this process's memory (``exposed``: its actor) and failed while its host
    may still run it (Ray's ``ActorUnavailableError``, say) fails only once that host is known
    dead: it is killed, and its death waited for (:data:`DEATH_WAIT_S` at most); past that,
    its commands fail with :class:`HostAdrift`, whose leases keep the memory out of reuse."""
    try:
        results = wire.STORE.get(call)
    except Exception as exc:
        lost = f"host {host}: device lost ({type(exc).__name__})"
        conn = ref()
        if conn is not None and epoch == conn._epoch:  # (a late reply of a host reconnected
            conn.lost = lost  # from marks nothing)
        del conn
        store = wire.STORE
        if exposed is None:
            dead = True
        elif store.died(exc):  # (Ray's word; its worker may still run: wait for its process)
            dead = exposed[1] is None or _killed(exposed[0], exposed[1], kill=False)
        else:
            dead = store.ended(exc) or _killed(exposed[0], exposed[1], kill=True)
        _fail(replies, HostLost(lost) if dead else HostAdrift(lost))
        return
    try:
        for reply, result in zip(replies, results, strict=True):
            if reply is not None:
                try:
                    reply(result, None)
                except Exception as exc:  # (fetching a copyout's bytes, say): this command
                    _reply_failed(reply, exc)  # fails; the waiter goes on with the others
    except Exception as exc:  # (a reply not one entry per command): the rest fail
        _fail(replies, exc)


class _Verdict:
    """Whether one actor, killed after a failed call that named this process's memory, is
    known dead: decided once, by :data:`DEATH_WAIT_S` after the first such failure."""

    __slots__ = ("dead", "deadline", "killed", "lock")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline  #: when the wait for its death ends (``time.monotonic``)
        self.lock = threading.Lock()  #: held while its death is waited for
        self.killed = False  #: the kill was asked
        self.dead: bool | None = None  #: the verdict (None: not decided yet)


#: The verdict of each actor that failed a call naming this process's memory, by actor id: the
#: first such failure kills the actor; later ones (other calls, other connections) wait for the
#: same verdict, until the same deadline at most.
_VERDICTS: dict[Any, _Verdict] = {}
_VERDICTS_LOCK = threading.Lock()


def _actor_key(actor: Any) -> Any:
    """What names ``actor`` (a Ray actor handle's actor id), the same for every handle of it."""
    key = getattr(actor, "_actor_id", None)
    return id(actor) if key is None else key


def _killed(actor: Any, process: tuple[int, str] | None, kill: bool) -> bool:
    """Kill ``actor`` (unless ``kill`` is false: Ray said it died) and wait until a call of it
    fails as a dead actor's and its process (``process``: pid and start time, where known) is
    gone: whether it is known dead. One verdict per actor (:data:`_VERDICTS`): only its first
    failure kills it, and every failure waits until :data:`DEATH_WAIT_S` after that first one
    at most. Waiter threads only."""
    key = _actor_key(actor)
    with _VERDICTS_LOCK:
        verdict = _VERDICTS.get(key)
        if verdict is None:
            verdict = _VERDICTS[key] = _Verdict(time.monotonic() + DEATH_WAIT_S)
    if verdict.dead is not None:
        return verdict.dead
    if not verdict.lock.acquire(timeout=max(verdict.deadline - time.monotonic(), 0.0)):
        return bool(verdict.dead)  # (another waits for it still, past the deadline: not known dead)
    try:
        if verdict.dead is None:
            if kill and not verdict.killed:
                verdict.killed = True
                with contextlib.suppress(Exception):
                    wire.STORE.kill_actor(actor)
            dead = not kill or _dies(actor, verdict.deadline)
            # (Ray may call an actor dead before its worker process has exited: a worker stalled
            # in a copy could still write this process's memory)
            verdict.dead = dead and (process is None or gone(process, verdict.deadline, PING_PAUSE_S))
        return verdict.dead
    finally:
        verdict.lock.release()


def _dies(actor: Any, deadline: float) -> bool:
    """Whether a call of ``actor`` fails as a dead actor's before ``deadline``. Pings pause
    (10 ms) between them, whether the last one answered or failed; an error that is not an
    actor's (one no later ping can tell apart) ends the wait at once: not known dead."""
    store = wire.STORE
    while (left := deadline - time.monotonic()) > 0:
        try:
            store.get(actor.ping.remote(), timeout=left)
        except Exception as exc:
            if store.died(exc):
                return True
            if store.ended(exc):  # (not an actor's error: the actor may be alive or dead)
                return False
        threading.Event().wait(min(PING_PAUSE_S, max(deadline - time.monotonic(), 0.0)))
    return False


def _stop(wake: _queue.SimpleQueue[bool | None], inflight: _queue.SimpleQueue[_InFlight | None]) -> None:
    """A dropped connection's finalizer: its threads end (after what they were handed)."""
    wake.put(None)
    inflight.put(None)


class _Item:
    """One entry of a connection's outbox: a batch, a part sent apart, or a reconnection."""

    __slots__ = ("batch", "part", "puts", "replies", "swap")

    def __init__(
        self,
        batch: list[Command] | None = None,
        replies: list[Reply | None] | None = None,
        part: Part | None = None,
        puts: bool = False,
        swap: tuple[Any, str] | None = None,
    ) -> None:
        self.batch, self.replies, self.part, self.puts, self.swap = batch, replies, part, puts, swap


class _Flush:
    """The flush a connection schedules on an event loop: flushes when called, or, if the loop
    drops it unrun (closed before its turn came), when it is collected."""

    __slots__ = ("conn", "ran")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.ran = False

    def __call__(self) -> None:
        self.ran = True
        self.conn.flush()

    def __del__(self) -> None:
        if not self.ran:  # (the sender thread flushes: a finalizer may run where a lock is held)
            self.conn._wake.put(False)


def _scheduler() -> Any:
    """The calling thread's event loop (asyncio, uvloop) or trio token; None outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        return None
    if library == "trio" and trio is not None:
        return trio.lowlevel.current_trio_token()
    return None


def _alive(scheduler: Any) -> bool:
    """Whether a flush scheduled on ``scheduler`` will still run: an asyncio loop that is
    closed or not running may never run it (trio runs what was scheduled before its run ended,
    and refuses what comes after)."""
    if isinstance(scheduler, asyncio.AbstractEventLoop):
        return scheduler.is_running() and not scheduler.is_closed()
    return True


def _call_soon(scheduler: Any, fn: Callable[[], None]) -> bool:
    """Call ``fn`` at the next turn of ``scheduler`` (its ``call_soon``, or the trio token's
    ``run_sync_soon``); False when it refuses (closed, its run finished)."""
    try:
        if isinstance(scheduler, asyncio.AbstractEventLoop):
            scheduler.call_soon(fn)  # (the calling thread's own loop)
        else:
            scheduler.run_sync_soon(fn)
    except RuntimeError:  # (trio's RunFinishedError is one)
        return False
    return True


def _reply_failed(reply: Reply, exc: BaseException) -> None:
    """A reply handler raised: its command fails with that error (a handler that had already
    completed its command before raising completes nothing twice: see ``_reply``)."""
    with contextlib.suppress(Exception):
        reply(None, exc)


def _fail(replies: Sequence[Reply | None], error: BaseException) -> None:
    """Fail each command of ``replies`` with ``error`` (a handler that raises fails only its own)."""
    for reply in replies:
        if reply is not None:
            try:
                reply(None, error)
            except Exception as exc:
                _reply_failed(reply, exc)


#: The connection of each host, while a device (or anything) holds it.
_CONNECTIONS: weakref.WeakValueDictionary[str, Connection] = weakref.WeakValueDictionary()
_CONNECTIONS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has none of the parent's sender and waiter threads: it connects anew."""
    global _CONNECTIONS_LOCK
    _CONNECTIONS_LOCK = threading.Lock()  # (a parent thread may have held it)
    _CONNECTIONS.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def connection(host: str) -> Connection:
    """The connection of this process to host ``host`` (made at first use: looks the host up)."""
    with _CONNECTIONS_LOCK:
        conn = _CONNECTIONS.get(host)
        if conn is None:
            conn = _CONNECTIONS[host] = Connection(host)
        return conn
