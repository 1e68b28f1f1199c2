"""What every flow shares: its Plan, cluster, worker groups, channels and device locks; the
train loop with progress, metrics, evaluation, checkpoints and resume. Weight sync and the
streams launched ahead of training (``Plan.run_ahead``, ``runner.max_staleness``) are the
runner's part ``Streams`` (``runners/streams.py``), made anew with each start of its groups.

What stops a run, and how it goes on or ends, is ``Runner``'s part ``Recovery``
(``runners/recovery.py``); what a run needs before its workers start, ``runners/start.py``.

A flow (``runners/flow.py``: ``Flow``) subclasses ``Runner`` with ``prepare`` (its data and
metrics), ``worker_args``, ``launch`` (start one step's data stream) and ``step`` (one
update); everything else it declares, the runner reads from its ``Flow``.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from m2flow.config.validate import ConfigError, validate
from m2flow.flow import Plan
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners.flow import Flow, flow_named
from m2flow.runners.metrics import RunLog
from m2flow.runners.recovery import Recovery
from m2flow.runners.start import claim_out_dir, gpu_slots_of, local_devices, plan_of, start_cluster
from m2flow.runners.status import RunFailed, RunStatus
from m2flow.runners.streams import Streams
from m2flow.runtime import Channel, Cluster, DeviceLock, WorkerGroup
from m2flow.runtime.errors import WorkerDiedError
from m2flow.runtime.group import GroupHandle, start_together, wait
from m2flow.runtime.pool import WorkerPool
from m2flow.runtime.stop import StopRequest
from m2flow.runtime.trace import get_tracer, write_chrome_trace
from m2flow.runtime.watchdog import Watchdog


class Runner(Recovery):
    def __init__(self, cfg: DictConfig, cluster: Cluster | None = None, pool: WorkerPool | None = None,
                 flow: Flow | None = None):
        """``cluster``: run on this one (else start or attach as the config says, and shut it
        down at ``close``); ``pool``: take worker processes from, and give them back to, a
        ``WorkerPool`` (runs of one flow under several plans in a row); ``flow``: the flow's
        declaration (default: the one ``cfg.flow`` names)."""
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
            self._setup(cfg, cluster, pool)
        except BaseException as e:
            self.status.failed(e)
            self.out_lock.release()
            raise

    def _setup(self, cfg: DictConfig, cluster: Cluster | None, pool: WorkerPool | None) -> None:
        self.components = self.flow.components(cfg)
        self.workflow = self.flow.workflow_of(cfg)
        # ``placement.mode=auto``: the planner's pick for n devices (set by whoever planned the
        # run), for a run that goes on after the cluster lost a node
        self.replanner: Callable[[int], Plan] | None = None
        self._own_cluster = cluster is None
        self.pool = pool
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
            self._first_start()  # a worker that dies while it starts is started again (``Recovery``)
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

    def _start(self) -> None:
        self.placement = self.plan.placement(self.cluster)
        self.fused = self.plan.fused(self.workflow)
        run = uuid.uuid4().hex[:6]
        names = self.pool.tag if self.pool else run  # a pool's processes keep their names
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
        self.channels = {ch: Channel.create(f"{ch}-{run}", **({"prefetch": prefetch[ch]} if ch in prefetch else {}))
                         for ch in self.channels_of()}
        start_together(*self.distinct_groups, channels=list(self.channels.values()), locks=locks)
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
        """The run: every update, with evaluations, checkpoints and at the end its trace
        (``trace.json``, ``timeline.png`` of the last update), unless told not to (a profiling
        run only times updates). A worker process that dies restarts every group
        from the last checkpoint this run wrote (or from where it started), up to
        ``runner.max_restarts`` times in a row (a checkpoint written between two deaths starts
        the count again); the watchdog stops a run in which nothing moves. SIGINT or
        SIGTERM stops it after the update in progress, with a checkpoint: ``RunStopped``; so does
        the loss of the Ray cluster's head (``runtime/head.py``), before Ray ends the driver:
        ``RunFailed``. Where the run is and how it ended: ``status.json`` (``runners/status.py``)."""
        r = self.cfg.runner
        log = RunLog(r.out_dir, self.metrics.progress_total, x=self.metrics.x, y=self.metrics.y, progress=r.progress)
        self.last_checkpoint: Path | None = None  # the last this run wrote: where a restart starts
        self.resumed_from: Path | None = None  # the checkpoint it started from, if one
        self.last_rolling: Path | None = None  # the last, if taken by time: the next one replaces it
        self.stop_request = StopRequest("stopping after the update in progress" + (", with a checkpoint" * checkpoint))
        self.halted: str | None = None  # where a stop asked for ended the run, if one did
        self.restarts, self.done = self.start_restarts, 0  # from those while the workers started on
        self.in_a_row = self.restarts  # restarts since the last checkpoint: runner.max_restarts bounds them
        # after a node's loss: the placement and device count the run started with, to grow back
        # to (``_grows``), and a device count its plan did not fit
        self.shrunk: tuple[DictConfig, int] | None = None
        self.unfit: int | None = None
        self.before_stall: str | None = None  # the warning a stall told replaced
        self.status.set("running", unit=self.metrics.x_name, total=self.total, **self._position())
        self.cluster.head.on_change = lambda head: self._head_changed(head, log, checkpoint)
        try:
            history = self._train(log, evaluate, checkpoint, trace)
        except BaseException as e:
            self.status.failed(e, **self._position())
            raise
        finally:
            self.cluster.head.on_change = None
            failing = sys.exc_info()[1]
            try:
                log.close()
            except OSError:  # the disk that failed the run fails its last writes too: the run's error stands
                if failing is None:
                    raise
        self.status.set("finished", **self._position())
        return history

    def _position(self) -> dict[str, Any]:
        """Where the run is, for ``status.json``."""
        return {"done": self.done, "last_checkpoint": self.last_checkpoint or self.resumed_from,
                "restarts": self.restarts}

    def _train(self, log: RunLog, evaluate: bool, checkpoint: bool, trace: bool) -> list[dict[str, float]]:
        """The loop, again from a checkpoint after each restart (``Recovery``)."""
        r = self.cfg.runner
        initial = {"metrics": self.metrics.state_dict(), "extra": self.extra_state()}  # to start over from
        origin = self.resume_path(log) if r.resume else None
        self.resumed_from = Path(origin) if origin else None
        point = origin
        while True:
            watchdog = Watchdog(r.hang_timeout_s, r.out_dir, self.distinct_groups, self.channels, self.lock_devices,
                                stall_factor=r.stall_warning,
                                on_stall=lambda told: self._stall(told, log)) if r.hang_timeout_s else None
            died: WorkerDiedError | None = None  # None below: the run grows onto nodes back (``_grows``)
            try:
                with watchdog or contextlib.nullcontext(), self.stop_request:
                    history = self._loop(log, evaluate, checkpoint, watchdog, point, initial)
                if history is not None:  # else it grows (``_grows``): its groups start again below
                    if self.halted and self.stop_request.signum is None:  # the head was lost
                        raise self._headless(log)
                    if trace:
                        self.write_trace(log)
                    if self.halted:
                        raise self._stopped(log)
                    return history
            except RunFailed:
                raise
            except BaseException as e:
                died = self._recoverable(e, log, watchdog)  # else raised
            # Every group starts again from the last checkpoint this run wrote (or where it started).
            point = str(self.last_checkpoint) if self.last_checkpoint else origin
            self._start_again(died, point, log)

    def _loop(self, log: RunLog, evaluate: bool, checkpoint: bool, watchdog: Watchdog | None, path: str | None,
              initial: dict[str, Any]) -> list[dict[str, float]] | None:
        """Every update from the first (that of checkpoint ``path``, else 0 with the metrics and
        the flow's own state ``initial``), with its evaluations and checkpoints; ``watchdog``
        hears of each update's end. None: it stopped at a checkpoint to grow (``_grows``)."""
        r = self.cfg.runner
        first = self.resume(path, log) if path else self._from_start(log, initial)
        self.streams.updates = first  # the trainer's weights are version ``first``: a sync sends that version
        self.done = first  # updates logged
        self.status.set(now=True, **self._position())  # a resumed run's position, at once: it may be long to the next
        self.checkpointed_at = time.perf_counter()
        log.note(f"{self.cluster.describe()}\n{self.plan.table(self.workflow)}"
                 + (f"\n{self.describe(first)}" if first < self.total else ""))
        if evaluate and first == 0 and self.evaluates(-1, False):
            log.record({self.metrics.x: 0, "time_s": 0.0, **self.evaluate()}, "evaluated")
        start = time.perf_counter()
        reached = False  # stop_early said so: the streams launched ahead are trained on, no more launched
        for i in range(first, self.total):
            if i == first and self.stop_request.signum is not None:  # asked while the run started
                self.halted = f"before its first {self.metrics.x_name}"
                break
            t0 = time.perf_counter()
            last = i + 1 == self.total
            # A checkpoint holds no stream in flight: one due by time, or by a stop asked for
            # (a signal, or the loss of the cluster's head), waits until those launched ahead
            # are trained on, launching no more.
            asked, headless = self.stop_request.signum is not None, self.cluster.head.lost
            drained = len(self.streams.ahead) <= 1
            halting = (asked or headless) and drained
            due = asked or headless or reached or (checkpoint and bool(r.checkpoint_every_min)
                                        and t0 - self.checkpointed_at >= 60 * r.checkpoint_every_min)
            scheduled = self._barrier(i, True, False)  # by update count, or the last
            saving = checkpoint and (scheduled or (due and drained))
            evaluating = evaluate and self.evaluates(i, last)
            wall = time.time()
            report = self.step(i, ahead=0 if due else self._lookahead(i, checkpoint, evaluate))
            self.last_update = (wall * 1e6, time.time() * 1e6)  # the timeline's window
            get_tracer().record(f"update {i}", wall, time.time(), cat="update")
            if i == first and "weight_mb" in report["sync"]:
                s = report["sync"]
                log.note(f"weights: {s['weight_mb']:.0f} MB in {s['weight_buckets']} bucket(s) by {s['weight_transport']}")
            row = self.metrics.row(i, report, time.perf_counter() - t0, time.perf_counter() - start)
            if evaluating and self.defers_evaluation():
                t1 = time.perf_counter()  # the trainer waits for it: in the next rows' time_s
                self.trainer.call("save_weights", str(self.saved_weights(row)), ranks=self.senders()).wait()
                row["save_weights_s"] = time.perf_counter() - t1
            elif evaluating:
                t1 = time.perf_counter()
                row |= self.evaluate()
                row["eval_s"] = time.perf_counter() - t1  # in the next rows' time_s
            log.record(row, self.metrics.summary(row))
            self.done = i + 1
            if watchdog is not None:
                watchdog.beat()
            if halting and not last:
                self.halted = f"after {i + 1} of {self.total} {self.metrics.x_name}s"
            early = reached or self.stop_early(row, log)
            if early and self.streams.ahead and not reached:  # their env steps are taken: trained on, not lost
                log.note(f"training on the {len(self.streams.ahead)} {self.metrics.x_name}(s) collected ahead, "
                         "then stopping")
            reached = early and bool(self.streams.ahead)
            stop = last or halting or (early and not reached)
            if stop:  # the last update or a halt: no stream is in flight any more
                self.streams.wait_ahead()
                self.streams.ahead.clear()
            wrote = (stop and checkpoint) or saving
            if wrote:  # one due by time alone is rolling
                self.checkpoint(i + 1, log, rolling=not (stop or scheduled))
                self.in_a_row = 0
            self.status.set(**self._position())
            if halting and not (asked or last or early or self.cluster.head.lost):  # it answers again
                log.note(f"the Ray cluster's head answers again: the run goes on after {self.metrics.x_name} {i + 1}")
                self.halted, stop = None, False
            if stop:
                break
            if wrote and self._grows(log):  # the cluster has nodes again: the run takes them
                return None
        if evaluate and self.defers_evaluation() and not self.halted:
            self.evaluate_deferred(log, watchdog)  # a resumed run evaluates what a stopped one left
        return log.history

    @property
    def saved_weights_dir(self) -> Path:
        """Where weights saved for deferred evaluations go (``saved_weights``)."""
        return Path(self.cfg.runner.out_dir) / "saved_weights"

    def saved_weights(self, row: dict[str, float]) -> Path:
        """Where the weights of the update that ``row`` reports are saved to be evaluated later."""
        x = self.metrics.x
        return self.saved_weights_dir / f"{x}-{int(row[x])}.safetensors"

    def evaluate_deferred(self, log: RunLog, watchdog: Watchdog | None = None) -> None:
        """The deferred evaluations: each row whose update saved its weights and that has no
        evaluation yet gets that of its weights (in metrics.csv and TensorBoard too); each
        file is deleted once evaluated, and ``watchdog`` hears of it. The weights the
        receivers hold are sent again before anything else uses them."""
        start, done = time.perf_counter(), 0
        for row in log.history:
            path = self.saved_weights(row)
            if self.stop_request.signum is not None and path.exists():
                left = sum(self.saved_weights(r).exists() for r in log.history)
                self.halted = f"with {left} deferred evaluation(s) left"
                break
            if path.exists() and not any(k.startswith("eval_") for k in row):
                log.amend(row, self.evaluate_saved(path))
                path.unlink()
                done += 1
                if watchdog is not None:
                    watchdog.beat()
        if done:
            self.streams.synced = None  # the rollout holds saved weights now, not the trainer's
            log.note(f"evaluated the weights saved at {done} update(s) in {time.perf_counter() - start:.1f} s")

    def _barrier(self, i: int, checkpoint: bool, evaluate: bool) -> bool:
        """Whether update ``i`` ends with nothing in flight: the last, one a checkpoint follows
        (``runner.checkpoint_every``), or an evaluation (not a deferred one)."""
        every, last = self.cfg.runner.checkpoint_every, i + 1 == self.total
        return (last or (checkpoint and bool(every) and (i + 1) % every == 0)
                or (evaluate and not self.defers_evaluation() and self.evaluates(i, last)))

    def _lookahead(self, i: int, checkpoint: bool, evaluate: bool) -> int:
        """Streams to have in flight behind update ``i``'s: up to the plan's ``run_ahead``, none
        past a barrier (stream j > b is launched only once update b has ended)."""
        n = 0
        while n < self.plan.run_ahead and not self._barrier(i + n, checkpoint, evaluate):
            n += 1
        return n

    def write_trace(self, log: RunLog) -> None:
        """Every process's spans as ``trace.json`` (Perfetto), the last update as
        ``timeline.png`` (``runners/timeline.py``)."""
        from m2flow.runners import timeline

        out = Path(self.cfg.runner.out_dir)
        if not getattr(self, "last_update", None):  # no update ran: the trace there stays the last run's
            return
        try:
            events = [e for g in self.distinct_groups for e in g.trace_events()] + get_tracer().drain()
        except Exception as e:  # noqa: BLE001 -- a trace is worth having, not worth failing a finished run
            log.write(f"no trace written: {type(e).__name__}: {e}")
            return
        write_chrome_trace(out / "trace.json", events)
        timeline.render(events, out / "timeline.png", self.last_update, title=f"the last update of {self.cfg.name}")
        log.note(f"trace: {out / 'trace.json'} (open in ui.perfetto.dev; m2flow trace {out} sums it up), "
                 f"{out / 'timeline.png'}")

    def _from_start(self, log: RunLog, initial: dict[str, Any]) -> int:
        for old in self.saved_weights_dir.glob("*.safetensors"):
            old.unlink()  # an earlier run's in this out_dir: never evaluated as this run's
        self.metrics.load_state_dict(initial["metrics"])
        self.load_extra_state(initial["extra"])
        log.history = []
        return 0

    def describe(self, first: int) -> str:
        return f"updates {first}-{self.total - 1}"

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self, done: int, log: RunLog, rolling: bool = False) -> Path:
        """Every stateful component's state (all ranks), the metrics' running values and the
        flow's own (data order), so that a resumed run continues exactly as an uninterrupted one.
        One safetensors file, written atomically (``m2flow.runners.checkpoint``). A ``rolling``
        one (taken by time) is deleted once a newer checkpoint of this run is written."""
        owned = {c: g for c, g in self._stateful().items() if g is not None}
        states = dict(zip(owned, wait(*(g.state() for g in owned.values()))))
        path = checkpoints.directory(self.cfg.runner.out_dir) / f"{self.metrics.x_name}_{done:06d}{checkpoints.SUFFIX}"
        checkpoints.save(path, {"done": done, "logged_to": log.history[-1][log.x] if log.history else 0,
                                "metrics": self.metrics.state_dict(), "extra": self.extra_state(),
                                "states": {c: states.get(c) for c in self._stateful()},
                                "config": OmegaConf.to_container(self.cfg, resolve=True)})
        self.checkpointed_at = time.perf_counter()
        if self.last_rolling not in (None, path):
            self.last_rolling.unlink(missing_ok=True)
        self.last_checkpoint, self.last_rolling = path, (path if rolling else None)
        return path

    def resume_path(self, log: RunLog) -> str | None:
        """``runner.resume``: a checkpoint file, or ``auto``: the latest complete one in this
        run's directory (none: the run starts afresh)."""
        r = self.cfg.runner
        if r.resume != "auto":
            return r.resume
        found = checkpoints.latest(checkpoints.directory(r.out_dir), log=log.note)
        log.note(f"resume=auto: continuing from {found}" if found else
                 f"resume=auto: no complete checkpoint in {checkpoints.directory(r.out_dir)}; starting afresh")
        return None if found is None else str(found)

    def resume(self, path: str, log: RunLog) -> int:
        """Loads a checkpoint written by ``checkpoint``; returns the first update to run."""
        ckpt = checkpoints.load(path)
        written = OmegaConf.create(ckpt["config"])
        for key in self.flow.resume_keys:  # what its states' shapes (or meaning) depend on
            then, now = OmegaConf.select(written, key), OmegaConf.select(self.cfg, key)
            if OmegaConf.is_config(then):
                then, now = OmegaConf.to_container(then), OmegaConf.to_container(now)
            if then != now:
                raise ConfigError("runner.resume", f"checkpoint {path} was written with {key}={then}, this run has "
                                                   f"{key}={now}: resume with the same {key}")
        x = self.metrics.x_name
        if ckpt["done"] > self.total:
            length = self.flow.length_key
            raise ConfigError(length, f"checkpoint {path} is {ckpt['done']} {x}s in, past the {self.total} "
                                      f"of this run: raise {length} to continue it")
        if ckpt["done"] == self.total:
            log.note(f"checkpoint {path} is {self.total} of {self.total} {x}s in: nothing left to train")
        states, moved = {}, []
        for c, group in self._stateful().items():
            if c not in ckpt["states"]:
                raise ConfigError("runner.resume", f"checkpoint {path} has no {c} state (a run with algorithm.name="
                                                   f"{ckpt['config']['algorithm']['name']}): resume with the same "
                                                   "algorithm")
            saved = ckpt["states"][c]
            if group is None or saved is None:  # fused into its host, now or then: the host's state serves
                if (group is None) != (saved is None):
                    moved.append(f"{c} {'fused' if saved is None else 'in processes of its own'} then, "
                                 f"{'fused' if group is None else 'in processes of its own'} now")
                continue
            try:
                states[c] = self.flow.workers[c].reshard(saved, group.world_size, *self.worker_args(c, False))
            except ValueError as e:
                raise ConfigError("runner.resume", f"checkpoint {path}'s {c} state does not fit this placement "
                                                   f"({e})") from None
            if len(saved) != group.world_size:
                moved.append(f"{c} {len(saved)} rank(s) then, {group.world_size} now")
        if moved:
            log.note(f"checkpoint {path} was written on another placement ({'; '.join(moved)}): its states are "
                     "spread over this one's ranks")
        wait(*(self.groups[c].load_state(state) for c, state in states.items()))
        self.streams.synced = None  # the loaded weights go out before the first step, whatever was synced before
        self.metrics.load_state_dict(ckpt["metrics"])
        self.load_extra_state(ckpt["extra"])
        log.history = [row for row in log.read_csv() if row[log.x] <= ckpt["logged_to"]]
        return ckpt["done"]

    def _stateful(self) -> dict[str, WorkerGroup | None]:
        """Stateful component -> its group; None for one fused into another's processes."""
        fused = self.workflow.fusable[1] if self.fused else None
        return {c: (None if c == fused else self.groups[c]) for c in self.flow.stateful if c in self.groups}

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
            channel.destroy()
        self.close_components()
        for g in self.distinct_groups:
            g.shutdown()
        if self._own_cluster:
            self.cluster.shutdown()
        self.out_lock.release()


    def close_components(self) -> None:
        """What a flow's components end themselves, after the channels and before their
        processes go (``close``); none by default."""
