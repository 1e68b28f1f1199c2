"""Tools for the tool workers' tests, named by import path as a user's are: ``f`` (one of them
in every trajectory of the taught model, ``test_tool_workers.taught_model``), a tally of a
trajectory's calls (stateful), and ``f`` that kills the process it runs in on its first call."""

import os
import signal
from pathlib import Path


def f() -> str:
    """Answers."""
    return "5"


class Tally:
    """How many calls this trajectory made so far, this one included."""

    name = "tally"

    def __init__(self):
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def call(self) -> str:
        """Counts.
        """
        self.calls += 1
        return f"{os.getpid()}:{self.calls}"


class DiesOnce:
    """``f``, but the first call of all (``marker`` not yet written) kills its process."""

    name = "f"

    def __init__(self, marker: str):
        self.marker = Path(marker)

    def call(self) -> str:
        """Answers."""
        if not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return "5"
