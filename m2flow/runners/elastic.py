"""A run on a Ray cluster whose nodes come and go, as the runner's part ``Elastic``: a node's
loss (the run goes on on the devices left, ``runner.on_node_loss``) and its return, or a new
node (the run grows back onto them, ``runner.on_node_return``), each under a plan laid out
anew on the devices there are.

It uses of the runner: its config, cluster, plan (which it replaces), placement, workflow,
components, flow and ``prepare``; and the run's ``Progress`` (``runners/status.py``).
"""

from __future__ import annotations

import contextlib
import copy
import traceback
from collections.abc import Callable
from typing import Protocol

from omegaconf import DictConfig

from m2flow.flow import Plan, Workflow
from m2flow.runners.flow import Flow
from m2flow.runners.metrics import RunLog
from m2flow.runners.start import gpu_slots_of, plan_of
from m2flow.runners.status import Progress, RunFailed, RunStatus
from m2flow.runtime import Cluster
from m2flow.runtime.placement import Placement


class Owner(Protocol):
    """What ``Elastic`` uses of the runner that owns it; it replaces ``plan``."""

    cfg: DictConfig
    cluster: Cluster
    plan: Plan
    placement: Placement
    workflow: Workflow
    components: tuple[str, ...]
    flow: Flow
    status: RunStatus
    progress: Progress

    def prepare(self) -> None: ...


class Elastic:
    def __init__(self, runner: Owner, replanner: Callable[[int], Plan] | None = None):
        """``replanner``: under ``placement.mode=auto``, the planner's pick for n devices (set by
        whoever planned the run)."""
        self.runner, self.progress, self.replanner = runner, runner.progress, replanner
        # after a node's loss: the placement and device count the run started with, to grow
        # back to (``grows``), and a device count its plan did not fit
        self.shrunk: tuple[DictConfig, int] | None = None
        self.unfit: int | None = None

    def check_nodes(self, log: RunLog, e: BaseException) -> bool:
        """Whether a node the plan places ranks on has left the Ray cluster (``e``: the error
        that came of it): no restart brings its devices back. With ``runner.on_node_loss=
        continue`` the run then goes on on the devices left, under a plan laid out on them
        (``plan_for``; the restart that follows starts from the last checkpoint, its states
        spread over the new ranks); else, where no plan fits them, or with no restart left,
        ``RunFailed`` in one paragraph."""
        run, p = self.runner, self.progress
        lost, gone = [], 0
        for n in run.cluster.lost_nodes():
            held = {d.index for d in n.devices}
            gone += len(held)
            there = [c for c in run.placement.components if run.placement[c].device_indices & held]
            if there:
                lost.append(f"node {n.rank} ({n.address}; devices {_span(held)}: {', '.join(there)})")
        if not lost:
            return False
        left = len(run.cluster.devices) - gone
        fitting = self.plan_for(left) if left else None
        r = run.cfg.runner
        if fitting is not None and r.on_node_loss == "continue" and p.in_a_row < r.max_restarts:
            if self.shrunk is None:  # what it grows back to
                self.shrunk = (copy.deepcopy(run.cfg.placement), len(run.cluster.devices))
            message = (f"the Ray cluster lost {'; '.join(lost)}: the run goes on on the {left} devices left"
                       f"{self._replan(*fitting)}, from {p.last_checkpoint or p.resumed_from or 'the beginning'}")
            log.note(f"{message}\n{run.plan.table(run.workflow)}")
            run.status.warn(message)
            return True
        # (placement.mode=auto plans for the devices there are: a resume under it needs nothing more)
        mode = run.cfg.placement.mode
        then = "" if fitting is None else f", or now on the {left} left" + (
            "" if fitting[1] == mode or mode == "auto" else f" with placement.mode={fitting[1]}")
        message = p.failed_after(f"the Ray cluster lost {'; '.join(lost)}; {p.then()} once the cluster has "
                                 f"its {len(run.cluster.devices)} devices again{then}")
        with contextlib.suppress(OSError):
            log.write(f"{message}\n\n{''.join(traceback.format_exception(e))}")
        raise RunFailed(message) from e

    def plan_for(self, n: int, placement: DictConfig | None = None) -> tuple[Plan, str] | None:
        """A plan of this run on ``n`` devices and its ``placement.mode``: that of the run's own
        mode (or ``placement``'s) where it lays itself out on them (``auto``: the planner's
        pick, ``replanner``), else collocated's; None where neither fits, or where the run gave
        device ranges (custom, a plan file)."""
        run = self.runner
        p, kind = placement or run.cfg.placement, run.cluster.device_kind
        if p.mode == "custom" or p.plan is not None and p.mode != "auto":
            return None

        def named(mode: str) -> Plan:
            cfg = copy.deepcopy(run.cfg)
            cfg.placement.mode, cfg.placement.plan = mode, None
            return plan_of(cfg, run.workflow, n, kind, run.components, **run.flow.plan_options(cfg))

        tries = [("auto", lambda: self.replanner(n))] if p.mode == "auto" and self.replanner else []
        tries += [(m, lambda m=m: named(m)) for m in dict.fromkeys((p.mode, "collocated")) if m != "auto"]
        for mode, make in tries:
            try:
                plan = make()
                plan.check(run.workflow, n, run.components, gpu_slots=gpu_slots_of(run.cfg, kind))
                run.flow.check_plan(run.cfg, plan)
            except ValueError:  # PlanError, ConfigError: it does not fit
                continue
            return plan, mode
        return None

    def _replan(self, plan: Plan, mode: str) -> str:
        """The run goes on under ``plan`` (of placement ``mode``) on the devices the cluster
        lists alive now; the restart that follows starts its groups. Returns `` under
        placement.mode=...`` where the mode changed."""
        run = self.runner
        run.cluster.rediscover()
        p = run.cfg.placement
        how = "" if mode == p.mode else f" under placement.mode={mode}"
        if mode == "auto":  # the plan the run follows now, in the file of the first
            p.mode, p.plan = mode, self.shrunk[0].plan
            plan.save(p.plan)
        else:  # a named mode: its checkpoints' config says which
            p.mode, p.plan = mode, None
        run.plan = plan
        run.cfg.runner.max_staleness = plan.run_ahead
        run.prepare()
        self.progress.total = run.total  # the flow's count of updates under the new plan
        return how

    def grows(self, log: RunLog) -> bool:
        """After a checkpoint of a run that went on on fewer devices (``check_nodes``): whether
        it takes the nodes the Ray cluster lists again (back, or new; ``runner.on_node_return=
        grow``), under a plan of its first placement laid out on every device listed now
        (``plan_for``), said in ``log.txt`` and ``status.json``. Its groups then start again
        from that checkpoint, their states spread over the new ranks; not a restart."""
        run = self.runner
        if self.shrunk is None or run.cfg.runner.on_node_return != "grow":
            return False
        joined = run.cluster.joined_nodes()
        n = len(run.cluster.devices) + sum(len(node.devices) for node in joined)
        if not joined or n == self.unfit or run.cluster.lost_nodes():
            return False
        first, devices = self.shrunk
        fitting = self.plan_for(n, first)
        if fitting is None:  # asked again once the cluster lists another count
            self.unfit = n
            return False
        now = ", ".join(f"node {node.rank} ({node.address}; {len(node.devices)} device(s))" for node in joined)
        whole = fitting[1] == first.mode and n >= devices
        message = (f"{now} joined the Ray cluster: the run grows onto the {n} devices there are now"
                   f"{self._replan(*fitting)}, from {self.progress.last_checkpoint}")
        log.note(f"{message}\n{run.plan.table(run.workflow)}")
        run.status.warn(None if whole else message)
        self.shrunk = None if whole else self.shrunk
        return True


def _span(indices: set[int]) -> str:
    """A node's device indices (consecutive) as a placement writes them: ``2-3``, or ``5``."""
    return f"{min(indices)}-{max(indices)}" if len(indices) > 1 else str(min(indices))
