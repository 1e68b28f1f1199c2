"""How a run meets what stops it, as ``Runner``'s part: a worker process's death (every group
starts again from the last checkpoint, ``runner.max_restarts`` times in a row; while the
workers start too), a node's loss
(the run goes on on the devices left, ``runner.on_node_loss``) and return (it grows back,
``runner.on_node_return``), the loss of the cluster's head, a stall (``runner.stall_warning``),
a disk that fails and a signal; and the one paragraph each ends a run in where it cannot go on.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import sys
import time
import traceback
from pathlib import Path

from omegaconf import DictConfig

from m2flow.flow import Plan
from m2flow.runners.metrics import RunLog
from m2flow.runners.start import gpu_slots_of, plan_of
from m2flow.runners.status import RunFailed, continue_from
from m2flow.runtime.errors import WorkerDiedError, WorkerError, death_reason
from m2flow.runtime.head import HeadMonitor, ray_grace_s
from m2flow.runtime import stop
from m2flow.runtime.stop import RunStopped
from m2flow.runtime.watchdog import Watchdog

# A file the run writes or reads failed for a reason outside the run: a restart would fail again
DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM}


class Recovery:
    """``Runner``'s answers to what stops a run: a part of ``Runner`` (``runners/base.py``),
    whose groups, plan, status and loop state it uses (``train`` sets the state). ``restarts``,
    ``in_a_row``: restarts in all, and since the last checkpoint; ``shrunk``: after a node's
    loss, the placement and device count the run started with, to grow back to (``_grows``);
    ``unfit``: a device count its plan did not fit; ``before_stall``: the warning a stall told
    replaced."""

    def _recoverable(self, e: BaseException, log: RunLog, watchdog: Watchdog | None) -> WorkerDiedError:
        """What ended a pass of the loop, ``e``: the death of a worker process that a restart
        answers (returned), after ``_check_nodes``; anything else is raised, as one paragraph
        where that ends the run (a hang, the head's loss, a disk, a signal, no restart left)."""
        if watchdog is not None and watchdog.report is not None:  # the watchdog stopped the run
            log.write(f"{watchdog.error()}\n(then: {type(e).__name__}: {e})")
            raise watchdog.error() from None
        if self.cluster.head.lost and self.stop_request.signum is None and not isinstance(e, KeyboardInterrupt):
            raise self._headless(log, e) from e  # no restart without it
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:  # no restart makes room on a disk
            raise self._failed(log, e) from e
        if isinstance(e, WorkerError):
            log.write(f"{e}\n\nthe worker's whole traceback:\n{e.traceback}")
            if self.stop_request.signum is not None:  # the signal reached the workers too
                self.halted = f"and the worker processes with it ({e.group} rank {e.rank} ended)"
                raise self._stopped(log) from None
        if not isinstance(e, WorkerDiedError) or self.pool is not None:
            raise e
        self._check_nodes(log, e)
        if self.in_a_row >= self.cfg.runner.max_restarts:
            raise self._out_of_restarts(log, e) from e
        return e

    def _first_start(self) -> None:
        """The groups' first start (``Runner._setup``). A worker process that dies while they
        start (killed, out of memory, a simulator that crashes in its constructor) starts every
        group again, as a death mid-run does, counted against ``runner.max_restarts``: the run's
        ``train`` begins with ``start_restarts`` of them. An exception a worker raises while it
        starts (a setting it refuses, a bug) is no death: it would be raised again, and ends the
        run at once; so does a death while a signal stops the run, and any in a pooled run
        (profiling). With no restart left, ``RunFailed`` in one paragraph."""
        self.start_restarts = 0
        allowed = self.cfg.runner.max_restarts
        while True:
            try:
                self._start()
                return
            except WorkerDiedError as e:
                if self.pool is not None or stop.requested() is not None:
                    raise
                self._log_at_start(f"{e}\n\nthe worker's whole traceback:\n{e.traceback}", console=False)
                if self.start_restarts >= allowed:
                    deaths = ("a worker process died" if allowed == 0 else
                              f"worker processes died {self.start_restarts + 1} times")
                    message = (f"the run failed while it started: {deaths}, more than runner.max_restarts={allowed} "
                               f"allows; the last: {str(e).splitlines()[0]}")
                    self._log_at_start(message, console=False)
                    raise RunFailed(message) from e
                self.start_restarts += 1
                self._log_at_start(f"restart {self.start_restarts} of at most {allowed}: {e.group} rank {e.rank} died "
                                   f"in {e.method}() ({_first_line(e.cause)}) while the workers started; all groups "
                                   "start again")
                self.status.set(restarts=self.start_restarts, now=True)

    def _log_at_start(self, text: str, console: bool = True) -> None:
        """A note before the run's log is open (``train`` opens it): on the console unless not
        ``console``, and time-stamped in ``log.txt`` as the log writes it."""
        if console:
            print(text, flush=True)
        with contextlib.suppress(OSError), open(Path(self.cfg.runner.out_dir) / "log.txt", "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")

    def _start_again(self, died: WorkerDiedError | None, point: str | None, log: RunLog) -> None:
        """Every group starts again, to continue from checkpoint ``point``: a restart after
        ``died``, or (None) the run grows onto nodes back. A process that dies while they start
        counts as a restart of its own."""
        r = self.cfg.runner
        while True:
            if died is not None:
                self.restarts += 1
                self.in_a_row += 1
                since = f" since the last checkpoint ({self.restarts} in all)" if self.restarts > self.in_a_row else ""
                log.note(f"restart {self.in_a_row} of at most {r.max_restarts}{since}: {died.group} rank "
                         f"{died.rank} died in {died.method}() ({_first_line(died.cause)}); all groups start "
                         f"again from {point or 'the beginning'}")
            try:
                self._restart()
                return
            except WorkerDiedError as e:
                self._check_nodes(log, e)
                if self.in_a_row >= r.max_restarts:
                    raise self._out_of_restarts(log, e) from e
                died = e
            except Exception as e:  # noqa: BLE001 - Ray refusing a rank a node that is gone, say
                if not self._check_nodes(log, e):  # else re-planned: started again
                    raise

    def _check_nodes(self, log: RunLog, e: BaseException) -> bool:
        """Whether a node the plan places ranks on has left the Ray cluster (``e``: the error
        that came of it): no restart brings its devices back. With ``runner.on_node_loss=
        continue`` the run then goes on on the devices left, under a plan laid out on them
        (``_plan_for``; the restart that follows starts from the last checkpoint, its states
        spread over the new ranks); else, where no plan fits them, or with no restart left,
        ``RunFailed`` in one paragraph."""
        lost, gone = [], 0
        for n in self.cluster.lost_nodes():
            held = {d.index for d in n.devices}
            gone += len(held)
            there = [c for c in self.placement.components if self.placement[c].device_indices & held]
            if there:
                lost.append(f"node {n.rank} ({n.address}; devices {_span(held)}: {', '.join(there)})")
        if not lost:
            return False
        left = len(self.cluster.devices) - gone
        fitting = self._plan_for(left) if left else None
        r = self.cfg.runner
        if fitting is not None and r.on_node_loss == "continue" and self.in_a_row < r.max_restarts:
            if self.shrunk is None:  # what it grows back to
                self.shrunk = (copy.deepcopy(self.cfg.placement), len(self.cluster.devices))
            message = (f"the Ray cluster lost {'; '.join(lost)}: the run goes on on the {left} devices left"
                       f"{self._replan(*fitting)}, from {self.last_checkpoint or self.resumed_from or 'the beginning'}")
            log.note(f"{message}\n{self.plan.table(self.workflow)}")
            self.status.warn(message)
            return True
        # (placement.mode=auto plans for the devices there are: a resume under it needs nothing more)
        mode = self.cfg.placement.mode
        then = "" if fitting is None else f", or now on the {left} left" + (
            "" if fitting[1] == mode or mode == "auto" else f" with placement.mode={fitting[1]}")
        message = self._failed_after(f"the Ray cluster lost {'; '.join(lost)}; {self._then()} once the cluster has "
                                     f"its {len(self.cluster.devices)} devices again{then}")
        with contextlib.suppress(OSError):
            log.write(f"{message}\n\n{''.join(traceback.format_exception(e))}")
        raise RunFailed(message) from e

    def _plan_for(self, n: int, placement: DictConfig | None = None) -> tuple[Plan, str] | None:
        """A plan of this run on ``n`` devices and its ``placement.mode``: that of the run's own
        mode (or ``placement``'s) where it lays itself out on them (``auto``: the planner's
        pick, ``replanner``), else collocated's; None where neither fits, or where the run gave
        device ranges (custom, a plan file)."""
        p, kind = placement or self.cfg.placement, self.cluster.device_kind
        if p.mode == "custom" or p.plan is not None and p.mode != "auto":
            return None

        def named(mode: str) -> Plan:
            cfg = copy.deepcopy(self.cfg)
            cfg.placement.mode, cfg.placement.plan = mode, None
            return plan_of(cfg, self.workflow, n, kind, self.components, **self.flow.plan_options(cfg))

        tries = [("auto", lambda: self.replanner(n))] if p.mode == "auto" and self.replanner else []
        tries += [(m, lambda m=m: named(m)) for m in dict.fromkeys((p.mode, "collocated")) if m != "auto"]
        for mode, make in tries:
            try:
                plan = make()
                plan.check(self.workflow, n, self.components, gpu_slots=gpu_slots_of(self.cfg, kind))
                self.flow.check_plan(self.cfg, plan)
            except ValueError:  # PlanError, ConfigError: it does not fit
                continue
            return plan, mode
        return None

    def _replan(self, plan: Plan, mode: str) -> str:
        """The run goes on under ``plan`` (of placement ``mode``) on the devices the cluster
        lists alive now; the restart that follows starts its groups. Returns `` under
        placement.mode=...`` where the mode changed."""
        self.cluster.rediscover()
        p = self.cfg.placement
        how = "" if mode == p.mode else f" under placement.mode={mode}"
        if mode == "auto":  # the plan the run follows now, in the file of the first
            p.mode, p.plan = mode, self.shrunk[0].plan
            plan.save(p.plan)
        else:  # a named mode: its checkpoints' config says which
            p.mode, p.plan = mode, None
        self.plan = plan
        self.cfg.runner.max_staleness = plan.run_ahead
        self.prepare()
        return how

    def _grows(self, log: RunLog) -> bool:
        """After a checkpoint of a run that went on on fewer devices (``_check_nodes``): whether
        it takes the nodes the Ray cluster lists again (back, or new; ``runner.on_node_return=
        grow``), under a plan of its first placement laid out on every device listed now
        (``_plan_for``), said in ``log.txt`` and ``status.json``. Its groups then start again
        from that checkpoint, their states spread over the new ranks; not a restart."""
        if self.shrunk is None or self.cfg.runner.on_node_return != "grow":
            return False
        joined = self.cluster.joined_nodes()
        n = len(self.cluster.devices) + sum(len(node.devices) for node in joined)
        if not joined or n == self.unfit or self.cluster.lost_nodes():
            return False
        first, devices = self.shrunk
        fitting = self._plan_for(n, first)
        if fitting is None:  # asked again once the cluster lists another count
            self.unfit = n
            return False
        now = ", ".join(f"node {node.rank} ({node.address}; {len(node.devices)} device(s))" for node in joined)
        whole = fitting[1] == first.mode and n >= devices
        message = (f"{now} joined the Ray cluster: the run grows onto the {n} devices there are now"
                   f"{self._replan(*fitting)}, from {self.last_checkpoint}")
        log.note(f"{message}\n{self.plan.table(self.workflow)}")
        self.status.warn(None if whole else message)
        self.shrunk = None if whole else self.shrunk
        return True

    def _restart(self) -> None:
        """New processes for every group (the living ones' state is the checkpoint's now) and
        new channels; the weights go out again before the next step."""
        for g in self.distinct_groups:
            g.kill()
        for channel in self.channels.values():
            channel.destroy()
        self._start()

    def _failed_after(self, why: str) -> str:
        """The paragraph of a run that could not go on: how far it got, and ``why``."""
        return f"the run failed after {self.done} of {self.total} {self.metrics.x_name}s: {why}"

    def _then(self) -> str:
        """Where the run can be continued from."""
        return continue_from(self._position()["last_checkpoint"], self.cfg.runner.out_dir)

    def _head_changed(self, head: HeadMonitor, log: RunLog, checkpoint: bool) -> None:
        """From the head monitor's thread: told on stderr and in ``status.json`` at once, in case
        Ray ends the driver before the update in progress does."""
        if self.stop_request.signum is not None:  # a Ctrl-C reaches Ray's processes too: the signal tells why
            return
        then = "a checkpoint follows the update in progress" if checkpoint else "the run ends after the update in progress"
        message = (f"{head.describe()}; Ray ends this driver and its workers {ray_grace_s():.0f} s after that: {then}"
                   if head.lost else "the Ray cluster's head answers again")
        with contextlib.suppress(OSError):
            log.write(message)
            self.status.warn(message if head.lost else None)
        print(f"\nm2flow: {message}", file=sys.stderr, flush=True)

    def _stall(self, told: str | None, log: RunLog) -> None:
        """From the watchdog's thread: a stall ``told`` (``runner.stall_warning``), or over
        (None): on stderr, in ``log.txt`` and as ``status.json``'s ``warning`` (the one before
        it again once over)."""
        if told is not None:
            self.before_stall = self.status.fields.get("warning")
        message = told or "something moves again: the stall is over"
        with contextlib.suppress(OSError):
            log.write(message)
            self.status.warn(told if told is not None else self.before_stall)
        print(f"\nm2flow: {message}", file=sys.stderr, flush=True)

    def _headless(self, log: RunLog, e: BaseException | None = None) -> RunFailed:
        """The run ended by the loss of the cluster's head (``e``: the error it then met, whose
        traceback goes to the log): one paragraph."""
        message = self._failed_after(f"{self.cluster.head.describe()}; {self._then()}")
        then = "" if e is None else f"\n\n(then: {''.join(traceback.format_exception(e))})"
        with contextlib.suppress(OSError):
            log.write(message + then)
        return RunFailed(message, traced=e is not None)

    def _stopped(self, log: RunLog) -> RunStopped:
        message = f"stopped by {self.stop_request.name} {self.halted}; {self._then()}"
        log.write(message)
        return RunStopped(message, self.stop_request.signum)

    def _failed(self, log: RunLog, e: OSError) -> RunFailed:
        """A file the run could not write or read (a full disk, a quota, permissions): one
        paragraph, the traceback in the log (if it can still be written)."""
        where = f": {str(e.filename)!r}" if e.filename is not None else ""
        then = self._then()
        then += ": run it again once that is fixed" if not self._position()["last_checkpoint"] else " once that is fixed"
        message = self._failed_after(f"{e.strerror}{where}; {then}")
        with contextlib.suppress(OSError):
            log.write(f"{message}\n\n{''.join(traceback.format_exception(e))}")
        return RunFailed(message)

    def _out_of_restarts(self, log: RunLog, e: WorkerDiedError) -> RunFailed:
        """A death after the last restart ``runner.max_restarts`` allows: one paragraph."""
        allowed = self.cfg.runner.max_restarts
        deaths = "a worker process died" if allowed == 0 else (f"worker processes died {self.in_a_row + 1} times "
                                                               f"with no checkpoint written in between")
        message = self._failed_after(f"{deaths}, more than runner.max_restarts={allowed} allows; the last: "
                                     f"{str(e).splitlines()[0]}; {self._then()}")
        log.write(message)
        return RunFailed(message)


def _span(indices: set[int]) -> str:
    """A node's device indices (consecutive) as a placement writes them: ``2-3``, or ``5``."""
    return f"{min(indices)}-{max(indices)}" if len(indices) > 1 else str(min(indices))


def _first_line(e: BaseException | None) -> str:
    if e is None:
        return "no cause given"
    reason = death_reason(e)
    return f"{type(e).__name__}: {reason.splitlines()[0] if reason else ''}"
