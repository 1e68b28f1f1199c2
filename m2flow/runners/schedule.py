"""Each flow as the scheduler sees it: the shape of a step (``flow.simulate.Shape``) under a
plan, the knobs its plans may turn, a run of a few updates for profiling, and the checks a
plan must pass before the flow can lay its work out on it."""

from __future__ import annotations

from typing import Any, ClassVar

from omegaconf import DictConfig

from m2flow.flow import Plan, Workflow
from m2flow.flow.simulate import Shape
from m2flow.runners.base import Runner
from m2flow.runners.embodied import EmbodiedRunner, env_layout
from m2flow.runners.reasoning import ReasoningRunner, sharded


class Schedule:
    runner: ClassVar[type[Runner]]
    duration: ClassVar[str]  # the metrics' column of a step's wall time

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.workflow: Workflow = self.runner.workflow
        self.components = self.runner.components_of(cfg)

    def shape(self, plan: Plan, fused: bool) -> Shape:
        raise NotImplementedError

    def knobs(self) -> dict[str, Any]:
        """``planner.candidates``'s keywords: the values each knob may take."""
        raise NotImplementedError

    def probe(self, updates: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Overrides that make a run of ``updates`` updates, and a plan setting that changes a
        chunk's size (so the profile sees each component at two sizes)."""
        raise NotImplementedError

    def check(self, plan: Plan) -> None:
        """Fails (ConfigError) unless the flow can lay its work out on ``plan``."""

    def plan_options(self) -> dict[str, Any]:
        return self.runner.plan_options(self.cfg)


class EmbodiedSchedule(Schedule):
    runner = EmbodiedRunner
    duration = "update_s"

    def shape(self, plan: Plan, fused: bool) -> Shape:
        """The envs, in ``stages`` batches, step and act ``rollout_steps`` times; then the
        actor trains on all of it."""
        c = self.cfg
        return Shape(("env", "rollout"), "actor", c.env.num_envs, plan.stages, repeats=c.runner.rollout_steps,
                     samples=c.env.num_envs * c.runner.rollout_steps * c.policy.chunk, whole_turns=("env", "rollout"))

    def knobs(self) -> dict[str, Any]:
        n = self.cfg.env.num_envs
        return {"stages": [s for s in (1, 2, 4) if n % s == 0 and n >= s]}

    def probe(self, updates: int) -> tuple[dict[str, Any], dict[str, Any]]:
        c = self.cfg
        steps = updates * c.runner.rollout_steps * c.env.num_envs * c.policy.chunk
        return {"runner.total_env_steps": steps, "runner.target_return": None}, {"stages": 2}

    def check(self, plan: Plan) -> None:
        env_layout(self.cfg, plan, self.components)


class ReasoningSchedule(Schedule):
    runner = ReasoningRunner
    duration = "step_s"

    def shape(self, plan: Plan, fused: bool) -> Shape:
        """The rollout generates the batch; its groups go on in chunks of ``granularity``
        through reward, inference (and critic) to the actor, which trains on each as it comes
        unless its ranks are sharded."""
        c = self.cfg
        chain = ("rollout", "reward", "inference") + (("critic",) if "critic" in self.components else ())
        prompts = c.data.prompts_per_step
        return Shape(chain, "actor", prompts * c.rollout.n, -(-prompts // plan.granularity["samples"]),
                     batched=("rollout",), trainer_streams=not sharded(c, plan))

    def knobs(self) -> dict[str, Any]:
        p = self.cfg.data.prompts_per_step  # a step in 1, 2, 4, ... 64 chunks of prompt groups
        return {"granularities": sorted({-(-p // chunks) for chunks in (1, 2, 4, 8, 16, 32, 64)})}

    def probe(self, updates: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"runner.steps": updates}, {"granularity": self.cfg.data.prompts_per_step}  # one chunk a step


def schedule_of(cfg: DictConfig) -> Schedule:
    if cfg.flow == "embodied":
        return EmbodiedSchedule(cfg)
    if cfg.flow == "reasoning":
        return ReasoningSchedule(cfg)
    raise ValueError(f"unknown flow {cfg.flow!r} (known: embodied, reasoning)")
