"""Embodied RL: env workers, rollout workers and a PPO actor, as one short loop.

The loop in ``step`` is the same whatever the Plan: collocated, the components take turns on
shared devices (and the rollout runs inside the env workers' processes); disaggregated or
hybrid, they run on devices of their own and stream to each other. A step's data flow:

    env.interact --obs--> rollout.act --actions--> env ... (runner.rollout_steps per env)
    env --trajectories channel--> actor.train --weights--> rollout (next step)
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from omegaconf import DictConfig, OmegaConf

from m2flow.config.validate import ConfigError, check_grpo_layout, resolved
from m2flow.envs import make_env
from m2flow.flow import Plan, Workflow
from m2flow.runners.base import Runner
from m2flow.runners.metrics import EmbodiedMetrics, RunLog
from m2flow.runtime.group import GroupHandle, wait
from m2flow.workers.actor import ActorWorker
from m2flow.workers.env import EnvWorker
from m2flow.workers.layout import EnvLayout
from m2flow.workers.rollout import RolloutWorker

WORKFLOW = Workflow(
    "embodied", components=("env", "rollout", "actor"), makers=("env", "rollout"), trainer="actor",
    channels=("trajectories",), fusable=("env", "rollout"), light_alone=("env",),
    # disaggregated: the envs on all devices but two, the rollout and the actor on one each;
    # hybrid: env and rollout split the devices, the actor spans them all.
    splits={"disaggregated": ((("env",), None), (("rollout",), 1), (("actor",), 1)),
            "hybrid": ((("env",), 0.5), (("rollout",), None))})


def env_layout(cfg: DictConfig, plan: Plan, components: tuple[str, ...]) -> EnvLayout:
    """Which envs each env rank steps in which stage, and which rollout rank acts for them."""
    try:
        ranks = (plan.world_size(c) for c in components)
        layout = EnvLayout.build(cfg.env.num_envs, *ranks, plan.stages, cfg.policy.chunk)
    except ValueError as e:  # the envs cannot be shared out among the plan's ranks and stages
        raise ConfigError("env.num_envs", str(e)) from None
    if cfg.algorithm.name == "grpo":
        check_grpo_layout(resolved(cfg), layout)
    return layout


def probe_spaces(cfg: DictConfig) -> tuple[Any, Any]:
    """The env's observation and action spaces, from one env made here; an env that cannot be
    made from ``env.id`` and ``env.kwargs`` is a config error."""
    kwargs = OmegaConf.to_container(cfg.env.kwargs)
    try:
        probe = make_env(cfg.env.id, **kwargs)
    except (gym.error.Error, ImportError) as e:
        raise ConfigError("env.id", f"cannot make {cfg.env.id!r}: {e}") from None
    except TypeError as e:  # the constructor's signature refused a keyword
        if not kwargs:
            raise
        raise ConfigError("env.kwargs", f"{cfg.env.id!r} refused {kwargs}: {e}") from None
    except Exception as e:  # the simulator refused the task or a keyword's value (an assert, a ValueError)
        what = f"{cfg.env.id!r} with env.kwargs {kwargs}" if kwargs else repr(cfg.env.id)
        raise ConfigError("env.kwargs" if kwargs else "env.id",
                          f"cannot make {what}: {type(e).__name__}: {e}") from e
    try:
        return probe.observation_space, probe.action_space
    finally:
        probe.close()


class EmbodiedRunner(Runner):
    workflow = WORKFLOW
    workers = {"env": EnvWorker, "rollout": RolloutWorker, "actor": ActorWorker}
    stateful = ("env", "rollout", "actor")
    length_key = "runner.total_env_steps"
    # the updates a checkpoint counts are of runner.rollout_steps x env.num_envs x policy.chunk env steps
    resume_keys = ("algorithm.name", "env.id", "env.num_envs", "env.group_size", "env.obs_norm", "env.reward_scale",
                   "policy.hidden", "policy.activation", "policy.chunk", "runner.rollout_steps")

    @staticmethod
    def plan_options(cfg: DictConfig) -> dict[str, Any]:
        p = cfg.placement
        return {"fuse": p.fuse, "trainer_devices_per_proc": p.actor_devices_per_proc, "stages": cfg.runner.stages}

    @classmethod
    def check_plan(cls, cfg: DictConfig, plan: Plan) -> None:
        env_layout(cfg, plan, cls.components_of(cfg))

    def prepare(self) -> None:
        cfg = self.cfg
        self.spaces = probe_spaces(cfg)
        self.layout = env_layout(cfg, self.plan, self.components)
        self.plain = OmegaConf.to_container(cfg, resolve=True)
        self.steps_per_update = steps_per_update(cfg)
        self.total = max(1, int(cfg.runner.total_env_steps) // self.steps_per_update)
        self.metrics = EmbodiedMetrics(self.total * self.steps_per_update)

    def worker_args(self, component: str, take_turns: bool) -> tuple:
        if component == "env":  # fused, the env workers run the rollout's policy too
            return (self.plain, self.layout, self.spaces, take_turns) if self.fused else (self.plain, self.layout)
        return self.plain, self.layout, *self.spaces, take_turns

    @classmethod
    def refreshing_of(cls, cfg: DictConfig, plan: Plan) -> set[str]:
        """Collecting ahead with ``runner.in_flight_updates``: the rollout (fused: the env
        workers' replica) takes new weights between env steps."""
        return {"rollout"} if plan.run_ahead and cfg.runner.in_flight_updates else set()

    def launch(self, key: int, trained_by: int) -> dict[str, GroupHandle]:
        """One rollout: env and rollout step together and stream trajectories into the channel
        (taking the actor's pushes as they come, from the last sync's on, when refreshing)."""
        steps, env, rollout = self.cfg.runner.rollout_steps, self.groups["env"], self.groups["rollout"]
        fresh = (self.trainer.name, self.synced or 0) if self.refreshing() else (None, 0)
        return {"env": env.interact(rollout.name, self.channels["trajectories"], steps, *fresh, key),
                "rollout": rollout.act(env.name, steps, *fresh)}

    def step(self, i: int, ahead: int = 0) -> dict[str, Any]:
        """One PPO update: the macro flow. Returns what each component reported.

        On-policy, the rollout and the actor's training (which starts on the trajectories as
        they stream in) make up the step. With ``ahead = k``, the rollouts of the next k
        updates are in flight while the actor trains (the newest, launched now, with this
        update's starting weights: its data is k versions old when trained on, which the PPO
        ratio or ``algorithm.off_policy`` accounts for)."""
        key, collecting, sync = self.stream(ahead)
        training = self.groups["actor"].train(self.channels["trajectories"], key, i, self.total)
        env, rollout, actor = wait(collecting["env"], collecting["rollout"], training)
        return {"env": env, "rollout": rollout, "actor": actor, "sync": sync}

    def stop_early(self, row: dict[str, float], log: RunLog) -> bool:
        target = self.cfg.runner.target_return
        if target is None or not row["episodes"] or row["episode_return"] < target:
            return False
        log.note(f"mean return {row['episode_return']:.1f} >= {target} after {row['env_steps']} env steps")
        return True

    def describe(self, first: int) -> str:
        return (f"stages={self.plan.stages}, updates {first}-{self.total - 1} of {self.steps_per_update} env steps"
                + ("; the rollout runs in the env workers (same devices)" if self.fused else ""))


def steps_per_update(cfg: DictConfig) -> int:
    """Env steps an update collects: every env steps ``rollout_steps`` times, ``chunk`` actions each."""
    return cfg.runner.rollout_steps * cfg.env.num_envs * cfg.policy.chunk
