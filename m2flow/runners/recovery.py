"""How a run meets what stops it, as the runner's part ``Recovery``: a worker process's death
(every group starts again from the last checkpoint, ``runner.max_restarts`` times in a row;
while the workers start too), the loss of the cluster's head, a stall
(``runner.stall_warning``), a disk that fails and a signal; and the one paragraph each ends a
run in where it cannot go on. A node's loss and return are its part ``Elastic``
(``runners/elastic.py``).

It uses of the runner: its config, cluster, status, groups and channels, ``start_groups``
(new processes for every group) and its part ``Elastic``; and the run's ``Progress``
(``runners/status.py``), whose restart counts it keeps.
"""

from __future__ import annotations

import contextlib
import errno
import sys
import time
import traceback
from pathlib import Path
from typing import Protocol

from omegaconf import DictConfig

from m2flow.runners.elastic import Elastic
from m2flow.runners.metrics import RunLog
from m2flow.runners.status import Progress, RunFailed, RunStatus
from m2flow.runtime import Channel, Cluster, WorkerGroup, stop
from m2flow.runtime.errors import WorkerDiedError, WorkerError, death_reason
from m2flow.runtime.head import HeadMonitor, ray_grace_s
from m2flow.runtime.pool import WorkerPool
from m2flow.runtime.stop import RunStopped
from m2flow.runtime.watchdog import Watchdog

# A file the run writes or reads failed for a reason outside the run: a restart would fail again
DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM}


class Owner(Protocol):
    """What ``Recovery`` uses of the runner that owns it."""

    cfg: DictConfig
    cluster: Cluster
    status: RunStatus
    pool: WorkerPool | None
    channels: dict[str, Channel]
    distinct_groups: list[WorkerGroup]
    elastic: Elastic
    progress: Progress

    def start_groups(self) -> None: ...


class Recovery:
    def __init__(self, runner: Owner):
        self.runner, self.progress = runner, runner.progress
        self.before_stall: str | None = None  # the warning a stall told replaced

    def recoverable(self, e: BaseException, log: RunLog, watchdog: Watchdog | None) -> WorkerDiedError:
        """What ended a pass of the loop, ``e``: the death of a worker process that a restart
        answers (returned), after ``Elastic.check_nodes``; anything else is raised, as one
        paragraph where that ends the run (a hang, the head's loss, a disk, a signal, no
        restart left)."""
        run, p = self.runner, self.progress
        if watchdog is not None and watchdog.report is not None:  # the watchdog stopped the run
            log.write(f"{watchdog.error()}\n(then: {type(e).__name__}: {e})")
            raise watchdog.error() from None
        if run.cluster.head.lost and p.stop.signum is None and not isinstance(e, KeyboardInterrupt):
            raise self.headless(log, e) from e  # no restart without it
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:  # no restart makes room on a disk
            raise self._failed(log, e) from e
        if isinstance(e, WorkerError):
            log.write(f"{e}\n\nthe worker's whole traceback:\n{e.traceback}")
            if p.stop.signum is not None:  # the signal reached the workers too
                p.halted = f"and the worker processes with it ({e.group} rank {e.rank} ended)"
                raise self.stopped(log) from None
        if not isinstance(e, WorkerDiedError):
            raise e
        run.elastic.check_nodes(log, e)
        if p.in_a_row >= run.cfg.runner.max_restarts:
            raise self._out_of_restarts(log, e) from e
        return e

    def first_start(self) -> None:
        """The groups' first start (``Runner``'s). A worker process that dies while they start
        (killed, out of memory, a simulator that crashes in its constructor) starts every group
        again, as a death mid-run does, counted against ``runner.max_restarts``: the run's loop
        begins with those restarts. An exception a worker raises while it starts (a setting it
        refuses, a bug) is no death: it would be raised again, and ends the run at once; so
        does a death while a signal stops the run. With no restart left (profiling's runs have
        none), ``RunFailed`` in one paragraph."""
        run, p = self.runner, self.progress
        allowed = run.cfg.runner.max_restarts
        while True:
            try:
                run.start_groups()
                return
            except WorkerDiedError as e:
                if stop.requested() is not None:
                    raise
                self._log_at_start(f"{e}\n\nthe worker's whole traceback:\n{e.traceback}", console=False)
                if p.restarts >= allowed:
                    deaths = ("a worker process died" if allowed == 0 else
                              f"worker processes died {p.restarts + 1} times")
                    message = (f"the run failed while it started: {deaths}, more than runner.max_restarts={allowed} "
                               f"allows; the last: {str(e).splitlines()[0]}")
                    self._log_at_start(message, console=False)
                    raise RunFailed(message) from e
                p.restarts += 1
                self._log_at_start(f"restart {p.restarts} of at most {allowed}: {e.group} rank {e.rank} died "
                                   f"in {e.method}() ({_first_line(e.cause)}) while the workers started; all groups "
                                   "start again")
                run.status.set(restarts=p.restarts, now=True)

    def _log_at_start(self, text: str, console: bool = True) -> None:
        """A note before the run's log is open (the loop opens it): on the console unless not
        ``console``, and time-stamped in ``log.txt`` as the log writes it."""
        if console:
            print(text, flush=True)
        with contextlib.suppress(OSError), open(Path(self.progress.out_dir) / "log.txt", "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")

    def start_again(self, died: WorkerDiedError | None, point: str | None, log: RunLog) -> None:
        """Every group starts again, to continue from checkpoint ``point``: a restart after
        ``died``, or (None) the run grows onto nodes back. A process that dies while they start
        counts as a restart of its own."""
        run, p, r = self.runner, self.progress, self.runner.cfg.runner
        while True:
            if died is not None:
                p.restarts += 1
                p.in_a_row += 1
                since = f" since the last checkpoint ({p.restarts} in all)" if p.restarts > p.in_a_row else ""
                log.note(f"restart {p.in_a_row} of at most {r.max_restarts}{since}: {died.group} rank "
                         f"{died.rank} died in {died.method}() ({_first_line(died.cause)}); all groups start "
                         f"again from {point or 'the beginning'}")
            try:
                self._restart()
                return
            except WorkerDiedError as e:
                run.elastic.check_nodes(log, e)
                if p.in_a_row >= r.max_restarts:
                    raise self._out_of_restarts(log, e) from e
                died = e
            except Exception as e:  # noqa: BLE001 - Ray refusing a rank a node that is gone, say
                if not run.elastic.check_nodes(log, e):  # else re-planned: started again
                    raise

    def _restart(self) -> None:
        """Every group starts again, with new channels: the living processes and channel
        actors go back to the run's pool and are re-initialised (their state is the
        checkpoint's now), those that died (or do not answer) start anew; the weights go out
        again before the next step."""
        run = self.runner
        for channel in run.channels.values():  # first: a call still reading one then ends
            channel.release(run.pool)
        for g in run.distinct_groups:
            g.shutdown()
        run.start_groups()

    def head_changed(self, head: HeadMonitor, log: RunLog, checkpoint: bool) -> None:
        """From the head monitor's thread: told on stderr and in ``status.json`` at once, in case
        Ray ends the driver before the update in progress does."""
        if self.progress.stop.signum is not None:  # a Ctrl-C reaches Ray's processes too: the signal tells why
            return
        then = "a checkpoint follows the update in progress" if checkpoint else "the run ends after the update in progress"
        message = (f"{head.describe()}; Ray ends this driver and its workers {ray_grace_s():.0f} s after that: {then}"
                   if head.lost else "the Ray cluster's head answers again")
        with contextlib.suppress(OSError):
            log.write(message)
            self.runner.status.warn(message if head.lost else None)
        print(f"\nm2flow: {message}", file=sys.stderr, flush=True)

    def stall(self, told: str | None, log: RunLog) -> None:
        """From the watchdog's thread: a stall ``told`` (``runner.stall_warning``), or over
        (None): on stderr, in ``log.txt`` and as ``status.json``'s ``warning`` (the one before
        it again once over)."""
        status = self.runner.status
        if told is not None:
            self.before_stall = status.fields.get("warning")
        message = told or "something moves again: the stall is over"
        with contextlib.suppress(OSError):
            log.write(message)
            status.warn(told if told is not None else self.before_stall)
        print(f"\nm2flow: {message}", file=sys.stderr, flush=True)

    def headless(self, log: RunLog, e: BaseException | None = None) -> RunFailed:
        """The run ended by the loss of the cluster's head (``e``: the error it then met, whose
        traceback goes to the log): one paragraph."""
        p = self.progress
        message = p.failed_after(f"{self.runner.cluster.head.describe()}; {p.then()}")
        then = "" if e is None else f"\n\n(then: {''.join(traceback.format_exception(e))})"
        with contextlib.suppress(OSError):
            log.write(message + then)
        return RunFailed(message, traced=e is not None)

    def stopped(self, log: RunLog) -> RunStopped:
        p = self.progress
        message = f"stopped by {p.stop.name} {p.halted}; {p.then()}"
        log.write(message)
        return RunStopped(message, p.stop.signum)

    def _failed(self, log: RunLog, e: OSError) -> RunFailed:
        """A file the run could not write or read (a full disk, a quota, permissions): one
        paragraph, the traceback in the log (if it can still be written)."""
        p = self.progress
        where = f": {str(e.filename)!r}" if e.filename is not None else ""
        then = p.then()
        then += ": run it again once that is fixed" if not p.position()["last_checkpoint"] else " once that is fixed"
        message = p.failed_after(f"{e.strerror}{where}; {then}")
        with contextlib.suppress(OSError):
            log.write(f"{message}\n\n{''.join(traceback.format_exception(e))}")
        return RunFailed(message)

    def _out_of_restarts(self, log: RunLog, e: WorkerDiedError) -> RunFailed:
        """A death after the last restart ``runner.max_restarts`` allows: one paragraph."""
        p, allowed = self.progress, self.runner.cfg.runner.max_restarts
        deaths = "a worker process died" if allowed == 0 else (f"worker processes died {p.in_a_row + 1} times "
                                                               f"with no checkpoint written in between")
        message = p.failed_after(f"{deaths}, more than runner.max_restarts={allowed} allows; the last: "
                                 f"{str(e).splitlines()[0]}; {p.then()}")
        log.write(message)
        return RunFailed(message)


def _first_line(e: BaseException | None) -> str:
    if e is None:
        return "no cause given"
    reason = death_reason(e)
    return f"{type(e).__name__}: {reason.splitlines()[0] if reason else ''}"
