"""A stop asked for by a signal: SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption, ``kill``).

While a ``StopRequest`` is entered, the first such signal only sets ``signum``: the loop that
polls it stops at its next safe point (a run: after the update in progress, with a checkpoint).
A second one raises ``KeyboardInterrupt`` at once. On leaving, the handlers before are put
back (one installed outside Python cannot be, and is replaced by the default).

One entered while another is (a run's loop inside the command that started the run) shares
the outer one's state: a signal that came while the run was starting is seen by the loop.
Handlers can only be set from the main thread; entered from another, a ``StopRequest``
watches for nothing and the signals keep their handlers.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_active: list[StopRequest] = []  # the entered ones, outermost first


class RunStopped(Exception):
    """A loop stopped at a safe point because a signal (``signum``) asked it to."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StopRequest:
    def __init__(self, what: str = "stopping at the next safe point"):
        self.what = what  # told on stderr when the first signal comes
        self._signum: int | None = None
        self._outer: StopRequest | None = None
        self._before: dict[int, Any] = {}

    @property
    def signum(self) -> int | None:
        return self._outer.signum if self._outer is not None else self._signum

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name

    def __enter__(self) -> StopRequest:
        if _active:
            self._outer = _active[0]
            reassert()
        elif threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._before[s] = signal.signal(s, self._handle)
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.remove(self)
        for s, before in self._before.items():
            signal.signal(s, signal.SIG_DFL if before is None else before)
        self._before.clear()
        self._signum, self._outer = self.signum, None  # what was asked stays readable

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._signum is not None:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} again: stopped at once")
        self._signum = signum
        # os.write: safe whatever the main thread was doing when the signal came
        os.write(2, f"\n{signal.Signals(signum).name}: {self.what} (send it again to stop at once)\n".encode())


def reassert() -> None:
    """The outermost entered request's handlers again: a library may have put its own in
    place meanwhile (Ray does for SIGTERM as it starts)."""
    if _active and _active[0]._before and threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _active[0]._handle)


def requested() -> int | None:
    """The signal the entered requests got, if one came (None: none did, or none is entered)."""
    return _active[0].signum if _active else None
