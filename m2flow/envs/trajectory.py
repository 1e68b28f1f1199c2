"""The embodied flow's batch: ``Trajectory``, the steps one rollout's envs took, as the env
workers send it to the actor; and ``Recorder``, which collects it step by step.

A trajectory is time-major: every array but ``last_obs`` is ``[T, n, ...]``, T rows (steps,
or action chunks) of n envs. The reasoning flow's batch (``engines.batch.SequenceBatch``) is
data of another shape, token rows ``[B, L]`` of a prompt and its completion under masks, so
the two stay apart. The arrays are numpy ones, as the envs make them; ``map`` gives the same
trajectory of torch tensors (the actor's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ROWS = ("obs", "actions", "logp", "versions", "rewards", "terminated", "truncated", "final_obs", "executed")


@dataclass
class Trajectory:
    """The rows of one rollout of ``n`` envs (one env rank's, or a share of its envs)."""

    obs: np.ndarray  # [T, n, *obs_shape]: the observation each row's actions were chosen on
    actions: np.ndarray  # [T, n, *action_shape] (chunks: [T, n, k, *action_shape])
    logp: np.ndarray  # [T, n]: their log-probability under the weights that chose them
    versions: np.ndarray  # int64 [T, n]: the version of those weights (-1: a padding row, no weights acted)
    rewards: np.ndarray  # [T, n], or [T, n, k] for chunks of k actions (0 for an action not run)
    terminated: np.ndarray  # bool [T, n]: the row ended its env's episode by termination...
    truncated: np.ndarray  # bool [T, n]: ...or by truncation
    final_obs: np.ndarray  # [T, n, *obs_shape]: the last observation of an episode that ended in the row, else obs
    last_obs: np.ndarray  # [n, *obs_shape]: the observation after the last row
    ids: np.ndarray  # int64 [n]: each env's index among all envs: its sample of the stream (a step's ``SampleId``)
    executed: np.ndarray | None = None  # [T, n]: chunks: how many of the chunk's k actions ran before an episode end
    env_rank: int = -1  # the env rank that collected it (-1: several)

    @property
    def size(self) -> int:
        """Rows x envs: the env-step rows it holds (chunks count one each)."""
        return self.logp.shape[0] * self.logp.shape[1]

    def map(self, fn: Callable[[Any], Any]) -> Trajectory:
        """``fn`` of every array (``torch.as_tensor``: the same trajectory as tensors)."""
        return self._map(fn, fn)

    def envs(self, start: int, stop: int) -> Trajectory:
        """Envs ``start`` to ``stop`` (views)."""
        return self._map(lambda v: v[:, start:stop], lambda v: v[start:stop])

    def padded(self, rows: int) -> Trajectory:
        """Padded with zero rows to ``rows``: no episode ends in them, so they fall outside every
        episode (their version is -1: no weights acted in them)."""
        pad = rows - len(self.logp)
        if pad == 0:
            return self
        return self._map(lambda v: np.concatenate([v, np.full((pad, *v.shape[1:]), -1 if v is self.versions else 0,
                                                              v.dtype)]), lambda v: v)

    @classmethod
    def concat(cls, parts: Sequence[Trajectory]) -> Trajectory:
        """The envs of ``parts`` side by side, in order."""
        first = parts[0]
        rows = {k: None if getattr(first, k) is None else np.concatenate([getattr(p, k) for p in parts], axis=1)
                for k in ROWS}
        return cls(**rows, last_obs=np.concatenate([p.last_obs for p in parts]),
                   ids=np.concatenate([p.ids for p in parts]), env_rank=first.env_rank if all(p.env_rank == first.env_rank for p in parts) else -1)

    def _map(self, rows: Callable[[Any], Any], per_env: Callable[[Any], Any]) -> Trajectory:
        """``rows`` of every ``[T, n, ...]`` array, ``per_env`` of the ``[n, ...]`` ones."""
        return dataclasses.replace(self, last_obs=per_env(self.last_obs), ids=per_env(self.ids), **{
            k: None if getattr(self, k) is None else rows(getattr(self, k)) for k in ROWS})


class Recorder:
    """Collects one env batch's steps (``EnvBatch.step``'s or ``step_chunk``'s results, and
    the rollout's replies) as the rows of a ``Trajectory``."""

    def __init__(self) -> None:
        self.columns: dict[str, list[np.ndarray]] = {k: [] for k in ROWS if k != "executed"}

    def add(self, obs: np.ndarray, reply: dict[str, Any], result: Any) -> None:
        c = self.columns
        c["obs"].append(obs)
        c["actions"].append(reply["actions"])
        c["logp"].append(reply["logp"])
        c["versions"].append(np.full(len(obs), reply["version"], np.int64))  # of the weights that acted
        c["rewards"].append(result.rewards)  # [n], or [n, k] for action chunks
        if hasattr(result, "valid"):  # chunks: how many of the k actions ran before an episode end
            c.setdefault("executed", []).append(result.valid.sum(-1))
        c["terminated"].append(result.terminated)
        c["truncated"].append(result.truncated)
        c["final_obs"].append(result.final_obs)

    @staticmethod
    def merge(records: Sequence[Recorder], last_obs: Sequence[np.ndarray], env_rank: int, first: int) -> Trajectory:
        """The batches' rows side by side along the env axis: ``[T, n_rank, ...]``, their envs
        numbered from ``first``."""
        rows = {k: np.concatenate([np.stack(r.columns[k]) for r in records], axis=1) for k in records[0].columns}
        last = np.concatenate(last_obs)
        return Trajectory(**rows, last_obs=last, ids=np.arange(first, first + len(last)), env_rank=env_rank)
