"""Worker: the base class of every component process (one Ray actor per rank).

A subclass is an ordinary class; ``WorkerGroup`` turns it into Ray actors placed on
devices. Before the subclass's ``__init__`` runs, the worker knows its group, rank,
world size and devices, has pinned itself to its CPU cores (or sees only its GPUs),
and has the torch.distributed environment variables set.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
from dataclasses import dataclass
from collections.abc import Hashable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import ray

from m2flow.runtime import listen
from m2flow.runtime.cluster import Device
from m2flow.runtime.comm import Communicator, CommWork, Envelope, PeerInfo
from m2flow.runtime.device_lock import DeviceLock
from m2flow.runtime.names import NAMESPACE
from m2flow.runtime.trace import get_tracer, set_process_name

# Methods in this concurrency group run on their own threads, so a worker busy in a
# long method (or blocked in recv) still answers deliveries, pings and trace requests.
IO_GROUP = "m2flow_io"
IO_THREADS = 4
# Methods marked ``@dispatch(concurrent=True)`` run here, up to ``Worker.CALL_THREADS`` at once
# (a worker that serves other workers' calls, each waiting on something of its own).
CALLS_GROUP = "m2flow_calls"


@dataclass(frozen=True)
class WorkerInfo:
    group: str
    rank: int
    world_size: int
    CALL_THREADS = 0  # threads for its methods marked ``@dispatch(concurrent=True)``; 0: it has none
    devices: tuple[Device, ...]
    local_rank: int
    session: str
    group_devices: tuple[int, ...]  # the device indices of every rank of the group


def visible_gpus(devices: tuple[Device, ...]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a process on ``devices``: each GPU once, in order (the
    slots of one GPU are that GPU)."""
    return ",".join(dict.fromkeys(str(d.local_index) for d in devices))


@functools.cache
def _usable_cores() -> list[int]:
    """The cores this process could run on before it pinned itself (a process re-initialised
    for another rank pins itself anew)."""
    return sorted(os.sched_getaffinity(0))


def _pin_process(cores: list[int]) -> None:
    # sched_setaffinity(0) pins only the calling thread; Ray's threads already exist,
    # so pin every thread of the process (threads started later inherit it).
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):
            pass


class Worker:
    """Base class for components. Attributes set before ``__init__``: ``group``, ``rank``,
    ``world_size``, ``local_rank``, ``devices``, ``device`` ("cpu" or "cuda")."""

    group: str
    rank: int
    world_size: int
    CALL_THREADS = 0  # threads for its methods marked ``@dispatch(concurrent=True)``; 0: it has none

    @classmethod
    def reshard(cls, states: list[Any], ranks: int, *args: Any) -> list[Any]:
        """The per-rank states a group of ``len(states)`` ranks saved, spread over a group of
        ``ranks`` ranks made with ``args`` (a run resumed on another placement). By default
        new rank i takes old rank ``i % len(states)``'s: right for ranks that hold the same
        state (replicas) or states of their own (random generators). A class whose ranks
        each hold a part of one whole overrides it; ``ValueError`` where it cannot be done."""
        return states if len(states) == ranks else [states[i % len(states)] for i in range(ranks)]

    # -- set-up, called by WorkerGroup --------------------------------------------
    def _m2flow_init(self, info: WorkerInfo, master: tuple[str, int], args: tuple, kwargs: dict) -> None:
        """``master``: rank 0's address for torch.distributed's rendezvous (``_m2flow_address``)."""
        self._m2flow_master = master
        self.group, self.rank, self.world_size = info.group, info.rank, info.world_size
        self.local_rank, self.devices = info.local_rank, info.devices
        self._group_devices = info.group_devices
        self.device = "cuda" if info.devices[0].kind == "cuda" else "cpu"
        os.environ.update(
            RANK=str(info.rank),
            WORLD_SIZE=str(info.world_size),
            LOCAL_RANK=str(info.local_rank),
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
            M2FLOW_SESSION=info.session,
        )
        # gloo's and NCCL's transports bind the interface of this node's Ray address only
        # (loopback on an embedded Ray), not every interface
        listen.set_interfaces(listen.node_address())
        if self.device == "cuda":
            # Ray must not overwrite the GPUs we chose; set before CUDA initialises.
            os.environ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus(info.devices)
        else:
            usable = _usable_cores()
            cores = sorted({usable[c % len(usable)] for d in info.devices for c in d.cores})
            _pin_process(cores)
            # As many threads as the devices' share of those cores: where slots share cores, a
            # process on two half-core slots computes with one thread, not two beside another
            # slot's process on the same cores (threads beyond the cores wait spinning). Torch
            # imported later (a worker that imports it in its __init__) reads the variable.
            threads = min(len(cores), max(1, round(sum(d.core_share * len(d.cores) for d in info.devices))))
            os.environ["OMP_NUM_THREADS"] = str(threads)
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(threads)
        set_process_name(f"{info.group}:{info.rank}")
        self.comm = Communicator((info.group, info.rank))
        self._group_sizes: dict[str, int] = {}
        with get_tracer().span(f"{info.group}.__init__", rank=info.rank):
            self._m2flow_user_cls.__init__(self, *args, **kwargs)

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_address(self) -> tuple[str, int]:
        """Rank 0's address for its group's rendezvous store: this node's Ray address and a port
        bound on it now and held (``init_process_group`` listens on it), so that no other process
        takes the port meanwhile."""
        host = listen.node_address()
        self._m2flow_listener = listen.bound_socket(host)
        return host, self._m2flow_listener.getsockname()[1]

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_ping(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_received(self) -> int:
        """Messages this worker has taken from others (progress the driver does not see)."""
        return self.comm.received

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_stacks(self) -> dict:
        """Every thread's Python stack, innermost frame last (hang reports): answered by the IO
        thread while the main one is busy or stuck."""
        import sys
        import threading
        import traceback

        names = {t.ident: t.name for t in threading.enumerate()}
        main = threading.main_thread().ident
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "threads": {f"{names.get(ident, ident)}{' (main)' if ident == main else ''}":
                            "".join(traceback.format_stack(frame))
                            for ident, frame in sys._current_frames().items()}}

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_trace(self) -> list[dict]:
        return get_tracer().drain()

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_close(self) -> None:
        self.comm.close()

    def _m2flow_recycle(self) -> None:
        """Makes the process ready for ``_m2flow_init`` again (``WorkerPool``): closes its
        communicator and process group and drops everything its last life set. Runs on the
        main thread, after every call the group was given."""
        import gc

        self.comm.close()
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self.__dict__.clear()
        gc.collect()

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_peer_info(self) -> PeerInfo:
        return self.comm.info

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_deliver(self, env: Envelope, reader: int = 0) -> None:
        self.comm.deliver(env, reader)

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_nccl_join(self, peer: tuple[str, int], store_addr: tuple[str, int]) -> None:
        self.comm.pairs.join(peer, store_addr)

    @ray.method(concurrency_group=IO_GROUP)
    def _m2flow_nccl_open(self, peer: tuple[str, int]) -> None:
        self.comm.pairs.open(peer)

    # -- communication ------------------------------------------------------------
    def send(self, obj: Any, dst_group: str, dst_rank: int, tag: Hashable = 0, timeout: float | None = None) -> str:
        """Sends ``obj`` to a worker of any group; returns the transport used."""
        return self.comm.send(obj, (dst_group, dst_rank), tag, timeout)

    def isend(self, obj: Any, dst_group: str, dst_rank: int, tag: Hashable = 0) -> CommWork:
        return self.comm.isend(obj, (dst_group, dst_rank), tag)

    def recv(self, src_group: str, src_rank: int, tag: Hashable = 0, timeout: float | None = None) -> Any:
        return self.comm.recv((src_group, src_rank), tag, timeout)

    def irecv(self, src_group: str, src_rank: int, tag: Hashable = 0, timeout: float | None = None) -> CommWork:
        return self.comm.irecv((src_group, src_rank), tag, timeout)

    def broadcast(self, obj: Any, src: tuple[str, int], group: str, tag: Hashable = 0, timeout: float | None = None) -> Any:
        """Collective over ``src`` and every rank of ``group``: all return the source's ``obj``."""
        return self.comm.broadcast(obj, tuple(src), [(group, r) for r in range(self.group_size(group))], tag, timeout)

    def broadcast_ready(self, src: tuple[str, int], tag: Hashable = 0) -> bool:
        """Whether a ``broadcast`` from ``src`` has arrived (its receiving side would not wait)."""
        return self.comm.ready(tuple(src), ("broadcast", tag)) > 0

    def group_size(self, group: str) -> int:
        """World size of a running group, found by its actors' names."""
        if group == self.group:
            return self.world_size
        if group not in self._group_sizes:
            n = 0
            while True:
                try:
                    ray.get_actor(f"{group}:{n}", namespace=NAMESPACE)
                except ValueError:
                    break
                n += 1
            if n == 0:
                raise LookupError(f"no worker group named {group!r} is running")
            self._group_sizes[group] = n
        return self._group_sizes[group]

    # -- helpers for subclasses ---------------------------------------------------
    def device_turns(self, take_turns: bool = True, all_ranks: bool = False) -> AbstractContextManager:
        """The lock of this worker's devices, for components that share them and take turns
        (a no-op context when they do not). ``all_ranks``: a turn of the whole group at once,
        for work with collectives (``GroupTurn``); every rank must enter it together."""
        if not take_turns:
            return nullcontext()
        if all_ranks and self.world_size > 1:
            return GroupTurn(self)
        return DeviceLock([d.index for d in self.devices], f"{self.group}:{self.rank}")

    def init_process_group(self, backend: str | None = None, timeout_s: float = 120.0) -> None:
        """torch.distributed over this worker's group: gloo on CPU; on GPUs nccl for CUDA
        tensors and gloo beside it for CPU ones (counts and statistics). The rendezvous store
        listens on rank 0's node's Ray address only (torch's ``tcp://`` rendezvous would listen
        on every interface)."""
        import datetime

        import torch.distributed as dist

        if dist.is_initialized():
            return
        backend = backend or ("cpu:gloo,cuda:nccl" if self.device == "cuda" else "gloo")
        host, port = self._m2flow_master
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.rank == 0:
            # the port held since the group was made; bound again where a group formed before
            listener = self.__dict__.pop("_m2flow_listener", None) or listen.bound_socket(host, port)
            store = listen.host_store(listener, self.world_size, timeout)
        else:
            store = listen.join_store(host, port, self.world_size, timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)


class GroupTurn:
    """A turn on the devices of every rank of a group at once, for work with collectives
    (gradient all-reduces). Were each rank to take its own lock, one could wait inside a
    collective holding its device while a component that spans devices holds another rank's
    and waits for the first: a cycle that only the collective's time-out ends. Here rank 0
    takes all of them (in ascending order, as every lock holder does) while the other ranks
    wait for it holding nothing; they all leave together. Needs the group's process group
    (``init_process_group``)."""

    def __init__(self, worker: Worker) -> None:
        self.lock = DeviceLock(worker._group_devices, f"{worker.group}:all") if worker.rank == 0 else None
        self.last_wait_s = 0.0

    def __enter__(self) -> GroupTurn:
        start = time.perf_counter()
        _barrier()  # every rank is done with what it did under its own lock
        if self.lock is not None:
            self.lock.acquire()
        _barrier()  # until rank 0 holds every rank's devices
        self.last_wait_s = time.perf_counter() - start
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: Any) -> None:
        try:
            if exc_type is None:
                _barrier()  # every rank is done with the devices
        finally:
            if self.lock is not None:
                self.lock.release()


def _barrier() -> None:
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))  # a CPU tensor: gloo, also beside NCCL (init_process_group)


# A group call of ``method`` runs the actor method CALL_PREFIX + method: the method itself, in
# a "call" trace span. One such entry point per method, rather than one taking the method's
# name, keeps a call as cheap as a plain Ray actor call (the name argument alone cost ~0.1 ms
# of a ~0.7 ms round trip); internal calls between a worker's own methods stay untraced.
CALL_PREFIX = "_m2flow_call_"

_ACTOR_CLASSES: dict[type, Any] = {}


def callable_methods(cls: type) -> list[str]:
    """The methods a group can call: the public plain functions of ``cls`` and its bases."""
    return [name for name in dir(cls)
            if not name.startswith("_") and inspect.isfunction(inspect.getattr_static(cls, name))]


def _traced(name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)  # also copies what @ray.method set on fn (its concurrency group)
    def call(self: Worker, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return fn(self, *args, **kwargs)
        finally:
            get_tracer().record(f"{self.group}.{name}", start, time.time(), cat="call", rank=self.rank)

    return call


def _process_started(self: Worker) -> None:
    """The actor's construction, in its new process, with its class's modules imported: they
    stay for the process's life, so their objects leave the collector's sight (``gc.freeze``).
    A full collection (each recycle's, the interpreter's own during a run) then skips them:
    0.13 s with torch and transformers loaded, about none after."""
    import gc

    gc.collect()
    gc.freeze()


def actor_class(cls: type) -> Any:
    """The Ray actor class for a Worker subclass; its ``__init__`` is deferred to
    ``_m2flow_init`` so that placement is in effect before user code runs."""
    if not issubclass(cls, Worker):
        raise TypeError(f"{cls.__name__} must subclass m2flow.runtime.Worker")
    if cls not in _ACTOR_CLASSES:
        entry_points = {CALL_PREFIX + name: _traced(name, getattr(cls, name)) for name in callable_methods(cls)}
        wrapper = type(cls.__name__, (cls,), {"__init__": _process_started, "_m2flow_user_cls": cls,
                                              "__module__": cls.__module__, **entry_points})
        groups = {IO_GROUP: IO_THREADS} | ({CALLS_GROUP: cls.CALL_THREADS} if cls.CALL_THREADS else {})
        concurrent = [n for n in callable_methods(cls) if getattr(getattr(cls, n), "_m2flow_concurrent", False)]
        if concurrent and not cls.CALL_THREADS:
            raise TypeError(f"{cls.__name__}: {concurrent} run concurrently, but it sets no CALL_THREADS")
        _ACTOR_CLASSES[cls] = ray.remote(concurrency_groups=groups)(wrapper)
    return _ACTOR_CLASSES[cls]
