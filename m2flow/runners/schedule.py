"""A flow as the scheduler sees it, for one config: the shape of a step
(``flow.simulate.Shape``) under a plan, the knobs its plans may turn, a run of a few updates
for profiling, and the checks a plan must pass before the flow can lay its work out on it.
Each flow declares these in its own file (``runners/flow.py``: ``Flow``); this is the one
view profiling (``runners/probes.py``, ``runners/profiling.py``), ``placement=auto``
(``runners/auto.py``) and the benchmarks take of any of them."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from m2flow.flow import Plan
from m2flow.flow.simulate import Shape
from m2flow.runners.flow import Flow, flow_named


class Schedule:
    def __init__(self, cfg: DictConfig, flow: Flow | None = None):
        self.cfg = cfg
        self.flow = flow or flow_named(cfg.flow)
        self.runner = self.flow.runner
        self.workflow = self.flow.workflow_of(cfg)
        self.components = self.flow.components(cfg)
        self.duration = self.flow.duration  # the metrics' column of a step's wall time
        # Updates the first profiling run makes, its first left out (warm-up); the later runs,
        # their processes warm, make one fewer and time them all.
        self.probe_updates = self.flow.probe_updates
        # The probe at the other size runs on one device (else on all of them, as the first
        # does): see ``probe_sizes``.
        self.sized_on_one_device = self.flow.sized_on_one_device
        # Updates of the probe that runs the split plan one version ahead, its components
        # computing at once, to measure how much they slow each other (``runners.probes``); 0: none.
        self.overlap_probe_updates = self.flow.overlap_probe_updates

    def shape(self, plan: Plan, fused: bool) -> Shape:
        return self.flow.shape(self.cfg, plan, fused)

    def knobs(self) -> dict[str, Any]:
        """``planner.candidates``'s keywords: the values each knob may take."""
        return self.flow.knobs(self.cfg)

    def length(self, updates: int) -> dict[str, Any]:
        """Overrides that make a run of ``updates`` updates."""
        return self.flow.length(self.cfg, updates)

    def probe_sizes(self, devices: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """How the profiling runs on ``devices`` devices size their work: overrides for every
        one of them, and the plan settings and overrides of the one that sees each component
        at another size on one device (so that the cost model can tell a component's fixed
        cost from its cost per item)."""
        return self.flow.probe_sizes(self.cfg, devices)

    def check(self, plan: Plan) -> None:
        """Fails (ConfigError) unless the flow can lay its work out on ``plan``."""
        self.flow.check_plan(self.cfg, plan)

    def plan_options(self) -> dict[str, Any]:
        return self.flow.plan_options(self.cfg)


def schedule_of(cfg: DictConfig) -> Schedule:
    return Schedule(cfg)
