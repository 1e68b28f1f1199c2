"""Rejection-sampling fine-tuning (best-of-n, expert iteration): the rollout samples
``rollout.n`` completions per prompt, the reward worker scores them, the select worker keeps
each prompt's best ``select.keep`` that reach ``select.min_reward``, and the actor takes a
supervised step on those alone (``algorithm.name=sft``: their negative log-likelihood):

    rollout --samples--> reward --scored--> select --batches--> actor --weights--> rollout

The reasoning flow's runner serves it (data, evaluation, checkpoints of the data order); the
stream it launches and its metrics row are its own. docs/flows.md walks through this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping

import torch
from omegaconf import DictConfig

from m2flow.config.schema import (AT_LEAST_1, ReasoningAlgorithmConfig, ReasoningConfig, ReasoningPlacementConfig, opt,
                                  section)
from m2flow.config.validate import ConfigError, check_custom_placement, check_data, check_model, check_rewards
from m2flow.flow import Plan, Workflow
from m2flow.flow.simulate import Shape
from m2flow.runners import reasoning
from m2flow.runners.flow import Flow
from m2flow.runners.metrics import component_times, trained_stats
from m2flow.runtime import Channel, Clock, Worker
from m2flow.runtime.group import GroupHandle
from m2flow.workers.lm_common import END, until_end
from m2flow.workers.reports import SelectReport

COMPONENTS = ("rollout", "reward", "select", "actor")


@dataclass
class SelectConfig:
    keep: int = opt(1, "completions kept per prompt: its best by reward", within=AT_LEAST_1)
    min_reward: float = opt(1.0, "a completion is kept only if its reward is at least this")


@dataclass
class RejectionAlgorithmConfig(ReasoningAlgorithmConfig):
    name: str = opt("sft", "sft: the negative log-likelihood of the kept completions", choices=("sft",))
    critic_lr: float = opt(1.0, "unused: no critic")


@dataclass
class RejectionPlacementConfig(ReasoningPlacementConfig):
    components: Dict[str, Any] = opt(dict.fromkeys(COMPONENTS), "mode custom: device ranges per component")


@dataclass
class RejectionConfig(ReasoningConfig):
    flow: str = opt("rejection", "which macro flow runs it")
    select: SelectConfig = section(SelectConfig, "which completions the actor trains on")
    algorithm: RejectionAlgorithmConfig = section(RejectionAlgorithmConfig, "the objective and its optimiser")
    placement: RejectionPlacementConfig = section(RejectionPlacementConfig, "which devices each component runs on")


def check(d: Mapping, training: bool = True) -> None:  # the rules between keys, on the resolved config
    check_model(d["model"]["path"])
    check_rewards(d["reward"]["functions"])
    check_data(d["data"], training)
    check_custom_placement(d["placement"], COMPONENTS)
    if d["select"]["keep"] > d["rollout"]["n"]:
        raise ConfigError("select.keep", f"must be <= rollout.n={d['rollout']['n']}, got {d['select']['keep']}")
    if d["algorithm"]["kl_coef"]:
        raise ConfigError("algorithm.kl_coef", "must be 0: this flow has no reference model")


class SelectWorker(Worker):
    def __init__(self, cfg: dict):
        self.keep, self.min_reward = cfg["select"]["keep"], cfg["select"]["min_reward"]

    def best(self, scored_in: Channel, batches_out: Channel, readers: int, key: int = 0) -> SelectReport:
        """Each group's best ``keep`` completions that reach ``min_reward``, on to the actor's
        ``readers`` ranks (each takes what it can; each gets the end marker)."""
        clock, groups, kept, dropped = Clock(), 0, 0, []
        for batch in until_end(scored_in, key, clock):
            with clock.busy():
                n, rewards = batch.extras["group_size"], batch.extras["reward"]
                order = rewards.view(-1, n).argsort(dim=1, descending=True, stable=True)[:, :self.keep]
                rows = (order + n * torch.arange(len(order))[:, None]).reshape(-1)
                rows = rows[rewards[rows] >= self.min_reward]
                groups, kept = groups + len(order), kept + len(rows)
                dropped += batch.sample_ids(sorted(set(range(len(rewards))) - set(rows.tolist())))  # not kept
                if len(rows):
                    batches_out.put(batch.select(rows), key, weight=len(rows))
        for _ in range(readers):
            batches_out.put(END, key)
        batches_out.flush()
        return SelectReport(**clock.report(), groups=groups, kept=kept, dropped=dropped)


class RejectionRunner(reasoning.ReasoningRunner):
    def prepare(self) -> None:
        super().prepare()
        self.metrics = RejectionMetrics(self.total)

    def launch(self, key: int, trained_by: int) -> dict[str, GroupHandle]:
        prompts, ch, g = next(self.loader), self.channels, self.groups
        return {"rollout": g["rollout"].generate(prompts, ch["samples"], self.plan.granularity["samples"], key,
                                                 None, self.streams.synced or 0),
                "reward": g["reward"].score(ch["samples"], ch["scored"], len(prompts), key),
                "select": g["select"].best(ch["scored"], ch["batches"], g["actor"].world_size, key)}

    def worker_args(self, component: str, take_turns: bool) -> tuple:
        return (self.plain,) if component == "select" else super().worker_args(component, take_turns)


class RejectionMetrics(reasoning.ReasoningMetrics):
    """A step's row: ``reward`` (of every completion), ``kept`` (the share trained on), ``loss``
    (their tokens' mean negative log-likelihood), ``grad_norm``, ``policy_lag``, ``completion_length``,
    and each component's busy and idle seconds."""

    def row(self, i: int, report: dict[str, Any], step_s: float, time_s: float) -> dict[str, float]:
        rollout, (reward,), (select,), actor = report["rollout"], report["reward"], report["select"], report["actor"]
        completions = max(1, sum(r.completions for r in rollout))
        row = {"step": i + 1, "time_s": time_s, "step_s": step_s, "reward": reward.reward,
               "kept": select.kept / completions, "weight_sync_s": report["sync"].weight_sync_s,
               "completion_length": sum(r.completion_tokens for r in rollout) / completions}
        row |= trained_stats(actor)
        self.ledger.record(i + 1, report)
        return row | component_times({"rollout": rollout, "reward": [reward], "select": [select], "actor": actor})


def shape(cfg: DictConfig, plan: Plan, fused: bool) -> Shape:
    """As the reasoning flow's: the groups stream in chunks through reward and select to the actor."""
    prompts = cfg.data.prompts_per_step
    waves = -(-prompts * cfg.rollout.n // cfg.rollout.max_batch_size)  # of sequences decoded at once
    return Shape(("rollout", "reward", "select"), "actor", prompts * cfg.rollout.n,
                 -(-prompts // plan.granularity["samples"]), batched=("rollout",),
                 trainer_streams=not reasoning.sharded(cfg, plan), first_out=1 / waves, row_groups=prompts)


WORKFLOW = Workflow(
    "rejection", components=COMPONENTS, makers=("rollout",), trainer="actor", channels=("samples", "scored", "batches"),
    splits={"disaggregated": ((("rollout",), 0.5), (("reward", "select", "actor"), None)),
            "hybrid": ((("rollout",), 0.5), (("reward", "select"), None))},
    single_rank=("reward", "select"), whole_on_cpu=COMPONENTS, light=("reward", "select"), gpu_collectives=("actor",))

FLOW = Flow(
    "rejection", WORKFLOW, {**reasoning.WORKERS, "select": SelectWorker}, RejectionRunner, config=RejectionConfig,
    check=check, length_key="runner.steps", shape=shape, knobs=reasoning.knobs, length=reasoning.length,
    probe_sizes=reasoning.probe_sizes, score=reasoning.score, duration="step_s", probe_updates=2,
    sized_on_one_device=False, stateful=("rollout", "actor"), resume_keys=("algorithm.name", "model.path"),
    prefetch={"batches": 1}, plan_options=reasoning.plan_options)
