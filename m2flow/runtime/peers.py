"""Direct calls from a worker to another group's ranks: one Ray actor call each way, never a
round trip through the driver (a rollout's tool calls to the tool workers).

``Peer(group, rank).call(method, *args)`` runs the worker method on that rank and returns a
``concurrent.futures.Future`` of its result at once. The rank's exception is the future's; a
rank whose process died (or is not there) answers ``PeerDiedError``, which a group call that
fails with it turns into that rank's death (``WorkerDiedError``): the run restarts, as on any
death. A method the callee marks ``@dispatch(concurrent=True)`` runs on its call threads, many
at once (``Worker.CALL_THREADS``)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import ray
from ray.exceptions import RayTaskError

from m2flow.runtime.errors import _DIED, PeerDiedError, death_reason
from m2flow.runtime.names import NAMESPACE
from m2flow.runtime.worker import CALL_PREFIX


class Peer:
    """One rank of another group, by the group's name (``WorkerGroup.name``)."""

    def __init__(self, group: str, rank: int):
        self.group, self.rank = group, rank
        self._actor: Any = None

    def call(self, method: str, *args: Any, **kwargs: Any) -> Future:
        out: Future = Future()
        try:
            if self._actor is None:
                self._actor = ray.get_actor(f"{self.group}:{self.rank}", namespace=NAMESPACE)
            ref = getattr(self._actor, CALL_PREFIX + method).remote(*args, **kwargs)
        except ValueError as e:  # no actor of that name: its process is gone
            out.set_exception(PeerDiedError(self.group, self.rank, method, str(e)))
            return out
        except _DIED as e:
            out.set_exception(PeerDiedError(self.group, self.rank, method, death_reason(e)))
            return out

        def settle(done: Future) -> None:
            try:
                out.set_result(done.result())
            except RayTaskError as e:  # the method's own exception (checked first: it may be an instance of _DIED)
                out.set_exception(e.cause if e.cause is not None else e)
            except _DIED as e:
                out.set_exception(PeerDiedError(self.group, self.rank, method, death_reason(e)))
            except BaseException as e:  # noqa: BLE001 - the caller reads it
                out.set_exception(e)

        ref.future().add_done_callback(settle)
        return out
