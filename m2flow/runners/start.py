"""What a run needs before its workers start: its output directory, held (``claim_out_dir``);
its cluster, embedded or attached (``start_cluster``, ``local_devices``); and its Plan
(``plan_of``, ``gpu_slots_of``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from m2flow.config.validate import ConfigError
from m2flow.flow import Plan, Workflow
from m2flow.runtime import Cluster
from m2flow.runtime.cluster import ClusterStartError, cpu_slot_count
from m2flow.runtime.files import DirectoryBusy, DirectoryLock


def claim_out_dir(cfg: DictConfig) -> DirectoryLock:
    """``runner.out_dir``, made if need be and held by this process (``DirectoryLock``, acquired):
    ``ConfigError`` where the run cannot write, or where another run writes already (two runs in
    one directory would interleave their metrics and checkpoints)."""
    out = Path(cfg.runner.out_dir)
    try:
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"{out} is a file")
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise PermissionError(f"{out} is not writable")
        return DirectoryLock(out).acquire()
    except DirectoryBusy as e:
        raise ConfigError("runner.out_dir", f"another run ({e}) writes its files there; "
                                            "give this one another runner.out_dir, or stop that one") from None
    except OSError as e:
        raise ConfigError("runner.out_dir", f"cannot write the run's files to {str(out)!r} "
                                            f"({e.strerror or e})") from None


def plan_of(cfg: DictConfig, workflow: Workflow, num_devices: int, kind: str, components: tuple[str, ...],
            **options: Any) -> Plan:
    """The run's Plan: a plan file (``placement.plan``, or ``placement=@FILE`` on the command
    line), the ranges of ``placement.mode=custom``, or a named mode laid out on the devices.
    ``options``: the flow's own plan settings (``Plan.for_mode``'s keywords)."""
    p = cfg.placement
    if p.plan is not None:
        return Plan.load(p.plan)
    options = {"run_ahead": cfg.runner.max_staleness} | options
    if p.mode != "custom":
        return Plan.for_mode(workflow, p.mode, num_devices, kind, components=components, **options)
    given = OmegaConf.to_container(p.components, resolve=True)  # every component's: validate checked
    span = options.pop("trainer_devices_per_proc", 1)
    if span > 1 and isinstance(given[workflow.trainer], (str, int)):
        given[workflow.trainer] = {"devices": given[workflow.trainer], "devices_per_proc": span}
    fuse = options.pop("fuse", True) and workflow.fusable is not None
    granularity = options.pop("granularity", 1)
    return Plan.from_dict({"components": {c: given[c] for c in components}, "fuse": [list(workflow.fusable)] if fuse else [],
                           "granularity": {ch: granularity for ch in workflow.channels}, **options})


def start_cluster(cluster: DictConfig) -> Cluster:
    """The cluster a config's ``cluster`` section names: an embedded Ray, or an existing one."""
    try:
        return Cluster(cluster.address, num_cpus=cluster.num_cpus, cpu_slots=cluster.cpu_slots,
                       gpu_slots=cluster.gpu_slots)
    except ConnectionError as e:  # an address where no cluster answers
        raise ConfigError("cluster.address", str(e)) from None
    except ClusterStartError as e:  # an embedded Ray that could not start (no room for its files)
        raise ConfigError("cluster", str(e)) from e


def gpu_slots_of(cfg: DictConfig, kind: str) -> int:
    """``Plan.check``'s ``gpu_slots`` for a run on devices of ``kind``."""
    return cfg.cluster.gpu_slots if kind == "cuda" else 0


def local_devices(cluster: DictConfig) -> tuple[int, str] | None:
    """The devices an embedded Ray will have: its GPUs (``gpu_slots`` each), else its CPU
    slots; None when the run attaches to an existing cluster (known once connected)."""
    if cluster.address is not None:
        return None
    if torch.cuda.is_available():
        return torch.cuda.device_count() * cluster.gpu_slots, "cuda"
    return cpu_slot_count(cluster.num_cpus or os.cpu_count() or 1, cluster.cpu_slots), "cpu"