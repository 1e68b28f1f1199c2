"""Env worker: steps a batch of simulators, asks the rollout workers for actions.

Each rank's environments are split into ``stages`` batches. Elastic pipelining: while
the rollout worker infers actions for one stage, the env worker steps another, so with
``stages=2`` simulation and inference overlap; ``stages=1`` alternates them. A fused
worker (rollout hosted in this process) runs its stages one after another: there is
nothing to overlap with.

GRPO (``algorithm.name: grpo``) aligns episodes to rollout windows: every env plays one
episode per window, from its group's shared seed; an env whose episode ended stays done
(its remaining rows carry no steps), an episode still running at the window's end is cut
there (reported with its partial return), and every env resets for the next window.
"""

from __future__ import annotations

from typing import Any

import torch

from m2flow.envs import EnvBatch
from m2flow.envs.trajectory import Recorder, Trajectory
from m2flow.runtime import Channel, Clock, dispatch
from m2flow.runtime.dispatching import routes
from m2flow.workers.layout import EnvLayout
from m2flow.workers.reports import EnvReport, RolloutReport
from m2flow.workers.rollout import PolicyHost, PolicyReplica


class EnvWorker(PolicyHost):
    """With ``spaces`` (observation and action space) the worker hosts the rollout itself
    (fused: inference in this process, no message per step) and then answers both the env
    role's calls and the rollout role's (``pull_weights``, ``act``)."""

    def __init__(self, cfg: dict, layout: EnvLayout, spaces: tuple | None = None, take_turns: bool = False):
        env, self.layout = cfg["env"], layout
        self.replica = PolicyReplica(cfg, *spaces, self.rank) if spaces else None
        self.turns = self.device_turns(take_turns)
        self.inference = RolloutReport()  # the fused rollout's last report
        self.stages = layout.stages
        n = layout.envs_per_stage
        group = env["group_size"]
        self.grpo = cfg["algorithm"]["name"] == "grpo"
        self.batches = []
        for s in range(self.stages):
            first = (self.rank * self.stages + s) * n  # global index of this batch's first env
            self.batches.append(EnvBatch(
                env["id"], n, cfg["seed"] + first // group, group_size=group,
                obs_norm=env["obs_norm"], reward_scale=env["reward_scale"],
                gamma=cfg["algorithm"]["gamma"], env_kwargs=dict(env["kwargs"]),
                auto_reset=not self.grpo,
            ))
        self.obs = [b.reset() for b in self.batches]
        self.faults_reported = 0  # the batches' env faults already reported
        self.loads = []  # fused: the pushes the replica took during a rollout

    # Each actor rank gets its share of the trajectory under the key (stream, actor rank): with
    # streams in flight at once, one env rank may put the next stream's part before another has
    # put this one's.
    @routes("trajectories_out", key="stream", split=lambda env, trajectory: env.layout.actor_shares(trajectory))
    def interact(self, policy: str, trajectories_out: Channel, steps: int, weights_from: str | None = None,
                 min_version: int = 0, stream: int = 0) -> tuple[EnvReport, Trajectory]:
        """One rollout of ``steps`` steps per env: observations go to this rank's rollout
        worker of group ``policy`` (point to point), or to the hosted replica when fused;
        the trajectory goes to the actor ranks (``routes``), the call returns the report. Every
        step records the version of the weights that chose its actions: fused, with
        ``weights_from`` (the actor's group), the replica takes the actor's pushes as they
        arrive, between env steps (from version ``min_version`` on), so a rollout's steps may
        come from several versions."""
        clock, inference = Clock(), Clock()  # inference: the fused rollout's
        executed = 0  # env steps: a chunk cut short by an episode end counts its executed actions
        records = [Recorder() for _ in self.batches]
        episodes: list[tuple[float, int, bool | None]] = []  # (raw return, length, success) of each ended one
        server = self.layout.rollout_of(self.rank)
        with clock.turn(self.turns):  # a lock only when hosting the rollout on shared devices
            if not self.replica:
                for s in range(self.stages):
                    self.isend(self.obs[s], policy, server, tag=("obs", s))
            for t in range(steps):
                if self.replica and weights_from is not None:
                    with inference.idle():  # waiting for the weights of min_version, or loading pushes
                        self.refresh(weights_from, min_version)
                for s, batch in enumerate(self.batches):
                    if self.replica:
                        with inference.busy():
                            actions, logp = self.replica.infer(self.obs[s])
                            reply = {"actions": actions, "logp": logp, "version": self.replica.version}
                    else:
                        with clock.idle():
                            reply = self.recv(policy, server, tag=("act", s))
                    with clock.busy():
                        result = batch.step_chunk(reply["actions"]) if self.layout.chunk > 1 else batch.step(reply["actions"])
                        records[s].add(self.obs[s], reply, result)
                        executed += int(result.valid.sum()) if self.layout.chunk > 1 else result.stepped
                        episodes += [(ret, length, success) for (_, ret), (_, length), success
                                     in zip(result.episode_returns, result.episode_lengths, result.episode_successes)]
                        self.obs[s] = result.obs
                        if t < steps - 1 and not self.replica:
                            self.isend(result.obs, policy, server, tag=("obs", s))
                # GRPO, fused: once every episode of the window has ended there is nothing left
                # to infer or step (a separate rollout worker expects all ``steps`` rounds).
                if self.grpo and self.replica and all(b.all_done for b in self.batches):
                    break
            if self.grpo:
                with clock.busy():
                    episodes += self._next_window()
        inference.waited(clock.lock_wait_s)  # the fused rollout waited for the same turn
        self.inference = RolloutReport(**inference.report(lock_wait=True),
                                       weight_loads=self.take_loads() if self.replica else [])
        # GRPO: last_obs is then the next window's first observation, which it never reads.
        trajectory = Recorder.merge(records, self.obs, self.rank, self.rank * self.layout.envs_per_rank)
        if self.grpo:  # a window that stopped early: every env rank sends the same shape
            trajectory = trajectory.padded(steps)
        faults = sum(b.faults for b in self.batches)
        self.faults_reported, faults = faults, faults - self.faults_reported
        return EnvReport(**clock.report(), episodes=episodes, env_steps=executed, env_faults=faults,
                         collected=trajectory.ids.tolist()), trajectory

    def _next_window(self) -> list[tuple[float, int, bool | None]]:
        """GRPO: cuts the episodes still running (their partial returns are reported as
        episodes) and resets every env to its group's next seed."""
        cut = []
        for s, batch in enumerate(self.batches):
            cut += [(ret, length, success) for _, ret, length, success in batch.unfinished_episodes()]
            self.obs[s] = batch.reset()
        return cut

    def act(self, envs: str, steps: int, weights_from: str | None = None, min_version: int = 0) -> RolloutReport:
        """The fused rollout's report: its inference (and its weight loads) ran inside
        ``interact``, which Ray has finished by now (one actor runs its calls in order)."""
        if self.replica is None:
            raise RuntimeError(f"{self.group}:{self.rank} hosts no rollout: launch a RolloutWorker group")
        return self.inference

    def normalization(self) -> dict[str, Any]:
        """Its first env batch's normalisation statistics (``EnvBatch.state_dict``): what an
        evaluation normalises observations with (``state`` snapshots every simulator too)."""
        return self.batches[0].state_dict()

    def state(self) -> dict[str, Any]:
        """Everything needed to continue this rank's simulation exactly (checkpoints)."""
        return {"batches": [b.snapshot() for b in self.batches], "obs": [o.copy() for o in self.obs],
                "rng": torch.get_rng_state()}

    @dispatch(split="per_rank")
    def load_state(self, state: dict[str, Any]) -> None:
        for b, snap in zip(self.batches, state["batches"], strict=True):
            b.restore(snap)
        self.faults_reported = sum(b.faults for b in self.batches)  # those before the checkpoint were reported
        # A regrouped state has no observations: its batches' statistics are new
        self.obs = [o.copy() for o in state["obs"]] if "obs" in state else [b.observations() for b in self.batches]
        torch.set_rng_state(state["rng"])

    @classmethod
    def reshard(cls, states: list[dict[str, Any]], ranks: int, *args: Any) -> list[dict[str, Any]]:
        """The envs of ``states`` (every rank's batches in global env order) regrouped into
        this layout's ranks and stages (``EnvBatch.regroup``); each rank keeps a random
        generator of the old ones (``Worker.reshard``). The same layout: ``states`` as they are."""
        layout: EnvLayout = args[1]
        n = layout.envs_per_stage
        if len(states) == ranks and all(len(s["envs"]) == n for state in states for s in state["batches"]):
            return states
        batches = EnvBatch.regroup([s for state in states for s in state["batches"]], [n] * (ranks * layout.stages))
        rngs = super().reshard([state["rng"] for state in states], ranks)
        return [{"batches": batches[r * layout.stages:(r + 1) * layout.stages], "rng": rngs[r]} for r in range(ranks)]

