"""Agentic RL: the model answers over several turns, calling tools between them.

The reasoning flow's stream, with a rollout that takes turns: a sequence generates until
the end of its turn; the turn's tool calls run (in parallel, off the engine's thread) while
the other sequences go on decoding; the results come back as the chat template's own
``tool`` turn and the sequence rejoins the batch (``m2flow.tools.episodes``). A trajectory
is exactly the tokens the model saw, in order; the loss mask is 1 on the tokens it sampled
and 0 on the tools' (``SequenceBatch.completion_mask``), so the actor trains on its own
tokens in the context of the results. The reward scores the last turn, the answer:

    rollout (<-> tool) --samples--> reward --scored--> inference --batches--> actor --weights--> rollout

The calls run on the rollout's own threads, or (``tools.workers``) in the ``tool``
component's processes (``workers/tool.py``), which the plan places like any other component:
on cores of their own, so that a tool's subprocesses do not crowd the rollout's, and as many
as the plan gives them. The reasoning flow's runner serves it (data, evaluation,
checkpoints); its rollout, tool workers, config sections (``tools``, the rollout's
trajectory bounds) and metrics row are its own.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, List, Mapping

import numpy as np
import torch
from omegaconf import DictConfig

from m2flow.config.schema import AT_LEAST_1, NON_NEGATIVE, POSITIVE, ReasoningConfig, RolloutConfig, opt, section
from m2flow.config.validate import ConfigError, check_reasoning
from m2flow.data.prompts import eval_prompts
from m2flow.engines import SamplingParams, build_engine
from m2flow.engines.batch import SequenceBatch
from m2flow.flow import Plan, Workflow
from m2flow.flow.simulate import Shape
from m2flow.runners import reasoning
from m2flow.runners.evaluate import checkpoint_lm
from m2flow.runners.flow import Flow
from m2flow.runners.metrics import component_times
from m2flow.rewards import Scores
from m2flow.runtime import Channel
from m2flow.tools import Toolbox
from m2flow.tools.base import MALFORMED
from m2flow.tools.episodes import ANSWERED, ToolTurns
from m2flow.workers.lm_rollout import LMRolloutWorker, engine_options
from m2flow.workers.reports import GenerateReport, RewardReport
from m2flow.workers.reward import RewardWorker
from m2flow.workers.tool import RemoteTools, ToolWorker


@dataclass
class ToolsConfig:
    names: List[Any] = opt([], "the task's tools: built-in names (python | calculator | search), import paths "
                               "(package.module:function or :Class), or {path: ..., <the class's options>}")
    max_turns: int = opt(4, "the model's turns in a trajectory at most", within=AT_LEAST_1)
    max_calls: int = opt(8, "tool calls a turn at most: those past it are answered with an error", within=AT_LEAST_1)
    timeout_s: float = opt(10.0, "seconds a call may take: then it is answered with an error", within=POSITIVE)
    max_response_tokens: int = opt(256, "a result's tokens at most: a longer one is cut and marked", within=AT_LEAST_1)
    threads: int = opt(8, "calls running at once, per rollout rank (where the rollout runs them)", within=AT_LEAST_1)
    workers: bool = opt(False, "the calls run in tool worker processes, the component 'tool' that the plan places "
                               "(one per device of its own by default), rather than on the rollout's threads")
    malformed_penalty: float = opt(0.0, "taken off a trajectory's reward for each malformed call it made",
                                   within=NON_NEGATIVE)
    error_penalty: float = opt(0.0, "taken off a trajectory's reward for each call answered with another error "
                                    "(a tool that raised, timed out, an unknown tool, bad arguments, too many calls)",
                               within=NON_NEGATIVE)


@dataclass
class AgenticRolloutConfig(RolloutConfig):
    max_total_tokens: int = opt(1024, "a trajectory's tokens at most (prompt, turns and results; within the model's "
                                      "context): results that would cross it end the trajectory, at 'length'",
                                within=AT_LEAST_1)
    resume: str = opt("park", "how a sequence whose tools answered rejoins the batch: park (its KV kept, the results "
                              "fed) | prefill (fed again whole)", choices=("park", "prefill"))
    batch_invariant: bool = opt(False, "every decode step at one shape and every prompt prefilled alone, so that which "
                                       "sequences share a step does not change a sequence's logits (docs/agentic.md: "
                                       "what holds, and its cost); false: steps only as large as needed")


@dataclass
class AgenticConfig(ReasoningConfig):
    flow: str = opt("agentic", "which macro flow runs it")
    tools: ToolsConfig = section(ToolsConfig, "the tools a trajectory may call, and the limits of its turns")
    rollout: AgenticRolloutConfig = section(AgenticRolloutConfig, "generation, over several turns")


def check(d: Mapping, training: bool = True) -> None:  # the rules between keys, on the resolved config
    check_reasoning(d, training)
    if not d["tools"]["names"]:
        raise ConfigError("tools.names", "names no tool: an agentic run needs at least one (e.g. [calculator])")
    try:
        Toolbox.load(d["tools"]["names"])
    except (ValueError, TypeError) as e:
        raise ConfigError("tools.names", str(e)) from None
    r = d["rollout"]
    if r["max_total_tokens"] <= r["max_new_tokens"]:
        raise ConfigError("rollout.max_total_tokens", f"must be above rollout.max_new_tokens={r['max_new_tokens']} "
                                                      f"(a turn's), got {r['max_total_tokens']}")


def tool_turns(plain: dict, toolbox: Toolbox, tokenizer: Any, eos_ids: set[int], **where: Any) -> ToolTurns:
    """The engine's ``turn_ended`` hook for the config's tools (``toolbox``) and limits;
    ``where``: ``run`` and ``forget`` where the calls run elsewhere (``RemoteTools``)."""
    t = plain["tools"]
    return ToolTurns(toolbox, tokenizer, eos_ids, max_turns=t["max_turns"], max_calls=t["max_calls"],
                     timeout=t["timeout_s"], max_response_tokens=t["max_response_tokens"], threads=t["threads"],
                     **where)


class ToolRolloutWorker(LMRolloutWorker):
    """The LM rollout, its sequences taking turns with the task's tools between them;
    ``tools``: the tool workers' group name and ranks, where they run the calls."""

    def __init__(self, cfg: dict, take_turns: bool = False, offload: bool = True, tools: tuple[str, int] | None = None):
        super().__init__(cfg, take_turns, offload)
        self.toolbox = Toolbox.load(cfg["tools"]["names"])
        self.tool_workers, self.engine_calls = tools, 0
        self.params = dataclasses.replace(self.params, max_total_tokens=cfg["rollout"]["max_total_tokens"])
        self.hook: ToolTurns | None = None
        # (prompt, sample) -> its calls, malformed ones and other errors, until its batch goes out
        self.calls: dict[tuple[int, int], tuple[int, int, int]] = {}

    def turn_options(self) -> dict:
        """A new engine call's hook: its trajectories' tool use is counted as their groups go out."""
        if self.hook is not None:
            self.hook.close()
        where = {}
        if self.tool_workers is not None:
            self.engine_calls += 1
            remote = RemoteTools(*self.tool_workers, self.rank, self.engine_calls)
            where = {"run": remote.run, "forget": remote.forget}
        self.hook = tool_turns(self.cfg, self.toolbox, self.tokenizer, self.engine.eos_ids, **where)
        return {"turn_ended": self.hook}

    def count_group(self, report: GenerateReport, prompt: dict, completions: list) -> None:
        super().count_group(report, prompt, completions)
        for c in completions:
            episode = self.hook.take(c.prompt_index, c.sample_index)
            report.tool_calls += episode.tool_calls
            report.tool_errors += sum(episode.errors.values())
            report.answered += episode.ended == ANSWERED
            report.tool_tokens += c.mask.count(False) if c.mask else 0
            report.tool_seconds += [r.seconds for turn in episode.results for r in turn]
            report.tool_wait_s += episode.waited_s
            errors = episode.errors
            self.calls[(prompt["index"], c.sample_index)] = (episode.tool_calls, errors[MALFORMED],
                                                             sum(errors.values()) - errors[MALFORMED])

    def _batch(self, groups: list[tuple[dict, list]]) -> SequenceBatch:
        """The rollout's batch, and each row's tool calls, malformed calls and other errors
        (``extras``: the reward worker's penalties and counts)."""
        batch = super()._batch(groups)
        counts = [self.calls.pop((p["index"], c.sample_index)) for p, group in groups for c in group]
        for name, values in zip(("tool_calls", "malformed_calls", "tool_errors"), zip(*counts)):
            batch.extras[name] = list(values)
        return batch


@dataclass(kw_only=True)
class ToolRewardReport(RewardReport):
    with_call: int = 0  # completions whose trajectory made a tool call
    solved_with_call: int = 0  # of them, solved (every reward function at 1 or more)
    without_call: int = 0
    solved_without_call: int = 0
    tool_penalty: float = 0.0  # the malformed and error penalties taken off the rewards, summed


class ToolRewardWorker(RewardWorker):
    """The reward worker, taking the tool penalties off each trajectory's reward (before the
    group's advantages, so a trajectory that erred ranks below its group's others that reached
    the same answer cleanly) and counting the answers solved with a tool call and without one."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.penalties = (cfg["tools"]["malformed_penalty"], cfg["tools"]["error_penalty"])
        self.tallies: dict[int, list[float]] = {}  # stream key -> the report's counts

    def score(self, samples_in: Channel, scored_out: Channel, num_groups: int, key: int = 0) -> ToolRewardReport:
        self.tallies[key] = [0, 0, 0, 0, 0.0]
        report = super().score(samples_in, scored_out, num_groups, key)
        counts = dict(zip(("with_call", "solved_with_call", "without_call", "solved_without_call", "tool_penalty"),
                          self.tallies.pop(key)))
        return ToolRewardReport(**{f.name: getattr(report, f.name) for f in dataclasses.fields(report)}, **counts)

    def shaping(self, key: int, batch: SequenceBatch, scores: Scores) -> torch.Tensor:
        solved = scores.solved
        called = np.array(batch.extras["tool_calls"]) > 0
        malformed, errors = (torch.tensor(batch.extras[k], dtype=torch.float32) for k in ("malformed_calls",
                                                                                          "tool_errors"))
        penalty = self.penalties[0] * malformed + self.penalties[1] * errors
        tally = self.tallies[key]
        tally[0] += int(called.sum())
        tally[1] += int((solved & called).sum())
        tally[2] += int((~called).sum())
        tally[3] += int((solved & ~called).sum())
        tally[4] += float(penalty.sum())
        return -penalty


TOOL = "tool"  # the tool workers' component (``tools.workers``)


def components(cfg: DictConfig) -> tuple[str, ...]:
    """The reasoning flow's, and the tool workers where the calls run in them."""
    return reasoning.components(cfg) + ((TOOL,) if cfg.tools.workers else ())


def with_tools(base: Workflow) -> Workflow:
    """The reasoning flow's workflow, and the tool workers: light (no model: they never take
    device turns), with the components after the rollout when the makers have devices of
    their own (their cores are then not the rollout's), one process per device unless the
    plan says otherwise."""
    splits = {mode: tuple((group + ((TOOL,) if share is None else ()), share) for group, share in groups)
              for mode, groups in base.splits.items()}
    return dataclasses.replace(base, name="agentic", components=(*base.components, TOOL), splits=splits,
                               light=(*base.light, TOOL))


def workflow(cfg: DictConfig) -> Workflow:
    return with_tools(reasoning.workflow(cfg))


def shape(cfg: DictConfig, plan: Plan, fused: bool) -> Shape:
    """The reasoning flow's step; the rollout <-> tool cycle priced as the tool workers' work
    beside the rollout's (``Shape.beside``)."""
    step = reasoning.shape(cfg, plan, fused)
    return dataclasses.replace(step, beside={"rollout": TOOL}) if TOOL in plan.components else step


class AgenticMetrics(reasoning.ReasoningMetrics):
    """The reasoning flow's row (docs/reasoning.md), and the tools': ``turns`` (the model's, per
    trajectory), ``tool_calls`` (per trajectory), ``tool_error_rate`` (of the calls),
    ``answered`` (the share of trajectories whose last turn made no call), ``tool_token_share``
    (of a trajectory's tokens after the prompt, the tools'), ``tool_latency_p50`` and
    ``tool_latency_p95`` (seconds a call took; 0 in a step with none), ``tool_wait_s`` (the
    seconds a trajectory spent waiting on its tools' results, out of the batch), ``tool_penalty``
    (the malformed and error penalties taken off a trajectory's reward, on average), and
    ``solved_with_tool_call`` and ``solved_without_tool_call``: the share solved of the
    trajectories that made a call, and of those that did not (nan where there are none). With
    tool workers, ``tool_busy_s`` and ``tool_idle_s`` (a rank's, on average, while at least one
    call ran and the rest of the step)."""

    def row(self, i: int, report: dict[str, Any], step_s: float, time_s: float) -> dict[str, float]:
        row = super().row(i, report, step_s, time_s)
        rollout = report["rollout"]
        n, calls = max(1, sum(r.completions for r in rollout)), sum(r.tool_calls for r in rollout)
        row |= {"turns": sum(r.turns for r in rollout) / n, "tool_calls": calls / n,
                "tool_error_rate": sum(r.tool_errors for r in rollout) / max(1, calls),
                "answered": sum(r.answered for r in rollout) / n}
        row["tool_token_share"] = sum(r.tool_tokens for r in rollout) / max(1, row["completion_tokens"])
        seconds = np.array([s for r in rollout for s in r.tool_seconds] or [0.0])
        row |= {"tool_latency_p50": float(np.percentile(seconds, 50)), "tool_latency_p95": float(np.percentile(seconds, 95)),
                "tool_wait_s": sum(r.tool_wait_s for r in rollout) / n}
        (reward,) = report["reward"]
        row["tool_penalty"] = reward.tool_penalty / n
        row["solved_with_tool_call"] = reward.solved_with_call / reward.with_call if reward.with_call else math.nan
        row["solved_without_tool_call"] = (reward.solved_without_call / reward.without_call if reward.without_call
                                           else math.nan)
        if TOOL in report:
            row |= component_times({TOOL: report[TOOL]})
        return row


class AgenticRunner(reasoning.ReasoningRunner):
    def prepare(self) -> None:
        super().prepare()
        self.metrics = AgenticMetrics(self.total)

    def worker_args(self, component: str, take_turns: bool) -> tuple:
        if component == TOOL:
            return (self.plain,)
        args = super().worker_args(component, take_turns)
        if component == "rollout" and TOOL in self.components:
            return (*args, (f"{TOOL}-{self.pool.tag}", self.plan.world_size(TOOL)))
        return args

    def step(self, i: int, ahead: int = 0) -> dict[str, Any]:
        """The reasoning flow's step, and the tool workers' calls and busy time since the last."""
        report = super().step(i, ahead)
        if TOOL in self.groups:
            report[TOOL] = self.groups[TOOL].report().wait()
        return report


def score(cfg: DictConfig, ckpt: dict, episodes: int = 0) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``m2flow eval``: the reasoning flow's scores of one greedy trajectory per prompt, its
    last turn scored; ``tool_call_rate``, the share of trajectories that made a call, the
    accuracy of those that did and of those that did not (None where there are none), and
    ``tool_wait_s``; and per prompt its whole trajectory, its turns and calls."""
    plain, model, tokenizer = checkpoint_lm(cfg, ckpt)
    prompts = eval_prompts(cfg)
    r = plain["rollout"]
    engine = build_engine(r["backend"], model, tokenizer, **engine_options(r, False))
    hook = tool_turns(plain, Toolbox.load(plain["tools"]["names"]), tokenizer, engine.eos_ids)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=r["max_new_tokens"], stop=tuple(r["stop"]), seed=0,
                            max_total_tokens=r["max_total_tokens"])
    out = {}
    try:
        for (c,) in engine.generate([p["token_ids"] for p in prompts], params, turn_ended=hook):
            out[c.prompt_index] = (c, hook.take(c.prompt_index, 0))
    finally:
        hook.close()
    answers = [tokenizer.decode(out[i][0].last_turn, skip_special_tokens=True) for i in range(len(prompts))]
    summary, examples = reasoning.scored(cfg, plain, tokenizer, prompts, answers)
    for i, example in enumerate(examples):
        c, episode = out[i]
        example |= {"trajectory": tokenizer.decode(c.token_ids), "turns": c.turns, "tool_calls": episode.tool_calls,
                    "tool_errors": sum(episode.errors.values()), "ended": episode.ended}
    called = [e for e in examples if e["tool_calls"]]
    uncalled = [e for e in examples if not e["tool_calls"]]
    return summary | {"tool_call_rate": len(called) / max(1, len(examples)),
                      "accuracy_with_tool_call": _accuracy(called), "accuracy_without_tool_call": _accuracy(uncalled),
                      "tool_wait_s": sum(out[i][1].waited_s for i in out) / max(1, len(out))}, examples


def _accuracy(examples: list[dict[str, Any]]) -> float | None:
    return sum(e["solved"] for e in examples) / len(examples) if examples else None


FLOW = Flow(
    "agentic", with_tools(reasoning.WORKFLOW),
    {**reasoning.WORKERS, "rollout": ToolRolloutWorker, "reward": ToolRewardWorker, TOOL: ToolWorker},
    AgenticRunner,
    config=AgenticConfig, check=check, length_key="runner.steps", shape=shape, knobs=reasoning.knobs,
    length=reasoning.length, probe_sizes=reasoning.probe_sizes, duration="step_s", probe_updates=2,
    sized_on_one_device=False, overlap_probe_updates=3, stateful=("rollout", "actor", "critic"),
    resume_keys=("algorithm.name", "model.path", "tools.names"), prefetch={"batches": 1},
    components_for=components, workflow_for=workflow, receivers=reasoning.receivers,
    refreshing=reasoning.refreshing, plan_options=reasoning.plan_options, score=score)
