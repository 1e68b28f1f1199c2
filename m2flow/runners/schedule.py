"""Each flow as the scheduler sees it: the shape of a step (``flow.simulate.Shape``) under a
plan, the knobs its plans may turn, a run of a few updates for profiling, and the checks a
plan must pass before the flow can lay its work out on it."""

from __future__ import annotations

from typing import Any, ClassVar

from omegaconf import DictConfig

from m2flow.flow import Plan, Workflow
from m2flow.flow.simulate import Shape
from m2flow.runners.base import Runner
from m2flow.runners.embodied import EmbodiedRunner, steps_per_update
from m2flow.runners.reasoning import ReasoningRunner, sharded


class Schedule:
    runner: ClassVar[type[Runner]]
    duration: ClassVar[str]  # the metrics' column of a step's wall time
    # Updates the first profiling run makes, its first left out (warm-up); the later runs, their
    # processes warm, make one fewer and time them all.
    probe_updates: ClassVar[int]
    # The probe at the other size runs on one device (else on all of them, as the first does):
    # see ``probe_sizes``.
    sized_on_one_device: ClassVar[bool] = True
    # Updates of the probe that runs the split plan one version ahead, its components computing
    # at once, to measure how much they slow each other (``runners.auto``); 0: no such probe.
    overlap_probe_updates: ClassVar[int] = 0

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.workflow: Workflow = self.runner.workflow_of(cfg)
        self.components = self.runner.components_of(cfg)

    def shape(self, plan: Plan, fused: bool) -> Shape:
        raise NotImplementedError

    def knobs(self) -> dict[str, Any]:
        """``planner.candidates``'s keywords: the values each knob may take."""
        raise NotImplementedError

    def length(self, updates: int) -> dict[str, Any]:
        """Overrides that make a run of ``updates`` updates."""
        raise NotImplementedError

    def probe_sizes(self, devices: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """How the profiling runs on ``devices`` devices size their work: overrides for every
        one of them, and the plan settings and overrides of the one that sees each component
        at another size on one device (so that the cost model can tell a component's fixed
        cost from its cost per item)."""
        raise NotImplementedError

    def check(self, plan: Plan) -> None:
        """Fails (ConfigError) unless the flow can lay its work out on ``plan``."""
        self.runner.check_plan(self.cfg, plan)

    def plan_options(self) -> dict[str, Any]:
        return self.runner.plan_options(self.cfg)


class EmbodiedSchedule(Schedule):
    runner = EmbodiedRunner
    duration = "update_s"
    probe_updates = 3

    def shape(self, plan: Plan, fused: bool) -> Shape:
        """The envs, in ``stages`` batches, step and act ``rollout_steps`` times; then the
        actor trains on all of it."""
        c = self.cfg
        return Shape(("env", "rollout"), "actor", c.env.num_envs, plan.stages, repeats=c.runner.rollout_steps,
                     samples=steps_per_update(c), whole_turns=("env", "rollout"),
                     in_flight=self.runner.in_flight(c, plan))

    def knobs(self) -> dict[str, Any]:
        n = self.cfg.env.num_envs
        return {"stages": [s for s in (1, 2, 4) if n % s == 0 and n >= s]}

    def length(self, updates: int) -> dict[str, Any]:
        c = self.cfg
        return {"runner.total_env_steps": updates * steps_per_update(c), "runner.target_return": None}

    def probe_sizes(self, devices: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The step as configured; the other size is every env in one batch on one device,
        where the first probe shares them out over all the devices (on a one-device cluster,
        the envs in two batches, ``stages``): the envs step and act in batches of two sizes,
        which tells a cost per call (a batched inference, an env worker's step) from a cost
        per env."""
        return {}, {"stages": 1 if devices > 1 else 2}, {}


class ReasoningSchedule(Schedule):
    runner = ReasoningRunner
    duration = "step_s"
    probe_updates = 2  # a step of a language model takes seconds to minutes
    sized_on_one_device = False
    # (The embodied flow has none: its profiling, about 8% of a 1M-env-step run, has no room for
    # another probe; its predictions leave contention out, and the planner says so.)
    overlap_probe_updates = 3

    def shape(self, plan: Plan, fused: bool) -> Shape:
        """The rollout generates the batch, its first groups done after about one wave of
        ``rollout.max_batch_size`` sequences; its groups go on in chunks of ``granularity``
        through reward, inference (and critic) to the actor, which trains on each as it comes
        unless its ranks are sharded; it skips the rows of a group whose samples all got one
        reward."""
        c = self.cfg
        chain = ("rollout", "reward", "inference") + (("critic",) if "critic" in self.components else ())
        prompts = c.data.prompts_per_step
        waves = -(-prompts * c.rollout.n // c.rollout.max_batch_size)  # of sequences decoded at once
        return Shape(chain, "actor", prompts * c.rollout.n, -(-prompts // plan.granularity["samples"]),
                     batched=("rollout",), trainer_streams=not sharded(c, plan), first_out=1 / waves,
                     in_flight=self.runner.in_flight(c, plan), row_groups=prompts)

    def knobs(self) -> dict[str, Any]:
        p = self.cfg.data.prompts_per_step  # a step in 1, 2, 4, ... 64 chunks of prompt groups
        return {"granularities": sorted({-(-p // chunks) for chunks in (1, 2, 4, 8, 16, 32, 64)})}

    def length(self, updates: int) -> dict[str, Any]:
        return {"runner.steps": updates}

    def probe_sizes(self, devices: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Steps of a quarter of the configured prompts (at least 4, at most all): every
        component's time grows with the completions it handles, so the model fitted on smaller
        steps predicts the configured one; the other size is twice as many prompts (at most
        all) in one chunk. Peak memory is about the same at either size: the rollout decodes
        ``rollout.max_batch_size`` sequences at a time and the trainers take micro-batches of
        ``algorithm.max_tokens_per_micro_batch`` tokens. The other size runs on all the
        devices, like the first: two sizes on as many devices tell a device effect per chunk
        (an all-reduce) from one per completion (a process's threads sharing the work less
        well), and the split probe gives the points on fewer devices."""
        p = self.cfg.data.prompts_per_step
        q = p if p <= 4 else max(4, p // 4)
        v = min(2 * q, p)
        return {"data.prompts_per_step": q}, {"granularity": v}, {"data.prompts_per_step": v}


def schedule_of(cfg: DictConfig) -> Schedule:
    if cfg.flow == "embodied":
        return EmbodiedSchedule(cfg)
    if cfg.flow == "reasoning":
        return ReasoningSchedule(cfg)
    raise ValueError(f"unknown flow {cfg.flow!r} (known: embodied, reasoning)")
