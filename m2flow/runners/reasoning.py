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

The file reads top to bottom: the components, the macro flow (``ReasoningRunner``), its
metrics, the step as the scheduler sees it, ``m2flow eval``'s scores, and ``FLOW``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from m2flow.config.schema import ReasoningConfig
from m2flow.config.validate import ConfigError, check_importable, check_reasoning
from m2flow.data import PromptLoader
from m2flow.data.prompts import eval_prompts, load_prompts
from m2flow.engines import SamplingParams, build_engine
from m2flow.flow import Plan, Workflow
from m2flow.flow.simulate import Shape
from m2flow.rewards.scorer import RewardScorer
from m2flow.runners.base import Runner
from m2flow.runners.evaluate import checkpoint_lm
from m2flow.runners.flow import Flow
from m2flow.runners.metrics import Ledger, Staleness, component_times, trained_stats
from m2flow.runtime.errors import WorkerError
from m2flow.runtime.group import GroupHandle, wait
from m2flow.workers.inference import InferenceWorker, holds_a_model
from m2flow.workers.lm_actor import LMActorWorker
from m2flow.workers.lm_critic import LMCriticWorker
from m2flow.workers.lm_rollout import LMRolloutWorker, engine_options
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
WORKERS = {"rollout": LMRolloutWorker, "reward": RewardWorker, "inference": InferenceWorker,
           "actor": LMActorWorker, "critic": LMCriticWorker}


def components(cfg: DictConfig) -> tuple[str, ...]:
    """A critic only for ppo."""
    return COMPONENTS if cfg.algorithm.name == "ppo" else COMPONENTS[:-1]


def workflow(cfg: DictConfig) -> Workflow:
    """The inference worker holds a model only for a KL term or recomputed log-probs: without
    either it is light (it takes no device turns and makes no one take them)."""
    if holds_a_model(cfg.algorithm):
        return WORKFLOW
    return dataclasses.replace(WORKFLOW, light=(*WORKFLOW.light, "inference"))


def receivers(cfg: DictConfig) -> list[str]:
    """The rollout, and the inference worker when it recomputes the old log-probs."""
    return ["rollout"] + (["inference"] if cfg.algorithm.old_logprobs == "recompute" else [])


def refreshing(cfg: DictConfig, plan: Plan) -> set[str]:
    """Generating ahead: the rollout takes new weights between decode steps
    (``rollout.partial``); the inference worker takes them before each batch when it
    recomputes the decoupled objective's proximal log-probs (the newest weights')."""
    if not plan.run_ahead:
        return set()
    a = cfg.algorithm
    return ({"rollout"} if cfg.rollout.partial else set()) | (
        {"inference"} if a.old_logprobs == "recompute" and a.off_policy == "decoupled" else set())


def plan_options(cfg: DictConfig) -> dict[str, Any]:
    return {"granularity": cfg.placement.granularity}


def sharded(cfg: DictConfig, plan: Plan) -> bool:
    """Whether the actor's ranks shard the model (fsdp over more than one rank)."""
    return cfg.algorithm.data_parallel == "fsdp" and plan.world_size("actor") > 1


class ReasoningRunner(Runner):
    def channels_of(self) -> tuple[str, ...]:
        return tuple(ch for ch in self.workflow.channels if ch != "logprobs" or "critic" in self.components)

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

    def senders(self) -> list[int] | None:
        return None if self.sharded else [0]  # sharded: every actor rank helps gather the weights

    def launch(self, key: int, trained_by: int) -> dict[str, GroupHandle]:
        """One step's stream, up to the batches channel: rollout -> reward -> inference (->
        critic). Items carry the stream's key: a reader that prefetches can then never take
        items of the next step's stream, generated ahead into the same channels."""
        prompts, ch, g = next(self.loader), self.channels, self.groups
        fresh = {c: (self.trainer.name if c in self.refreshing else None) for c in ("rollout", "inference")}
        # a rollout that takes weights itself starts on those of the last sync at the earliest;
        # one that generates continuously is told of the stream at once, so that its prompts
        # join the decode batch while the streams before it finish (answered at once), on
        # weights at most one version behind those that will train on it
        min_version = self.streams.synced or 0
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
        key, calls, sync = self.streams.next(ahead)
        calls = calls | {"actor": self.groups["actor"].train(self.channels["batches"], key)}
        return dict(zip(calls, wait(*calls.values()))) | {"sync": sync}

    def evaluates(self, i: int, last: bool) -> bool:
        """Before the first step (``i == -1``), every ``runner.eval_every`` steps and after the last."""
        every = self.cfg.runner.eval_every
        return i == -1 or last or (bool(every) and (i + 1) % every == 0)

    def evaluate(self) -> dict[str, float]:
        """Mean reward of one greedy completion per held-out prompt (accuracy, with a 0/1 reward)."""
        self.streams.sync_weights()
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


class ReasoningMetrics:
    """The reasoning flow's rows (documented in docs/reasoning.md), against steps."""

    x, y, x_name = "step", "eval_reward", "step"

    def __init__(self, progress_total: int):
        self.progress_total = progress_total
        self.staleness = Staleness()
        self.ledger = Ledger()  # each step's completions by id: (prompt index, index in its group)

    @property
    def trained(self) -> dict[int, list[int]]:
        """Step -> the prompt index of every completion trained on (the ledger's)."""
        return {step: [prompt for prompt, _ in ids] for step, ids in self.ledger.trained.items()}

    def state_dict(self) -> dict[str, float]:
        return {}  # nothing runs on from one step to the next

    def load_state_dict(self, state: dict[str, float]) -> None:
        pass

    def summary(self, row: dict[str, float]) -> str:
        return f"reward {row['reward']:.3f}  {row['step_s']:.1f} s/step"

    def row(self, i: int, report: dict[str, Any], step_s: float, time_s: float) -> dict[str, float]:
        """The metrics of step ``i + 1`` (steps count from 1; row 0 is the evaluation before training)."""
        rollout, (reward,), (inference,), actor = report["rollout"], report["reward"], report["inference"], report["actor"]
        row: dict[str, float] = {"step": i + 1, "time_s": time_s, "step_s": step_s, "reward": reward.reward,
                                 "reward_std": reward.reward_std, "groups_kept": reward.groups_kept,
                                 "groups": reward.groups, "reward_timeouts": reward.reward_timeouts, **reward.parts}
        completions = max(1, sum(r.completions for r in rollout))
        row["completion_tokens"] = sum(r.completion_tokens for r in rollout)
        row["completion_length"] = row["completion_tokens"] / completions
        row["truncated"] = sum(r.truncated for r in rollout) / completions
        row["rollout_tokens_per_s"] = row["completion_tokens"] / max(max(r.busy_s for r in rollout), 1e-9)
        row["decode_steps"] = sum(r.decode_steps for r in rollout)  # over the rollout ranks
        row["graph_replays"] = sum(r.graph_replays for r in rollout)
        row["prompts_joined_early"] = sum(r.joined_early for r in rollout)
        row |= trained_stats(actor)
        row["optimizer_steps"] = actor[0].optimizer_steps
        row["inert_rows"] = sum(r.inert_rows for r in actor)
        row["actor_update_busy_s"] = sum(r.update_busy_s for r in actor) / len(actor)
        row["stale_dropped"] = sum(r.stale_dropped for r in actor)
        row |= self.staleness.row(rollout, actor)
        self.ledger.record(i + 1, report)
        if inference.logprob_diff_max is not None:
            row["logprob_diff_max"] = inference.logprob_diff_max
        row |= {"weight_sync_s": report["sync"].weight_sync_s, "weight_mb": report["sync"].weight_mb or 0.0}
        parts = {"rollout": rollout, "reward": [reward], "inference": [inference], "actor": actor}
        if "critic" in report:
            (critic,) = parts["critic"] = report["critic"]
            row |= critic.stats
        return row | component_times(parts, memory=True)


# -- the step as the scheduler sees it (``runners.schedule``) -------------------------------
def shape(cfg: DictConfig, plan: Plan, fused: bool) -> Shape:
    """The rollout generates the batch, its first groups done after about one wave of
    ``rollout.max_batch_size`` sequences; its groups go on in chunks of ``granularity``
    through reward, inference (and critic) to the actor, which trains on each as it comes
    unless its ranks are sharded; it skips the rows of a group whose samples all got one
    reward."""
    chain = ("rollout", "reward", "inference") + (("critic",) if "critic" in components(cfg) else ())
    prompts = cfg.data.prompts_per_step
    waves = -(-prompts * cfg.rollout.n // cfg.rollout.max_batch_size)  # of sequences decoded at once
    return Shape(chain, "actor", prompts * cfg.rollout.n, -(-prompts // plan.granularity["samples"]),
                 batched=("rollout",), trainer_streams=not sharded(cfg, plan), first_out=1 / waves,
                 in_flight=FLOW.in_flight(cfg, plan), row_groups=prompts)


def knobs(cfg: DictConfig) -> dict[str, Any]:
    p = cfg.data.prompts_per_step  # a step in 1, 2, 4, ... 64 chunks of prompt groups
    return {"granularities": sorted({-(-p // chunks) for chunks in (1, 2, 4, 8, 16, 32, 64)})}


def length(cfg: DictConfig, updates: int) -> dict[str, Any]:
    return {"runner.steps": updates}


def probe_sizes(cfg: DictConfig, devices: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Steps of a quarter of the configured prompts (at least 4, at most all): a component's
    time grows with the completions it handles, so a model fitted on smaller steps predicts the
    configured one (peak memory is about the same: the rollout decodes ``max_batch_size``
    sequences at a time, the trainers take micro-batches by tokens). The other size, twice as
    many prompts (at most all) in one chunk, runs on all the devices too: it tells a cost per
    chunk (an all-reduce) from one per completion; the split probe sees fewer devices."""
    p = cfg.data.prompts_per_step
    q = p if p <= 4 else max(4, p // 4)
    v = min(2 * q, p)
    return {"data.prompts_per_step": q}, {"granularity": v}, {"data.prompts_per_step": v}


# -- m2flow eval -------------------------------------------------------------------------------
def score(cfg: DictConfig, ckpt: dict, episodes: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``m2flow eval``: one greedy completion per prompt, scored by ``reward.functions``, the
    weights rounded to ``rollout.dtype`` as in the run's own evaluations; the prompts are every
    row of ``data.source`` when it names a file, else the generated held-out problems. The mean
    weighted reward, each function's mean, and the accuracy: the share of prompts on which every
    reward function scored 1 or more; and per prompt its text (chat-formatted, as the model saw
    it), completion, reference answer and scores."""
    plain, model, tokenizer = checkpoint_lm(cfg, ckpt)
    prompts = eval_prompts(cfg)
    r = plain["rollout"]
    engine = build_engine(r["backend"], model, tokenizer, **engine_options(r, False))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=r["max_new_tokens"], stop=tuple(r["stop"]), seed=0)
    texts: dict[int, str] = {}
    for (c,) in engine.generate([p["token_ids"] for p in prompts], params):
        texts[c.prompt_index] = c.text
    return scored(cfg, plain, tokenizer, prompts, [texts[i] for i in range(len(prompts))])


def scored(cfg: DictConfig, plain: dict, tokenizer: Any, prompts: list[dict],
           completions: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The summary and the per-prompt rows of ``score``, for ``completions`` of ``prompts``."""
    with RewardScorer(dict(plain["reward"]["functions"]), timeout_s=plain["reward"]["timeout_s"]) as scorer:
        scores = scorer.score(completions, [p["answer"] for p in prompts])
    full = scores.solved
    names = {k: f"reward_{k.rpartition(':')[2]}" for k in scores.parts}
    examples = [{"index": i, "prompt": tokenizer.decode(p["token_ids"]), "completion": completions[i],
                 "answer": p["answer"], "reward": float(scores.total[i]), "solved": bool(full[i]),
                 **{names[k]: float(v[i]) for k, v in scores.parts.items()}, "timed_out": bool(scores.timed_out[i])}
                for i, p in enumerate(prompts)]
    return {"source": cfg.data.source, "prompts": len(prompts), "accuracy": float(full.mean()),
            "reward": float(scores.total.mean()), **{names[k]: float(v.mean()) for k, v in scores.parts.items()},
            "timed_out": int(scores.timed_out.sum())}, examples


FLOW = Flow(
    "reasoning", WORKFLOW, WORKERS, ReasoningRunner, config=ReasoningConfig, check=check_reasoning,
    length_key="runner.steps", shape=shape, knobs=knobs, length=length, probe_sizes=probe_sizes, duration="step_s",
    probe_updates=2,  # a step of a language model takes seconds to minutes
    sized_on_one_device=False, overlap_probe_updates=3,
    stateful=("rollout", "actor", "critic"), resume_keys=("algorithm.name", "model.path"),
    prefetch={"batches": 1},  # actor ranks take batches one at a time: a rank that is free takes the next
    components_for=components, workflow_for=workflow, receivers=receivers, refreshing=refreshing,
    plan_options=plan_options, score=score)
