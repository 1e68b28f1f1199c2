"""The channel's actor: one small async Ray actor per channel keeps the order, the bound
and the waiting producers and consumers (``channel.Channel`` is the handle users call).

Payloads never pass through it: it holds the producers' packed items as opaque blobs and
never unpickles them. So it runs in a process that never sees a tensor: this module imports
neither torch nor an m2flow module that does, and a channel starts in a third of the time
(tests/test_imports.py checks it stays so).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import ray

# Actor replies carry a status rather than raising: a Ray exception costs a traceback.
OK, CLOSED, FULL, TIMEOUT = range(4)

# A comm.Packed item, pickled by its producer: the actor never unpickles it, and later
# changes to the producer's objects cannot reach it. One that holds object-store
# references is put in the object store instead, where Ray keeps them alive.
Blob = bytes | ray.ObjectRef
Entry = tuple[Blob, float]  # an item in the channel and its weight


@dataclass(eq=False, slots=True)
class _Put:
    key: Hashable
    blob: Blob
    weight: float
    nowait: bool
    status: int | None = None
    future: asyncio.Future | None = None  # only when the call has to wait


@dataclass(eq=False, slots=True)
class _Get:
    max_items: int
    target: float | None  # batch getters: the weight to reach
    status: int | None = None
    future: asyncio.Future | None = None
    taken: list[Entry] = field(default_factory=list)
    weight: float = 0.0


def _resolve(waiter: _Put | _Get, status: int) -> None:
    waiter.status = status
    if waiter.future is not None and not waiter.future.done():
        waiter.future.set_result(None)


class ChannelActor:
    """All methods run on one event loop and never await between reading and changing
    state, so each is atomic; waiting calls park on a future that others resolve.

    The calls that change it carry the channel's ``uid``: an actor kept for a later channel
    of the same name (``reset``) refuses the calls of the handles of the one before
    (``CLOSED``), and ignores their ``requeue`` and ``close``."""

    def __init__(self, name: str, uid: str, maxsize: int, max_weight: float | None, multi_node: bool):
        self.name = name
        self._clear(uid, maxsize, max_weight, multi_node)

    def _clear(self, uid: str | None, maxsize: int, max_weight: float | None, multi_node: bool) -> None:
        self.uid, self.maxsize, self.max_weight, self.multi_node = uid, maxsize, max_weight, multi_node
        self.items: dict[Hashable, deque[Entry]] = {}
        self.count, self.weight = 0, 0.0
        self.closed = False
        self.next_seq: dict[str, int] = {}
        self.early: dict[str, dict[int, list[_Put]]] = {}  # puts that overtook an earlier put of their producer
        self.putters: deque[_Put] = deque()  # admitted in order, waiting for room
        self.getters: dict[Hashable, deque[_Get]] = {}
        self.puts = self.gets = 0  # items in and out so far: a run's progress

    async def reset(self, uid: str | None, maxsize: int = 0, max_weight: float | None = None,
                    multi_node: bool = False) -> None:
        """Ends the channel as ``close`` does, drops what it holds, and makes it a new, empty
        channel ``uid`` (None: a channel that refuses every call, kept for a later one)."""
        self._close()
        self._clear(uid, maxsize, max_weight, multi_node)
        self.closed = uid is None

    async def info(self) -> tuple[str, int, float | None, bool]:
        return self.uid, self.maxsize, self.max_weight, self.multi_node

    async def qsize(self, key: Hashable) -> int:
        return len(self.items.get(key, ()))

    async def stats(self) -> dict:
        """Items in and out so far, what it holds and who waits on it (hang reports)."""
        return {"puts": self.puts, "gets": self.gets, "closed": self.closed,
                "items": {repr(k): len(q) for k, q in self.items.items()},
                "waiting_getters": {repr(k): len(w) for k, w in self.getters.items()},
                "waiting_putters": len(self.putters) + sum(len(e) for e in self.early.values())}

    async def put(self, uid: str, producer: str, seq: int, key: Hashable, blob: Blob, weight: float,
                  timeout: float | None, nowait: bool) -> int:
        """One put that the caller waits for: its status is OK, CLOSED, FULL or TIMEOUT."""
        if uid != self.uid:
            return CLOSED
        p = _Put(key, blob, weight, nowait)
        self._arrive(producer, seq, [p])
        if p.status is None:
            p.future = asyncio.get_running_loop().create_future()
            await asyncio.wait([p.future], timeout=timeout)
            if p.status is None:  # timed out; a put still in `early` is skipped when its turn comes
                p.status = TIMEOUT
                if p in self.putters:
                    self.putters.remove(p)
        return p.status

    async def put_batch(self, uid: str, producer: str, seq: int, entries: list[tuple[Hashable, Blob, float]]) -> int:
        """Pipelined puts: returns OK once all are in the channel, CLOSED if any was refused."""
        if uid != self.uid:
            return CLOSED
        puts = [_Put(key, blob, weight, False) for key, blob, weight in entries]
        self._arrive(producer, seq, puts)
        last = puts[-1]  # admitted in order: the last one is in when all are
        if last.status is None:
            last.future = asyncio.get_running_loop().create_future()
            await last.future
        return CLOSED if any(p.status == CLOSED for p in puts) else OK

    async def get(self, uid: str, key: Hashable, timeout: float | None, max_items: int = 1,
                  target: float | None = None) -> tuple[int, list[Entry]]:
        if uid != self.uid:
            return CLOSED, []
        g = _Get(max_items, target)
        self.getters.setdefault(key, deque()).append(g)
        self._pump()
        if g.status is None and self.closed:
            self._drop_getter(key, g)
            _resolve(g, OK if g.taken else CLOSED)
        if g.status is None and timeout != 0:
            g.future = asyncio.get_running_loop().create_future()
            await asyncio.wait([g.future], timeout=timeout)
        if g.status is None:
            self._drop_getter(key, g)
            self._requeue(key, g.taken)
            return TIMEOUT, []
        return g.status, g.taken

    async def requeue(self, uid: str, key: Hashable, entries: list[Entry]) -> None:
        if uid == self.uid:
            self._requeue(key, entries)

    async def close(self, uid: str) -> None:
        if uid == self.uid:
            self._close()

    def _close(self) -> None:
        self.closed = True
        for p in itertools.chain(self.putters, *(ps for e in self.early.values() for ps in e.values())):
            _resolve(p, CLOSED)
        self.putters.clear()
        self.early.clear()
        # No key has both items and getters (`_pump` keeps it so): these get only what they took.
        for waiting in self.getters.values():
            for g in waiting:
                _resolve(g, OK if g.taken else CLOSED)
        self.getters.clear()

    # -- internals, all synchronous ---------------------------------------------------
    def _arrive(self, producer: str, seq: int, puts: list[_Put]) -> None:
        """Admits a producer's calls in the order it made them."""
        expected = self.next_seq.get(producer, 0)
        if seq != expected:
            self.early.setdefault(producer, {})[seq] = puts
            if self.closed:
                for p in puts:
                    _resolve(p, CLOSED)
            return
        for p in puts:
            self._admit(p)
        early = self.early.get(producer)
        while early and expected + 1 in early:
            expected += 1
            for p in early.pop(expected):
                self._admit(p)
        if early is not None and not early:
            del self.early[producer]
        self.next_seq[producer] = expected + 1

    def _admit(self, p: _Put) -> None:
        if p.status is not None:
            return
        if self.closed:
            _resolve(p, CLOSED)
        elif not self.putters and self._has_room(p.weight):
            self._append(p)
            _resolve(p, OK)
            if p.key in self.getters:
                self._pump()
        elif p.nowait:
            _resolve(p, FULL)
        else:
            self.putters.append(p)

    def _has_room(self, weight: float) -> bool:
        if self.count == 0:  # an item heavier than max_weight still passes, alone
            return True
        return (not self.maxsize or self.count < self.maxsize) and (
            self.max_weight is None or self.weight + weight <= self.max_weight)

    def _append(self, p: _Put) -> None:
        self.items.setdefault(p.key, deque()).append((p.blob, p.weight))
        self.puts += 1
        self.count += 1
        self.weight += p.weight

    def _pump(self) -> None:
        """Hands queued items to waiting getters and room to waiting putters until neither can move."""
        while True:
            moved = False
            for key in [k for k in self.getters if k in self.items]:
                self._serve(key)
                moved = True
            while self.putters and self._has_room(self.putters[0].weight):
                p = self.putters.popleft()
                self._append(p)
                _resolve(p, OK)
                moved = True
            if not moved:
                return

    def _serve(self, key: Hashable) -> None:
        q, waiting = self.items[key], self.getters[key]
        while q and waiting:
            g = waiting[0]
            if g.target is None:
                # Prefetch only when nobody else waits on this key: idle consumers come first.
                n = 1 if len(waiting) > 1 else min(g.max_items, len(q))
                g.taken = [self._take(q) for _ in range(n)]
            else:
                while q and g.weight < g.target:
                    g.taken.append(self._take(q))
                    g.weight += g.taken[-1][1]
                if g.weight < g.target:
                    break
            waiting.popleft()
            _resolve(g, OK)
        if not q:
            del self.items[key]
        if not waiting:
            del self.getters[key]

    def _take(self, q: deque[Entry]) -> Entry:
        entry = q.popleft()
        self.gets += 1
        self.count -= 1
        self.weight = self.weight - entry[1] if self.count else 0.0  # no float drift when empty
        return entry

    def _drop_getter(self, key: Hashable, g: _Get) -> None:
        waiting = self.getters.get(key)
        if waiting is not None and g in waiting:
            waiting.remove(g)
            if not waiting:
                del self.getters[key]

    def _requeue(self, key: Hashable, entries: list[Entry]) -> None:
        """Puts items a reader took back at the front of their key's queue (older than any
        there), ahead of those a batch getter still waiting has taken meanwhile."""
        if entries:
            waiting = self.getters.get(key)
            if waiting and waiting[0].taken:  # only the first getter of a key fills, and only a batch one waits so
                g = waiting[0]
                entries = [*entries, *g.taken]
                self.gets -= len(g.taken)
                g.taken, g.weight = [], 0.0
            self.items.setdefault(key, deque()).extendleft(reversed(entries))
            self.count += len(entries)
            self.weight += sum(w for _, w in entries)
            self._pump()

