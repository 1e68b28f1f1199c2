"""``status.json`` in a run's directory: where the run is and how it ended, for whatever watches
it from outside (a script that launched it, a cluster scheduler, a person over ssh) without
reading its log.

``state`` is ``starting`` while its workers start (and ``placement=auto`` profiles), ``running``
while it trains, then one of ``finished``, ``stopped`` (a signal asked it to; ``signal`` names
it), ``hung`` (the watchdog stopped it) or ``failed`` (``message`` says why). ``warning``, while
it runs, says what threatens it (the Ray cluster's head lost: ``runtime/head.py``). ``updated`` is
when the file was last written: a running run rewrites it after an update at most every
``every_s`` seconds, and at once on every change of state, so a ``running`` file that has not
changed for much longer than an update takes belongs to a driver that no longer runs (killed
with SIGKILL, its machine gone). Each write replaces the file whole, as checkpoints are written
(``runtime.files.write_text``): a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from m2flow.runtime.files import DirectoryLock, write_text, write_whole
from m2flow.runtime.stop import RunStopped, StopRequest

FILE = "status.json"
CHECKPOINTS = "checkpoints"  # the folder of a run's directory its checkpoints go to


class RunFailed(RuntimeError):
    """The run could not go on for a reason outside it (a file it could not write); the message
    says how far it got and where it can continue from. ``traced``: the run's log holds the
    traceback of the error behind it."""

    def __init__(self, message: str, traced: bool = True):
        super().__init__(message)
        self.traced = traced


def read(out_dir: str | Path) -> dict[str, Any]:
    """The status a run in ``out_dir`` wrote last; ``ValueError`` if the file holds none."""
    status = json.loads((Path(out_dir) / FILE).read_text())
    if not isinstance(status, dict) or not {"state", "pid", "host", "started", "updated"} <= status.keys():
        raise ValueError("not the fields of a run's status")
    return status


class RunStatus:
    def __init__(self, out_dir: str | Path, every_s: float = 5.0):
        """A run that starts (its workers, profiling): written at once. What the file held
        before (an earlier run's ending) is kept, to be put back should a config error stop
        this run while it starts (``failed``)."""
        self.path = Path(out_dir) / FILE
        try:
            self.before: bytes | None = self.path.read_bytes()
        except OSError:
            self.before = None
        self.every_s = every_s
        now = time.time()
        self.fields: dict[str, Any] = {"state": "starting", "pid": os.getpid(), "host": socket.gethostname(),
                                       "started": _stamp(now), "updated": _stamp(now)}
        self.written = 0.0
        self._lock = threading.Lock()  # ``warn`` comes from another thread
        self.write()

    def set(self, state: str | None = None, *, now: bool = False, **fields: Any) -> None:
        """``fields`` (``done``, ``total``, ``last_checkpoint``, ...), written if ``every_s`` has
        passed since the last write; a new ``state``, or ``now``, is written at once."""
        with self._lock:
            changed = state is not None and state != self.fields["state"]
            self.fields |= _plain(fields) | ({"state": state} if state else {})
            if changed or now or time.monotonic() - self.written >= self.every_s:
                self.write()

    def warn(self, message: str | None) -> None:
        """What threatens the run as it goes on (``warning``; None: nothing any more), written at once."""
        with self._lock:
            self.fields["warning"] = message
            self.write()

    def failed(self, e: BaseException, **fields: Any) -> None:
        """How ``e`` ended the run (``ending``); a write that fails then is let go: ``e`` stands.
        A config error while the run starts, in a directory an earlier run wrote its status to,
        puts that status back: the earlier run keeps its record (the error goes to stderr)."""
        from m2flow.config.validate import ConfigError

        with contextlib.suppress(OSError):
            if isinstance(e, ConfigError) and self.before is not None and self.fields["state"] == "starting":
                self.restore()
                return
            state, more = ending(e)
            self.set(state, **more, **fields)

    def restore(self) -> None:
        """The file as this run found it."""
        with self._lock:
            write_whole(self.path, lambda tmp: tmp.write_bytes(self.before))

    def write(self) -> None:
        self.fields["updated"] = _stamp(time.time())
        write_text(self.path, json.dumps(self.fields, indent=1) + "\n")
        self.written = time.monotonic()


@dataclass
class Progress:
    """Where a run is: what its loop (``runners/loop.py``), its checkpoints
    (``runners/checkpointer.py``) and its recovery (``runners/recovery.py``) share, and what
    ``status.json`` says of it (``position``)."""

    total: int  # the run's updates
    unit: str  # what one is called: ``update``, ``step``
    out_dir: str
    done: int = 0  # updates logged
    last_checkpoint: Path | None = None  # the last this run wrote: where a restart starts
    resumed_from: Path | None = None  # the checkpoint it started from, if one
    restarts: int = 0  # in all, those while the workers started included
    in_a_row: int = 0  # restarts since the last checkpoint: ``runner.max_restarts`` bounds them
    halted: str | None = None  # where a stop asked for ended the run, if one did
    stop: StopRequest = field(default_factory=StopRequest)  # the signal that asks the run to stop

    def position(self) -> dict[str, Any]:
        """Where the run is, for ``status.json``."""
        return {"done": self.done, "last_checkpoint": self.last_checkpoint or self.resumed_from,
                "restarts": self.restarts}

    def then(self) -> str:
        """Where the run can be continued from."""
        return continue_from(self.last_checkpoint or self.resumed_from, self.out_dir)

    def failed_after(self, why: str) -> str:
        """The paragraph of a run that could not go on: how far it got, and ``why``."""
        return f"the run failed after {self.done} of {self.total} {self.unit}s: {why}"


def ending(e: BaseException) -> tuple[str, dict[str, Any]]:
    """The state and fields of a run that ``e`` ended."""
    from m2flow.runtime.watchdog import RunHung  # here: ``m2flow status`` needs no Ray or torch

    if isinstance(e, RunStopped):
        return "stopped", {"signal": e.name, "message": str(e)}
    if isinstance(e, KeyboardInterrupt):  # a second signal: at once
        return "stopped", {"message": str(e) or "interrupted"}
    if isinstance(e, RunHung):
        return "hung", {"message": str(e)}
    if isinstance(e, RunFailed):  # its message says it all
        return "failed", {"message": str(e)}
    return "failed", {"message": f"{type(e).__name__}: {e}"}


def continue_from(checkpoint: str | Path | None, out_dir: str | Path) -> str:
    """Where a run that ended can be continued from: its last checkpoint, and the
    ``runner.resume`` that finds it (``auto`` for one in the run's own checkpoint directory)."""
    if not checkpoint:
        return "no checkpoint written"
    own = Path(checkpoint).resolve().parent == (Path(out_dir) / CHECKPOINTS).resolve()
    return f"the last checkpoint: {checkpoint}; continue with runner.resume={'auto' if own else checkpoint}"


def describe(out_dir: str | Path) -> tuple[str, bool]:
    """``m2flow status``: one paragraph on the run in ``out_dir``, and whether it is well (starting,
    running or finished). A run of this machine whose file says it runs but whose directory no
    process holds any more (``runtime.files.DirectoryLock``) ended without a word (SIGKILL); one
    of another machine is taken at its word (its lock may not reach this one)."""
    s = read(out_dir)
    unit, done, total = s.get("unit", "update"), s.get("done", 0), s.get("total")
    where = f"{done} of {total} {unit}s" if total is not None else "before its first update"
    then = f"; the last checkpoint: {s['last_checkpoint']}" if s.get("last_checkpoint") else "; no checkpoint written"
    who = f"pid {s['pid']} on {s['host']}, since {s['started']}; written {s['updated']}, {_ago(s['updated'])}"
    if s["state"] in ("starting", "running"):
        warning = f"; {s['warning']}" if s.get("warning") else ""
        if DirectoryLock.holder(out_dir) is not None:
            return f"{out_dir}: {s['state']}, {where} ({who}){then}{warning}", True
        if s["host"] != socket.gethostname():  # a lock another machine holds may not be seen from here
            return (f"{out_dir}: {s['state']}, {where}, as its status says ({who}); whether its driver on "
                    f"{s['host']} still runs cannot be told from this machine{then}{warning}"), True
        said = f"; it had said: {s['warning']}" if s.get("warning") else ""
        return (f"{out_dir}: ended without a word after {where} (its status says {s['state']}, but no process "
                f"holds the directory: {who}){said}; {continue_from(s.get('last_checkpoint'), out_dir)}"), False
    if s["state"] == "finished":
        return f"{out_dir}: finished, {where} ({who}){then}", True
    return f"{out_dir}: {s['state']}, {where} ({who}): {s.get('message', '')}", False


def _ago(stamp: str) -> str:
    """How long ago ``stamp`` (``_stamp``'s) was: a run that no longer moves shows here."""
    try:
        seconds = time.time() - datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return "at an unknown time"
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in fields.items()}


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
