"""A Plan: how a workflow executes on a cluster, whatever the loop that drives it.

For each component, the devices its processes run on and how processes map to devices (one
per device, several per device, or one spanning several); which components are fused into
one process; for each channel, its granularity (items per message); the env pipeline
stages; and how far data collection may run ahead of training. Every runner consumes a Plan;
``Plan.for_mode`` derives one from a named mode, and a Plan written out as YAML runs as it
is (``m2flow train <preset> placement=@plan.yaml``).

The mode is derived, and named the same in every flow: every component on the same devices
is *collocated*; the components that make the data (``Workflow.makers``) on devices the one
that trains (``Workflow.trainer``) does not use, *disaggregated*; anything in between, *hybrid*.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from m2flow.config.validate import ConfigError
from m2flow.runtime.files import write_text
from m2flow.runtime.placement import Placement, PlacementError, parse_range, processes, rank_devices

MODES = ("collocated", "disaggregated", "hybrid")


class PlanError(ConfigError):
    """A plan that cannot run: unknown components, devices the cluster lacks, a bad shape."""

    def __init__(self, problem: str, key: str = "placement"):
        super().__init__(key, problem)


@dataclass(frozen=True)
class Workflow:
    """What a flow is made of, as far as planning goes (no worker classes: plain names).

    ``splits`` says how the named modes divide the devices: for each mode, groups of
    components in device order, each with its share: an int (that many devices), a float
    (that fraction of them, at least one) or None (the devices left). Components a mode's
    groups leave out span every device (the hybrid trainer). ``single_rank`` components are
    one process whatever their devices (a stream passes through them in order);
    ``whole_on_cpu`` components make one process of all their CPU slots (its threads span
    them), unless they span every device in a hybrid plan. ``fusable`` names a pair that may
    share one process when placed rank for rank on the same devices. ``light`` components
    hold no model: they never take device turns; ``light_alone`` ones only when they host
    the other of the fusable pair (the env workers running the rollout's policy).
    ``gpu_collectives`` components' ranks all-reduce over NCCL on GPUs, which takes one GPU
    per rank: no two of their ranks may share a GPU (``Plan.check``'s ``gpu_slots``).
    """

    name: str
    components: tuple[str, ...]
    makers: tuple[str, ...]
    trainer: str
    channels: tuple[str, ...]
    splits: Mapping[str, tuple[tuple[tuple[str, ...], int | float | None], ...]]
    single_rank: tuple[str, ...] = ()
    whole_on_cpu: tuple[str, ...] = ()
    fusable: tuple[str, str] | None = None
    light: tuple[str, ...] = ()
    light_alone: tuple[str, ...] = ()
    gpu_collectives: tuple[str, ...] = ()

    def turns(self, devices: Mapping[str, AbstractSet], fused: bool) -> dict[str, bool]:
        """For each process (``devices``: its component's devices; a fused pair's host only),
        whether it takes device turns: it holds a model and shares a device with another
        process that holds one."""
        heavy = [c for c in devices if c not in self.light and (fused or c not in self.light_alone)]
        return {c: c in heavy and any(devices[c] & devices[o] for o in heavy if o != c) for c in devices}


@dataclass
class ComponentPlan:
    devices: str
    procs_per_device: int = 1
    devices_per_proc: int = 1

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if k == "devices" or v != 1}


@dataclass
class Plan:
    components: dict[str, ComponentPlan]
    fuse: list[list[str]] = field(default_factory=list)
    granularity: dict[str, int] = field(default_factory=dict)
    stages: int = 1
    run_ahead: int = 0
    # Whether components that take turns on shared devices move their memory out between turns
    # (the rollout its weights and KV cache, a trainer its optimizer state: on a GPU, to host
    # memory). False keeps it where it is: the planner sets it on GPUs where the memory of
    # every component fits at once, and the turns then cost only their handover.
    offload: bool = True

    # -- building -----------------------------------------------------------------
    @classmethod
    def for_mode(cls, workflow: Workflow, mode: str, num_devices: int, device_kind: str = "cpu", *,
                 components: tuple[str, ...] | None = None, fuse: bool = True, granularity: int = 1,
                 stages: int = 1, run_ahead: int = 0, trainer_devices_per_proc: int = 1) -> Plan:
        """The plan of a named mode on ``num_devices`` devices of ``device_kind``."""
        names = components or workflow.components
        if mode == "collocated":
            ranges = {c: (0, num_devices - 1) for c in names}
        elif mode in workflow.splits:
            ranges = _split(workflow, mode, names, num_devices)
        else:
            raise PlanError(f"expected {' | '.join(('collocated', *workflow.splits))}, got {mode!r}", "placement.mode")
        plans = {}
        for c, (lo, hi) in ranges.items():
            span = hi - lo + 1
            spans_all = mode == "hybrid" and (lo, hi) == (0, num_devices - 1)
            whole = c in workflow.single_rank or (device_kind == "cpu" and c in workflow.whole_on_cpu and not spans_all)
            per = span if whole else (trainer_devices_per_proc if c == workflow.trainer else 1)
            plans[c] = ComponentPlan(f"{lo}-{hi}", devices_per_proc=per)
        fused = [list(workflow.fusable)] if fuse and workflow.fusable and all(c in plans for c in workflow.fusable) else []
        return cls(plans, fused, {ch: granularity for ch in workflow.channels}, stages, run_ahead)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        data = dict(data)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise PlanError(f"unknown key(s) {sorted(unknown)}; known: components, fuse, granularity, stages, "
                            "run_ahead, offload")
        if not isinstance(data.get("offload", True), bool):
            raise PlanError(f"offload must be true or false, got {data['offload']!r}")
        comps = {}
        for name, entry in dict(data.pop("components", {})).items():
            entry = {"devices": entry} if isinstance(entry, (str, int)) else dict(entry)
            try:
                comps[name] = ComponentPlan(**{k: (str(v) if k == "devices" else int(v)) for k, v in entry.items()})
            except TypeError:
                raise PlanError(f"component {name!r}: keys are devices, procs_per_device, devices_per_proc; "
                                f"got {sorted(entry)}") from None
        return cls(comps, **data)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"no such plan file {str(path)!r}", "placement.plan")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise PlanError(f"{path} is not YAML ({' '.join(str(e).split())})", "placement.plan") from None
        if not isinstance(data, (dict, type(None))):
            raise PlanError(f"{path} holds a {type(data).__name__}, not a plan (a mapping with components)",
                            "placement.plan")
        return cls.from_dict(data or {})

    # -- writing --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"components": {c: p.as_dict() for c, p in self.components.items()}, "fuse": self.fuse,
                "granularity": dict(self.granularity), "stages": self.stages, "run_ahead": self.run_ahead,
                **({} if self.offload else {"offload": False})}

    def save(self, path: str | Path) -> Path:
        """Writes the plan as YAML, whole (``runtime.files.write_text``); folders are made."""
        return write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

    def mode(self, workflow: Workflow) -> str:
        """collocated (every component on the same devices), disaggregated (the makers on
        devices the trainer does not use) or hybrid (anything in between)."""
        sets = [self.devices(c) for c in self.components]
        if all(s == sets[0] for s in sets):
            return "collocated"
        made = set().union(*(self.devices(c) for c in workflow.makers if c in self.components))
        return "hybrid" if made & self.devices(workflow.trainer) else "disaggregated"

    def devices(self, component: str) -> set[tuple[str, int]]:
        group, indices = parse_range(self.components[component].devices, component)
        return {(group, i) for i in indices}

    def world_size(self, component: str) -> int:
        """The component's processes (ranks)."""
        p = self.components[component]
        return processes(component, len(parse_range(p.devices, component)[1]), p.procs_per_device, p.devices_per_proc)

    def table(self, workflow: Workflow) -> str:
        """The plan as a table, one row per component."""
        lines = [f"plan ({self.mode(workflow)}):", f"  {'component':<11} {'devices':<9} {'processes':<22} fused with"]
        for c, p in self.components.items():
            per = (f"{p.devices_per_proc} devices each" if p.devices_per_proc > 1
                   else f"{p.procs_per_device} per device")
            procs = self.world_size(c)
            fused = next((", ".join(x for x in f if x != c) for f in self.fuse if c in f), "")
            lines.append(f"  {c:<11} {p.devices:<9} {f'{procs} ({per})':<22} {fused}")
        extras = [f"stages {self.stages}", f"run ahead {self.run_ahead}"] + ([] if self.offload else ["no offload"])
        extras += [f"{ch} granularity {g}" for ch, g in self.granularity.items()]
        return "\n".join(lines + ["  " + ", ".join(extras)])

    # -- checking and placing -------------------------------------------------------------
    def check(self, workflow: Workflow, num_devices: int, components: tuple[str, ...] | None = None, *,
              gpu_slots: int = 0, devices_per_node: int = 0) -> None:
        """Fails, naming the component and what is short, unless the plan fits ``num_devices``.
        ``gpu_slots``: where the devices are GPUs, how many devices each GPU is (0: they are
        not GPUs); ``devices_per_node``: on nodes of that many devices each (0: not known), no
        process may span two of them."""
        names = components or workflow.components
        missing = [c for c in names if c not in self.components]
        if missing:
            raise PlanError(f"no devices for component(s) {missing} (placement.components.<name>)")
        extra = sorted(set(self.components) - set(names))
        if extra:
            raise PlanError(f"unknown component(s) {extra}; this run has {list(names)}")
        for c, p in self.components.items():
            try:
                group, devices = parse_range(p.devices, c)
            except PlacementError as e:
                raise PlanError(f"{e}") from None
            if group == "all" and max(devices) >= num_devices:  # a node group's size is known once Ray runs
                raise PlanError(f"component {c!r} needs device {max(devices)} ({p.devices}), the cluster has "
                                f"{num_devices} device(s) (0-{num_devices - 1})")
            try:
                ranks = processes(c, len(devices), p.procs_per_device, p.devices_per_proc)
            except PlacementError as e:
                raise PlanError(str(e)) from None
            if c in workflow.single_rank and ranks != 1:
                raise PlanError(f"component {c!r} must be one process (the stream passes through it in order), "
                                f"got devices {p.devices} with {p.devices_per_proc} device(s) per process")
            if gpu_slots and c in workflow.gpu_collectives and group == "all":  # a group's GPUs: known once Ray runs
                self._one_gpu_per_rank(c, devices, gpu_slots)
            if devices_per_node and group == "all":
                for rank, devs in enumerate(rank_devices(devices, p.procs_per_device, p.devices_per_proc)):
                    if len({d // devices_per_node for d in devs}) > 1:
                        raise PlanError(f"component {c!r}: rank {rank} would span devices of nodes "
                                        f"{sorted({d // devices_per_node for d in devs})} ({devices_per_node} "
                                        "device(s) a node); one process runs on one node")
        for group in self.fuse:
            if workflow.fusable is None or sorted(group) != sorted(workflow.fusable):
                raise PlanError(f"cannot fuse {group}" + (f"; only {list(workflow.fusable)}" if workflow.fusable else ""))
        unknown = sorted(set(self.granularity) - set(workflow.channels))
        if unknown:
            raise PlanError(f"granularity for unknown channel(s) {unknown}; channels: {list(workflow.channels)}")
        if any(g < 1 for g in self.granularity.values()):
            raise PlanError(f"granularity must be >= 1, got {self.granularity}")
        if self.stages < 1:
            raise PlanError(f"stages must be >= 1, got {self.stages}")
        if self.run_ahead < 0:
            raise PlanError(f"run_ahead must be >= 0 (the streams launched ahead of training), got {self.run_ahead}")

    def _one_gpu_per_rank(self, c: str, devices: list[int], gpu_slots: int) -> None:
        p = self.components[c]
        holder: dict[int, int] = {}  # GPU (global ordinal) -> the rank on it
        for rank, devs in enumerate(rank_devices(devices, p.procs_per_device, p.devices_per_proc)):
            for gpu in sorted({d // gpu_slots for d in devs}):
                if gpu in holder:
                    raise PlanError(f"component {c!r}: ranks {holder[gpu]} and {rank} would share GPU {gpu} (devices "
                                    f"{p.devices}, {gpu_slots} device(s) per GPU); its all-reduces (NCCL) take one GPU "
                                    "per rank (a rank may span its GPU's devices: devices_per_proc)")
                holder[gpu] = rank

    def placement(self, cluster) -> Placement:
        """The runtime placement of the plan's components on ``cluster``'s devices."""
        return Placement.from_config({c: p.as_dict() for c, p in self.components.items()}, cluster)

    def hosts(self, workflow: Workflow) -> dict[str, str]:
        """Fused component -> the component in whose processes it runs (none unless fused)."""
        return {workflow.fusable[1]: workflow.fusable[0]} if self.fused(workflow) else {}

    def fused(self, workflow: Workflow) -> bool:
        """Whether the fusable pair runs in one process: asked for, and placed rank for rank
        alike (the same devices, in order, cut into processes the same way)."""
        if not self.fuse or workflow.fusable is None or not all(c in self.components for c in workflow.fusable):
            return False
        a, b = ((parse_range(self.components[c].devices, c), self.components[c].procs_per_device,
                 self.components[c].devices_per_proc) for c in workflow.fusable)
        return a == b


def _split(workflow: Workflow, mode: str, names: tuple[str, ...], n: int) -> dict[str, tuple[int, int]]:
    groups = [(tuple(c for c in group if c in names), share) for group, share in workflow.splits[mode]]
    groups = [(group, share) for group, share in groups if group]
    fixed = {i: (share if isinstance(share, int) else max(1, math.floor(n * share)))
             for i, (_, share) in enumerate(groups) if share is not None}
    rest = n - sum(fixed.values())
    if rest < sum(share is None for _, share in groups) or len(groups) > n:
        parts = " | ".join("+".join(g) for g, _ in groups)
        raise PlanError(f"{mode} needs >= {len(groups)} devices ({parts} on devices of their own), the cluster has "
                        f"{n} (set cluster.cpu_slots={len(groups)} to run it on fewer cores)", "placement.mode")
    out, lo = {}, 0
    for i, (group, _) in enumerate(groups):
        size = fixed.get(i, rest)
        out |= {c: (lo, lo + size - 1) for c in group}
        lo += size
    return out | {c: (0, n - 1) for c in names if c not in out}
