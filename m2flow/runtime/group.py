"""WorkerGroup: N ranks of one component, launched by placement, called as one.

``group.generate(batch)`` runs ``generate`` on every rank (or ``ranks=[...]``) and returns
a ``GroupHandle`` at once (``group.generate`` has the worker method's signature, plus
``ranks``, and docstring); ``handle.wait()`` gives the gathered result, or raises a
``WorkerError`` naming the group, the rank and the remote traceback. A rank whose process
died surfaces as ``WorkerDiedError`` as soon as Ray notices, not at a time-out. A death is
often first seen as another rank's error (a collective whose peer is gone: its connection
reset), a moment before Ray notices it: an error is held back until the calls waited on with
it have finished or ``DEATH_GRACE_S`` seconds have passed, and if one of them shows a death,
the death is raised instead, as its cause (a run restarts on a death, not on an error).
"""

from __future__ import annotations

import functools
import inspect
import os
import time
import types
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable

import ray
from ray.exceptions import GetTimeoutError, RayTaskError

from m2flow.runtime.dispatching import _gather, _split
from m2flow.runtime.errors import _ANSI, _DIED, PeerDiedError, WorkerDiedError, WorkerError, _death_among, death_reason, own_frames
from m2flow.runtime.placement import ComponentPlacement
from m2flow.runtime.pool import WorkerPool, _new_actor
from m2flow.runtime.worker import CALL_PREFIX, WorkerInfo, callable_methods

if TYPE_CHECKING:
    from m2flow.runtime.channel import Channel
    from m2flow.runtime.device_lock import DeviceLock

# How long an error waits for a death among the calls waited on with it (Ray notices a killed
# process within about a second; the peers that talked to it fail at once).
DEATH_GRACE_S = 5.0


class GroupHandle:
    """The pending result of a group call."""

    def __init__(self, group: WorkerGroup, method: str, ranks: list[int], refs: list, gather: str):
        self.group, self.method, self.ranks, self._refs, self._gather = group, method, ranks, refs, gather
        self._results: list | None = None

    def done(self) -> bool:
        if self._results is not None:
            return True
        ready, _ = ray.wait(self._refs, num_returns=len(self._refs), timeout=0)
        return len(ready) == len(self._refs)

    def wait(self, timeout: float | None = None) -> Any:
        if self._results is None:
            self._results = self._collect(timeout)
        return _gather(self._results, self._gather)

    @property
    def results(self) -> list:
        """One result per called rank, in rank order (waits if needed)."""
        self.wait()
        return self._results

    def _collect(self, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        rank_of = {ref: rank for ref, rank in zip(self._refs, self.ranks)}
        outputs: dict[int, Any] = {}
        pending = list(self._refs)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if len(pending) == 1:  # the common single-rank call: one Ray round trip, no ray.wait
                ref = pending.pop()
            else:
                # One ready ref at a time: the first failure is raised without waiting for the rest.
                ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
                if not ready:
                    self._timeout(timeout, [rank_of[r] for r in pending])
                ref = ready[0]
            rank = rank_of[ref]
            try:
                outputs[rank] = ray.get(ref, timeout=remaining)
            except GetTimeoutError:
                self._timeout(timeout, [rank])
            except RayTaskError as e:
                if isinstance(e.cause, PeerDiedError):  # it called a rank of another group directly, and that died
                    p = e.cause
                    raise WorkerDiedError(p.group, p.rank, p.method, f"the worker process died: {p.reason}", p,
                                          str(e)) from None
                died = _death_among(pending, DEATH_GRACE_S)  # a peer's death may be what made it fail
                if died is not None:
                    self._died(rank_of[died[0]], died[1])
                full = _ANSI.sub("", str(e)).strip()
                frames = "".join(f"\n  at {f}" for f in own_frames(full))
                detail = f"{type(e.cause).__name__}: {e.cause}{frames}"
                raise WorkerError(self.group.name, rank, self.method, detail, e.cause, full) from None
            except _DIED as e:
                self._died(rank, e)
        return [outputs[r] for r in self.ranks]

    def _died(self, rank: int, e: BaseException) -> None:
        raise WorkerDiedError(self.group.name, rank, self.method, f"the worker process died: {death_reason(e)}", e,
                              str(e)) from None

    def _timeout(self, timeout: float | None, ranks: list[int]) -> None:
        raise TimeoutError(f"{self.group.name}.{self.method}() not finished after {timeout}s on rank(s) {sorted(ranks)}")


def start_together(*groups: WorkerGroup, channels: Sequence[Channel] = (), locks: DeviceLock | None = None) -> None:
    """Waits until every rank of ``groups`` (made with ``wait=False``) is constructed, then
    until the actors of ``channels`` and ``locks``, which start in the background too, are
    up (else the first put, get or acquire would wait for them). If a group fails or times
    out, every group is killed, the channels are destroyed and the first error raised."""
    try:
        wait(*(g._starting for g in groups), timeout=max(g.init_timeout_s for g in groups))
    except BaseException:
        for g in groups:
            g.kill()
        for channel in channels:
            channel.destroy()
        raise
    for channel in channels:
        channel.wait_ready()
    if locks is not None:
        locks.wait_ready()


def wait(*handles: GroupHandle, timeout: float | None = None) -> list:
    """Waits for several group calls that run together; the first failure in any of them
    is raised at once (a consumer whose producer died must not wait forever)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    owner = {ref: h for h in handles if h._results is None for ref in h._refs}
    pending = list(owner)
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            stuck = sorted({f"{h.group.name}.{h.method}()" for r, h in owner.items() if r in pending})
            raise TimeoutError(f"not finished after {timeout}s: {', '.join(stuck)}")
        try:
            ray.get(ready[0])
        except Exception:
            failed = owner[ready[0]]
            try:
                failed.wait()  # raises the WorkerError with group, rank and traceback
            except WorkerDiedError:
                raise
            except WorkerError:  # a death in another call may be what made it fail
                died = _death_among([r for r in pending if owner[r] is not failed], DEATH_GRACE_S)
                if died is not None:
                    owner[died[0]].wait()  # raises its WorkerDiedError
                raise
    return [h.wait() for h in handles]


class WorkerGroup:
    """Launches one Ray actor per rank of a component placement."""

    def __init__(self, cls: type, placement: ComponentPlacement, *, args: tuple = (), kwargs: Mapping | None = None,
                 name: str | None = None, session: str | None = None, init_timeout_s: float = 300.0,
                 wait: bool = True, pool: WorkerPool | None = None):
        """Starts the ranks; with ``wait`` (default) returns once every rank is constructed.
        Without, call ``ready`` (or ``start_together`` for several groups): groups then
        start their processes in parallel. ``pool``: re-use (and later give back) the
        processes of earlier groups of the same name (``WorkerPool``)."""
        self.cls = cls
        self._methods = frozenset(callable_methods(cls))
        self.name = name or placement.component
        self.placement = placement
        self.world_size = placement.world_size
        self.pool = pool
        session = session or os.environ.get("M2FLOW_SESSION", "default")
        ranks = placement.ranks()
        if pool is not None:
            pool.trim(self.name, self.world_size)
        self.actors = [(pool and pool.take(f"{self.name}:{r.rank}", cls, r.node_id, r.devices))
                       or _new_actor(cls, f"{self.name}:{r.rank}", r.node_id) for r in ranks]
        node_order: dict[str, list[int]] = {}
        for r in ranks:
            node_order.setdefault(r.node_id, []).append(r.rank)
        # Rank 0's address, resolved by Ray before each rank's constructor runs: nothing here
        # waits for a process to start.
        master = self.actors[0]._m2flow_address.remote()
        group_devices = tuple(sorted({d.index for r in ranks for d in r.devices}))
        refs = []
        for r, actor in zip(ranks, self.actors):
            info = WorkerInfo(self.name, r.rank, self.world_size, r.devices, node_order[r.node_id].index(r.rank), session,
                              group_devices)
            refs.append(actor._m2flow_init.remote(info, master, tuple(args), dict(kwargs or {})))
        self._starting = GroupHandle(self, "__init__", list(range(self.world_size)), refs, "list")
        self.init_timeout_s = init_timeout_s
        for method, call in _group_methods(cls).items():
            if method not in vars(self) and not hasattr(type(self), method):  # the group's own names come first
                setattr(self, method, types.MethodType(call, self))
        if wait:
            self.ready()

    def ready(self) -> None:
        """Waits until every rank is constructed; if one fails, kills the group and raises."""
        start_together(self)

    # -- calls -----------------------------------------------------------------
    def call(self, method: str, *args: Any, ranks: Sequence[int] | None = None, **kwargs: Any) -> GroupHandle:
        if method not in self._methods:
            raise _no_method(self.cls, method)
        split, gather = getattr(getattr(self.cls, method), "_m2flow_dispatch", ("all", "list"))
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise IndexError(f"{self.name} has ranks 0-{self.world_size - 1}, asked for {bad}")
        per_rank = _split(args, kwargs, len(ranks), split)
        # Arguments travel at top level so that Ray resolves those shared as ObjectRefs.
        refs = [getattr(self.actors[r], CALL_PREFIX + method).remote(*a, **k) for r, (a, k) in zip(ranks, per_rank)]
        return GroupHandle(self, method, ranks, refs, gather)

    def __getattr__(self, name: str) -> Any:
        # Reached only for a name that is neither the group's nor one of its worker's methods.
        cls = self.__dict__.get("cls")
        if cls is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        raise _no_method(cls, name)

    def init_process_group(self, backend: str | None = None) -> None:
        self.call("init_process_group", backend).wait()

    def trace_events(self) -> list[dict]:
        return [e for events in ray.get([a._m2flow_trace.remote() for a in self.actors]) for e in events]

    def received(self, timeout_s: float | None = None) -> list[int]:
        """Messages each rank has taken from other workers (point to point, broadcasts)."""
        return ray.get([a._m2flow_received.remote() for a in self.actors], timeout=timeout_s)

    def pids(self) -> list[int]:
        return ray.get([a._m2flow_ping.remote() for a in self.actors])

    def shutdown(self, timeout_s: float = 10.0, to_pool: bool = True) -> None:
        """Lets every rank release what it holds (shared memory), then ends the processes;
        with a pool (and ``to_pool``), gives them back to it instead once each has dropped its
        state (a rank that does not within ``timeout_s`` is ended)."""
        if self.pool is not None and to_pool:
            refs = [a._m2flow_recycle.remote() for a in self.actors]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            for rank, ref, actor in zip(self.placement.ranks(), refs, self.actors):
                try:
                    ok = ref in done and ray.get(ref) is None
                except Exception:  # noqa: BLE001 - a rank that cannot recycle is ended below
                    ok = False
                if ok:
                    self.pool.give(f"{self.name}:{rank.rank}", self.cls, rank.node_id, rank.devices, actor)
                else:
                    ray.kill(actor, no_restart=True)
            return
        try:
            ray.wait([a._m2flow_close.remote() for a in self.actors], num_returns=len(self.actors), timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)


def _no_method(cls: type, name: str) -> AttributeError:
    return AttributeError(f"{cls.__name__} has no public method {name!r}")


_RANKS = inspect.Parameter("ranks", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Sequence[int] | None")


@functools.cache
def _group_methods(cls: type) -> dict[str, Callable]:
    """The group's methods for a worker class, bound to each group at its construction:
    ``group.<name>(...)`` is ``group.call(name, ...)``, with the worker method's docstring
    and signature, plus ``ranks`` and returning a ``GroupHandle``."""
    return {name: _group_method(name, getattr(cls, name)) for name in callable_methods(cls)}


def _group_method(name: str, method: Callable) -> Callable:
    def call(self: WorkerGroup, *args: Any, **kwargs: Any) -> GroupHandle:
        return self.call(name, *args, **kwargs)

    functools.update_wrapper(call, method)
    signature = inspect.signature(method)
    # Ray adds _ray_trace_ctx (its tracing) to the signature of every method of an actor class.
    params = [p for p in signature.parameters.values() if p.name != "_ray_trace_ctx"]
    if "ranks" not in signature.parameters:  # a worker parameter of that name is taken by call() anyway
        params.insert(next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params)), _RANKS)
    call.__signature__ = signature.replace(parameters=params, return_annotation="GroupHandle")
    return call
