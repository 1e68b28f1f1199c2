"""Reward worker: scores completions as their groups stream in from the rollout.

The reward functions run in ``RewardScorer``'s own process (math-verify needs a main thread);
DAPO's soft overlong penalty is added here, and with dynamic sampling the groups whose
rewards are all equal (no learning signal) are dropped before anything downstream pays for
them.
"""

from __future__ import annotations

import numpy as np
import torch

from m2flow.algorithms import dynamic_sampling_keep, overlong_penalty
from m2flow.engines.batch import SequenceBatch
from m2flow.rewards import RewardScorer, Scores
from m2flow.runtime import Channel, Clock, Worker
from m2flow.workers.lm_common import END
from m2flow.workers.reports import RewardReport


class RewardWorker(Worker):
    def __init__(self, cfg: dict):
        r = cfg["reward"]
        # Its process starts with the worker: a step (or a profile's probe, timed from its
        # first step) would otherwise pay the spawn and imports as the reward's work.
        self.scorer = RewardScorer(dict(r["functions"]), timeout_s=r["timeout_s"]).start()
        self.max_new_tokens = cfg["rollout"]["max_new_tokens"]
        self.overlong = (r["overlong_buffer"], r["overlong_factor"])
        self.dynamic_sampling = cfg["algorithm"]["dynamic_sampling"]

    def score(self, samples_in: Channel, scored_out: Channel, num_groups: int, key: int = 0) -> RewardReport:
        """Scores the step's ``num_groups`` groups (channel key ``key``), then sends the end marker."""
        clock = Clock()
        seen = kept = timed_out = 0
        dropped = []  # the ids of the completions of the groups dynamic sampling drops
        rewards_all, parts_all = [], {}
        while seen < num_groups:
            with clock.idle():
                batch = samples_in.get(key)
            with clock.busy():
                seen += batch.extras["groups"]
                scores = self.scorer.score(batch.extras["text"], batch.extras["answer"])
                shaping = self.shaping(key, batch, scores)
                timed_out += int(scores.timed_out.sum())
                rewards = torch.from_numpy(scores.total)
                if shaping is not None:
                    rewards = rewards + shaping
                rewards_all.append(scores.total)
                for name, part in scores.parts.items():
                    parts_all.setdefault(name, []).append(part)
                buffer, factor = self.overlong
                if buffer:
                    lengths = batch.completion_mask.sum(1)
                    rewards = rewards + overlong_penalty(lengths, self.max_new_tokens, buffer, factor)
                batch.extras["reward"] = rewards
                if self.dynamic_sampling:
                    n = batch.extras["group_size"]
                    keep = dynamic_sampling_keep(rewards, n)
                    groups = int(keep.sum())
                    rows = torch.arange(len(batch)).view(-1, n)
                    dropped += batch.sample_ids(rows[~keep].reshape(-1))
                    batch = batch.select(rows[keep].reshape(-1)) if groups else None
                else:
                    groups = batch.extras["groups"]
                if batch is not None:
                    batch.extras["groups"] = groups
                    scored_out.put(batch, key, weight=groups)
                    kept += groups
        scored_out.put(END, key)
        scored_out.flush()
        rewards = np.concatenate(rewards_all)
        return RewardReport(**clock.report(), reward=float(rewards.mean()), reward_std=float(rewards.std()),
                            groups_kept=kept, groups=seen, reward_timeouts=timed_out, dropped=dropped,
                            parts={f"reward_{_short(k)}": float(np.concatenate(v).mean())
                                   for k, v in parts_all.items()})

    def shaping(self, key: int, batch: SequenceBatch, scores: Scores) -> torch.Tensor | None:
        """A batch of stream ``key`` scored: what a flow's own reward worker adds to each row's
        reward (its penalties; the overlong penalty comes on top), and counts for its report.
        None here: nothing."""
        return None

    def score_texts(self, texts: list[str], answers: list[str]) -> dict:
        """Mean scores of finished texts (evaluation)."""
        scores = self.scorer.score(texts, answers)
        return {"reward": float(scores.total.mean()), **{_short(k): float(v.mean()) for k, v in scores.parts.items()}}

    def close(self) -> None:
        self.scorer.close()


def _short(spec: str) -> str:
    """A reward's name in metrics: ``math``, or a function's name for ``package.module:function``."""
    return spec.rpartition(":")[2]
