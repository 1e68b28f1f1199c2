"""Off-policy embodied RL (SAC, CrossQ, RLPD): the envs feed a replay buffer, the learner samples it.

The embodied flow's env workers (the rollout's policy in their processes) and a learner in
place of PPO's actor (the trainer component, named ``actor`` in every embodied flow). The two
exchange point to point every env step, without the driver (``workers/replay.py``):

    env: act (the newest weights it holds), step --transitions--> learner: into the replay buffer,
         utd_ratio gradient steps per env step --weights, every runner.weights_every steps--> env

For the first ``algorithm.learning_starts`` env steps the envs act uniformly at random and the
learner takes no step. ``runner.max_staleness`` bounds, in learner updates, how far the acting
weights may lag the learner's: 0, they alternate (SB3's SAC, step for step); 1, an env step
runs while the learner takes the step before it. ``policy_lag`` reports the largest lag of a
round's env steps, ``staleness_<j>`` their shares (in updates here, in versions in the
on-policy flows).

A step of this flow, for the runner, is a *round* of ``runner.rollout_steps`` env steps per env
and their gradient steps: metrics, evaluations and checkpoints come between rounds, and the
next round's collection starts while the learner finishes this one. The file reads top to
bottom: the config sections, their checks, the macro flow (``ReplayRunner``), its metrics and
``FLOW``. The scheduler sees a round as it sees the embodied flow's update (makers, then the
trainer on the round's samples).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

from omegaconf import DictConfig

from m2flow.config.schema import (AT_LEAST_1, FRACTION, NON_NEGATIVE, POSITIVE, UNIT, EmbodiedConfig,
                                  EmbodiedRunnerConfig, PolicyConfig, opt, section)
from m2flow.config.validate import ConfigError, check_embodied
from m2flow.flow import Plan
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners import embodied
from m2flow.runners.flow import Flow
from m2flow.runtime.group import GroupHandle, wait
from m2flow.workers.replay import DEFAULTS, LearnerWorker, ReplayEnvWorker, resolved_algorithm
from m2flow.workers.rollout import RolloutWorker

ALGORITHMS = tuple(DEFAULTS)  # sac | rlpd | crossq


# -- the config -------------------------------------------------------------------------------
@dataclass
class ReplayAlgorithmConfig:
    name: str = opt("sac", "sac | crossq (no target critics, batch renormalisation: sb3-contrib's) | rlpd (a critic "
                           "ensemble with LayerNorm, a random pair of it for the target, demonstrations mixed in)",
                    choices=ALGORITHMS)
    gamma: float = opt(0.99, "discount per env step", within=UNIT)
    lr: Optional[float] = opt(None, "Adam's learning rate (actor, critics, entropy coefficient; 0: nothing learns); "
                                    "null: the algorithm's (sac, rlpd: 3e-4; crossq: 1e-3)", within=NON_NEGATIVE)
    batch_size: int = opt(256, "transitions per gradient step", within=AT_LEAST_1)
    buffer_size: int = opt(1_000_000, "transitions the replay buffer holds (the oldest overwritten)", within=AT_LEAST_1)
    learning_starts: int = opt(10_000, "env steps of uniform random actions before the first gradient step",
                               within=NON_NEGATIVE)
    utd_ratio: int = opt(1, "gradient steps per env step (update-to-data ratio)", within=AT_LEAST_1)
    tau: float = opt(0.005, "the target critics' Polyak step (sac, rlpd)", within=UNIT)
    critics: Optional[int] = opt(None, "critics in the ensemble; null: the algorithm's (sac, crossq: 2; rlpd: 10)",
                                 within=AT_LEAST_1)
    target_subset: Optional[int] = opt(None, "critics drawn at random whose minimum makes the target; null: the "
                                             "algorithm's (rlpd: 2; sac, crossq: all)", within=AT_LEAST_1)
    critic_hidden: Optional[List[int]] = opt(None, "the critics' hidden widths; null: the algorithm's (sac, rlpd: "
                                                   "[256, 256]; crossq: [1024, 1024])", within=AT_LEAST_1)
    layer_norm: Optional[bool] = opt(None, "LayerNorm after the critics' hidden layers; null: the algorithm's (rlpd)")
    policy_delay: int = opt(3, "crossq: critic steps per actor and entropy step", within=AT_LEAST_1)
    init_alpha: float = opt(1.0, "the entropy coefficient's initial value (then tuned)", within=POSITIVE)
    target_entropy: Optional[float] = opt(None, "the entropy the coefficient's tuning aims at; null: -(action dims)")
    n_step: int = opt(1, "rewards summed (discounted) in a transition's return before bootstrapping", within=AT_LEAST_1)
    demonstrations: Optional[str] = opt(None, "a replay buffer file (scripts/robot_demonstrations.py) sampled beside "
                                              "the online data; null: none")
    demo_share: float = opt(0.5, "with demonstrations: their share of each batch (rlpd: 0.5)", within=FRACTION)


@dataclass
class ReplayPolicyConfig(PolicyConfig):
    hidden: List[int] = opt([256, 256], "widths of the policy MLP's hidden layers", within=AT_LEAST_1)
    activation: str = opt("relu", "the MLP's activation (a squashed Gaussian's is ReLU)", choices=("relu",))
    kind: str = opt("squashed_gaussian", "the replay flow's policy: a Gaussian tanh-squashed to the action bounds",
                    choices=("squashed_gaussian",))


@dataclass
class ReplayRunnerConfig(EmbodiedRunnerConfig):
    rollout_steps: int = opt(1000, "env steps per env in a round (between metrics rows, evaluations, checkpoints)",
                             within=AT_LEAST_1)
    total_env_steps: int = opt(100_000, "env steps in all; rounds = total_env_steps / (rollout_steps x num_envs)",
                               within=AT_LEAST_1)
    max_staleness: int = opt(0, "learner updates the acting weights may lag the learner's: 0, env and learner "
                                "alternate; 1, an env step runs while the learner takes the step before it",
                             within=NON_NEGATIVE)
    weights_every: int = opt(1, "learner updates between the weights the env workers may act with (those some env "
                                "step will act with are sent; the acting weights lag by up to max_staleness + "
                                "weights_every - 1)", within=AT_LEAST_1)


@dataclass
class ReplayConfig(EmbodiedConfig):
    flow: str = opt("replay", "which macro flow runs it")
    policy: ReplayPolicyConfig = section(ReplayPolicyConfig, "the policy (the learner's actor)")
    algorithm: ReplayAlgorithmConfig = section(ReplayAlgorithmConfig, "the off-policy algorithm and its optimiser")
    runner: ReplayRunnerConfig = section(ReplayRunnerConfig, "the training loop")


def check(d: Mapping, training: bool = True) -> None:
    """The rules between keys (on the resolved config)."""
    check_embodied(d, training)
    a, env, policy = d["algorithm"], d["env"], d["policy"]
    if d["runner"]["stages"] != 1:
        raise ConfigError("runner.stages", "the replay flow steps its envs in one batch per env rank: set 1")
    if not d["placement"]["fuse"]:
        raise ConfigError("placement.fuse", "the replay flow runs the rollout in the env workers: set true")
    if policy["chunk"] != 1:
        raise ConfigError("policy.chunk", f"the replay flow learns from transitions of one action each; action "
                                          f"chunks are not defined for them (got {policy['chunk']})")
    for key in ("obs_norm", "reward_scale"):
        if env[key]:
            raise ConfigError(f"env.{key}", "the replay flow stores raw observations and rewards: set it false")
    if env["group_size"] != 1:
        raise ConfigError("env.group_size", "env groups are GRPO's: the replay flow has none (set 1)")
    if policy["batch_renorm"] != (a["name"] == "crossq"):
        raise ConfigError("policy.batch_renorm", "must be true for algorithm.name=crossq (its actor renormalises "
                                                 "batches) and false otherwise")
    if a["buffer_size"] < 2 * env["num_envs"]:
        raise ConfigError("algorithm.buffer_size", f"must hold 2 transitions per env at least "
                                                   f"({2 * env['num_envs']}), got {a['buffer_size']}")
    critics = resolved_algorithm(a)["critics"]
    if a["target_subset"] is not None and a["target_subset"] > critics:
        raise ConfigError("algorithm.target_subset", f"draws {a['target_subset']} of {critics} critics")


def check_plan(cfg: DictConfig, plan: Plan) -> None:
    """The embodied flow's env layout, the rollout in the env workers' processes and one
    learner rank (``Workflow.single_rank`` makes it one whatever its devices; a custom plan may
    not split it)."""
    embodied.env_layout(cfg, plan)
    if plan.stages != 1:
        raise ConfigError("placement", f"the replay flow steps its envs in one batch per env rank; the plan has "
                                       f"{plan.stages} stages")
    if "rollout" in plan.components and not plan.fused(WORKFLOW):
        raise ConfigError("placement", "the replay flow runs the rollout in the env workers: place env and rollout "
                                       "on the same devices (placement.fuse=true)")
    if plan.world_size("actor") != 1:
        raise ConfigError("placement", f"the replay flow's learner (component actor) runs on one rank; the plan gives "
                                       f"it {plan.world_size('actor')}")


# -- the macro flow -----------------------------------------------------------------------------
class ReplayRunner(embodied.EmbodiedRunner):
    """A round (``launch``: the env workers collect; ``step``: the learner takes the rows as
    they come, and its gradient steps), the embodied flow's evaluations (``runner.eval_every``:
    deterministic episodes of the learner's policy on envs of their own) and early stop; its own
    metrics."""

    def prepare(self) -> None:
        demonstrations = self.cfg.algorithm.demonstrations  # a file a script writes: looked for at the start
        if demonstrations is not None and not os.path.isfile(demonstrations):
            raise ConfigError("algorithm.demonstrations", f"no such file: {demonstrations} (write it with "
                                                          "scripts/robot_demonstrations.py)")
        super().prepare()
        self.metrics = ReplayMetrics(self.total * self.steps_per_update)

    def launch(self, key: int, trained_by: int) -> dict[str, GroupHandle]:
        steps, env = self.cfg.runner.rollout_steps, self.groups["env"]
        return {"env": env.collect(self.trainer.name, steps, key), "rollout": env.act(env.name, steps)}

    def step(self, i: int, ahead: int = 0) -> dict[str, Any]:
        key, collecting, sync = self.streams.next(ahead)
        training = self.trainer.train(self.groups["env"].name, key, self.cfg.runner.rollout_steps)
        env, rollout, actor = wait(collecting["env"], collecting["rollout"], training)
        return {"env": env, "rollout": rollout, "actor": actor, "sync": sync}

    def describe(self, first: int) -> str:
        a = self.cfg.algorithm
        return (f"{a.name}: rounds {first}-{self.total - 1} of {self.steps_per_update} env steps, "
                f"{a.utd_ratio} gradient step(s) per env step after {a.learning_starts}, the acting weights at most "
                f"{self.cfg.runner.max_staleness} update(s) behind")


class ReplayMetrics(embodied.EmbodiedMetrics):
    """The embodied flow's row (``EmbodiedMetrics``: env steps, returns, evaluations,
    throughput, busy and idle times), with ``policy_lag`` and ``staleness_<j>`` in learner
    updates (the largest lag of the round's env steps, and their shares j updates behind), and
    the learner's statistics in place of PPO's, averaged over the round's gradient steps (absent
    in a round that took none):

    critic_loss, actor_loss   the critics' TD loss (0.5 x the sum over critics of the mean
                              squared error) and the actor's (alpha log pi - Q); crossq: the
                              actor's in rounds with an actor step
    alpha, entropy            the entropy coefficient and the policy's entropy estimate (-log pi)
    q                         the critics' mean value of the sampled transitions
    updates                   gradient steps taken so far
    weight_push_s             the learner's seconds sending weights to the env workers in the round
    buffer_transitions        slots filled in the replay buffer (transitions and one pad per
                              ended episode)
    """


# -- the scheduler's view -----------------------------------------------------------------------
def knobs(cfg: DictConfig) -> dict[str, Any]:
    return {"stages": [1]}  # one env batch per env rank (each row is every env's step)


def length(cfg: DictConfig, updates: int) -> dict[str, Any]:
    """A run of ``updates`` rounds, learning from the first env step: a profiling run measures
    the learner's gradient steps, not the warm-up's random ones."""
    return embodied.length(cfg, updates) | {"algorithm.learning_starts": 0}


# -- m2flow eval ----------------------------------------------------------------------------------
def score(cfg: DictConfig, ckpt: dict, episodes: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``m2flow eval``: ``play`` with the checkpoint's learner's policy (raw observations)."""
    weights = checkpoints.trainer_weights(ckpt, "learner")["actor"]
    return embodied.play(cfg, weights, None, episodes)


# disaggregated: env and rollout on one device (fused), the learner on the rest; hybrid: the
# envs on half the devices, the rollout on the others, the learner spanning them all
WORKFLOW = dataclasses.replace(embodied.WORKFLOW, name="replay", single_rank=("actor",),
                               splits={"disaggregated": ((("env", "rollout"), 1), (("actor",), None)),
                                       "hybrid": embodied.WORKFLOW.splits["hybrid"]})

FLOW = Flow(
    "replay", WORKFLOW, {"env": ReplayEnvWorker, "rollout": RolloutWorker, "actor": LearnerWorker}, ReplayRunner,
    config=ReplayConfig, check=check, length_key="runner.total_env_steps", stateful=("env", "rollout", "actor"),
    shape=embodied.shape, knobs=knobs, length=length, probe_sizes=embodied.probe_sizes,
    duration="update_s", probe_updates=3,
    resume_keys=("algorithm.name", "env.id", "env.num_envs", "policy.hidden", "policy.batch_renorm",
                 "algorithm.critics", "algorithm.critic_hidden", "algorithm.buffer_size", "runner.rollout_steps",
                 "runner.weights_every"),
    # the weights go from the learner to the env workers as it takes its steps, not through the
    # runner's sync; so a round launched ahead starts at once (``Streams``: in flight)
    receivers=lambda cfg: [], refreshing=lambda cfg, plan: {"env"},
    plan_options=embodied.plan_options, check_plan=check_plan, score=score)
