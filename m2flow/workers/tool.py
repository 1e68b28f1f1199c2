"""The tool workers: processes with no model that run the rollout's tool calls.

A rollout rank sends each turn's calls straight to a tool rank (``runtime.peers``: one Ray
actor call there and back, never through the driver) and goes on decoding its other
sequences; the results come back as the future its turn waits on (``tools.episodes``). All of
a trajectory's calls go to the same rank, chosen by its id, which holds the trajectory's
toolbox (its stateful tools' state) until the rollout says the trajectory is out. A rank runs
up to ``CALL_THREADS`` turns at once, each turn's calls in parallel as on the rollout's own
threads (``Toolbox.run``: timeouts, errors as observations); a tool's subprocesses (the python
sandbox) run on the cores the plan gave the tool workers, not on the rollout's.

A tool rank that dies fails the rollout's call that waits on it with ``PeerDiedError``, which
the driver reads as the tool rank's death: every group starts again from the last checkpoint
and the step is done again, with nothing lost or trained twice, as after any death.
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import Future

from m2flow.runtime import Worker, dispatch
from m2flow.runtime.peers import Peer
from m2flow.tools import Toolbox
from m2flow.tools.base import ToolCall, ToolResult
from m2flow.tools.cut import CHARS_PER_TOKEN
from m2flow.workers.reports import ToolReport

TrajectoryId = tuple[int, ...]  # (rollout rank, its engine call, prompt index, sample index)


class ToolWorker(Worker):
    """One tool rank: ``run`` a turn's calls for a trajectory, ``forget`` a trajectory that is out."""

    CALL_THREADS = 64  # turns run at once (each waits on its tools: a subprocess, a sleep, an index)

    def __init__(self, cfg: dict):
        t = cfg["tools"]
        self.toolbox = Toolbox.load(t["names"])
        self.stateful = any(tool.stateful for tool in self.toolbox.tools.values())
        # The rollout cuts each result to the response limit by its tokenizer; here, by
        # characters, only what could never fit (a tool that prints megabytes crosses no wire).
        self.limits = {"timeout": t["timeout_s"], "max_calls": t["max_calls"],
                       "max_response_tokens": t["max_response_tokens"] * CHARS_PER_TOKEN}
        self.trajectories: dict[TrajectoryId, Toolbox] = {}
        self.lock = threading.Lock()
        self.running, self.calls, self.busy_s = 0, 0, 0.0
        self.since = self.window = time.perf_counter()  # busy from ``since`` while running; the report's window

    @dispatch(concurrent=True)
    def run(self, trajectory: TrajectoryId, calls: list[ToolCall | ToolResult]) -> list[ToolResult]:
        """The results of one turn's calls of ``trajectory``, on its toolbox."""
        with self.lock:
            toolbox = self.trajectories.get(trajectory) if self.stateful else self.toolbox
            if toolbox is None:
                toolbox = self.trajectories[trajectory] = self.toolbox.copy()
            self._count(+1)
        try:
            return toolbox.run(calls, **self.limits)
        finally:
            with self.lock:
                self.calls += len(calls)
                self._count(-1)

    @dispatch(concurrent=True)
    def forget(self, trajectory: TrajectoryId) -> None:
        """``trajectory`` is out: its toolbox goes."""
        with self.lock:
            self.trajectories.pop(trajectory, None)

    @dispatch(immediate=True)
    def report(self) -> ToolReport:
        """Its calls and busy time since the last report."""
        with self.lock:
            now = time.perf_counter()
            busy = self.busy_s + (now - self.since if self.running else 0.0)
            report = ToolReport(busy_s=busy, idle_s=max(0.0, now - self.window - busy), calls=self.calls,
                                trajectories=len(self.trajectories))
            self.busy_s, self.calls, self.since, self.window = 0.0, 0, now, now
        return report

    def _count(self, change: int) -> None:
        """``running`` changes by ``change`` (under the lock): time with a call running is busy."""
        now = time.perf_counter()
        if self.running:
            self.busy_s += now - self.since
        self.since, self.running = now, self.running + change


class RemoteTools:
    """A rollout rank's side of the tool workers (``group``'s ``ranks`` ranks), for one engine
    call of its (``call``): ``run`` and ``forget`` as ``tools.episodes.ToolTurns`` takes them."""

    def __init__(self, group: str, ranks: int, rollout_rank: int, call: int):
        self.peers = [Peer(group, r) for r in range(ranks)]
        self.prefix = (rollout_rank, call)

    def _rank(self, trajectory: TrajectoryId) -> Peer:
        digest = hashlib.blake2b(repr(trajectory).encode(), digest_size=8).digest()  # the same in every process
        return self.peers[int.from_bytes(digest, "big") % len(self.peers)]

    def run(self, key: tuple[int, int], calls: list) -> Future:
        trajectory = self.prefix + key
        return self._rank(trajectory).call("run", trajectory, calls)

    def forget(self, key: tuple[int, int]) -> Future:
        """Sent, not waited for (a rank that died forgot it already); the future says when it is done."""
        trajectory = self.prefix + key
        return self._rank(trajectory).call("forget", trajectory)

