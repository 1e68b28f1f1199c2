"""The Ray cluster m2flow runs on, and the devices it offers.

A device is a CUDA GPU (or a *GPU slot*: one of ``gpu_slots`` devices that share a GPU and
whose processes run on it at once), or on a node without one a *CPU slot*: a fixed set of
cores that a worker pins itself to. Devices are numbered globally, node by node, so a
placement such as ``"0-3"`` means the same on one laptop and on many GPU nodes.
"""

from __future__ import annotations

import os
import shutil
import socket
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray._private import ray_constants

from m2flow.runtime import shm, stop
from m2flow.runtime.pipes import cleanup_pipes
from m2flow.runtime.head import HeadMonitor, end_leftovers
from m2flow.runtime.names import NAMESPACE, shm_prefix


_RAY_CLUSTERS = ray_constants.ENABLE_RAY_CLUSTER  # Ray's own setting, restored at shutdown


class ClusterStartError(RuntimeError):
    """The embedded Ray could not start; the message says why, and where its logs are."""


MIN_FREE_MB = 100  # room an embedded Ray needs where it writes its sockets and logs


def check_room(temp_dir: Path) -> None:
    """``ClusterStartError`` unless the file system of ``temp_dir`` (or of its nearest existing
    parent) has ``MIN_FREE_MB`` free: a Ray without room there waits 30 s for a node that never
    starts, then fails with a traceback that does not say why."""
    existing = next(p for p in (temp_dir, *temp_dir.parents) if p.exists())
    free_mb = shutil.disk_usage(existing).free / 2**20
    if free_mb < MIN_FREE_MB:
        raise ClusterStartError(f"only {free_mb:.1f} MB free in {existing}, where the embedded Ray writes its "
                                f"sockets and logs ({MIN_FREE_MB:.0f} MB needed): free some, or set M2FLOW_RAY_TMP "
                                "to a directory with room")


def answers(address: str, timeout_s: float = 5.0) -> None:
    """``ConnectionError`` unless something accepts a TCP connection at ``address``'s
    ``host:port`` (``ray://host:port`` too) within ``timeout_s``; ``auto`` and other forms
    are left to Ray."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConnectionError(f"no Ray cluster answers at {address} ({e.strerror or e})") from None


@contextmanager
def _loopback_only():
    """An embedded Ray listens on the loopback address only: every one of its processes binds
    the node's address, which Ray takes to be the loopback one where it runs without clusters
    (its switch ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read by this process at call time and
    by Ray's processes from the environment they start with). Passing ``127.0.0.1`` as the
    node's address instead does not do it: Ray swaps a loopback node address for the machine's
    external one."""
    saved = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False  # until this cluster shuts down
    try:
        yield
    except BaseException:
        ray_constants.ENABLE_RAY_CLUSTER = _RAY_CLUSTERS
        raise
    finally:
        if saved is None:
            os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)
        else:
            os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = saved


@dataclass(frozen=True)
class Device:
    index: int  # global index, across nodes
    kind: str  # "cuda" or "cpu"
    node_id: str
    node_rank: int
    local_index: int  # GPU index on its node (its slots share it), or CPU slot index on its node
    cores: tuple[int, ...] = ()  # CPU slots: indices into the node's usable cores
    # CPU slots: the share of its cores' time the slot has, under 1 where the node has more
    # slots than cores (another slot's process computes on the same cores at the same time)
    core_share: float = 1.0

    def __str__(self) -> str:
        gpu = f", GPU {self.local_index}" if self.kind == "cuda" else ""  # the slots of a GPU share it
        return f"{self.kind}:{self.index}(node {self.node_rank}{gpu})"


@dataclass(frozen=True)
class Node:
    rank: int
    node_id: str
    address: str
    num_cpus: float
    num_gpus: int
    devices: tuple[Device, ...] = field(default=())


def cpu_slot_count(num_cpus: float, cpu_slots: int | None, cores_per_slot: int = 1) -> int:
    """A GPU-less node's devices: ``cpu_slots`` if set, else one per ``cores_per_slot`` of its CPUs."""
    return cpu_slots or max(1, int(num_cpus) // cores_per_slot)


class Cluster:
    """Starts an embedded local Ray, or attaches to a running one, and lists devices.

    ``address=None`` starts a private local Ray (dashboard off, loopback, temp dir under
    ``run_dir``); ``"auto"`` or ``"host:port"`` attaches to an existing cluster.
    ``cpu_slots`` sets the number of CPU slots per GPU-less node (default: one per
    ``cores_per_slot`` cores); it may exceed the cores present, slots then share cores (each
    has its ``core_share`` of their time, and its processes as many threads).
    ``gpu_slots`` makes each GPU that many devices (consecutive indices): their processes run
    on the GPU at once, sharing its memory and compute, where the components of one device
    take turns. ``node_groups`` names sets of nodes, so that a placement can say ``"sim:0-3"``.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        num_cpus: int | None = None,
        cpu_slots: int | None = None,
        gpu_slots: int = 1,
        cores_per_slot: int = 1,
        node_groups: dict[str, list[int]] | None = None,
        run_dir: str | os.PathLike = ".m2flow",
        **ray_init_kwargs: Any,
    ):
        if cores_per_slot < 1:
            raise ValueError(f"cores_per_slot must be >= 1, got {cores_per_slot}")
        if cpu_slots is not None and cpu_slots < 1:
            raise ValueError(f"cpu_slots must be >= 1, got {cpu_slots}")
        if gpu_slots < 1:
            raise ValueError(f"gpu_slots must be >= 1, got {gpu_slots}")
        self.run_dir = Path(run_dir).resolve()
        self.session = uuid.uuid4().hex[:8]
        self._started_ray = False
        self._ray_dir: Path | None = None  # an embedded Ray's temporary directory
        if not ray.is_initialized():
            self._init_ray(address, num_cpus, ray_init_kwargs)
        self._cpu_slots = cpu_slots
        self.gpu_slots = gpu_slots
        self._cores_per_slot = cores_per_slot
        self.nodes = self._discover_nodes(ray.nodes())
        self.devices: tuple[Device, ...] = tuple(d for n in self.nodes for d in n.devices)
        self.node_groups = self._check_node_groups(node_groups or {})
        try:
            gcs = ray.get_runtime_context().gcs_address
        except Exception:  # noqa: BLE001 - a client connection (ray://) tells none: nothing is watched
            gcs = None
        self.head = HeadMonitor(gcs)  # the runner sets what happens when it is lost
        # Names this run's shared-memory segments and pipes, so that shutdown can remove what
        # crashed workers left behind; workers inherit it through WorkerGroup. Set last: a
        # cluster that failed to start must not rename the segments of the one in use.
        os.environ["M2FLOW_SESSION"] = self.session
        shm.hold(shm_prefix(self.session))
        shm.sweep()  # what sessions whose processes were all killed left here

    # -- start-up --------------------------------------------------------------
    def _init_ray(self, address: str | None, num_cpus: int | None, kwargs: dict) -> None:
        if address is None:
            temp_dir = Path(os.environ.get("M2FLOW_RAY_TMP", "/tmp")) / f"m2flow-ray-{os.getpid()}"
            kwargs = {
                "num_cpus": num_cpus if num_cpus is not None else os.cpu_count(),
                "include_dashboard": False,
                "_temp_dir": str(temp_dir),
                "log_to_driver": True,
                **kwargs,
            }
            self._ray_dir = Path(kwargs["_temp_dir"])
            check_room(self._ray_dir)
            try:
                with _loopback_only():
                    ray.init(namespace=NAMESPACE, **kwargs)
            except Exception as e:  # noqa: BLE001 - Ray's own errors here name no cause the user can act on
                ray.shutdown()  # what did start goes
                first = (str(e).strip().splitlines() or [""])[0]
                raise ClusterStartError(f"the embedded Ray did not start ({type(e).__name__}: {first}); its logs: "
                                        f"{self._ray_dir}/session_latest/logs") from e
        else:
            answers(address)  # Ray itself would retry an address where nothing listens for minutes
            ray.init(namespace=NAMESPACE, address=address, **kwargs)
        self._started_ray = True
        stop.reassert()  # Ray put its own SIGTERM handler in place of a stop request's

    def _discover_nodes(self, listed: list[dict]) -> tuple[Node, ...]:
        """``listed``: Ray's ``ray.nodes()``."""
        alive = [n for n in listed if n["Alive"]]
        # Head node first, then by address: a stable order, so device indices are stable.
        alive.sort(key=lambda n: (not n["Resources"].get("node:__internal_head__"), n["NodeManagerAddress"], n["NodeID"]))
        nodes = []
        index = 0
        for rank, n in enumerate(alive):
            res = n["Resources"]
            num_gpus = int(res.get("GPU", 0))
            num_cpus = res.get("CPU", 0.0)
            devices = []
            if num_gpus:
                for g in range(num_gpus):
                    for _ in range(self.gpu_slots):
                        devices.append(Device(index, "cuda", n["NodeID"], rank, g))
                        index += 1
            else:
                slots = cpu_slot_count(num_cpus, self._cpu_slots, self._cores_per_slot)
                share = min(1.0, num_cpus / (slots * self._cores_per_slot))
                for s in range(slots):
                    cores = tuple(range(s * self._cores_per_slot, (s + 1) * self._cores_per_slot))
                    devices.append(Device(index, "cpu", n["NodeID"], rank, s, cores, share))
                    index += 1
            nodes.append(Node(rank, n["NodeID"], n["NodeManagerAddress"], num_cpus, num_gpus, tuple(devices)))
        if not nodes:
            raise RuntimeError("the Ray cluster has no live node")
        return tuple(nodes)

    def _check_node_groups(self, groups: dict[str, list[int]]) -> dict[str, tuple[int, ...]]:
        checked = {"all": tuple(range(len(self.nodes)))}
        for name, ranks in groups.items():
            bad = [r for r in ranks if not 0 <= r < len(self.nodes)]
            if bad:
                raise ValueError(f"node group {name!r} names nodes {bad}, but the cluster has {len(self.nodes)} node(s)")
            checked[name] = tuple(ranks)
        return checked

    # -- queries ----------------------------------------------------------------
    def group_devices(self, group: str) -> tuple[Device, ...]:
        """Devices of a named node group, in global order; ``"all"`` is every device."""
        if group not in self.node_groups:
            raise KeyError(f"unknown device group {group!r}; known: {sorted(self.node_groups)}")
        return tuple(d for r in self.node_groups[group] for d in self.nodes[r].devices)

    def lost_nodes(self) -> list[Node]:
        """The nodes found at the start (or at the last ``rediscover``) that the Ray cluster no
        longer lists alive."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return [n for n in self.nodes if n.node_id not in alive]

    def joined_nodes(self) -> list[Node]:
        """The nodes the Ray cluster lists alive that were not found at the start (or at the last
        ``rediscover``): new ones, or lost ones back (their ranks and device indices are those
        a ``rediscover`` would give them now)."""
        held = {n.node_id for n in self.nodes}
        return [n for n in self._discover_nodes(ray.nodes()) if n.node_id not in held]

    def rediscover(self) -> None:
        """The nodes and devices as the Ray cluster lists them alive now (after it lost one, or
        has one again: a plan is then laid out on the devices there are, numbered afresh).
        Named node groups name nodes by rank, which the nodes left do not keep: only ``all`` is
        left."""
        self.nodes = self._discover_nodes(ray.nodes())
        self.devices = tuple(d for n in self.nodes for d in n.devices)
        self.node_groups = self._check_node_groups({})

    @property
    def device_kind(self) -> str:
        return "cuda" if any(d.kind == "cuda" for d in self.devices) else "cpu"

    def describe(self) -> str:
        lines = [f"Ray cluster, {len(self.nodes)} node(s), {len(self.devices)} device(s):"]
        for n in self.nodes:
            kinds = ", ".join(str(d) for d in n.devices)
            slots = f" ({self.gpu_slots} devices each)" if n.num_gpus and self.gpu_slots > 1 else ""
            lines.append(f"  node {n.rank} {n.address} cpus={n.num_cpus:g} gpus={n.num_gpus}{slots}: {kinds}")
        return "\n".join(lines)

    # -- shutdown ---------------------------------------------------------------
    def shutdown(self) -> None:
        """Stops the Ray this cluster started (an attached cluster is left running) and
        removes this session's shared-memory segments on this node; of an embedded Ray whose
        head was lost, the processes its shutdown leaves too."""
        self.head.stop()
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
            if self.head.lost and self._ray_dir is not None:
                end_leftovers(self._ray_dir)
        self._started_ray = False
        ray_constants.ENABLE_RAY_CLUSTER = _RAY_CLUSTERS
        shm.cleanup(shm_prefix(self.session))
        cleanup_pipes(shm_prefix(self.session))
        shm.release(shm_prefix(self.session))

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
