"""Rollout: batched policy inference for env workers.

``RolloutWorker`` is the rollout as a component of its own, answering the env workers
it serves point to point. Where env and rollout are placed on the same devices, the
runner can fuse them instead: each env worker then hosts a ``PolicyReplica`` and infers
in its own process, with no message per step (see ``EnvWorker``).
"""

from __future__ import annotations

import numpy as np
import torch

from m2flow.models import build_policy
from m2flow.runtime import Clock, dispatch
from m2flow.workers.layout import EnvLayout
from m2flow.workers.reports import RolloutReport
from m2flow.workers.weights import WeightFollower


class PolicyReplica:
    """A rollout's copy of the policy: versioned weights, seeded sampling."""

    def __init__(self, cfg: dict, observation_space, action_space, rank: int):
        torch.manual_seed(cfg["seed"] + 7919 * (rank + 1))  # action sampling, reproducible per rank
        self.policy = build_policy(observation_space, action_space, cfg["policy"])
        self.policy.requires_grad_(False).eval()  # acting: batch statistics (CrossQ's) stay the trained ones
        self.version = -1  # no weights yet: acting before the first sync is an error

    def load(self, message: dict) -> int:
        self.policy.load_state_dict(message["weights"])
        self.version = message["version"]
        return self.version

    def infer(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.version < 0:
            raise RuntimeError("the rollout has no policy weights: the actor must sync them first")
        with torch.inference_mode():  # ~10% less per call than no_grad: no view or version tracking
            actions, logp = self.policy.act(torch.as_tensor(obs))
        return actions.numpy(), logp.numpy()


class PolicyHost(WeightFollower):
    """A worker that holds a PolicyReplica and receives the actor's weight broadcasts."""

    replica: PolicyReplica
    loads: list[tuple[int, float]]  # (version, wall time) of the pushes a rollout took while it ran

    @property
    def version(self) -> int:
        return self.replica.version

    def _receive(self, actor_group: str) -> int:
        return self.replica.load(self.broadcast(None, (actor_group, 0), self.group))

    def refresh(self, actor_group: str | None, min_version: int = 0) -> None:
        """In-flight weight updates (``runner.in_flight_updates``), before each env step of a
        rollout: waits for the weights of ``min_version`` if the replica is older (a rollout
        starts on those of the sync launched with it), then loads every push that has
        arrived, recording each; nothing without ``actor_group``."""
        if actor_group is None:
            return
        if self.replica.version < min_version:
            self.pull_weights(actor_group, min_version)
        self.loads += self.take_newer(actor_group)

    def take_loads(self) -> list[tuple[int, float]]:
        loads, self.loads = self.loads, []
        return loads


class RolloutWorker(PolicyHost):
    def __init__(self, cfg: dict, layout: EnvLayout, observation_space, action_space, take_turns: bool = False):
        self.layout = layout
        # Sharing devices with the actor: generate and train take turns on them.
        self.turns = self.device_turns(take_turns)
        self.replica = PolicyReplica(cfg, observation_space, action_space, self.rank)
        self.envs = layout.envs_of_rollout(self.rank)
        self.loads = []

    def state(self) -> dict:
        return {"rng": torch.get_rng_state()}

    @dispatch(split="per_rank")
    def load_state(self, state: dict) -> None:
        torch.set_rng_state(state["rng"])

    def act(self, envs: str, steps: int, weights_from: str | None = None, min_version: int = 0) -> RolloutReport:
        """Answers ``steps`` observations per stage of each env rank of group ``envs`` that
        it serves, batching those env ranks into one inference. With ``weights_from`` (the
        actor's group), the actor's pushes are taken as they arrive, between env steps."""
        clock = Clock()
        with clock.turn(self.turns):
            self._serve(envs, steps, clock, weights_from, min_version)
        return RolloutReport(**clock.report(lock_wait=True), weight_loads=self.take_loads())

    def _serve(self, envs: str, steps: int, clock: Clock, weights_from: str | None, min_version: int) -> None:
        for _ in range(steps):
            if weights_from is not None:
                with clock.idle():  # waiting for the weights of min_version, or loading pushes
                    self.refresh(weights_from, min_version)
            for s in range(self.layout.stages):
                with clock.idle():
                    obs = [self.recv(envs, e, tag=("obs", s)) for e in self.envs]
                with clock.busy():
                    actions, logp = self.replica.infer(np.concatenate(obs))
                    offset = 0
                    for e, o in zip(self.envs, obs):
                        n = len(o)
                        self.isend({"actions": actions[offset:offset + n], "logp": logp[offset:offset + n],
                                    "version": self.replica.version}, envs, e, tag=("act", s))
                        offset += n
