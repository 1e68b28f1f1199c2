"""WorkerPool: worker processes (and channel actors) kept between groups (channels) of the
same names, and the start and end of a worker's process."""

from __future__ import annotations

import time
import uuid
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from m2flow.runtime.names import NAMESPACE
from m2flow.runtime.placement import ComponentPlacement
from m2flow.runtime.worker import actor_class

# Every worker gets a sliver of a CPU: Ray must not refuse to place the third actor on a
# 2-core node; the real CPU share is the slot the worker pins itself to.
ACTOR_CPUS = 0.01


class WorkerPool:
    """Worker processes kept between worker groups of the same names, for a driver that runs
    one flow under several plans in a row (profiling): a group made with the pool takes the
    process of each rank from it when that rank (group name and rank, worker class, node, and
    on GPUs the same devices) ran before, and re-initialises it, instead of starting a process
    and importing everything anew; its ``shutdown`` gives the processes back with their
    state dropped. ``close`` ends them. A channel ``release``d to the pool keeps its actor
    for the next channel of its name in the same way (``Channel.create(..., pool=)``).

    ``for_one_run``: a pool that profiling hands to the run it planned: once that run's groups
    started (``started``), the processes they did not take are ended."""

    def __init__(self, for_one_run: bool = False) -> None:
        self.tag = uuid.uuid4().hex[:6]  # the runs that share the pool name their groups alike
        self.for_one_run = for_one_run
        self._idle: dict[str, tuple[type, str, tuple, Any]] = {}  # actor name -> (class, node, devices, actor)

    def take(self, name: str, cls: type, node_id: str, devices: tuple) -> Any | None:
        got = self._idle.pop(name, None)
        if got is None:
            return None
        if _fits(got, cls, node_id, devices):
            return got[3]
        _kill_named((name, got[3]))  # its name is the new rank's
        return None

    def holds(self, cls: type, placement: ComponentPlacement, name: str) -> bool:
        """Whether a group to be made (``placement``, named ``name``) would take every rank's
        process from the pool, starting none anew (on GPUs a process moves only with its
        devices)."""
        return all((got := self._idle.get(f"{name}:{r.rank}")) is not None and _fits(got, cls, r.node_id, r.devices)
                   for r in placement.ranks())

    def give(self, name: str, cls: type, node_id: str, devices: tuple, actor: Any) -> None:
        self._idle[name] = (cls, node_id, devices, actor)

    def prestart(self, cls: type, placement: ComponentPlacement, name: str) -> None:
        """Starts the processes of a group to be made later (the ranks the pool lacks), in
        the background: they start beside whatever runs now, not one group after another."""
        for r in placement.ranks():
            if f"{name}:{r.rank}" not in self._idle:
                self.give(f"{name}:{r.rank}", cls, r.node_id, r.devices, _new_actor(cls, f"{name}:{r.rank}", r.node_id))

    def ready(self) -> None:
        """Waits until every idle process is up (a prestarted one may still be importing)."""
        ray.get([actor.__ray_ready__.remote() for _, _, _, actor in self._idle.values()])  # channel actors too

    def trim(self, group: str, world_size: int) -> None:
        """Ends the idle processes of ``group``'s ranks beyond ``world_size``: a group's size
        is read off the names of its running ranks."""
        for name in [n for n in self._idle if n.rpartition(":")[0] == group and int(n.rpartition(":")[2]) >= world_size]:
            _kill_named((name, self._idle.pop(name)[3]))

    def started(self) -> None:
        """A run's groups started: a pool ``for_one_run`` ends the processes they left idle."""
        if self.for_one_run:
            self.close()

    def close(self) -> None:
        """Ends the idle processes; returns once their names are free, so that the pool's
        next runs start processes named as these were."""
        _kill_named(*((name, actor) for name, (_, _, _, actor) in self._idle.items()))
        self._idle.clear()


def _fits(idle: tuple[type, str, tuple, Any], cls: type, node_id: str, devices: tuple) -> bool:
    """Whether an idle process (class, node, devices, actor) can be a rank of ``cls`` on
    ``node_id`` with ``devices``: a CPU worker re-pins itself, a GPU one keeps its GPUs."""
    same_devices = idle[2] == devices or all(d.kind == "cpu" for d in devices)
    return idle[0] is cls and idle[1] == node_id and same_devices


def _new_actor(cls: type, name: str, node_id: str, timeout_s: float = 10.0) -> Any:
    """A worker process (its class's module imported; ``_m2flow_init`` not yet called). A name
    still held by a process just ended (a restart replaces it) is waited for."""
    options = actor_class(cls).options(name=name, namespace=NAMESPACE, num_cpus=ACTOR_CPUS,
                                       scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return options.remote()
        except ValueError as e:
            if "already taken" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _kill_named(*named: tuple[str, Any], timeout_s: float = 10.0) -> None:
    """Kills actors (name, handle) and waits until their names are free."""
    for _, actor in named:
        ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    for name, _ in named:
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {name} still registered {timeout_s}s after it was killed")
            time.sleep(0.02)
