"""What profiling runs: the probe plans of a flow on ``n`` devices, and each one's config.

Three probe plans (every component on all the devices; the same at another size, on one
device or on all; one split mode), each run for a few updates by ``runners/profiling.py``.
On CPU slots, components of a split plan compute at once and slow each other (they share the
node's memory and caches: SmolLM2's actor trained 14-20% slower per row beside the rollout
than alone). Where the config may run ahead (``runner.max_staleness >= 1``, the plans whose
components overlap most) and the flow has one (``Schedule.overlap_probe_updates``), a fourth
probe runs the split plan one version ahead, to measure that slowdown (``flow/hidden_costs.py``
reads it off).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from m2flow.config.validate import ConfigError
from m2flow.flow import Plan, PlanError
from m2flow.runners.schedule import Schedule
from m2flow.runners.start import gpu_slots_of


@dataclass
class ProbeRun:
    name: str
    role: str  # "collocated", "sized" (the other size), "split" or "overlap" (the split plan run ahead)
    plan: Plan
    overrides: dict[str, Any]  # the config of this run, over the flow's
    updates: int | None = None  # its updates, all timed (default: the schedule's probe_updates)


def measures_contention(s: Schedule, kind: str) -> bool:
    """Whether a profile of this config measures contention (``overlap`` probe): on CPU, for a
    config that may run ahead, of a flow that has the probe."""
    return kind == "cpu" and s.cfg.runner.max_staleness >= 1 and s.overlap_probe_updates > 0


def probes(s: Schedule, n: int, kind: str) -> list[ProbeRun]:
    """The profiling runs on ``n`` devices: every component on every device; on one device
    (or on every device: ``Schedule.sized_on_one_device``) at the other size
    (``Schedule.probe_sizes``); the first split mode that fits (to time messages between
    processes); and where it ``measures_contention``, that split mode one version ahead."""
    wf, opts = s.workflow, s.plan_options() | {"stages": 1, "run_ahead": 0}
    every, variant, variant_overrides = s.probe_sizes(n)

    def of(mode: str, devices: int, **changes: Any) -> Plan:
        p = Plan.for_mode(wf, mode, devices, kind, components=s.components, **opts | changes)
        if not fits(p) and len(p.devices(wf.trainer)) > 1:
            # the trainer's ranks may not share its devices (the slots of one GPU): one rank
            # over all of them, as the planner's candidates also have it
            one = Plan.for_mode(wf, mode, devices, kind, components=s.components,
                                **opts | changes | {"trainer_devices_per_proc": len(p.devices(wf.trainer))})
            return one if fits(one) else p
        return p

    def unfit(p: Plan) -> ValueError | None:
        """Why the plan cannot run (PlanError, ConfigError), or None."""
        try:
            p.check(wf, n, s.components, gpu_slots=gpu_slots_of(s.cfg, kind))
            s.check(p)
        except ValueError as e:
            return e
        return None

    def fits(p: Plan) -> bool:
        return unfit(p) is None

    sized = ", ".join(f"{k} {v}" for k, v in (variant or variant_overrides).items())
    out = [ProbeRun("collocated", "collocated", of("collocated", n), every)]
    if (why := unfit(out[0].plan)) is not None:  # the probe every fit starts from: without it, no profile
        raise ConfigError("placement", f"profiling runs every component on all {n} devices first (collocated), "
                                       f"which this config cannot: {why}")
    if n > 1 and s.sized_on_one_device:
        out.append(ProbeRun(f"collocated on device 0, {sized}", "sized",
                            of("collocated", 1, trainer_devices_per_proc=1, **variant),
                            every | variant_overrides))
    else:
        out.append(ProbeRun(f"collocated, {sized}", "sized", of("collocated", n, **variant),
                            every | variant_overrides))
    for mode in wf.splits:
        try:
            p = of(mode, n, fuse=False)
        except PlanError:
            continue
        if fits(p):
            out.append(ProbeRun(mode, "split", p, every))
            ahead = of(mode, n, fuse=False, run_ahead=1)
            if measures_contention(s, kind) and fits(ahead):
                out.append(ProbeRun(f"{mode}, one ahead", "overlap", ahead, every, s.overlap_probe_updates))
            break
    return [r for r in out if fits(r.plan)]


def probe_config(s: Schedule, run: ProbeRun, tmp: Path, updates: int) -> DictConfig:
    cfg = copy.deepcopy(s.cfg)
    slug = run.name.replace(" ", "-").replace(",", "").replace("=", "")
    for k, v in s.length(updates).items() | run.overrides.items() | {
            "runner.out_dir": str(tmp / slug), "runner.progress": False, "runner.resume": None,
            "runner.max_restarts": 0,  # a probe whose process died measured nothing worth keeping
            "runner.max_staleness": run.plan.run_ahead,
            "placement.plan": str(run.plan.save(tmp / f"{slug}.yaml"))}.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg
