"""What every flow shares: its Plan, cluster, worker groups, channels and device locks, and the
parts it is composed of, each an object of its own with the few things of the runner it uses:

- ``Streams`` (``runners/streams.py``): weight sync and the data streams launched ahead of
  training (``Plan.run_ahead``, ``runner.max_staleness``), made anew with each start of its groups;
- ``Loop`` (``runners/loop.py``): the updates, with progress, metrics, evaluations, checkpoints
  and the trace;
- ``Checkpointer`` (``runners/checkpointer.py``): what a checkpoint holds and how a run resumes;
- ``Recovery`` (``runners/recovery.py``): what stops a run, and how it goes on or ends;
- ``Elastic`` (``runners/elastic.py``): a node's loss and return;
- ``Progress`` (``runners/status.py``): where the run is, which those parts share.

What a run needs before its workers start is ``runners/start.py``'s.

A flow (``runners/flow.py``: ``Flow``) subclasses ``Runner`` with ``prepare`` (its data and
metrics), ``worker_args``, ``launch`` (start one step's data stream) and ``step`` (one
update); everything else it declares, the runner reads from its ``Flow``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from m2flow.config.validate import ConfigError, validate
from m2flow.flow import Plan
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners.checkpointer import Checkpointer
from m2flow.runners.elastic import Elastic
from m2flow.runners.flow import Flow, flow_named
from m2flow.runners.loop import Loop
from m2flow.runners.metrics import RunLog
from m2flow.runners.recovery import Recovery
from m2flow.runners.start import claim_out_dir, gpu_slots_of, local_devices, plan_of, start_cluster
from m2flow.runners.status import Progress, RunStatus
from m2flow.runners.streams import Streams
from m2flow.runtime import Channel, Cluster, DeviceLock, WorkerGroup
from m2flow.runtime.group import GroupHandle, start_together
from m2flow.runtime.pool import WorkerPool


class Runner:
    def __init__(self, cfg: DictConfig, cluster: Cluster | None = None, pool: WorkerPool | None = None,
                 flow: Flow | None = None, replanner: Callable[[int], Plan] | None = None):
        """``cluster``: run on this one (else start or attach as the config says, and shut it
        down at ``close``); ``pool``: take worker processes from, and give them back to, a
        ``WorkerPool`` (runs of one flow under several plans in a row); ``flow``: the flow's
        declaration (default: the one ``cfg.flow`` names); ``replanner``: under
        ``placement.mode=auto``, the planner's pick for n devices (set by whoever planned the
        run), for a run that goes on after the cluster lost a node."""
        self.cfg = copy.deepcopy(cfg)  # the run's own: the plan settles some of its keys
        validate(self.cfg)  # again: a config may change after it is loaded
        self.flow = flow or flow_named(cfg.flow)
        if self.cfg.runner.resume not in (None, "auto"):  # a file that is no checkpoint fails before Ray starts
            try:
                checkpoints.check(self.cfg.runner.resume)
            except checkpoints.CheckpointError as e:
                raise ConfigError("runner.resume", str(e)) from None
        self.out_lock = claim_out_dir(self.cfg)  # so does a directory it cannot write, or another run's
        self.status = RunStatus(self.cfg.runner.out_dir)
        try:
            self._setup(cfg, cluster, pool, replanner)
        except BaseException as e:
            self.status.failed(e)
            self.out_lock.release()
            raise

    def _setup(self, cfg: DictConfig, cluster: Cluster | None, pool: WorkerPool | None,
               replanner: Callable[[int], Plan] | None) -> None:
        self.components = self.flow.components(cfg)
        self.workflow = self.flow.workflow_of(cfg)
        self._own_cluster = cluster is None
        # The run's processes go back to a pool when its groups end: a restart re-initialises
        # the living ones and starts anew only those that died (``Recovery``).
        self._own_pool = pool is None
        self.pool = pool or WorkerPool()
        # On an embedded Ray the devices are known before it starts: a plan or config that
        # cannot run fails before any process does.
        known = (len(cluster.devices), cluster.device_kind) if cluster else local_devices(cfg.cluster)
        if known:
            self.plan = self._plan(*known)
            self.prepare()
        self.cluster = cluster or start_cluster(cfg.cluster)
        try:
            if not known:
                self.plan = self._plan(len(self.cluster.devices), self.cluster.device_kind)
                self.prepare()
            self.progress = Progress(self.total, self.metrics.x_name, self.cfg.runner.out_dir)
            self.checkpointer, self.recovery = Checkpointer(self), Recovery(self)
            self.elastic = Elastic(self, replanner)
            self.recovery.first_start()  # a worker that dies while it starts is started again
        except BaseException:
            if self._own_cluster:
                self.cluster.shutdown()
            raise

    def _plan(self, num_devices: int, kind: str) -> Plan:
        plan = plan_of(self.cfg, self.workflow, num_devices, kind, self.components, **self.flow.plan_options(self.cfg))
        plan.check(self.workflow, num_devices, self.components, gpu_slots=gpu_slots_of(self.cfg, kind))
        # The workers take data as old as the plan makes it (a plan file may run ahead), and
        # the rules that depend on it (rollout.partial's) hold for that.
        if plan.run_ahead != self.cfg.runner.max_staleness:
            self.cfg.runner.max_staleness = plan.run_ahead
            validate(self.cfg)
        return plan

    def start_groups(self) -> None:
        """Every component's processes under the plan, the channels between them and a new
        ``Streams``: at the run's start, and again at each restart (``Recovery``)."""
        self.placement = self.plan.placement(self.cluster)
        self.fused = self.plan.fused(self.workflow)
        names = self.pool.tag  # a pool's processes and channels keep their names
        host = self.plan.hosts(self.workflow)
        processes = [c for c in self.components if c not in host]
        devices = {c: self.placement[c].device_indices for c in processes}
        turns = self.workflow.turns(devices, self.fused)
        # Lock actors live as long as the process that made them: the driver.
        locks = DeviceLock(sorted(set().union(*devices.values())), holder="driver") if any(turns.values()) else None
        self.lock_devices = locks.devices if locks else []
        self.groups: dict[str, WorkerGroup] = {}
        for c in processes:  # the groups start their processes in parallel
            self.groups[c] = WorkerGroup(self.flow.workers[c], self.placement[c], args=self.worker_args(c, turns[c]),
                                         name=f"{c}-{names}", wait=False, pool=self.pool)
        for c, h in host.items():  # a fused component's calls go to its host's processes
            self.groups[c] = self.groups[h]
        prefetch = self.flow.prefetch
        self.channels = {ch: Channel.create(f"{ch}-{names}", pool=self.pool,
                                            **({"prefetch": prefetch[ch]} if ch in prefetch else {}))
                         for ch in self.channels_of()}
        start_together(*self.distinct_groups, channels=list(self.channels.values()), locks=locks)
        self.pool.started()
        # weight sync and the data streams, anew for these groups (the version and the stream
        # keys carry on from the last groups'); the weights go out again before the next step
        last = getattr(self, "streams", None)
        self.streams = Streams(self.trainer, [self.groups[c] for c in self.flow.receivers(self.cfg)], self.senders(),
                               self.flow.in_flight(self.cfg, self.plan), self.launch,
                               updates=last.updates if last else 0, launched=last.launched if last else 0)

    # -- what a flow defines ------------------------------------------------------------
    def channels_of(self) -> tuple[str, ...]:
        return self.workflow.channels

    def prepare(self) -> None:
        """Work done before any process starts (data, env probes); its errors stop the run early."""

    def worker_args(self, component: str, take_turns: bool) -> tuple:
        raise NotImplementedError

    def launch(self, key: int, trained_by: int) -> dict[str, GroupHandle]:
        """Starts one step's data stream (keyed ``key``): the calls of the components that make
        it. ``trained_by``: the version of the trainer's weights that will train on it."""
        raise NotImplementedError

    def step(self, i: int, ahead: int) -> dict[str, Any]:
        raise NotImplementedError

    def senders(self) -> list[int] | None:
        """The trainer ranks that send weights (None: every rank)."""
        return [0]

    @property
    def refreshing(self) -> set[str]:
        """The receivers that take the trainer's pushes themselves under the plan (``Flow.refreshing``)."""
        return self.flow.refreshing(self.cfg, self.plan)

    def evaluate(self) -> dict[str, float]:
        return {}

    def evaluates(self, i: int, last: bool) -> bool:
        return False

    def defers_evaluation(self) -> bool:
        """Whether evaluations after the first are of saved weights, once training ends
        (``runner.eval_deferred``), instead of pausing the run with nothing in flight."""
        return False

    def evaluate_saved(self, path: Path) -> dict[str, float]:
        """``evaluate`` of the weights the trainer saved at ``path`` (``save_weights``)."""
        raise NotImplementedError(f"{type(self).__name__} does not evaluate saved weights")

    def stop_early(self, row: dict[str, float], log: RunLog) -> bool:
        return False

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    # -- weights and streams --------------------------------------------------------------
    @property
    def trainer(self) -> WorkerGroup:
        return self.groups[self.workflow.trainer]

    # -- the loop ---------------------------------------------------------------------------
    def train(self, evaluate: bool = True, checkpoint: bool = True, trace: bool = True) -> list[dict[str, float]]:
        """The run (its part ``Loop``): every update, with evaluations, checkpoints and at the end
        its trace (``trace.json``, ``timeline.png`` of the last update), unless told not to (a
        profiling run only times updates). A worker process that dies restarts every group
        from the last checkpoint this run wrote (or from where it started), up to
        ``runner.max_restarts`` times in a row (a checkpoint written between two deaths starts
        the count again); the watchdog stops a run in which nothing moves. SIGINT or
        SIGTERM stops it after the update in progress, with a checkpoint: ``RunStopped``; so does
        the loss of the Ray cluster's head (``runtime/head.py``), before Ray ends the driver:
        ``RunFailed``. Where the run is and how it ended: ``status.json`` (``runners/status.py``)."""
        return Loop(self, evaluate, checkpoint, trace).run()

    @property
    def saved_weights_dir(self) -> Path:
        """Where weights saved for deferred evaluations go (``Loop.saved_weights``)."""
        return Path(self.cfg.runner.out_dir) / "saved_weights"

    def describe(self, first: int) -> str:
        return f"updates {first}-{self.total - 1}"

    # -- the end ------------------------------------------------------------------------------
    @property
    def distinct_groups(self) -> list[WorkerGroup]:
        """The worker groups, each once (a fused component shares its host's)."""
        return list({id(g): g for g in self.groups.values()}.values())

    def close(self) -> None:
        # The channels go first: a call still reading one (a failed run's, from a component
        # that will not write again) then fails, and what is asked of the workers next is not
        # queued behind it.
        for channel in self.channels.values():
            channel.destroy() if self._own_pool else channel.release(self.pool)
        self.close_components()
        for g in self.distinct_groups:
            g.shutdown(to_pool=not self._own_pool)  # a pool of its own ends with the run
        if self._own_pool:
            self.pool.close()  # what a restart left idle (a plan of fewer ranks)
        if self._own_cluster:
            self.cluster.shutdown()
        self.out_lock.release()

    def close_components(self) -> None:
        """What a flow's components end themselves, after the channels and before their
        processes go (``close``); none by default."""
