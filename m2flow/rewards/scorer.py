"""Scoring completions with a weighted sum of reward functions.

Rewards are named by import path (``"package.module:function"``) or by a built-in name
(``BUILTIN``). Those marked ``in_process`` (string work) run in the caller; the others run
in one dedicated worker process, in its main thread, because math-verify times itself out
with ``signal.alarm`` and a custom reward may hang outright. The caller watches every item
with a deadline: an item that takes longer than ``timeout_s`` gets ``timeout_score`` from
those rewards, the worker is killed and a fresh one scores the rest. A reward that raises
stops the batch with a ``RewardError`` carrying the worker's traceback: a buggy reward is
an error to fix, not a silent zero.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import traceback
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from m2flow.rewards.math import RewardFn

BUILTIN = {
    "math": "m2flow.rewards.math:math_reward",
    "format": "m2flow.rewards.math:format_reward",
    "last_number": "m2flow.rewards.math:last_number_reward",
    "exact_match": "m2flow.rewards.match:exact_match",
}
_STARTUP_TIMEOUT_S = 120.0  # spawning and importing sympy on a busy 2-core machine


class RewardError(RuntimeError):
    pass


def resolve_reward(spec: str) -> RewardFn:
    """A built-in name ("math") or ``"package.module:function"``."""
    path = BUILTIN.get(spec, spec)
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"reward {spec!r}: expected a built-in name {sorted(BUILTIN)} or 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"cannot import reward {spec!r}: {e}") from e
    if not callable(fn):
        raise RewardError(f"reward {spec!r} is not callable")
    return fn


@dataclass
class Scores:
    total: np.ndarray  # [N] float32, the weighted sum
    parts: dict[str, np.ndarray]  # each reward's unweighted scores, [N]
    timed_out: np.ndarray  # [N] bool

    @property
    def solved(self) -> np.ndarray:
        """[N] bool: every reward function scored 1 or more (accuracy, with 0/1 rewards)."""
        return np.all(np.stack([part >= 1.0 for part in self.parts.values()]), axis=0)


def _serve(conn: Connection, specs: list[str]) -> None:
    """Worker loop: for each item, send ("ok", i, scores) once every reward has scored it,
    or ("error", i, message) and drop the rest of the batch."""
    try:
        fns = [resolve_reward(s) for s in specs]
        for fn in fns:
            getattr(fn, "warmup", lambda: None)()  # heavy imports before the first deadline
    except BaseException:  # noqa: BLE001 -- the parent raises it with this traceback
        conn.send(("error", -1, traceback.format_exc()))
        return
    conn.send(("ready", -1, None))
    while (msg := conn.recv()) is not None:
        for i, completion, answer in msg:
            try:
                scores = [float(fn(completion, answer)) for fn in fns]
            except BaseException:  # noqa: BLE001 -- the parent raises it with this traceback
                conn.send(("error", i, traceback.format_exc()))
                break
            conn.send(("ok", i, scores))


class RewardScorer(AbstractContextManager):
    """``RewardScorer({"math": 1.0, "format": 0.1})`` or ``RewardScorer(["math"])`` (weight 1).
    ``score(completions, answers)`` returns ``Scores``. Close it (or use ``with``) to stop
    the worker process."""

    def __init__(self, rewards: Mapping[str, float] | Sequence[str] | str, timeout_s: float = 10.0,
                 timeout_score: float = 0.0):
        rewards = {rewards: 1.0} if isinstance(rewards, str) else rewards
        self.weights = dict(rewards) if isinstance(rewards, Mapping) else {r: 1.0 for r in rewards}
        if not self.weights:
            raise ValueError("no reward functions given")
        self.fns = {spec: resolve_reward(spec) for spec in self.weights}
        self.local = [s for s, fn in self.fns.items() if getattr(fn, "in_process", False)]
        self.remote = [s for s in self.fns if s not in self.local]
        self.timeout_s, self.timeout_score = timeout_s, timeout_score
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def start(self) -> RewardScorer:
        """Starts the worker process now, not at the first ``score``: its spawn and imports
        (sympy for math-verify: half a second on a quiet core, seconds where Python's start is
        slow) then fall outside the first scored batch. No process where every reward runs in
        the caller. Returns the scorer."""
        if self.remote:
            self._start()
        return self

    def _start(self) -> Connection:
        if self._proc is None or not self._proc.is_alive():
            self._kill()  # a worker that died between batches
            # spawn: the caller may hold threads (Ray, torch) that fork would copy mid-state.
            ctx = mp.get_context("spawn")
            parent, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(child, self.remote), daemon=True, name="m2flow-reward")
            self._proc.start()
            child.close()
            self._conn = parent
            if not parent.poll(_STARTUP_TIMEOUT_S):
                self._kill()
                raise RewardError(f"reward worker for {self.remote} did not start within {_STARTUP_TIMEOUT_S} s")
            try:
                kind, _, payload = parent.recv()
            except EOFError:
                self._proc.join(timeout=5)
                kind, payload = "died", f"exit code {self._proc.exitcode}"
            if kind != "ready":
                self._kill()
                raise RewardError(f"reward worker could not load {self.remote}:\n{payload}")
        assert self._conn is not None
        return self._conn

    def _kill(self) -> None:
        if self._proc is not None and self._proc.pid is not None:  # a process whose start failed has none
            self._proc.kill()
            self._proc.join()
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def _score_remote(self, items: list[tuple[int, str, str]], out: np.ndarray, timed_out: np.ndarray) -> None:
        """Fills ``out[i]`` ([N, len(remote)]) for every item, restarting the worker after a hang."""
        while items:
            conn = self._start()
            conn.send(items)
            for k, (i, completion, _) in enumerate(items):
                if not conn.poll(self.timeout_s):
                    # The worker is stuck on item i: it gets the timeout score, a fresh
                    # worker takes the rest.
                    out[i], timed_out[i] = self.timeout_score, True
                    self._kill()
                    items = items[k + 1:]
                    break
                try:
                    kind, j, payload = conn.recv()
                except EOFError:  # the worker died (os._exit, a crash in native code, the OOM killer)
                    assert self._proc is not None
                    self._proc.join(timeout=5)
                    code = self._proc.exitcode
                    self._kill()
                    raise RewardError(f"reward worker for {self.remote} died (exit code {code}) on item {i} "
                                      f"(completion {completion[:200]!r})") from None
                if kind == "error":
                    raise RewardError(f"reward {self.remote} raised on item {j} "
                                      f"(completion {completion[:200]!r}):\n{payload}")
                out[j] = payload
            else:
                items = []

    def score(self, completions: Sequence[str], answers: Sequence[str]) -> Scores:
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        n = len(completions)
        answers = [str(a) for a in answers]
        parts = {s: np.array([self.fns[s](c, a) for c, a in zip(completions, answers)], np.float32)
                 for s in self.local}
        timed_out = np.zeros(n, bool)
        if self.remote:
            remote = np.zeros((n, len(self.remote)), np.float32)
            self._score_remote([(i, str(c), a) for i, (c, a) in enumerate(zip(completions, answers))],
                               remote, timed_out)
            parts.update({s: remote[:, k] for k, s in enumerate(self.remote)})
        parts = {s: parts[s] for s in self.weights}
        for spec, values in parts.items():  # a nan would make its whole group's update a skipped step
            if not np.isfinite(values).all():
                i = int(np.flatnonzero(~np.isfinite(values))[0])
                raise RewardError(f"reward {spec} gave {values[i]} on item {i} "
                                  f"(completion {str(completions[i])[:200]!r}): a reward must be a finite number")
        total = sum((w * parts[s] for s, w in self.weights.items()), np.zeros(n, np.float32))
        return Scores(total.astype(np.float32), parts, timed_out)

    def close(self) -> None:
        if self._conn is not None and self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(timeout=5)
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)  # absent if __init__ failed
        if proc is not None and proc.is_alive():
            proc.kill()
