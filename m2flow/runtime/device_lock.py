"""Device locks: components placed on the same device take turns on it (context switching).

Each device index has one lock, a named async Ray actor ``m2flow-lock-{device}`` created on
first use (get-or-create). Requests are granted strictly in arrival order. A ``DeviceLock``
handle acquires several devices in ascending index order, so components whose device sets
overlap cannot deadlock each other.

Lock actors are not detached: they live as long as the process that created them first.
Create them from the driver (``lock_actor(device)`` or any ``DeviceLock(...)`` there) before
starting workers, so that a worker dying does not take the locks down with it.

A holder that dies must not block its devices forever: every acquire registers the calling
process (pid and node) and, inside a Ray actor, that actor's handle, pickled: unpickling a
handle loads its actor class (a worker's module, torch and all), which the lock actor does
only once it has to probe that holder, off its event loop. While others wait, the lock actor
checks about once a second whether the holder is still alive and, if not, passes the lock
on with a warning.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError

from m2flow.runtime.trace import get_tracer

logger = logging.getLogger(__name__)

LIVENESS_CHECK_INTERVAL_S = 1.0
_WAIT_SLICE_S = 0.5  # how often a blocked acquire wakes up to let an interrupt through
PROBE_WAIT_S = 5.0  # how long a process under a live-looking holder's name waits to hear whether it died


class LockTimeout(TimeoutError):
    """A device lock was not granted within the timeout."""


def lock_name(device: int) -> str:
    return f"m2flow-lock-{device}"


@dataclass
class _Request:
    holder: str
    pid: int
    node_id: str
    actor: bytes | None  # the holder actor's pickled handle
    granted: asyncio.Future[None]
    arrived: float = field(default_factory=time.monotonic)
    # At most one outstanding ``__ray_ready__`` call to the holder actor: it fails with
    # ActorDiedError once the actor is dead, and merely stays pending while the actor is busy.
    probe: asyncio.Future[Any] | None = None


class _DeviceLockActor:
    """One device's lock. All methods run on one event loop, so no further locking is needed."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._node_id = ray.get_runtime_context().get_node_id()
        self._owner: _Request | None = None
        self._waiting: deque[_Request] = deque()  # invariant: non-empty only while owned
        self._watcher: asyncio.Task[None] | None = None
        self._acquisitions = 0
        self._total_wait_s = 0.0
        self._free = asyncio.Event()  # set while nobody holds the lock
        self._free.set()
        self._free_waiters = 0

    async def acquire(
        self, holder: str, timeout: float | None, pid: int, node_id: str, actor: bytes | None
    ) -> tuple[str, str | None]:
        """Returns (status, holder in the way): status is "granted", "timeout", "reentrant" or
        "withdrawn" (the request was dropped, see ``withdraw``)."""
        for existing in [self._owner, *self._waiting]:
            if existing is not None and existing.holder == holder:
                # A dead earlier self (e.g. an actor that Ray restarted) must not lock itself out.
                dead = self._why_dead(existing)
                if dead is None and (existing.pid, existing.node_id) != (pid, node_id) and existing.probe:
                    # another process under the name: on another node only its actor's probe tells
                    await asyncio.wait([existing.probe], timeout=PROBE_WAIT_S)
                    if existing is not self._owner and existing not in self._waiting:
                        break  # gone meanwhile
                    dead = self._why_dead(existing)
                if dead is None:
                    return "reentrant", holder
                self._forget(holder)
                break
        request = _Request(holder, pid, node_id, actor, asyncio.get_running_loop().create_future())
        if self._owner is None:
            self._grant(request)
        else:
            self._waiting.append(request)
            self._watch()
            # asyncio.wait, unlike wait_for, never cancels the future, so a grant that races
            # with the timeout is seen below instead of being lost.
            await asyncio.wait([request.granted], timeout=timeout)
            if not request.granted.done():
                self._waiting.remove(request)
                return "timeout", self._owner.holder if self._owner else None
            if request.granted.cancelled():
                return "withdrawn", None
        return "granted", None

    async def release(self, holder: str) -> str | None:
        """Returns None, or why ``holder`` may not release."""
        if self._owner is None or self._owner.holder != holder:
            current = self._owner.holder if self._owner else "nobody"
            return f"{holder!r} cannot release {self._name}: it is held by {current!r}"
        self._pass_on()
        return None

    async def wait_free(self, timeout: float | None) -> bool:
        """Returns once nobody holds the lock (True), or False after ``timeout`` seconds."""
        if self._owner is None:
            return True
        self._free_waiters += 1
        self._watch()  # a dead holder is passed over for these waiters too
        try:
            await asyncio.wait_for(self._free.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            self._free_waiters -= 1

    async def withdraw(self, holder: str) -> None:
        """Forget ``holder`` whether it is waiting or was granted the lock meanwhile: used when
        an acquire was interrupted on the client and nobody will ever release it."""
        self._forget(holder)

    def _forget(self, holder: str) -> None:
        if self._owner is not None and self._owner.holder == holder:
            self._pass_on()
        for request in [r for r in self._waiting if r.holder == holder]:
            self._waiting.remove(request)
            request.granted.cancel()  # ends its pending acquire() call

    async def state(self) -> dict[str, Any]:
        return {
            "name": self._name,
            "holder": self._owner.holder if self._owner else None,
            "waiting": [r.holder for r in self._waiting],
            "acquisitions": self._acquisitions,
            "total_wait_s": self._total_wait_s,
        }

    def _grant(self, request: _Request) -> None:
        self._owner = request
        self._free.clear()
        self._acquisitions += 1
        self._total_wait_s += time.monotonic() - request.arrived
        request.granted.set_result(None)

    def _pass_on(self) -> None:
        if self._owner is not None and self._owner.probe is not None:
            self._owner.probe.cancel()
        self._owner = None
        if self._waiting:
            self._grant(self._waiting.popleft())
        else:
            self._free.set()

    def _watch(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch_owner())

    async def _watch_owner(self) -> None:
        """While anybody waits for the lock (to take it, or for it to be free), checks about
        once a second that its holder is alive, and passes it on if not."""
        while self._owner is not None and (self._waiting or self._free_waiters):
            reason = self._why_dead(self._owner)
            if reason is None:
                await asyncio.sleep(LIVENESS_CHECK_INTERVAL_S)
                continue
            logger.warning("%s: holder %r %s; passing the lock to %r", self._name, self._owner.holder, reason,
                           self._waiting[0].holder if self._waiting else None)
            self._pass_on()

    def _why_dead(self, owner: _Request) -> str | None:
        # A pid only means something on the node it came from.
        if owner.node_id == self._node_id:
            try:
                os.kill(owner.pid, 0)
            except ProcessLookupError:
                return f"(pid {owner.pid}) has exited"
            except PermissionError:
                pass  # exists, owned by another user
        if owner.actor is not None:
            probe = owner.probe
            if probe is not None and probe.done():
                if isinstance(probe.exception(), ActorDiedError):
                    return "is a dead actor"
                probe = None
            if probe is None:
                owner.probe = asyncio.ensure_future(_probe(owner.actor))
        return None


async def _probe(actor: bytes) -> Any:
    """Calls the holder actor (raises ActorDiedError once it is dead); its handle is unpickled
    in a thread, as that may import the actor's module."""
    handle: ActorHandle = await asyncio.get_running_loop().run_in_executor(None, pickle.loads, actor)
    return await asyncio.wrap_future(handle.__ray_ready__.remote().future())


_LockActor = ray.remote(num_cpus=0)(_DeviceLockActor)

# Ray garbage-collects a non-detached actor, named or not, once its creator drops the last
# handle; keeping every handle for the life of the process keeps the locks (and their queues)
# alive. Keyed by node id too, because a later ray.init() in this process is a new cluster.
_lock_actors: dict[tuple[str, str | None, int], ActorHandle] = {}


def lock_actor(device: int, namespace: str | None = None) -> ActorHandle:
    """Get or create the lock actor of ``device`` (in the current namespace by default)."""
    key = (ray.get_runtime_context().get_node_id(), namespace, device)
    if key not in _lock_actors:
        name = lock_name(device)
        _lock_actors[key] = _LockActor.options(
            name=name, namespace=namespace, get_if_exists=True, lifetime=None).remote(name)
    return _lock_actors[key]


def lock_state(device: int, namespace: str | None = None) -> dict[str, Any]:
    """Current holder, waiting holders in order, number of acquisitions and their total wait."""
    return ray.get(lock_actor(device, namespace).state.remote())


class DeviceLock:
    """A holder's handle on the locks of a set of devices: ``with DeviceLock([0, 1], "rollout:0"):``.

    ``last_wait_s`` / ``last_hold_s`` are the wait and hold time of the latest acquire; both
    are also recorded as "lock" spans on the process tracer.
    """

    def __init__(self, devices: Iterable[int], holder: str, namespace: str | None = None) -> None:
        self.devices = sorted(set(devices))
        if not self.devices:
            raise ValueError(f"DeviceLock for {holder!r} needs at least one device")
        self.holder = holder
        self._actors = {d: lock_actor(d, namespace) for d in self.devices}
        ctx = ray.get_runtime_context()
        actor = pickle.dumps(ctx.current_actor) if ctx.get_actor_id() is not None else None
        self._liveness = (os.getpid(), ctx.get_node_id(), actor)
        self._held_since: float | None = None
        self.last_wait_s = 0.0
        self.last_hold_s = 0.0

    @property
    def held(self) -> bool:
        return self._held_since is not None

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Blocks until the lock actors of these devices are up (they start in the background)."""
        try:
            ray.get([a.__ray_ready__.remote() for a in self._actors.values()], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"the lock actors of devices {self.devices} did not start within {timeout}s") from None

    def wait_free(self, timeout: float | None = None) -> float:
        """Blocks, without taking them, until none of these devices is held by anybody;
        returns the seconds waited. Nothing stops another holder from taking them right after:
        it tells a worker when it could start, not that it will."""
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        for device in self.devices:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not _get_interruptibly(self._actors[device].wait_free.remote(remaining)):
                raise LockTimeout(f"{lock_name(device)} was still held after {timeout} s")
        return time.monotonic() - start

    def acquire(self, timeout: float | None = None) -> float:
        """Block until all devices are held (ascending order); returns the seconds waited."""
        if self.held:
            raise RuntimeError(f"{self.holder!r} already holds device lock(s) {self.devices}; "
                               "device locks are not re-entrant")
        start, granted = time.time(), False
        try:
            self._acquire_in_order(timeout)
            granted = True
        finally:
            # Recorded on failure too: a wait that ends in a timeout is what one looks for.
            end = time.time()
            get_tracer().record(f"wait devices {self.devices}", start, end, cat="lock",
                                holder=self.holder, devices=self.devices, granted=granted)
        self._held_since = end
        self.last_wait_s = end - start
        return self.last_wait_s

    def _acquire_in_order(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        acquired: list[int] = []
        for device in self.devices:
            actor = self._actors[device]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ref = actor.acquire.remote(self.holder, remaining, *self._liveness)
            try:
                status, other = _get_interruptibly(ref)
            except BaseException:
                # Interrupted (or the lock actor failed) while queued: the request may still be
                # waiting or granted, and nobody would ever release it.
                actor.withdraw.remote(self.holder)
                self._release_devices(acquired)
                raise
            if status == "granted":
                acquired.append(device)
                continue
            self._release_devices(acquired)
            if status == "timeout":
                raise LockTimeout(f"{self.holder!r} timed out after {timeout} s waiting for "
                                  f"{lock_name(device)}, held by {other!r}")
            if status == "reentrant":
                raise RuntimeError(f"{self.holder!r} already holds or waits for {lock_name(device)} "
                                   "through another handle; device locks are not re-entrant")
            raise RuntimeError(f"{self.holder!r}'s request for {lock_name(device)} was withdrawn "
                               "by a newer request under the same holder name")

    def release(self) -> None:
        if self._held_since is None:
            raise RuntimeError(f"{self.holder!r} cannot release device lock(s) {self.devices}: "
                               "it does not hold them")
        errors = self._release_devices(self.devices)
        end = time.time()
        self.last_hold_s = end - self._held_since
        get_tracer().record(f"hold devices {self.devices}", self._held_since, end, cat="lock",
                            holder=self.holder, devices=self.devices)
        self._held_since = None
        if errors:
            raise RuntimeError("; ".join(errors))

    def _release_devices(self, devices: list[int]) -> list[str]:
        results = ray.get([self._actors[d].release.remote(self.holder) for d in devices])
        return [r for r in results if r is not None]

    def __enter__(self) -> DeviceLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _get_interruptibly(ref: ray.ObjectRef) -> Any:
    """The result of ``ref``, waited for in Python rather than in Ray's C++ wait: a blocking
    ``ray.get`` checks for signals itself and can swallow a KeyboardInterrupt (or a test
    timeout's signal) and wait on. A future's wait wakes up every slice, so an interrupt
    reaches the caller, which then withdraws its request."""
    future = ref.future()
    while True:
        try:
            return future.result(timeout=_WAIT_SLICE_S)
        except concurrent.futures.TimeoutError:
            continue

