"""A run's loop, as the runner's part ``Loop``: every update, each the flow's ``step``, with its
evaluations (or their weights saved, to be evaluated once training ends), checkpoints (by
update count, by time, or when a stop is asked for), its trace at the end, and what the loop
does when a pass of it ends early: a restart from the last checkpoint, or the run growing onto
nodes back (both ``Recovery``'s answers, ``runners/recovery.py``).

Streams launched ahead of their update (``Plan.run_ahead``) never cross a barrier: an update a
checkpoint or an evaluation follows ends with nothing in flight (``barrier``).

It uses of the runner: the flow's hooks (``step``, ``evaluate``, ``evaluates``,
``defers_evaluation``, ``evaluate_saved``, ``stop_early``, ``describe``), its plan, cluster,
groups, streams, metrics and status; its parts ``Checkpointer`` and ``Recovery``; and the run's
``Progress``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from omegaconf import DictConfig

from m2flow.flow import Plan, Workflow
from m2flow.runners.checkpointer import Checkpointer
from m2flow.runners.elastic import Elastic
from m2flow.runners.metrics import RunLog
from m2flow.runners.recovery import Recovery
from m2flow.runners.status import Progress, RunFailed, RunStatus
from m2flow.runners.streams import Streams
from m2flow.runtime import Channel, Cluster, WorkerGroup
from m2flow.runtime.errors import WorkerDiedError
from m2flow.runtime.stop import StopRequest
from m2flow.runtime.trace import get_tracer, write_chrome_trace
from m2flow.runtime.watchdog import Watchdog


class Owner(Protocol):
    """What the ``Loop`` uses of the runner that owns it: its state, its other parts, and the
    flow's hooks (``runners/base.py`` says what each does)."""

    cfg: DictConfig
    cluster: Cluster
    plan: Plan
    workflow: Workflow
    channels: dict[str, Channel]
    distinct_groups: list[WorkerGroup]
    lock_devices: list[int]
    trainer: WorkerGroup
    metrics: Any  # the flow's metrics: row, summary, state_dict, load_state_dict, x, x_name, y
    status: RunStatus
    total: int
    saved_weights_dir: Path
    progress: Progress
    streams: Streams
    checkpointer: Checkpointer
    recovery: Recovery
    elastic: Elastic

    def step(self, i: int, ahead: int) -> dict[str, Any]: ...
    def senders(self) -> list[int] | None: ...
    def describe(self, first: int) -> str: ...
    def evaluate(self) -> dict[str, float]: ...
    def evaluates(self, i: int, last: bool) -> bool: ...
    def defers_evaluation(self) -> bool: ...
    def evaluate_saved(self, path: Path) -> dict[str, float]: ...
    def stop_early(self, row: dict[str, float], log: RunLog) -> bool: ...
    def extra_state(self) -> dict[str, Any]: ...
    def load_extra_state(self, state: dict[str, Any]) -> None: ...


def barrier(run: Owner, i: int, checkpoint: bool, evaluate: bool) -> bool:
    """Whether update ``i`` ends with nothing in flight: the last, one a checkpoint follows
    (``runner.checkpoint_every``), or an evaluation (not a deferred one)."""
    every, last = run.cfg.runner.checkpoint_every, i + 1 == run.total
    return (last or (checkpoint and bool(every) and (i + 1) % every == 0)
            or (evaluate and not run.defers_evaluation() and run.evaluates(i, last)))


class Loop:
    def __init__(self, runner: Owner, evaluate: bool = True, checkpoint: bool = True, trace: bool = True):
        """The loop of one ``train`` call: with evaluations, checkpoints and its trace, unless
        told not to (a profiling run only times updates)."""
        self.runner, self.progress = runner, runner.progress
        self.evaluate, self.checkpoint, self.trace = evaluate, checkpoint, trace
        r = runner.cfg.runner
        m = runner.metrics
        self.log = RunLog(r.out_dir, m.progress_total, x=m.x, y=m.y, progress=r.progress)
        self.last_update: tuple[float, float] | None = None  # the last update's window (µs): the timeline's

    def run(self) -> list[dict[str, float]]:
        """Every update (``Runner.train``); where the run is and how it ended: ``status.json``."""
        run, p, log = self.runner, self.progress, self.log
        p.stop = StopRequest("stopping after the update in progress" + (", with a checkpoint" * self.checkpoint))
        p.halted, p.done, p.in_a_row = None, 0, p.restarts  # restarts while the workers started count
        run.status.set("running", unit=run.metrics.x_name, total=run.total, **p.position())
        run.cluster.head.on_change = lambda head: run.recovery.head_changed(head, log, self.checkpoint)
        try:
            history = self._passes()
        except BaseException as e:
            run.status.failed(e, **p.position())
            raise
        finally:
            run.cluster.head.on_change = None
            failing = sys.exc_info()[1]
            try:
                log.close()
            except OSError:  # the disk that failed the run fails its last writes too: the run's error stands
                if failing is None:
                    raise
        run.status.set("finished", **p.position())
        return history

    def _passes(self) -> list[dict[str, float]]:
        """The loop, again from a checkpoint after each restart, or after the run grew."""
        run, p, log, r = self.runner, self.progress, self.log, self.runner.cfg.runner
        initial = {"metrics": run.metrics.state_dict(), "extra": run.extra_state()}  # to start over from
        origin = run.checkpointer.origin(log) if r.resume else None
        p.resumed_from = Path(origin) if origin else None
        point = origin
        while True:
            watchdog = Watchdog(r.hang_timeout_s, r.out_dir, run.distinct_groups, run.channels, run.lock_devices,
                                stall_factor=r.stall_warning,
                                on_stall=lambda told: run.recovery.stall(told, log)) if r.hang_timeout_s else None
            died: WorkerDiedError | None = None  # None below: the run grows onto nodes back
            try:
                with watchdog or contextlib.nullcontext(), p.stop:
                    history = self._updates(watchdog, point, initial)
                if history is not None:  # else it grows: its groups start again below
                    if p.halted and p.stop.signum is None:  # the head was lost
                        raise run.recovery.headless(log)
                    if self.trace:
                        self.write_trace()
                    if p.halted:
                        raise run.recovery.stopped(log)
                    return history
            except RunFailed:
                raise
            except BaseException as e:
                died = run.recovery.recoverable(e, log, watchdog)  # else raised
            # Every group starts again from the last checkpoint this run wrote (or where it started).
            point = str(p.last_checkpoint) if p.last_checkpoint else origin
            run.recovery.start_again(died, point, log)

    def _updates(self, watchdog: Watchdog | None, path: str | None,
                 initial: dict[str, Any]) -> list[dict[str, float]] | None:
        """Every update from the first (that of checkpoint ``path``, else 0 with the metrics and
        the flow's own state ``initial``), with its evaluations and checkpoints; ``watchdog``
        hears of each update's end. None: it stopped at a checkpoint to grow (``Elastic.grows``)."""
        run, p, log, r = self.runner, self.progress, self.log, self.runner.cfg.runner
        x = run.metrics.x_name
        first = run.checkpointer.load(path, log) if path else self._from_start(initial)
        run.streams.updates = first  # the trainer's weights are version ``first``: a sync sends that version
        p.done = first
        run.status.set(now=True, **p.position())  # a resumed run's position, at once: it may be long to the next
        run.checkpointer.at = time.perf_counter()
        log.note(f"{run.cluster.describe()}\n{run.plan.table(run.workflow)}"
                 + (f"\n{run.describe(first)}" if first < run.total else ""))
        if self.evaluate and first == 0 and run.evaluates(-1, False):
            log.record({run.metrics.x: 0, "time_s": 0.0, **run.evaluate()}, "evaluated")
        start = time.perf_counter()
        reached = False  # stop_early said so: the streams launched ahead are trained on, no more launched
        for i in range(first, run.total):
            if i == first and p.stop.signum is not None:  # asked while the run started
                p.halted = f"before its first {x}"
                break
            t0 = time.perf_counter()
            last = i + 1 == run.total
            # A checkpoint holds no stream in flight: one due by time, or by a stop asked for
            # (a signal, or the loss of the cluster's head), waits until those launched ahead
            # are trained on, launching no more.
            asked, headless = p.stop.signum is not None, run.cluster.head.lost
            drained = len(run.streams.ahead) <= 1
            halting = (asked or headless) and drained
            due = asked or headless or reached or (self.checkpoint and bool(r.checkpoint_every_min)
                                                   and t0 - run.checkpointer.at >= 60 * r.checkpoint_every_min)
            scheduled = barrier(run, i, True, False)  # by update count, or the last
            saving = self.checkpoint and (scheduled or (due and drained))
            evaluating = self.evaluate and run.evaluates(i, last)
            wall = time.time()
            report = run.step(i, ahead=0 if due else self._lookahead(i))
            self.last_update = (wall * 1e6, time.time() * 1e6)
            get_tracer().record(f"update {i}", wall, time.time(), cat="update")
            if i == first and (s := report["sync"]).weight_mb is not None:
                log.note(f"weights: {s.weight_mb:.0f} MB in {s.weight_buckets} bucket(s) by {s.weight_transport}")
            row = run.metrics.row(i, report, time.perf_counter() - t0, time.perf_counter() - start)
            if evaluating and run.defers_evaluation():
                t1 = time.perf_counter()  # the trainer waits for it: in the next rows' time_s
                run.trainer.call("save_weights", str(self.saved_weights(row)), ranks=run.senders()).wait()
                row["save_weights_s"] = time.perf_counter() - t1
            elif evaluating:
                t1 = time.perf_counter()
                row |= run.evaluate()
                row["eval_s"] = time.perf_counter() - t1  # in the next rows' time_s
            log.record(row, run.metrics.summary(row))
            p.done = i + 1
            if watchdog is not None:
                watchdog.beat()
            if halting and not last:
                p.halted = f"after {i + 1} of {run.total} {x}s"
            early = reached or run.stop_early(row, log)
            if early and run.streams.ahead and not reached:  # their env steps are taken: trained on, not lost
                log.note(f"training on the {len(run.streams.ahead)} {x}(s) collected ahead, then stopping")
            reached = early and bool(run.streams.ahead)
            stop = last or halting or (early and not reached)
            if stop:  # the last update or a halt: no stream is in flight any more
                run.streams.wait_ahead()
                run.streams.ahead.clear()
            wrote = (stop and self.checkpoint) or saving
            if wrote:  # one due by time alone is rolling
                run.checkpointer.save(i + 1, log, rolling=not (stop or scheduled))
            run.status.set(**p.position())
            if halting and not (asked or last or early or run.cluster.head.lost):  # it answers again
                log.note(f"the Ray cluster's head answers again: the run goes on after {x} {i + 1}")
                p.halted, stop = None, False
            if stop:
                break
            if wrote and run.elastic.grows(log):  # the cluster has nodes again: the run takes them
                return None
        if self.evaluate and run.defers_evaluation() and not p.halted:
            self.evaluate_deferred(watchdog)  # a resumed run evaluates what a stopped one left
        return log.history

    def _lookahead(self, i: int) -> int:
        """Streams to have in flight behind update ``i``'s: up to the plan's ``run_ahead``, none
        past a barrier (stream j > b is launched only once update b has ended)."""
        n = 0
        while n < self.runner.plan.run_ahead and not barrier(self.runner, i + n, self.checkpoint, self.evaluate):
            n += 1
        return n

    def _from_start(self, initial: dict[str, Any]) -> int:
        for old in self.runner.saved_weights_dir.glob("*.safetensors"):
            old.unlink()  # an earlier run's in this out_dir: never evaluated as this run's
        self.runner.metrics.load_state_dict(initial["metrics"])
        self.runner.load_extra_state(initial["extra"])
        self.log.history = []
        return 0

    def saved_weights(self, row: dict[str, float]) -> Path:
        """Where the weights of the update that ``row`` reports are saved to be evaluated later."""
        x = self.runner.metrics.x
        return self.runner.saved_weights_dir / f"{x}-{int(row[x])}.safetensors"

    def evaluate_deferred(self, watchdog: Watchdog | None = None) -> None:
        """The deferred evaluations: each row whose update saved its weights and that has no
        evaluation yet gets that of its weights (in metrics.csv and TensorBoard too); each
        file is deleted once evaluated, and ``watchdog`` hears of it. The weights the
        receivers hold are sent again before anything else uses them."""
        run, p, log = self.runner, self.progress, self.log
        start, done = time.perf_counter(), 0
        for row in log.history:
            path = self.saved_weights(row)
            if p.stop.signum is not None and path.exists():
                left = sum(self.saved_weights(r).exists() for r in log.history)
                p.halted = f"with {left} deferred evaluation(s) left"
                break
            if path.exists() and not any(k.startswith("eval_") for k in row):
                log.amend(row, run.evaluate_saved(path))
                path.unlink()
                done += 1
                if watchdog is not None:
                    watchdog.beat()
        if done:
            run.streams.synced = None  # the rollout holds saved weights now, not the trainer's
            log.note(f"evaluated the weights saved at {done} update(s) in {time.perf_counter() - start:.1f} s")

    def write_trace(self) -> None:
        """Every process's spans as ``trace.json`` (Perfetto), the last update as
        ``timeline.png`` (``runners/timeline.py``)."""
        from m2flow.runners import timeline

        run = self.runner
        out = Path(run.cfg.runner.out_dir)
        if self.last_update is None:  # no update ran: the trace there stays the last run's
            return
        try:
            events = [e for g in run.distinct_groups for e in g.trace_events()] + get_tracer().drain()
        except Exception as e:  # noqa: BLE001 -- a trace is worth having, not worth failing a finished run
            self.log.write(f"no trace written: {type(e).__name__}: {e}")
            return
        write_chrome_trace(out / "trace.json", events)
        timeline.render(events, out / "timeline.png", self.last_update, title=f"the last update of {run.cfg.name}")
        self.log.note(f"trace: {out / 'trace.json'} (open in ui.perfetto.dev; m2flow trace {out} sums it up), "
                      f"{out / 'timeline.png'}")
