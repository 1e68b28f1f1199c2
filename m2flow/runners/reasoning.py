"""Reasoning RL: LM rollout, reward, inference and actor, as one short loop.

The loop in ``step`` is the same whatever the Plan. Collocated, the components share every
device and take turns under the device locks: the rollout generates the whole batch, then
frees its KV cache (and on a GPU its weights) while the inference worker and the actor use
the devices; the actor's optimizer state leaves while the rollout generates. Disaggregated,
the rollout has devices of its own and streams each group of completions on as soon as it is
complete: reward, reference/old log-probs and the actor's forward and backward (unless its
ranks are sharded) run on the first groups while the rollout still generates the rest. With
``algorithm.name=ppo`` a critic sits between the inference worker and the actor: it adds
values and GAE advantages. A step's data flow, each arrow a channel:

    rollout.generate --samples--> reward.score --scored--> inference.logprobs
        [--logprobs--> critic.train] --batches--> actor.train --weights--> rollout (next step)
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from m2flow.config.validate import ConfigError, check_importable
from m2flow.data import PromptLoader
from m2flow.data.prompts import load_prompts
from m2flow.flow import Plan, Workflow
from m2flow.runners.base import Runner
from m2flow.runners.metrics import ReasoningMetrics
from m2flow.runtime.group import GroupHandle, WorkerError, wait
from m2flow.workers.inference import InferenceWorker, holds_a_model
from m2flow.workers.lm_actor import LMActorWorker
from m2flow.workers.lm_critic import LMCriticWorker
from m2flow.workers.lm_rollout import LMRolloutWorker
from m2flow.workers.reward import RewardWorker

COMPONENTS = ("rollout", "reward", "inference", "actor", "critic")
CLOSE_TIMEOUT_S = 10.0  # for the reward worker to end its scorer process
WORKFLOW = Workflow(
    "reasoning", components=COMPONENTS, makers=("rollout",), trainer="actor",
    channels=("samples", "scored", "logprobs", "batches"),
    # disaggregated: the rollout on the first half of the devices, the rest on the second;
    # hybrid: the same, but the actor has a rank on every device, so the ranks beside the
    # rollout join in once it has generated the step's batch.
    splits={"disaggregated": ((("rollout",), 0.5), (("reward", "inference", "critic", "actor"), None)),
            "hybrid": ((("rollout",), 0.5), (("reward", "inference", "critic"), None))},
    single_rank=("reward", "inference", "critic"),  # the stream passes through each in order
    whole_on_cpu=COMPONENTS,  # on CPU slots one rank spans its slots (its threads do)
    light=("reward",),  # holds no model: it never takes device turns
    gpu_collectives=("actor",))  # its ranks all-reduce gradients over NCCL on GPUs


def sharded(cfg: DictConfig, plan: Plan) -> bool:
    """Whether the actor's ranks shard the model (fsdp over more than one rank)."""
    return cfg.algorithm.data_parallel == "fsdp" and plan.world_size("actor") > 1


class ReasoningRunner(Runner):
    workflow = WORKFLOW
    workers = {"rollout": LMRolloutWorker, "reward": RewardWorker, "inference": InferenceWorker,
               "actor": LMActorWorker, "critic": LMCriticWorker}
    stateful = ("rollout", "actor", "critic")
    length_key = "runner.steps"
    resume_keys = ("algorithm.name", "model.path")
    prefetch = {"batches": 1}  # actor ranks take batches one at a time: a rank that is free takes the next

    @classmethod
    def components_of(cls, cfg: DictConfig) -> tuple[str, ...]:
        """A critic only for ppo."""
        return COMPONENTS if cfg.algorithm.name == "ppo" else COMPONENTS[:-1]

    @classmethod
    def workflow_of(cls, cfg: DictConfig) -> Workflow:
        """The inference worker holds a model only for a KL term or recomputed log-probs:
        without either it is light (it takes no device turns and makes no one take them)."""
        if holds_a_model(cfg.algorithm):
            return WORKFLOW
        return dataclasses.replace(WORKFLOW, light=(*WORKFLOW.light, "inference"))

    @staticmethod
    def plan_options(cfg: DictConfig) -> dict[str, Any]:
        return {"granularity": cfg.placement.granularity}

    def channels_of(self) -> tuple[str, ...]:
        return tuple(ch for ch in WORKFLOW.channels if ch != "logprobs" or "critic" in self.components)

    def prepare(self) -> None:
        check_importable(self.cfg)
        self.train_prompts, self.test_prompts = load_prompts(self.cfg)
        d = self.cfg.data
        self.loader = PromptLoader(self.train_prompts, d.prompts_per_step, seed=self.cfg.seed)
        self.plain = OmegaConf.to_container(self.cfg, resolve=True)
        self.total = self.cfg.runner.steps
        self.metrics = ReasoningMetrics(self.total)
        self.sharded = sharded(self.cfg, self.plan)

    def worker_args(self, component: str, take_turns: bool) -> tuple:
        return (self.plain,) if component == "reward" else (self.plain, take_turns, self.plan.offload)

    @classmethod
    def receivers_of(cls, cfg: DictConfig) -> list[str]:
        """The rollout, and the inference worker when it recomputes the old log-probs."""
        return ["rollout"] + (["inference"] if cfg.algorithm.old_logprobs == "recompute" else [])

    def senders(self) -> list[int] | None:
        return None if self.sharded else [0]  # sharded: every actor rank helps gather the weights

    @classmethod
    def refreshing_of(cls, cfg: DictConfig, plan: Plan) -> set[str]:
        """Generating ahead: the rollout takes new weights between decode steps
        (``rollout.partial``); the inference worker takes them before each batch when it
        recomputes the decoupled objective's proximal log-probs (the newest weights')."""
        if not plan.run_ahead:
            return set()
        a = cfg.algorithm
        return ({"rollout"} if cfg.rollout.partial else set()) | (
            {"inference"} if a.old_logprobs == "recompute" and a.off_policy == "decoupled" else set())

    def launch(self, key: int, trained_by: int) -> dict[str, GroupHandle]:
        """One step's stream, up to the batches channel: rollout -> reward -> inference (->
        critic). Items carry the stream's key: a reader that prefetches can then never take
        items of the next step's stream, generated ahead into the same channels."""
        prompts, ch, g = next(self.loader), self.channels, self.groups
        fresh = {c: (self.trainer.name if c in self.refreshing() else None) for c in ("rollout", "inference")}
        # a rollout that takes weights itself starts on those of the last sync at the earliest;
        # one that generates continuously is told of the stream at once, so that its prompts
        # join the decode batch while the streams before it finish (answered at once), on
        # weights at most one version behind those that will train on it
        min_version = self.synced or 0
        if fresh["rollout"] and self.cfg.rollout.continuous:
            g["rollout"].offer(prompts, key, min_version, trained_by - 1).wait()
        calls = {"rollout": g["rollout"].generate(prompts, ch["samples"], self.plan.granularity["samples"], key,
                                                  fresh["rollout"], min_version),
                 "reward": g["reward"].score(ch["samples"], ch["scored"], len(prompts), key)}
        if "critic" in g:  # ppo: the critic adds values, advantages and returns on the way to the actor
            calls["inference"] = g["inference"].logprobs(ch["scored"], ch["logprobs"], 1, key, fresh["inference"])
            calls["critic"] = g["critic"].train(ch["logprobs"], ch["batches"], g["actor"].world_size, key)
        else:
            calls["inference"] = g["inference"].logprobs(ch["scored"], ch["batches"], g["actor"].world_size, key,
                                                         fresh["inference"])
        return calls

    def step(self, i: int, ahead: int = 0) -> dict[str, Any]:
        """One policy update: the macro flow. Returns what each component reported.

        On-policy, the actor trains on the completions of the weights it starts from, as they
        stream in. With ``ahead = k``, the next k steps' rollouts are in flight while the actor
        trains, the newest started with this step's starting weights once the rollout is done
        with the one before: its data is k versions old when trained on (the ratio is taken
        against the log-probs it was sampled with, or ``algorithm.off_policy`` corrects)."""
        key, calls, sync = self.stream(ahead)
        calls = calls | {"actor": self.groups["actor"].train(self.channels["batches"], key)}
        return dict(zip(calls, wait(*calls.values()))) | {"sync": sync}

    def evaluates(self, i: int, last: bool) -> bool:
        """Before the first step (``i == -1``), every ``runner.eval_every`` steps and after the last."""
        every = self.cfg.runner.eval_every
        return i == -1 or last or (bool(every) and (i + 1) % every == 0)

    def evaluate(self) -> dict[str, float]:
        """Mean reward of one greedy completion per held-out prompt (accuracy, with a 0/1 reward)."""
        self.sync_weights()
        return self.held_out_scores()

    def defers_evaluation(self) -> bool:
        return self.cfg.runner.eval_deferred

    def evaluate_saved(self, path: Path) -> dict[str, float]:
        self.groups["rollout"].load_weights_file(str(path)).wait()
        return self.held_out_scores()

    def held_out_scores(self) -> dict[str, float]:
        """``evaluate`` with the weights the rollout holds."""
        texts = self.groups["rollout"].complete(self.test_prompts, 0.0).wait()
        (scores,) = self.groups["reward"].score_texts(texts, [p["answer"] for p in self.test_prompts]).wait()
        return {f"eval_{k}": v for k, v in scores.items()}

    def describe(self, first: int) -> str:
        c = self.cfg
        return (f"{c.algorithm.name}: steps {first}-{c.runner.steps - 1} of {c.data.prompts_per_step} prompts x "
                f"{c.rollout.n} samples; granularity {self.plan.granularity['samples']} group(s)")

    def extra_state(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        try:
            self.loader.load_state_dict(state["loader"])
        except ValueError as e:  # another data set's position
            raise ConfigError("runner.resume", f"the checkpoint's prompts are not this run's ({e}): resume with the "
                                               "same data.source and sizes") from None

    def close_components(self) -> None:
        # The reward worker's scorer process ends with its close(); the call waits behind the
        # worker's current one (which the channels' end has ended), for a bounded time.
        with contextlib.suppress(TimeoutError, WorkerError):
            self.groups["reward"].close().wait(timeout=CLOSE_TIMEOUT_S)
