"""The replay flow's workers: env workers that send each env step's transitions to the learner
as they make them, and the learner (the trainer component, ``actor``), which puts them into its
replay buffer and takes SAC's (CrossQ's, RLPD's) gradient steps on batches sampled from it.

The two exchange point to point, every env step, without the driver:

    env worker: wait for weights new enough (``Schedule.required``), act, step the envs,
                send the step's ``Row`` to the learner
    learner:    receive the row (from every env rank), add it to the buffer, take
                ``utd_ratio`` gradient steps per env step (once more than ``learning_starts``
                env steps are in), push the policy's weights every ``weights_every`` steps

The env workers act uniformly at random for the first ``learning_starts`` env steps (the
warm-up, as SB3's ``learning_starts``), then with the newest weights they hold, taken between
env steps. How old those may be is ``runner.max_staleness``, in learner updates: at 0 the two
alternate, exactly as SB3's SAC does in one process (the env acts with the weights of every
gradient step taken so far); at 1 an env step runs while the learner takes the step before it.
Both sides compute the same ``Schedule``, so neither waits for a message the other will not send.

The learner is one rank: its data does not split (every gradient step samples the whole buffer).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from m2flow.engines.sac import CrossQLearner, SACLearner
from m2flow.replay import ReplayBuffer, sample_mixed
from m2flow.runtime import Clock, Worker, dispatch
from m2flow.workers.env import EnvWorker
from m2flow.workers.layout import EnvLayout
from m2flow.workers.reports import EnvReport, RolloutReport, TrainReport

# each algorithm's defaults for the keys a config leaves null (RLPD: Ball et al. 2023; CrossQ: sb3-contrib's)
DEFAULTS = {
    "sac": {"lr": 3e-4, "critics": 2, "target_subset": None, "critic_hidden": [256, 256], "layer_norm": False},
    "rlpd": {"lr": 3e-4, "critics": 10, "target_subset": 2, "critic_hidden": [256, 256], "layer_norm": True},
    "crossq": {"lr": 1e-3, "critics": 2, "target_subset": None, "critic_hidden": [1024, 1024], "layer_norm": False},
}


def resolved_algorithm(algorithm: dict) -> dict:
    """The ``algorithm`` section with each null key the algorithm's default (``DEFAULTS``)."""
    return algorithm | {k: v for k, v in DEFAULTS[algorithm["name"]].items() if algorithm.get(k) is None}


def make_learner(cfg: dict, obs_dim: int, low: np.ndarray, high: np.ndarray, device: str = "cpu") -> SACLearner:
    """The config's learner: its networks seeded with ``cfg['seed']``, the actor as the policy
    config makes it (``models.policies.build_policy``, ``kind: squashed_gaussian``)."""
    a = resolved_algorithm(cfg["algorithm"])
    common = dict(critics=a["critics"], target_subset=a["target_subset"], layer_norm=a["layer_norm"], lr=a["lr"],
                  target_entropy=a["target_entropy"], init_alpha=a["init_alpha"], seed=cfg["seed"],
                  actor_hidden=cfg["policy"]["hidden"], device=device)
    if a["name"] == "crossq":
        return CrossQLearner(obs_dim, low, high, a["critic_hidden"], policy_delay=a["policy_delay"], **common)
    return SACLearner(obs_dim, low, high, a["critic_hidden"], tau=a["tau"],
                      actor_reduce="mean" if a["name"] == "rlpd" else "min", **common)


@dataclass(frozen=True)
class Schedule:
    """When the learner steps and which weights the envs must hold, as both sides compute it.
    A *row* is one env step of every env (``num_envs`` transitions)."""

    num_envs: int
    learning_starts: int
    utd_ratio: int
    weights_every: int
    max_lag: int  # learner updates the acting weights may lag (runner.max_staleness)

    @classmethod
    def of(cls, cfg: dict) -> Schedule:
        a = cfg["algorithm"]
        return cls(cfg["env"]["num_envs"], a["learning_starts"], a["utd_ratio"], cfg["runner"]["weights_every"],
                   cfg["runner"]["max_staleness"])

    def random(self, rows: int) -> bool:
        """Whether row ``rows`` (0-based) acts at random: fewer than learning_starts env steps taken."""
        return rows * self.num_envs < self.learning_starts

    def updates_after(self, rows: int) -> int:
        """Gradient steps the learner has taken once ``rows`` rows are in: ``utd_ratio`` per env
        step of each row that takes the env steps past ``learning_starts`` (and is not the first)."""
        # rows after which env steps <= learning_starts; one at least: the buffer holds a
        # transition once the observation after it is in, with the next row
        quiet = max(1, self.learning_starts // self.num_envs)
        return self.utd_ratio * self.num_envs * max(0, rows - quiet)

    def acted_with(self, version: int) -> bool:
        """Whether some row's ``required`` is ``version``: the pushes no row will act with (those
        between two rows' updates) need not be sent. Row ``r`` requires
        ``floor(max(0, c m - max_lag) / weights_every) * weights_every`` with ``c`` gradient steps
        a row and ``m = max(0, r - quiet)``: a version past 0 is required when some multiple of
        ``c`` lies in ``[version + max_lag, version + max_lag + weights_every)``."""
        if version == 0:
            return True
        if version % self.weights_every:
            return False
        c, low = self.utd_ratio * self.num_envs, version + self.max_lag
        return -(-low // c) * c < low + self.weights_every

    def required(self, rows: int) -> int:
        """The oldest weights (in learner updates) row ``rows`` may act with: the newest pushed
        (every ``weights_every`` updates) at most ``max_lag`` updates behind the learner's, once
        it has taken the rows before."""
        behind = max(0, self.updates_after(rows) - self.max_lag)
        return behind // self.weights_every * self.weights_every


@dataclass
class Row:
    """One env step of an env rank's envs, as the learner's buffer takes it."""

    obs: np.ndarray  # [n, *obs_shape]: what the actions were chosen on
    actions: np.ndarray  # [n, *action_shape]
    rewards: np.ndarray  # [n]
    terminated: np.ndarray  # [n] bool
    truncated: np.ndarray  # [n] bool
    next_obs: np.ndarray  # [n, *obs_shape]: the observation after, the final one where an episode ended
    version: int  # the learner updates behind the weights that acted (their version)


class ReplayEnvWorker(EnvWorker):
    """The env workers, the rollout's policy in their own processes (the replay flow fuses the
    two): each env step's ``Row`` goes to the learner as it is made (module docstring)."""

    def __init__(self, cfg: dict, layout: EnvLayout, spaces: tuple | None = None, take_turns: bool = False):
        if spaces is None:
            raise RuntimeError("the replay flow runs the rollout in the env workers (placement.fuse=true)")
        # No device turns: the env and the learner alternate step by step, or overlap by design.
        super().__init__(cfg, layout, spaces, take_turns=False)
        self.schedule = Schedule.of(cfg)
        low, high = spaces[1].low, spaces[1].high
        self.bounds = (torch.tensor(low, dtype=torch.float32), torch.tensor(high, dtype=torch.float32))
        self.rows = 0  # env steps each env has taken (every rank alike)

    def _receive(self, learner: str) -> int:
        """One push of the learner's: its flat array into the replica's weights and statistics."""
        message = self.broadcast(None, (learner, 0), self.group)
        flat, offset = torch.from_numpy(message["flat"]), 0
        with torch.no_grad():
            for v in self.replica.policy.state_dict().values():
                v.copy_(flat[offset:offset + v.numel()].view_as(v))
                offset += v.numel()
        self.replica.version = message["version"]
        return self.replica.version

    def collect(self, learner: str, steps: int, stream: int) -> EnvReport:
        """``steps`` env steps of this rank's envs, each row sent to rank 0 of group ``learner``
        (tagged with the stream and the step), its weight pushes taken between steps."""
        clock, inference = Clock(), Clock()
        episodes: list[tuple[float, int, bool | None]] = []
        batch = self.batches[0]  # one stage (the flow's check)
        for t in range(steps):
            with inference.idle():  # waiting for weights new enough, or loading pushes
                self.refresh(learner, self.schedule.required(self.rows))
            with inference.busy():
                obs = self.obs[0]
                if self.schedule.random(self.rows):  # the warm-up: uniform in the action bounds
                    low, high = self.bounds
                    actions = (low + (high - low) * torch.rand(len(obs), *low.shape)).numpy()
                else:
                    actions, _ = self.replica.infer(obs)
            with clock.busy():
                result = batch.step(actions)
                self.isend(Row(obs, actions, result.rewards, result.terminated, result.truncated, result.final_obs,
                               self.replica.version), learner, 0, tag=("row", stream, t))
                episodes += [(ret, length, success) for (_, ret), (_, length), success
                             in zip(result.episode_returns, result.episode_lengths, result.episode_successes)]
                self.obs[0] = result.obs
            self.rows += 1
        self.inference = RolloutReport(**inference.report(), weight_loads=self.take_loads())
        faults = batch.faults
        self.faults_reported, faults = faults, faults - self.faults_reported
        first = self.rank * self.layout.envs_per_rank
        return EnvReport(**clock.report(), episodes=episodes, env_steps=steps * batch.num_envs, env_faults=faults,
                         collected=list(range(first, first + self.layout.envs_per_rank)))

    def state(self) -> dict[str, Any]:
        return super().state() | {"rows": self.rows}

    @dispatch(split="per_rank")
    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.rows = state["rows"]

    @classmethod
    def reshard(cls, states: list[dict[str, Any]], ranks: int, *args: Any) -> list[dict[str, Any]]:
        rows = states[0]["rows"]
        return [s | {"rows": rows} for s in super().reshard(states, ranks, *args)]


class LearnerWorker(Worker):
    def __init__(self, cfg: dict, layout: EnvLayout, observation_space, action_space, take_turns: bool = False):
        if self.world_size > 1:
            raise RuntimeError(f"the replay flow's learner runs on one rank, not {self.world_size}")
        self.cfg, self.layout = cfg, layout
        self.algo = a = resolved_algorithm(cfg["algorithm"])
        self.schedule = Schedule.of(cfg)
        self.learner = make_learner(cfg, observation_space.shape[0], action_space.low, action_space.high, self.device)
        self.buffer = ReplayBuffer(a["buffer_size"], cfg["env"]["num_envs"], observation_space.shape,
                                   action_space.shape, n_step=a["n_step"], gamma=a["gamma"])
        self.demonstrations = None
        if a["demonstrations"]:
            self.demonstrations = ReplayBuffer.from_file(a["demonstrations"], n_step=a["n_step"], gamma=a["gamma"])
            got = (self.demonstrations.obs.shape[2:], self.demonstrations.actions.shape[2:])
            if got != (self.buffer.obs.shape[2:], self.buffer.actions.shape[2:]):
                raise ValueError(f"algorithm.demonstrations: observations x actions {got} do not fit the env's "
                                 f"{(self.buffer.obs.shape[2:], self.buffer.actions.shape[2:])}")
        self.rng = np.random.default_rng(cfg["seed"] + 2_000)  # which transitions each batch samples
        self.rows = 0  # rows put into the buffer
        self.version = 0  # rounds trained (the runner's count of updates)
        self.pushed: tuple[int, dict] | None = None  # the last push: its version and weights
        self.envs_pushed_to = False  # whether this process has pushed to the env workers (a restart has not)

    # -- weights ----------------------------------------------------------------------
    def _push(self, envs: str) -> None:
        """The policy's weights and statistics as one flat array (one small message: a dict of
        tensors costs several times as much to send), tagged with their version."""
        if self.pushed is None or self.pushed[0] != self.learner.updates:
            flat = torch.cat([v.detach().reshape(-1).float() for v in self.learner.actor.state_dict().values()])
            self.pushed = (self.learner.updates, flat.cpu().numpy())
        version, flat = self.pushed
        self.broadcast({"flat": flat, "version": version}, (self.group, self.rank), envs)
        self.envs_pushed_to = True

    def policy_weights(self) -> dict[str, Any]:
        """The policy's weights alone (an evaluation's)."""
        return {k: v.cpu() for k, v in self.learner.actor.state_dict().items()}

    def weights_hash(self) -> str:
        """sha256 of every network's weights and statistics, the entropy coefficient and the
        replay buffer's content: equal on two learners exactly when they hold the same."""
        from m2flow.engines.weights import weights_hash

        learner = self.learner
        named = [(f"actor.{k}", v) for k, v in learner.actor.state_dict().items()]
        named += [(f"critic.{k}", v) for k, v in learner.critic.state_dict().items()]
        if learner.target is not None:
            named += [(f"target.{k}", v) for k, v in learner.target.state_dict().items()]
        named += [("log_alpha", learner.log_alpha)]
        named += [(f"buffer.{k}", torch.from_numpy(np.ascontiguousarray(v))) for k, v in self.buffer.state().items()]
        return weights_hash(named)

    def state(self) -> dict[str, Any]:
        return {"learner": self.learner.state(), "buffer": self.buffer.state(), "rng": self.rng.bit_generator.state,
                "torch_rng": torch.get_rng_state(), "rows": self.rows, "version": self.version,
                "pushed": None if self.pushed is None else {"version": self.pushed[0], "flat": self.pushed[1]}}

    @dispatch(split="per_rank")
    def load_state(self, state: dict[str, Any]) -> None:
        self.learner.load_state(state["learner"])
        self.buffer.load_state(state["buffer"])
        self.rng.bit_generator.state = state["rng"]
        torch.set_rng_state(state["torch_rng"])
        self.rows, self.version = state["rows"], state["version"]
        pushed = state["pushed"]
        self.pushed = None if pushed is None else (pushed["version"], pushed["flat"])
        self.envs_pushed_to = False

    # -- training ---------------------------------------------------------------------
    def train(self, envs: str, stream: int, steps: int) -> TrainReport:
        """One round: ``steps`` rows from every env rank of group ``envs``, each into the buffer,
        then its gradient steps (module docstring)."""
        clock = Clock(busy_unless_idle=True)
        a, schedule = self.algo, self.schedule
        if not self.envs_pushed_to:  # the env workers' first weights (of a run, or after a restart)
            self._push(envs)
        sources = [(self.buffer, 1.0 - a["demo_share"]), (self.demonstrations, a["demo_share"])] \
            if self.demonstrations is not None else None
        lags: Counter[int] = Counter()
        totals: dict[str, torch.Tensor] = {}  # each statistic summed over the steps that report it
        counts: Counter[str] = Counter()
        pushing = 0.0  # seconds sending weights
        for t in range(steps):
            with clock.idle():
                rows = [self.recv(envs, e, tag=("row", stream, t)) for e in range(self.layout.env_ranks)]
            for r in rows:
                lags[self.learner.updates - r.version] += len(r.obs)
            self.buffer.add(*(np.concatenate([getattr(r, k) for r in rows]) for k in
                              ("obs", "actions", "rewards", "terminated", "truncated", "next_obs")))
            self.rows += 1
            for _ in range(schedule.updates_after(self.rows) - self.learner.updates):
                batch = sample_mixed(sources, a["batch_size"], self.rng) if sources else \
                    self.buffer.sample(a["batch_size"], self.rng)
                for k, v in self.learner.update_from(batch).items():
                    totals[k] = totals[k] + v if k in totals else v
                    counts[k] += 1
                if schedule.acted_with(self.learner.updates):
                    t0 = time.perf_counter()
                    self._push(envs)
                    pushing += time.perf_counter() - t0
        if max(lags) > schedule.max_lag + schedule.weights_every - 1:
            raise RuntimeError(f"the learner got env steps of weights {sorted(lags)} updates behind its own, "
                               f"runner.max_staleness is {schedule.max_lag} (weights every {schedule.weights_every})")
        stats = {k: float(v) / counts[k] for k, v in totals.items()}
        stats["weight_push_s"] = pushing
        stats |= {"updates": self.learner.updates,
                  "buffer_transitions": int(np.minimum(self.buffer.head, self.buffer.size).sum())}
        self.version += 1
        return TrainReport(**clock.report(), stats=stats, policy_lag=max(lags), lags=dict(lags),
                           version=self.version, update_end=time.time(),
                           trained=list(range(self.cfg["env"]["num_envs"])))
