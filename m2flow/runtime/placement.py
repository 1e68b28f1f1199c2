"""Placement: which devices each component's processes run on.

Grammar of a device range: ``"0-3"``, ``"0,2"``, ``"0-1,4-5"``, optionally prefixed by a
node group, ``"sim:0-7"`` (indices then count within that group's devices). Each component
gets a range and either ``procs_per_device`` (several ranks share a device) or
``devices_per_proc`` (one rank spans several devices). The execution mode follows from
the overlap between components: all on the same devices is *collocated*, all on
disjoint devices is *disaggregated*, anything in between is *hybrid*.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from m2flow.runtime.cluster import Cluster, Device

T = TypeVar("T")
_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+))?\s*$")


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    devices: tuple[Device, ...]

    @property
    def node_id(self) -> str:
        return self.devices[0].node_id


@dataclass(frozen=True)
class ComponentPlacement:
    component: str
    devices: tuple[Device, ...]
    procs_per_device: int = 1
    devices_per_proc: int = 1
    exclusive: bool = False  # may not share a device with another component

    @property
    def world_size(self) -> int:
        return processes(self.component, len(self.devices), self.procs_per_device, self.devices_per_proc)

    @property
    def device_indices(self) -> frozenset[int]:
        return frozenset(d.index for d in self.devices)

    def ranks(self) -> list[RankPlacement]:
        return [RankPlacement(r, devs)
                for r, devs in enumerate(rank_devices(self.devices, self.procs_per_device, self.devices_per_proc))]


def rank_devices(devices: Sequence[T], procs_per_device: int = 1, devices_per_proc: int = 1) -> list[tuple[T, ...]]:
    """Each rank's devices, in rank order: ``devices_per_proc`` consecutive devices per rank, or
    ``procs_per_device`` ranks per device."""
    if devices_per_proc > 1:
        return [tuple(devices[i:i + devices_per_proc]) for i in range(0, len(devices), devices_per_proc)]
    return [(d,) for d in devices for _ in range(procs_per_device)]


def processes(component: str, devices: int, procs_per_device: int = 1, devices_per_proc: int = 1) -> int:
    """A component's processes (ranks) on ``devices`` devices; a shape that cannot be made
    fails naming the component."""
    if procs_per_device < 1 or devices_per_proc < 1:
        raise PlacementError(f"component {component!r}: procs_per_device and devices_per_proc must be >= 1")
    if procs_per_device > 1 and devices_per_proc > 1:
        raise PlacementError(f"component {component!r}: set procs_per_device or devices_per_proc, not both")
    if devices % devices_per_proc:
        raise PlacementError(f"component {component!r}: {devices} device(s) cannot be split into processes of "
                             f"{devices_per_proc} devices")
    return devices * procs_per_device // devices_per_proc


def parse_range(spec: str | int, component: str = "?") -> tuple[str, list[int]]:
    """``"sim:0-2,4"`` -> ``("sim", [0, 1, 2, 4])``: the device group (``"all"`` without a
    prefix) and the indices within it, in order; errors name the component."""
    text, group = str(spec).strip(), "all"
    if ":" in text:
        group, text = (s.strip() for s in text.split(":", 1))
    indices: list[int] = []
    for part in text.split(","):
        m = _RANGE.match(part)
        if not m:
            raise PlacementError(f"component {component!r}: cannot parse device range {spec!r} (expected e.g. '0-3', '0,2', 'group:0-7')")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise PlacementError(f"component {component!r}: empty device range {part.strip()!r} in {spec!r}")
        indices.extend(range(lo, hi + 1))
    if len(set(indices)) != len(indices):
        raise PlacementError(f"component {component!r}: device range {spec!r} names a device twice")
    return group, indices


def parse_devices(spec: str | int, cluster: Cluster, component: str = "?") -> tuple[Device, ...]:
    """Resolves a device-range string against the cluster; errors name the component."""
    group, indices = parse_range(spec, component)
    if group not in cluster.node_groups:
        raise PlacementError(f"component {component!r}: unknown device group {group!r} in {spec!r}; known: {sorted(cluster.node_groups)}")
    pool = cluster.group_devices(group)
    if max(indices) >= len(pool):
        raise PlacementError(
            f"component {component!r}: device range {spec!r} reaches device {max(indices)}, "
            f"but group {group!r} has {len(pool)} device(s) (0-{len(pool) - 1})"
        )
    return tuple(pool[i] for i in indices)


class Placement:
    """Component name -> ComponentPlacement, validated against a cluster."""

    def __init__(self, components: Mapping[str, ComponentPlacement]):
        self.components = dict(components)
        self._check_exclusive()

    @classmethod
    def from_config(cls, config: Mapping, cluster: Cluster) -> Placement:
        """``{"env": "0", "actor": {"devices": "0-1", "procs_per_device": 1}}``."""
        comps = {}
        for name, entry in config.items():
            if isinstance(entry, (str, int)):
                entry = {"devices": entry}
            entry = dict(entry)
            unknown = set(entry) - {"devices", "procs_per_device", "devices_per_proc", "exclusive"}
            if unknown:
                raise PlacementError(f"component {name!r}: unknown placement keys {sorted(unknown)}")
            if "devices" not in entry:
                raise PlacementError(f"component {name!r}: placement needs 'devices'")
            devices = parse_devices(entry["devices"], cluster, name)
            ppd, dpp = int(entry.get("procs_per_device", 1)), int(entry.get("devices_per_proc", 1))
            processes(name, len(devices), ppd, dpp)
            if dpp > 1 and len({d.node_id for d in devices}) > 1:
                for i in range(0, len(devices), dpp):
                    if len({d.node_id for d in devices[i : i + dpp]}) > 1:
                        raise PlacementError(f"component {name!r}: one process cannot span devices on different nodes ({entry['devices']!r})")
            comps[name] = ComponentPlacement(name, devices, ppd, dpp, bool(entry.get("exclusive", False)))
        return cls(comps)

    def _check_exclusive(self) -> None:
        for name, comp in self.components.items():
            if not comp.exclusive:
                continue
            for other, oc in self.components.items():
                shared = comp.device_indices & oc.device_indices
                if other != name and shared:
                    raise PlacementError(
                        f"component {name!r} is exclusive but shares device(s) {sorted(shared)} with {other!r}"
                    )

    def __getitem__(self, name: str) -> ComponentPlacement:
        if name not in self.components:
            raise KeyError(f"no placement for component {name!r}; placed: {sorted(self.components)}")
        return self.components[name]

    @property
    def sharing(self) -> str:
        """How the components' devices relate: ``shared`` (all on the same devices),
        ``disjoint`` (no two share a device) or ``overlapping``. (A flow's *mode* also says
        which components make the data and which trains: ``flow.Plan.mode``.)"""
        sets = [c.device_indices for c in self.components.values()]
        if all(s == sets[0] for s in sets):
            return "shared"
        if all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1 :]):
            return "disjoint"
        return "overlapping"

    def describe(self) -> str:
        lines = [f"placement (devices {self.sharing}):"]
        for c in self.components.values():
            devs = ",".join(str(d.index) for d in c.devices)
            per = f"{c.procs_per_device} proc/device" if c.devices_per_proc == 1 else f"{c.devices_per_proc} devices/proc"
            lines.append(f"  {c.component:<12} devices [{devs}] x {per} -> {c.world_size} rank(s)")
        return "\n".join(lines)
