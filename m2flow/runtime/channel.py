"""Channel: a named, bounded, keyed, weighted FIFO between components.

One small async Ray actor per channel (``channel_actor``) keeps the order, the bound and
the waiting producers and consumers; this module is the handle that users call. Payloads
never pass through the actor: ``comm.pack`` puts large CPU tensors in the producer's
shared memory (or the object store on a multi-node cluster), so a 10 MB tensor makes one
hop, producer to consumer; the actor holds the small packed metadata, and small items
ride inline.

Throughput, since one actor round trip costs most of a millisecond:

- ``put`` is pipelined: it queues the item and returns; a sender thread per process
  and channel ships everything queued in one call whenever it has none in flight. At
  most ``put_window`` puts per process are un-acknowledged; a full channel holds
  their calls back, so the producer still feels backpressure. A put refused because
  the channel closed raises ``ChannelClosed`` at a later put or at ``flush()``.
  ``put(..., timeout=t)``, ``put_nowait`` and a handle with ``put_window=0`` wait
  until the item is in the channel.
- ``get`` takes up to ``prefetch`` ready items of its key in one call, but only while
  no other consumer waits on that key. Prefetched items belong to that handle: its
  next gets return them, in order. A handle dropped with prefetched items left gives
  them back to the front of their key.

A bounded channel holds at most ``maxsize`` items; window and prefetch are capped at
``maxsize`` too, so each producer process and each consumer handle adds at most that
many more on their way.

Order: FIFO per key, and a process's puts keep their order (sequence numbers per
process, since an async actor may start calls out of order).

A runner that starts one flow several times (profiling plans, restarts) gives its channels'
actors to its ``WorkerPool`` (``release``) and takes them back for the next channels of the
same names (``create(..., pool=)``): a reset instead of a process start. Each channel has a
``uid`` that its handles send along, so that the calls of a handle on the channel before
are refused.
"""

from __future__ import annotations

import itertools
import pickle
import queue
import threading
import uuid
import weakref
from collections import deque
from collections.abc import Hashable
from typing import Any

import ray
from ray import cloudpickle

from m2flow.runtime import comm, payload
from m2flow.runtime.channel_actor import CLOSED, FULL, OK, TIMEOUT, Blob, ChannelActor, Entry
from m2flow.runtime.names import NAMESPACE
from m2flow.runtime.pool import WorkerPool, _kill_named
from m2flow.runtime.trace import get_tracer

# Like worker groups: a sliver of a CPU, so that a 2-core node can still place it.
ACTOR_CPUS = 0.01
PUT_WINDOW = 32
PREFETCH = 16
RESET_TIMEOUT_S = 10.0


class ChannelClosed(Exception):
    """Put on a closed channel, or get from a closed channel with nothing left."""


class ChannelFull(queue.Full):
    """put_nowait on a full channel."""


class ChannelEmpty(queue.Empty):
    """get_nowait with no item of that key ready."""


def _refused(name: str, key: Hashable) -> ChannelClosed:
    return ChannelClosed(f"channel {name!r} is closed: cannot put (key {key!r})")


_RemoteChannelActor = ray.remote(ChannelActor)


def _actor_name(name: str) -> str:
    return f"channel:{name}"


def _lookup(name: str) -> Any:
    try:
        return ray.get_actor(_actor_name(name), namespace=NAMESPACE)
    except ValueError:
        return None


class _Producer:
    """This process's puts to one channel, as one ordered stream of actor calls.

    Pipelined puts wait in ``outbox``; a sender thread ships all of them in one call
    whenever it has no call in flight, and collects the acknowledgements: the faster
    the producer, the bigger the batches, and a lone put still leaves at once.
    """

    def __init__(self, name: str, uid: str, actor: Any) -> None:
        self.name, self.uid, self.actor = name, uid, actor
        self.id = uuid.uuid4().hex
        self.seq = itertools.count()
        self.cond = threading.Condition()
        self.outbox: list[tuple[Hashable, Blob, float]] = []
        self.inflight: deque[tuple[ray.ObjectRef, int]] = deque()  # batch calls and their sizes
        self.unacked = 0  # puts in the outbox or in flight
        self.closed = False  # known closed: puts fail at once
        self.refused = False  # pipelined puts were refused since the last flush
        self.error: BaseException | None = None  # the sender's, e.g. the channel's actor died
        self.sender: threading.Thread | None = None

    def pipeline(self, entry: tuple[Hashable, Blob, float], window: int) -> bool:
        """Queues a put; True if the window is now over-full and the caller should wait_room()."""
        with self.cond:
            self._check(entry[0])
            self.outbox.append(entry)
            self.unacked += 1
            if self.sender is None:
                self.sender = threading.Thread(target=self._send, name=f"channel-{self.name}", daemon=True)
                self.sender.start()
            self.cond.notify_all()
            return self.unacked > window

    def wait_room(self, window: int, key: Hashable) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.unacked <= window or self.closed or self.error)
            self._check(key)

    def call(self, key: Hashable, blob: Blob, weight: float, timeout: float | None, nowait: bool) -> ray.ObjectRef:
        """A put the caller waits for, ordered after the pipelined ones."""
        with self.cond:
            self._check(key)
            self._ship()
            return self.actor.put.remote(self.uid, self.id, next(self.seq), key, blob, weight, timeout, nowait)

    def flush(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.unacked or self.error)
            if self.error is not None:
                raise self.error
            if self.refused:
                self.refused = False
                raise ChannelClosed(f"channel {self.name!r} was closed before all puts of this process got in")

    def mark_closed(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _check(self, key: Hashable) -> None:
        if self.error is not None:
            raise self.error
        if self.closed:
            raise _refused(self.name, key)

    def _ship(self) -> None:
        if self.outbox:
            ref = self.actor.put_batch.remote(self.uid, self.id, next(self.seq), self.outbox)
            self.inflight.append((ref, len(self.outbox)))
            self.outbox = []
            self.cond.notify_all()

    def _send(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.inflight or self.outbox or self.closed)
                if not self.inflight:
                    if not self.outbox:  # closed with nothing left to send
                        self.sender = None
                        return
                    self._ship()
                ref, n = self.inflight[0]
            try:
                status = ray.get(ref)
            except BaseException as e:
                with self.cond:
                    self.error = e
                    self.cond.notify_all()
                return
            with self.cond:
                self.inflight.popleft()
                self.unacked -= n
                if status == CLOSED:
                    self.closed = self.refused = True
                    self.unacked -= len(self.outbox)
                    self.outbox = []
                self.cond.notify_all()


_producers: dict[str, _Producer] = {}
_producers_lock = threading.Lock()


def _producer(name: str, uid: str, actor: Any) -> _Producer:
    with _producers_lock:
        if uid not in _producers:
            _producers[uid] = _Producer(name, uid, actor)
        return _producers[uid]


def _give_back(actor: Any, uid: str, buffers: dict[Hashable, deque[Entry]]) -> None:
    for key, entries in buffers.items():
        if entries:
            try:
                actor.requeue.remote(uid, key, list(entries))
            except Exception:  # the channel is gone, and its items with it
                return


class Channel:
    """A picklable handle on a channel; pass it into worker calls. See the module docstring."""

    def __init__(self, name: str, actor: Any, uid: str, maxsize: int, multi_node: bool, *,
                 put_window: int = PUT_WINDOW, prefetch: int = PREFETCH):
        self.name, self.maxsize, self.multi_node = name, maxsize, multi_node
        # Bounded channels bound these too, so a small maxsize keeps its meaning.
        self.put_window = min(put_window, maxsize) if maxsize else put_window
        self.prefetch = max(1, min(prefetch, maxsize) if maxsize else prefetch)
        self.last_transport: str | None = None  # of the last item this handle returned
        self._actor, self._uid = actor, uid
        self._producer = _producer(name, uid, actor)
        self._buffers: dict[Hashable, deque[Entry]] = {}  # prefetched, per key
        weakref.finalize(self, _give_back, actor, uid, self._buffers).atexit = False

    @classmethod
    def create(cls, name: str, maxsize: int = 0, max_weight: float | None = None, *,
               put_window: int = PUT_WINDOW, prefetch: int = PREFETCH, pool: WorkerPool | None = None) -> Channel:
        """Starts the channel's actor. ``maxsize``: items (0 = unbounded); ``max_weight``:
        total weight; a put waits while either bound would be passed. ``pool``: takes the
        actor of a channel of this name ``release``d to it, if there is one (a round trip
        instead of a process start)."""
        if maxsize < 0 or (max_weight is not None and max_weight <= 0):
            raise ValueError(f"channel {name!r}: maxsize must be >= 0 and max_weight > 0")
        # Decided once: shared memory needs producer and consumer on one node.
        multi_node = len([n for n in ray.nodes() if n["Alive"]]) > 1
        uid = uuid.uuid4().hex
        kept = pool.take(_actor_name(name), ChannelActor, "", ()) if pool is not None else None
        if kept is not None:
            try:
                ray.get(kept.reset.remote(uid, maxsize, max_weight, multi_node), timeout=RESET_TIMEOUT_S)
                return cls(name, kept, uid, maxsize, multi_node, put_window=put_window, prefetch=prefetch)
            except Exception:  # noqa: BLE001 - its process died: a new one instead
                _kill_named((_actor_name(name), kept))
        taken = f"a channel named {name!r} already exists; attach to it with Channel.connect({name!r})"
        if _lookup(name) is not None:
            raise ValueError(taken)
        try:
            actor = _RemoteChannelActor.options(
                name=_actor_name(name), namespace=NAMESPACE, num_cpus=ACTOR_CPUS, max_concurrency=10_000,
            ).remote(name, uid, maxsize, max_weight, multi_node)
        except ValueError:  # created by someone else meanwhile
            raise ValueError(taken) from None
        return cls(name, actor, uid, maxsize, multi_node, put_window=put_window, prefetch=prefetch)

    @classmethod
    def connect(cls, name: str, *, put_window: int = PUT_WINDOW, prefetch: int = PREFETCH) -> Channel:
        actor = _lookup(name)
        if actor is None:
            raise LookupError(f"no channel named {name!r}; create it with Channel.create({name!r})")
        uid, maxsize, _, multi_node = ray.get(actor.info.remote())
        return cls(name, actor, uid, maxsize, multi_node, put_window=put_window, prefetch=prefetch)

    def __reduce__(self):
        return _rebuild, (self.name, self._actor, self._uid, self.maxsize, self.multi_node, self.put_window,
                          self.prefetch)

    def __repr__(self) -> str:
        return f"Channel({self.name!r}, maxsize={self.maxsize})"

    # -- put ------------------------------------------------------------------------------
    def put(self, item: Any, key: Hashable = None, weight: float = 1.0, timeout: float | None = None) -> None:
        """Pipelined (see the module docstring) unless ``timeout`` is given or the handle
        has ``put_window=0``; then returns once the item is in the channel."""
        blob = self._pack(item)
        if timeout is None and self.put_window:
            if self._producer.pipeline((key, blob, float(weight)), self.put_window):
                with self._span("put", key):
                    self._producer.wait_room(self.put_window, key)
        else:
            ref = self._producer.call(key, blob, float(weight), timeout, False)
            with self._span("put", key):
                self._check_put(ray.get(ref), key, timeout)

    def put_nowait(self, item: Any, key: Hashable = None, weight: float = 1.0) -> None:
        self._check_put(ray.get(self._producer.call(key, self._pack(item), float(weight), None, True)), key, 0)

    def flush(self) -> None:
        """Waits until every put this process made to the channel is in it; raises
        ChannelClosed if the channel refused some."""
        with self._span("flush", None):
            self._producer.flush()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Blocks until the channel's actor is up: ``create`` starts its process in the
        background, and the first put or get would otherwise wait for it (seconds)."""
        try:
            ray.get(self._actor.__ray_ready__.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"channel {self.name!r}: its actor did not start within {timeout}s "
                               "(a cluster with no CPU left for it?)") from None

    def close(self) -> None:
        """Flushes, then closes: later puts raise ChannelClosed, gets drain what is left."""
        try:
            self.flush()
        finally:
            ray.get(self._actor.close.remote(self._uid))
            self._producer.mark_closed()

    def destroy(self) -> None:
        """Kills the channel's actor; items still in it are lost."""
        self._producer.mark_closed()
        ray.kill(self._actor, no_restart=True)

    def release(self, pool: WorkerPool) -> None:
        """Ends the channel as ``destroy`` does (its waiting calls return closed, its items
        are lost), but gives its actor to ``pool`` for the next channel of this name."""
        self._producer.mark_closed()
        try:
            ray.get(self._actor.reset.remote(None), timeout=RESET_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - dead or stuck: the next channel starts a new one
            _kill_named((_actor_name(self.name), self._actor))
            return
        pool.give(_actor_name(self.name), ChannelActor, "", (), self._actor)

    def _pack(self, item: Any) -> Blob:
        skeleton, tensors = payload.flatten(item)
        # No NCCL pair joins a channel's writers and readers: CUDA tensors go as CPU copies
        # (a reader moves them to its device).
        tensors = [t.cpu() if t.is_cuda else t for t in tensors]
        packed = comm.pack_flat(skeleton, tensors, same_node=not self.multi_node)
        # Object-store references must travel where Ray can see them, inside an object.
        return ray.put(packed) if packed.transport == "object_store" else cloudpickle.dumps(packed)

    def _check_put(self, status: int, key: Hashable, timeout: float | None) -> None:
        if status == CLOSED:
            self._producer.mark_closed()
            raise _refused(self.name, key)
        if status == FULL:
            raise ChannelFull(f"channel {self.name!r} is full (key {key!r})")
        if status == TIMEOUT:
            raise TimeoutError(f"channel {self.name!r}, key {key!r}: still full after {timeout} s")

    # -- get ------------------------------------------------------------------------------
    def get(self, key: Hashable = None, timeout: float | None = None) -> Any:
        buf = self._buffers.get(key)
        if not buf:
            with self._span("get", key):
                status, entries = ray.get(self._actor.get.remote(self._uid, key, timeout, self.prefetch))
            buf = self._fill(key, status, entries, timeout)
        return self._unpack(buf.popleft())

    def get_nowait(self, key: Hashable = None) -> Any:
        buf = self._buffers.get(key)
        if not buf:
            status, entries = ray.get(self._actor.get.remote(self._uid, key, 0, self.prefetch))
            if status == TIMEOUT:
                raise ChannelEmpty(f"channel {self.name!r} has no item with key {key!r}")
            buf = self._fill(key, status, entries, 0)
        return self._unpack(buf.popleft())

    def get_batch(self, target_weight: float, key: Hashable = None, timeout: float | None = None) -> list:
        """Items in FIFO order whose weights sum to >= target_weight; fewer only once the
        channel is closed and drained (ChannelClosed if nothing at all is left)."""
        taken, need = self._take_buffered(key, target_weight)
        if need > 0:
            with self._span("get_batch", key):
                reply = ray.get(self._actor.get.remote(self._uid, key, timeout, 1, need))
            taken += self._batch_reply(key, taken, reply, timeout)
        return [self._unpack(e) for e in taken]

    def stats(self, timeout: float | None = None) -> dict:
        """The channel actor's counts: items in and out so far (``puts``, ``gets``), held per
        key, getters and putters waiting."""
        return ray.get(self._actor.stats.remote(), timeout=timeout)

    def qsize(self, key: Hashable = None) -> int:
        """Items of ``key`` in the channel, plus those this handle prefetched. This
        process's pipelined puts may still be on their way: ``flush()`` first to count them."""
        return ray.get(self._actor.qsize.remote(key)) + len(self._buffers.get(key, ()))

    # -- helpers ----------------------------------------------------------------------
    def _fill(self, key: Hashable, status: int, entries: list[Entry], timeout: float | None) -> deque[Entry]:
        if status == CLOSED:
            raise self._drained(key)
        if status == TIMEOUT:
            raise TimeoutError(f"channel {self.name!r}, key {key!r}: no item after {timeout} s")
        buf = self._buffers.setdefault(key, deque())
        buf.extend(entries)
        return buf

    def _take_buffered(self, key: Hashable, target: float) -> tuple[list[Entry], float]:
        taken, buf = [], self._buffers.get(key)
        while buf and target > 0:
            taken.append(buf.popleft())
            target -= taken[-1][1]
        return taken, target

    def _batch_reply(self, key: Hashable, taken: list[Entry], reply: tuple[int, list[Entry]],
                     timeout: float | None) -> list[Entry]:
        status, entries = reply
        if status == OK or (status == CLOSED and taken):
            return entries
        self._buffers.setdefault(key, deque()).extendleft(reversed(taken))  # still this handle's, in order
        if status == CLOSED:
            raise self._drained(key)
        raise TimeoutError(f"channel {self.name!r}, key {key!r}: not enough weight after {timeout} s")

    def _unpack(self, entry: Entry) -> Any:
        blob = entry[0]
        packed = ray.get(blob) if isinstance(blob, ray.ObjectRef) else pickle.loads(blob)
        self.last_transport = packed.transport
        return comm.unpack(packed)

    def _span(self, op: str, key: Hashable):
        return get_tracer().span(f"{op} {self.name}", cat="channel", key=repr(key))

    def _drained(self, key: Hashable) -> ChannelClosed:
        return ChannelClosed(f"channel {self.name!r} is closed and has no item left with key {key!r}")


def _rebuild(name: str, actor: Any, uid: str, maxsize: int, multi_node: bool, put_window: int,
             prefetch: int) -> Channel:
    return Channel(name, actor, uid, maxsize, multi_node, put_window=put_window, prefetch=prefetch)
