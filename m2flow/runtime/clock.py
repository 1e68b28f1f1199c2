"""Clock: where the time of a worker call went, for the ``busy_s``, ``idle_s`` and
``lock_wait_s`` that workers report.

    clock = Clock()
    with clock.idle():                        # waiting for input
        batch = batches_in.get(key)
    with clock.turn(self.turns), clock.busy():
        ...                                   # the turn's wait is idle (and lock wait), the work busy
    return stats | clock.report()             # {"busy_s": ..., "idle_s": ...}

Idle time inside a ``busy()`` block (an ``idle()`` block, a turn's wait) counts as idle
only. Blocks of one kind do not nest.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any


class Clock:
    """Busy, idle and lock-wait seconds of one worker call, from its construction on.

    ``busy_unless_idle``: all of the clock's time is busy but its idle time, as if one
    ``busy()`` block ran from the construction to ``report()``: for a call that works
    whenever it does not wait.
    """

    __slots__ = ("start", "busy_s", "idle_s", "lock_wait_s", "busy_unless_idle", "_busy", "_idle")

    def __init__(self, busy_unless_idle: bool = False) -> None:
        self.start = time.perf_counter()
        self.busy_s = self.idle_s = self.lock_wait_s = 0.0
        self.busy_unless_idle = busy_unless_idle
        self._busy, self._idle = _Busy(self), _Idle(self)

    def busy(self) -> AbstractContextManager:
        """A block of work: its time, less the idle time inside it, is busy."""
        return self._busy

    def idle(self) -> AbstractContextManager:
        """A block of waiting (for input, for a free device): its time is idle."""
        return self._idle

    def turn(self, turns: AbstractContextManager) -> AbstractContextManager:
        """Enters a device turn (``Worker.device_turns``, or any context): the wait for it
        (its ``last_wait_s``) is idle and lock wait; the body is not timed."""
        return _Turn(self, turns)

    def waited(self, seconds: float) -> None:
        """Counts ``seconds`` of waiting for a device turn: idle, and lock wait."""
        self.idle_s += seconds
        self.lock_wait_s += seconds

    def elapsed(self) -> float:
        """Seconds since the clock was made."""
        return time.perf_counter() - self.start

    def report(self, lock_wait: bool = False) -> dict[str, float]:
        """``busy_s`` and ``idle_s``, and with ``lock_wait`` ``lock_wait_s`` (part of ``idle_s``)."""
        busy = self.elapsed() - self.idle_s if self.busy_unless_idle else self.busy_s
        if lock_wait:
            return {"busy_s": busy, "idle_s": self.idle_s, "lock_wait_s": self.lock_wait_s}
        return {"busy_s": busy, "idle_s": self.idle_s}


# One of each per clock, reused: a block costs two clock reads and no allocation, which
# matters in loops over small env steps.
class _Busy:
    __slots__ = ("clock", "start", "idle_before")

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        self.idle_before = self.clock.idle_s
        self.start = time.perf_counter()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        clock = self.clock
        clock.busy_s += time.perf_counter() - self.start - (clock.idle_s - self.idle_before)


class _Idle:
    __slots__ = ("clock", "start")

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.clock.idle_s += time.perf_counter() - self.start


class _Turn:
    __slots__ = ("clock", "turns")

    def __init__(self, clock: Clock, turns: AbstractContextManager) -> None:
        self.clock, self.turns = clock, turns

    def __enter__(self) -> Any:
        entered = self.turns.__enter__()
        self.clock.waited(getattr(self.turns, "last_wait_s", 0.0))  # a no-op context has none
        return entered

    def __exit__(self, *exc: Any) -> Any:
        return self.turns.__exit__(*exc)
