"""Embodied RL: env workers, rollout workers and a PPO actor, as one short loop.

The loop in ``step`` is the same whatever the Plan: collocated, the components take turns on
shared devices (and the rollout runs inside the env workers' processes); disaggregated or
hybrid, they run on devices of their own and stream to each other. A step's data flow:

    env.interact --obs--> rollout.act --actions--> env ... (runner.rollout_steps per env)
    env --trajectories channel--> actor.train --weights--> rollout (next step)

The file reads top to bottom: the components, the macro flow (``EmbodiedRunner``), its
metrics, the step as the scheduler sees it, ``m2flow eval``'s scores, and ``FLOW``, which
declares them all.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from m2flow.config.schema import EmbodiedConfig
from m2flow.config.validate import ConfigError, check_embodied, check_grpo_layout, resolved
from m2flow.envs import EnvBatch, make_env
from m2flow.flow import Plan, Workflow
from m2flow.flow.simulate import Shape
from m2flow.models.policies import build_policy
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners.base import Runner
from m2flow.runners.flow import Flow
from m2flow.runners.metrics import Ledger, RunLog, Staleness, component_times, trained_stats
from m2flow.runtime.group import GroupHandle, wait
from m2flow.workers.actor import ActorWorker
from m2flow.workers.env import EnvWorker
from m2flow.workers.layout import EnvLayout
from m2flow.workers.rollout import RolloutWorker

WORKERS = {"env": EnvWorker, "rollout": RolloutWorker, "actor": ActorWorker}
WORKFLOW = Workflow(
    "embodied", components=("env", "rollout", "actor"), makers=("env", "rollout"), trainer="actor",
    channels=("trajectories",), fusable=("env", "rollout"), light_alone=("env",),
    # disaggregated: the envs on all devices but two, the rollout and the actor on one each;
    # hybrid: env and rollout split the devices, the actor spans them all.
    splits={"disaggregated": ((("env",), None), (("rollout",), 1), (("actor",), 1)),
            "hybrid": ((("env",), 0.5), (("rollout",), None))})


def check(d: dict, training: bool = True) -> None:
    """The rules between keys (``check_embodied``); PPO and GRPO train an actor-critic policy."""
    check_embodied(d, training)
    if d["policy"]["kind"] != "actor_critic":
        raise ConfigError("policy.kind", f"the embodied flow (PPO, GRPO) trains an actor_critic policy; "
                                         f"{d['policy']['kind']} is the replay flow's (flow: replay)")


def steps_per_update(cfg: DictConfig) -> int:
    """Env steps an update collects: every env steps ``rollout_steps`` times, ``chunk`` actions each."""
    return cfg.runner.rollout_steps * cfg.env.num_envs * cfg.policy.chunk


def env_layout(cfg: DictConfig, plan: Plan) -> EnvLayout:
    """Which envs each env rank steps in which stage, and which rollout rank acts for them."""
    try:
        ranks = (plan.world_size(c) for c in WORKFLOW.components)
        layout = EnvLayout.build(cfg.env.num_envs, *ranks, plan.stages, cfg.policy.chunk)
    except ValueError as e:  # the envs cannot be shared out among the plan's ranks and stages
        raise ConfigError("env.num_envs", str(e)) from None
    if cfg.algorithm.name == "grpo":
        check_grpo_layout(resolved(cfg), layout)
    return layout


def refreshing(cfg: DictConfig, plan: Plan) -> set[str]:
    """Collecting ahead with ``runner.in_flight_updates``: the rollout (fused: the env
    workers' replica) takes new weights between env steps."""
    return {"rollout"} if plan.run_ahead and cfg.runner.in_flight_updates else set()


def plan_options(cfg: DictConfig) -> dict[str, Any]:
    p = cfg.placement
    return {"fuse": p.fuse, "trainer_devices_per_proc": p.actor_devices_per_proc, "stages": cfg.runner.stages}


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
    def prepare(self) -> None:
        cfg = self.cfg
        self.spaces = probe_spaces(cfg)
        self.layout = env_layout(cfg, self.plan)
        self.plain = OmegaConf.to_container(cfg, resolve=True)
        self.steps_per_update = steps_per_update(cfg)
        self.total = max(1, int(cfg.runner.total_env_steps) // self.steps_per_update)
        self.metrics = EmbodiedMetrics(self.total * self.steps_per_update)

    def worker_args(self, component: str, take_turns: bool) -> tuple:
        if component == "env":  # fused, the env workers run the rollout's policy too
            return (self.plain, self.layout, self.spaces, take_turns) if self.fused else (self.plain, self.layout)
        return self.plain, self.layout, *self.spaces, take_turns

    def launch(self, key: int, trained_by: int) -> dict[str, GroupHandle]:
        """One rollout: env and rollout step together and stream trajectories into the channel
        (taking the actor's pushes as they come, from the last sync's on, when refreshing)."""
        steps, env, rollout = self.cfg.runner.rollout_steps, self.groups["env"], self.groups["rollout"]
        fresh = (self.trainer.name, self.streams.synced or 0) if self.refreshing else (None, 0)
        return {"env": env.interact(rollout.name, self.channels["trajectories"], steps, *fresh, key),
                "rollout": rollout.act(env.name, steps, *fresh)}

    def step(self, i: int, ahead: int = 0) -> dict[str, Any]:
        """One PPO update: the macro flow. Returns what each component reported.

        On-policy, the rollout and the actor's training (which starts on the trajectories as
        they stream in) make up the step. With ``ahead = k``, the rollouts of the next k
        updates are in flight while the actor trains (the newest, launched now, with this
        update's starting weights: its data is k versions old when trained on, which the PPO
        ratio or ``algorithm.off_policy`` accounts for)."""
        key, collecting, sync = self.streams.next(ahead)
        training = self.groups["actor"].train(self.channels["trajectories"], key, i, self.total)
        env, rollout, actor = wait(collecting["env"], collecting["rollout"], training)
        return {"env": env, "rollout": rollout, "actor": actor, "sync": sync}

    def evaluates(self, i: int, last: bool) -> bool:
        """With ``runner.eval_every``: before the first update (``i == -1``), every that many and after the last."""
        every = self.cfg.runner.eval_every
        return bool(every) and (i == -1 or last or (i + 1) % every == 0)

    def evaluate(self) -> dict[str, float]:
        """``runner.eval_episodes`` deterministic episodes of the actor's weights (``play``)."""
        (weights,), (stats,) = wait(self.groups["actor"].call("policy_weights", ranks=[0]),
                                    self.groups["env"].call("normalization", ranks=[0]))
        summary, _ = play(self.cfg, weights, stats, self.cfg.runner.eval_episodes)
        return {"eval_return": summary["mean_return"], "eval_length": summary["mean_length"]} | (
            {} if summary["success_rate"] is None else {"eval_success_rate": summary["success_rate"]})

    def stop_early(self, row: dict[str, float], log: RunLog) -> bool:
        target = self.cfg.runner.target_return
        if target is None or not row["episodes"] or row["episode_return"] < target:
            return False
        log.note(f"mean return {row['episode_return']:.1f} >= {target} after {row['env_steps']} env steps")
        return True

    def describe(self, first: int) -> str:
        return (f"stages={self.plan.stages}, updates {first}-{self.total - 1} of {self.steps_per_update} env steps"
                + ("; the rollout runs in the env workers (same devices)" if self.fused else ""))


class EmbodiedMetrics:
    """The embodied flow's rows, against env steps: every update's, as metrics.csv columns
    and TensorBoard scalars:

    env_steps            env steps so far (all envs; a chunk counts the actions it ran)
    time_s / update_s    wall time since the start (of a resumed run: since it resumed) / of
                         this update (incl. weight sync)
    env_steps_per_s      env steps taken by this process / time_s: end-to-end throughput,
                         training included
    episode_return       mean raw (unnormalised) return of the episodes that ended in this
                         update; the previous value when none ended
    episode_length       their mean length; episodes: how many ended
    env_faults           env steps in this update that raised or gave a non-finite reward or
                         observation: each ended its episode (truncated, reward 0) and the
                         env was made again (EnvBatch._fault)
    eval_return, eval_length, eval_success_rate
                         with runner.eval_every: the mean return, length and success of
                         runner.eval_episodes deterministic episodes of the actor's weights
                         on envs of their own (``play``); before the first update (a row of
                         its own), every that many updates and after the last
    success_rate         the fraction of them that reached success (the env's info["success"]
                         at any step: ManiSkill, Meta-World); the previous value when none
                         ended; absent for envs that report no success
    policy_loss, value_loss, entropy, approx_kl, clip_fraction, grad_norm, epochs,
    explained_variance   PPO statistics averaged over the minibatches and the actor's ranks
    policy_lag           policy versions between the weights trained and the oldest that
                         collected the data (0 on-policy; up to runner.max_staleness)
    staleness_<j>        the share of the update's env steps whose actions came from weights j
                         versions older than those trained (staleness_0 = 1 on-policy)
    weight_latency_s     runner.in_flight_updates: from an update's end to the rollout taking
                         its weights between env steps, averaged over this rollout's loads
                         (absent when it took none)
    weight_sync_s        actor -> rollout weight broadcast time
    {env,rollout,actor}_busy_s / _idle_s
                         per-component busy time (stepping, inferring, training) and idle
                         time (waiting for actions, observations, trajectories or a device
                         lock), averaged over the component's ranks; with the rollout
                         fused into the env workers, rollout_busy_s is their inference time
    """

    x, y, x_name = "env_steps", "episode_return", "update"

    def __init__(self, progress_total: int):
        self.progress_total = progress_total
        self.staleness, self.ledger = Staleness(), Ledger()  # the ledger: each update's envs trained on
        self.env_steps = self.start_steps = 0
        self.last_return = self.last_success = math.nan

    def state_dict(self) -> dict[str, float]:
        return {"env_steps": self.env_steps, "last_return": self.last_return, "last_success": self.last_success}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continues a run: throughput counts the steps this process adds."""
        self.env_steps = self.start_steps = state["env_steps"]
        self.last_return, self.last_success = state["last_return"], state["last_success"]

    def row(self, update: int, report: dict[str, Any], update_s: float, time_s: float) -> dict[str, float]:
        env, rollout, actor = report["env"], report["rollout"], report["actor"]
        self.ledger.record(update + 1, report)
        self.env_steps += sum(e.env_steps for e in env)
        episodes = [ep for e in env for ep in e.episodes]
        if episodes:
            self.last_return = sum(r for r, _, _ in episodes) / len(episodes)
        successes = [s for _, _, s in episodes if s is not None]
        if successes:
            self.last_success = sum(successes) / len(successes)
        row: dict[str, float] = {
            "update": update, "env_steps": self.env_steps, "time_s": time_s, "update_s": update_s,
            "env_steps_per_s": (self.env_steps - self.start_steps) / time_s, "episode_return": self.last_return,
            "episode_length": sum(n for _, n, _ in episodes) / len(episodes) if episodes else math.nan,
            "episodes": len(episodes), "weight_sync_s": report["sync"].weight_sync_s,
            "env_faults": sum(e.env_faults for e in env),
        }
        if not math.isnan(self.last_success):
            row["success_rate"] = self.last_success
        row |= trained_stats(actor) | self.staleness.row(rollout, actor)
        return row | component_times({"env": env, "rollout": rollout, "actor": actor})

    def summary(self, row: dict[str, float]) -> str:
        success = "" if math.isnan(self.last_success) else f"  success {self.last_success:.2f}"
        return f"{row['env_steps_per_s']:,.0f} steps/s  return {self.last_return:.1f}{success}"


# -- the step as the scheduler sees it (``runners.schedule``) -------------------------------
def shape(cfg: DictConfig, plan: Plan, fused: bool) -> Shape:
    """The envs, in ``stages`` batches, step and act ``rollout_steps`` times; then the actor
    trains on all of it."""
    return Shape(("env", "rollout"), "actor", cfg.env.num_envs, plan.stages, repeats=cfg.runner.rollout_steps,
                 samples=steps_per_update(cfg), whole_turns=("env", "rollout"), in_flight=FLOW.in_flight(cfg, plan))


def knobs(cfg: DictConfig) -> dict[str, Any]:
    n = cfg.env.num_envs
    return {"stages": [s for s in (1, 2, 4) if n % s == 0 and n >= s]}


def length(cfg: DictConfig, updates: int) -> dict[str, Any]:
    return {"runner.total_env_steps": updates * steps_per_update(cfg), "runner.target_return": None}


def probe_sizes(cfg: DictConfig, devices: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The step as configured; the other size is every env in one batch on one device, where
    the first probe shares them out over all the devices (on a one-device cluster, the envs in
    two batches, ``stages``): the envs step and act in batches of two sizes, which tells a cost
    per call (a batched inference, an env worker's step) from a cost per env. (No probe of
    contention: profiling, about 8% of a 1M-env-step run, has no room for another; the
    predictions leave contention out, and the planner says so.)"""
    return {}, {"stages": 1 if devices > 1 else 2}, {}


# -- m2flow eval -------------------------------------------------------------------------------
EVAL_SEED_OFFSET = 1_000_003  # evaluation episodes start from seeds no training env used


def score(cfg: DictConfig, ckpt: dict, episodes: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``m2flow eval``: ``play`` with the checkpoint's policy and its first env worker's statistics."""
    env_state = ckpt["states"].get("env")  # rank 0, stage 0
    return play(cfg, checkpoints.trainer_weights(ckpt, "policy"), env_state[0]["batches"][0]["stats"] if env_state
                else None, episodes)


def play(cfg: DictConfig, weights: dict[str, Any], obs_stats: dict | None, episodes: int,
         max_steps: int = 1_000_000) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``episodes`` episodes of the config's env on envs of their own (seeds no training env
    uses), the policy of ``weights`` acting on its mean action (deterministic), observations
    normalised with ``obs_stats``; raw returns. The mean and spread of the returns, the mean
    length and the success rate (envs that report success: ManiSkill, Meta-World); and each
    episode's."""
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    probe_spaces(cfg)  # an env that cannot be made is a config error
    env = cfg.env
    n = min(episodes, env.num_envs)
    batch = EnvBatch(env.id, n, cfg.seed + EVAL_SEED_OFFSET, obs_norm=env.obs_norm,
                     env_kwargs=OmegaConf.to_container(env.kwargs, resolve=True))
    batch.training = False  # the normalisation statistics stay the ones given
    if obs_stats:
        batch.load_state_dict(obs_stats)
    policy = build_policy(batch.observation_space, batch.action_space, OmegaConf.to_container(cfg.policy, resolve=True))
    try:
        policy.load_state_dict(weights)
    except RuntimeError as e:
        raise ConfigError("policy", f"the checkpoint's policy does not fit this config's env and policy: "
                          f"{str(e).splitlines()[0]}") from None
    policy.eval()
    # Each env runs its share of the episodes (SB3's rule: no bias towards short episodes).
    target = np.array([episodes // n + (i < episodes % n) for i in range(n)])
    done = np.zeros(n, dtype=np.int64)
    returns, lengths, successes, envs = [], [], [], []
    obs = batch.reset()
    steps = 0
    while (done < target).any():
        with torch.inference_mode():
            actions, _ = policy.act(torch.as_tensor(obs), deterministic=True)
        result = batch.step_chunk(actions.numpy()) if cfg.policy.chunk > 1 else batch.step(actions.numpy())
        obs = result.obs
        steps += 1
        for (i, ret), (_, length), success in zip(result.episode_returns, result.episode_lengths,
                                                  result.episode_successes):
            if done[i] < target[i]:
                done[i] += 1
                returns.append(ret)
                lengths.append(length)
                successes.append(success)
                envs.append(i)
        if steps * n >= max_steps:
            raise RuntimeError(f"{int(done.sum())} of {episodes} episodes ended within {max_steps} env steps: "
                               "give the env a time limit (env.kwargs.max_episode_steps)")
    reported = [s for s in successes if s is not None]
    episodes_played = [{"episode": k, "env": i, "return": ret, "length": n, "success": s}
                       for k, (i, ret, n, s) in enumerate(zip(envs, returns, lengths, successes))]
    return {"env": env.id, "episodes": len(returns), "mean_return": statistics.fmean(returns),
            "std_return": statistics.pstdev(returns), "min_return": min(returns), "max_return": max(returns),
            "mean_length": statistics.fmean(lengths),
            "success_rate": statistics.fmean(reported) if reported else None}, episodes_played  # None: none reported


FLOW = Flow(
    "embodied", WORKFLOW, WORKERS, EmbodiedRunner, config=EmbodiedConfig, check=check,
    length_key="runner.total_env_steps", stateful=("env", "rollout", "actor"),
    shape=shape, knobs=knobs, length=length, probe_sizes=probe_sizes, duration="update_s", probe_updates=3,
    # the updates a checkpoint counts are of runner.rollout_steps x env.num_envs x policy.chunk env steps
    resume_keys=("algorithm.name", "env.id", "env.num_envs", "env.group_size", "env.obs_norm", "env.reward_scale",
                 "policy.hidden", "policy.activation", "policy.chunk", "runner.rollout_steps"),
    refreshing=refreshing, plan_options=plan_options, check_plan=env_layout, score=score)
