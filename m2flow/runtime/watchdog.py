"""Hang diagnosis: a run in which nothing moves for ``timeout_s`` is stopped, with a report.

Progress is anything the driver or the channels, device locks and workers see happen: a step
ending (``beat``), an item put into or taken from a channel, a device lock changing hands, a
worker taking a message from another (point to point). A thread
of the driver polls those counts; when none has changed for ``timeout_s`` it writes a report
(every rank's Python stacks, what each is doing, what each channel holds and who waits on it,
who holds and who waits for each device lock), kills the worker processes, so that the
driver's pending calls fail at once, and keeps the report's path (``report``) for the error
the run then raises (``RunHung``).

Long before that, a quiet spell far longer than any the run has had since its first step
ended (``stall_factor`` times the longest, at least ``STALL_FLOOR_S``) is told: the same
report of every rank (``stall-*.txt``) and a call of ``on_stall`` with a line saying so, the
run going on; ``on_stall(None)`` once something moves again. A spell told so counts among
those seen: a long step that is only slow is told once.

A rank's stacks are answered by its IO thread, which runs while the main one is busy or stuck;
a rank that does not answer within ``answer_s`` is reported so (a process stuck in C code that
holds the GIL: ``py-spy dump --pid <pid>`` shows its native stack).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from m2flow.runtime.device_lock import lock_state
from m2flow.runtime.errors import own_frames

if TYPE_CHECKING:
    from m2flow.runtime.channel import Channel
    from m2flow.runtime.group import WorkerGroup


STALL_FLOOR_S = 60.0  # no quiet spell shorter than this is told as a stall


class RunHung(RuntimeError):
    """No component made progress for the watchdog's time-out; the message names the report."""


# Where a rank's innermost frames of its own code are, and what that means it is doing.
_WAITS = (("m2flow/runtime/channel", "waiting on a channel"), ("m2flow/runtime/device_lock", "waiting for a device lock"),
          ("m2flow/runtime/comm", "waiting for a message from another rank"),
          ("m2flow/runtime/pairs", "waiting for a message from another rank"))


class Watchdog:
    def __init__(self, timeout_s: float, report_dir: str | Path, groups: Sequence[WorkerGroup],
                 channels: Mapping[str, Channel] | None = None, lock_devices: Sequence[int] = (),
                 poll_s: float | None = None, answer_s: float = 10.0, stall_factor: float = 0.0,
                 on_stall: Callable[[str | None], None] | None = None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.report_dir = timeout_s, Path(report_dir)
        self.groups, self.channels, self.lock_devices = list(groups), dict(channels or {}), list(lock_devices)
        self.stall_factor, self.on_stall = (stall_factor, on_stall) if on_stall else (0.0, None)
        self.poll_s = poll_s if poll_s is not None else min(10.0, timeout_s / 4, STALL_FLOOR_S / 4)
        self.answer_s = answer_s
        self.report: Path | None = None
        self.summary = ""
        self._last = time.monotonic()
        self._counts: tuple | None = None
        self._beats = 0  # steps ended: quiet spells count from the first on
        self._longest = 0.0  # the longest quiet spell seen since then (to a poll)
        self._stalled = False  # a stall was told, and nothing has moved since
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="m2flow-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.answer_s + 5)

    def beat(self) -> None:
        """The driver saw progress (a step ended)."""
        self._last = time.monotonic()
        self._beats += 1

    def error(self) -> RunHung:
        return RunHung(f"no component made progress for {self.timeout_s:g} s (runner.hang_timeout_s): "
                       f"{self.summary}; report: {self.report}")

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        spell = 0.0  # the quiet spell under way, as long as the last poll saw it
        seen = self._last  # the last progress the last poll knew of
        while not self._stop.wait(self.poll_s):
            counts, beats = self._progress_counts(), self._beats
            idle = time.monotonic() - self._last
            if counts != self._counts:
                self._counts = counts
                self._last = time.monotonic()
            elif idle >= self.timeout_s:
                self._fire()
                return
            elif (self.stall_factor and beats and not self._stalled
                  and idle >= max(STALL_FLOOR_S, self.stall_factor * self._longest)):
                self._tell_stall(idle)
            moved = self._last != seen  # here, or a step ended meanwhile
            if moved and beats:  # the spell that ended counts (a stall told too), to a poll
                self._longest = max(self._longest, spell)
            spell, seen = 0.0 if moved else idle, self._last
            if moved and self._stalled:
                self._stalled = False
                self.on_stall(None)

    def _tell_stall(self, idle_s: float) -> None:
        ranks = self._stacks()
        summary = self._summary(ranks)
        seen = f"the longest quiet spell since the first step ended was {self._longest:.0f} s"
        path = self._write_report("stall", ranks, [f"Nothing moved for {idle_s:.0f} s; {seen}. The run goes on.",
                                                   f"Busy: {summary}"])
        self._stalled = True
        self.on_stall(f"nothing has moved for {idle_s:.0f} s, where {seen} ({summary}; stacks: {path}); "
                      f"runner.hang_timeout_s={self.timeout_s:g} stops the run if nothing moves")

    def _progress_counts(self) -> tuple:
        counts = []
        for name, ch in self.channels.items():
            try:
                s = ch.stats(timeout=self.answer_s)
                counts.append((name, s["puts"], s["gets"]))
            except Exception:  # noqa: BLE001 -- a channel that does not answer moves nothing
                counts.append((name, None))
        for g in self.groups:  # messages between workers: a flow's own exchange (the replay flow's)
            try:
                counts.append((g.name, tuple(g.received(self.answer_s))))
            except Exception:  # noqa: BLE001 -- a group that does not answer moves nothing
                counts.append((g.name, None))
        for d in self.lock_devices:
            try:
                counts.append((d, lock_state(d)["acquisitions"]))
            except Exception:  # noqa: BLE001
                counts.append((d, None))
        return tuple(counts)

    def _fire(self) -> None:
        idle_s = time.monotonic() - self._last
        ranks = self._stacks()
        self.summary = self._summary(ranks)
        self.report = self._write_report("hang", ranks, [
            f"No component made progress for {idle_s:.0f} s (runner.hang_timeout_s={self.timeout_s:g}).",
            f"Busy: {self.summary}"])
        for g in self.groups:  # the driver's pending calls fail now, rather than wait forever
            try:
                g.kill()
            except Exception:  # noqa: BLE001 -- already gone
                pass

    @staticmethod
    def _summary(ranks: list[dict]) -> str:
        busy = [f"{r['name']} {r['doing']}" + (f" at {r['where']}" if r["where"] else "") for r in ranks
                if r["doing"] in ("busy", "not answering")]
        return "; ".join(busy) or "every rank waits on another"

    def _write_report(self, kind: str, ranks: list[dict], head: list[str]) -> Path:
        """``report_dir/KIND-<time>.txt``: ``head``, then every rank, channel and device lock."""
        self.report_dir.mkdir(parents=True, exist_ok=True)
        path = self.report_dir / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}.txt"
        lines = [*head, "", "== ranks"]
        lines += [f"{r['name']} (pid {r['pid']}): {r['doing']}" + (f" at {r['where']}" if r["where"] else "")
                  for r in ranks]
        lines += ["", "== channels"]
        for name, ch in self.channels.items():
            try:
                lines.append(f"{name}: {json.dumps(ch.stats(timeout=self.answer_s))}")
            except Exception as e:  # noqa: BLE001
                lines.append(f"{name}: did not answer ({type(e).__name__})")
        lines += ["", "== device locks"]
        for d in self.lock_devices:
            try:
                lines.append(f"device {d}: {json.dumps(lock_state(d))}")
            except Exception as e:  # noqa: BLE001
                lines.append(f"device {d}: did not answer ({type(e).__name__})")
        lines += ["", "== stacks (innermost frame last)"]
        for r in ranks:
            lines.append(f"-- {r['name']} (pid {r['pid']})")
            lines += [f"thread {t}:\n{stack}" for t, stack in r["threads"].items()] or ["(no answer)"]
        path.write_text("\n".join(lines) + "\n")
        return path

    def _stacks(self) -> list[dict]:
        asked = [(g, rank, actor._m2flow_stacks.remote()) for g in self.groups for rank, actor in enumerate(g.actors)]
        ranks = []
        for g, rank, ref in asked:
            name = f"{g.name} rank {rank}"
            try:
                got = ray.get(ref, timeout=self.answer_s)
            except Exception:  # noqa: BLE001 -- dead, or stuck in C code holding the GIL
                ranks.append({"name": name, "pid": "?", "doing": "not answering", "where": "", "threads": {}})
                continue
            doing, where = "idle", ""
            for stack in got["threads"].values():
                if 'm2flow/runtime/worker.py", ' not in stack or "in call\n" not in stack:
                    continue  # not running a group call
                frames = own_frames(stack, last=1)
                where = frames[0] if frames else ""
                doing = next((what for file, what in _WAITS if file in where), "busy")
            ranks.append({"name": name, "pid": got["pid"], "doing": doing, "where": where, "threads": got["threads"]})
        return ranks
