"""Embodied RL: env workers, rollout workers and a PPO actor, as one short loop.

The loop in ``step`` is the same in every placement mode; the placement (from config
alone) decides whether the components take turns on shared devices (collocated) or run
on their own devices and stream to each other (disaggregated, hybrid).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from m2flow.config.validate import check_grpo_layout, resolved, validate
from m2flow.envs import make_env
from m2flow.runners.metrics import MetricsLogger
from m2flow.runtime import Channel, Cluster, DeviceLock, Placement, WorkerGroup
from m2flow.runtime.group import start_together, wait
from m2flow.workers.actor import ActorWorker
from m2flow.workers.env import EnvWorker
from m2flow.workers.layout import Layout
from m2flow.workers.rollout import RolloutWorker

COMPONENTS = ("env", "rollout", "actor")


def placement_config(cfg: DictConfig, num_devices: int) -> dict[str, Any]:
    """Device ranges per component for a placement mode.

    collocated: all three on every device; disaggregated: env, rollout and actor on
    disjoint devices (needs three or more); hybrid: env and rollout split the devices,
    the actor spans all of them; custom: ``placement.components`` as given.
    ``actor_devices_per_proc > 1`` makes each actor rank span that many of its devices.
    """
    ranges = _mode_ranges(cfg, num_devices)
    span = cfg.get("actor_devices_per_proc", 1)
    if span > 1 and isinstance(ranges["actor"], str):  # one actor rank over several devices: no all-reduce
        ranges["actor"] = {"devices": ranges["actor"], "devices_per_proc": span}
    return ranges


def _mode_ranges(cfg: DictConfig, num_devices: int) -> dict[str, Any]:
    mode, last = cfg.mode, num_devices - 1
    if mode == "custom":
        given = OmegaConf.to_container(cfg.components, resolve=True)
        missing = [c for c in COMPONENTS if given.get(c) is None]
        if missing:
            raise ValueError(f"placement.mode=custom needs placement.components for {missing}")
        return given
    if mode == "collocated":
        return {c: f"0-{last}" for c in COMPONENTS}
    if mode == "disaggregated":
        if num_devices < 3:
            raise ValueError(f"placement.mode=disaggregated needs >= 3 devices, the cluster has {num_devices} "
                             "(set cluster.cpu_slots=3 to run it on fewer cores)")
        return {"env": f"0-{last - 2}", "rollout": str(last - 1), "actor": str(last)}
    if mode == "hybrid":
        if num_devices < 2:
            raise ValueError("placement.mode=hybrid needs >= 2 devices")
        half = num_devices // 2
        return {"env": f"0-{half - 1}", "rollout": f"{half}-{last}", "actor": f"0-{last}"}
    raise ValueError(f"unknown placement.mode {mode!r}: collocated | disaggregated | hybrid | custom")


def check_algorithm(cfg: DictConfig, layout: Layout) -> None:
    """Config errors that would otherwise surface deep inside a worker, or not at all: the
    checks of ``m2flow.config.validate`` (run when the config is loaded, again here for a
    config changed since), then GRPO's rules that depend on the ranks (``check_grpo_layout``).
    Each raises a ``ConfigError``."""
    validate(cfg)
    if cfg.algorithm.name == "grpo":
        check_grpo_layout(resolved(cfg), layout)


class EmbodiedRunner:
    def __init__(self, cfg: DictConfig, cluster: Cluster | None = None):
        self.cfg = cfg
        c = cfg.cluster
        self._own_cluster = cluster is None
        self.cluster = cluster or Cluster(c.address, num_cpus=c.num_cpus, cpu_slots=c.cpu_slots)
        self.placement = Placement.from_config(placement_config(cfg.placement, len(self.cluster.devices)), self.cluster)
        probe = make_env(cfg.env.id, **OmegaConf.to_container(cfg.env.kwargs))
        spaces = (probe.observation_space, probe.action_space)
        probe.close()
        self.layout = Layout.build(cfg.env.num_envs, *(self.placement[n].world_size for n in COMPONENTS),
                                   cfg.runner.stages, cfg.policy.chunk)
        check_algorithm(cfg, self.layout)
        plain = OmegaConf.to_container(cfg, resolve=True)
        run = uuid.uuid4().hex[:6]
        self.names = {n: f"{n}-{run}" for n in COMPONENTS}
        shared = self.placement.mode != "disaggregated"  # components that share devices take turns
        # Lock actors live as long as the process that made them: the driver.
        locks = DeviceLock([d.index for d in self.cluster.devices], holder="driver") if shared else None
        # Env and rollout on the same devices, rank for rank: fuse them, the rollout then runs
        # inside each env worker's process (no message per step). The loop below is unchanged:
        # the rollout's calls go to the same workers.
        env_ranks, rollout_ranks = self.placement["env"].ranks(), self.placement["rollout"].ranks()
        self.fused = bool(cfg.placement.get("fuse", True)) and [r.devices for r in env_ranks] == [r.devices for r in rollout_ranks]
        if self.fused:
            self.env = WorkerGroup(EnvWorker, self.placement["env"], args=(plain, self.layout, spaces, shared),
                                   name=self.names["env"], wait=False)
            self.rollout, self.names["rollout"] = self.env, self.names["env"]
        else:
            self.env = WorkerGroup(EnvWorker, self.placement["env"], args=(plain, self.layout), name=self.names["env"],
                                   wait=False)
            self.rollout = WorkerGroup(RolloutWorker, self.placement["rollout"], args=(plain, self.layout, *spaces, shared),
                                       name=self.names["rollout"], wait=False)
        self.actor = WorkerGroup(ActorWorker, self.placement["actor"], args=(plain, self.layout, *spaces, shared),
                                 name=self.names["actor"], wait=False)
        self.trajectories = Channel.create(f"trajectories-{run}")
        start_together(*self.groups, channels=[self.trajectories], locks=locks)  # processes start in parallel
        self.steps_per_update = cfg.runner.rollout_steps * cfg.env.num_envs * cfg.policy.chunk
        self.total_updates = max(1, int(cfg.runner.total_env_steps) // self.steps_per_update)
        self.collecting: tuple | None = None  # a rollout started ahead of its update (runner.collect_ahead)

    def sync_weights(self) -> float:
        """Actor rank 0 broadcasts versioned weights to every rollout rank."""
        start = time.perf_counter()
        wait(self.actor.call("push_weights", self.names["rollout"], ranks=[0]),
             self.rollout.pull_weights(self.names["actor"]))
        return time.perf_counter() - start

    def collect(self) -> tuple:
        """Starts one rollout: env and rollout stream trajectories into the channel."""
        steps = self.cfg.runner.rollout_steps
        return self.env.interact(self.names["rollout"], self.trajectories, steps), self.rollout.act(self.names["env"], steps)

    def step(self, update: int, collect_next: bool = False) -> dict[str, Any]:
        """One PPO update: the macro flow. Returns what each component reported.

        On-policy, the rollout and the actor's training (which starts on the trajectories as
        they stream in) make up the step. With ``collect_next``, the next update's rollout
        runs with this update's starting weights while the actor trains (its data is then
        one version old, which the PPO ratio accounts for)."""
        if self.collecting is None:  # nothing collected ahead: the first update, or the one after a pause
            sync_s, collecting = self.sync_weights(), self.collect()
            ahead = self.collect() if collect_next else None  # the same weights: it queues behind this one
        else:
            collecting, sync_s = self.collecting, 0.0
            wait(*collecting)  # the rollout workers are free again: they can take the new weights
            if collect_next:
                sync_s = self.sync_weights()
            ahead = self.collect() if collect_next else None
        training = self.actor.train(self.trajectories, update, self.total_updates)
        env, rollout, actor = wait(*collecting, training)
        self.collecting = ahead
        return {"env": env, "rollout": rollout, "actor": actor, "weight_sync_s": sync_s}

    def train(self) -> list[dict[str, float]]:
        r = self.cfg.runner
        logger = MetricsLogger(r.out_dir, total_env_steps=self.total_updates * self.steps_per_update, progress=r.progress)
        try:
            return self._train(logger)
        finally:
            logger.close()

    def _train(self, logger: MetricsLogger) -> list[dict[str, float]]:
        r = self.cfg.runner
        first = self.resume(r.resume, logger) if r.get("resume") else 0
        logger.note(self.cluster.describe() + "\n" + self.placement.describe()
                    + ("\nrollout fused into the env workers (same devices)" if self.fused else "")
                    + f"\nstages={r.stages}, updates {first}-{self.total_updates - 1} of {self.steps_per_update} env steps")
        start = time.perf_counter()
        for update in range(first, self.total_updates):
            t0 = time.perf_counter()
            saving = bool(r.checkpoint_every) and (update + 1) % r.checkpoint_every == 0
            # A checkpoint holds no trajectories in flight: nothing is collected past it.
            ahead = bool(r.get("collect_ahead")) and update + 1 < self.total_updates and not saving
            report = self.step(update, collect_next=ahead)
            row = logger.log_update(update, report, time.perf_counter() - t0, time.perf_counter() - start)
            done = update + 1 == self.total_updates
            if r.get("target_return") is not None and row["episodes"] and row["episode_return"] >= r.target_return:
                logger.note(f"mean return {row['episode_return']:.1f} >= {r.target_return} after {row['env_steps']} env steps")
                done = True
            if done and self.collecting is not None:  # stopped early: the rollout ahead goes untrained
                wait(*self.collecting)
                self.collecting = None
            if done or saving:
                self.checkpoint(update + 1, logger)
            if done:
                break
        return logger.history

    # -- checkpoints -----------------------------------------------------------------
    def checkpoint(self, updates_done: int, logger: MetricsLogger) -> Path:
        """Saves every rank's state: simulators mid-episode, sampling RNGs, weights and
        optimizer, so that a resumed run continues exactly as an uninterrupted one."""
        if self.fused:  # the env workers' state includes the rollout's
            (env, actor), rollout = wait(self.env.state(), self.actor.state()), None
        else:
            env, rollout, actor = wait(self.env.state(), self.rollout.state(), self.actor.state())
        path = Path(self.cfg.runner.out_dir) / "checkpoints" / f"update_{updates_done:06d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"updates_done": updates_done, "env_steps": logger.env_steps, "last_return": logger.last_return,
                    "last_success": logger.last_success,
                    "env": env, "rollout": rollout, "actor": actor,
                    "config": OmegaConf.to_container(self.cfg, resolve=True)}, path)
        return path

    def resume(self, path: str, logger: MetricsLogger) -> int:
        """Loads a checkpoint written by ``checkpoint``; returns the first update to run."""
        ckpt = torch.load(path, weights_only=False)
        if (ckpt["rollout"] is None) != self.fused:
            raise ValueError(f"checkpoint {path} was written with placement.fuse={ckpt['rollout'] is None}: resume the same way")
        groups = [("env", self.env), ("actor", self.actor)] + ([] if self.fused else [("rollout", self.rollout)])
        for name, group in groups:
            if len(ckpt[name]) != group.world_size:
                raise ValueError(f"checkpoint {path} has {len(ckpt[name])} {name} rank(s), this placement has "
                                 f"{group.world_size}: resume with the same placement")
        wait(*(group.load_state(ckpt[name]) for name, group in groups))
        logger.resume(ckpt["env_steps"], ckpt["last_return"], ckpt["last_success"])
        return ckpt["updates_done"]

    @property
    def groups(self) -> list[WorkerGroup]:
        """The distinct worker groups (fused, env and rollout are one)."""
        return list({id(g): g for g in (self.env, self.rollout, self.actor)}.values())

    def close(self) -> None:
        self.trajectories.destroy()
        for g in self.groups:
            g.shutdown()
        if self._own_cluster:
            self.cluster.shutdown()
