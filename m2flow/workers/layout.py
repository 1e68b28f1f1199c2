"""Who talks to whom in the embodied flow: env ranks, their stages, rollout and actor ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from m2flow.envs.trajectory import Trajectory


@dataclass(frozen=True)
class EnvLayout:
    env_ranks: int
    rollout_ranks: int
    actor_ranks: int
    envs_per_rank: int
    stages: int = 1
    chunk: int = 1

    def __post_init__(self):
        if self.envs_per_rank % self.stages:
            raise ValueError(f"{self.envs_per_rank} envs per env rank cannot be split into {self.stages} stages")
        if self.envs_per_rank % self.actor_ranks:
            raise ValueError(f"{self.envs_per_rank} envs per env rank cannot be shared by {self.actor_ranks} actor ranks")

    @classmethod
    def build(cls, num_envs: int, env_ranks: int, rollout_ranks: int, actor_ranks: int, stages: int, chunk: int) -> EnvLayout:
        if num_envs % env_ranks:
            raise ValueError(f"env.num_envs={num_envs} is not divisible by the {env_ranks} env rank(s)")
        return cls(env_ranks, rollout_ranks, actor_ranks, num_envs // env_ranks, stages, chunk)

    @property
    def envs_per_stage(self) -> int:
        return self.envs_per_rank // self.stages

    def rollout_of(self, env_rank: int) -> int:
        return env_rank % self.rollout_ranks

    def envs_of_rollout(self, rollout_rank: int) -> list[int]:
        """Env ranks whose observations this rollout rank answers, batched together."""
        return [e for e in range(self.env_ranks) if self.rollout_of(e) == rollout_rank]

    def actor_shares(self, trajectory: Trajectory) -> list[tuple[Trajectory, int]]:
        """An env rank's trajectory cut into one share per actor rank, each weighted by its rows:
        actor rank a gets the a-th equal share of the env rank's envs (data parallel)."""
        n = self.envs_per_rank // self.actor_ranks
        return [(part, part.size) for part in (trajectory.envs(a * n, (a + 1) * n) for a in range(self.actor_ranks))]
