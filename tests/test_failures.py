"""A component that raises in its main call, in each flow and placement: the run fails with
that component's error, naming its group, rank and method, and closing it ends in seconds.
The other components' calls were waiting on channels the failed one would have filled; a
close that queued behind one of them waited forever (a reasoning run whose rollout failed
while the reward worker waited for its first group, until the channels went first).

The case that hung runs by default; the other 20 with ``-m slow`` (about 15 s each)."""

import dataclasses
import functools
import threading
import time

import pytest

from m2flow.config import load_config
from m2flow.runners import embodied, reasoning
from m2flow.runtime.errors import WorkerError

REASONING_CALLS = {"rollout": "generate", "reward": "score", "inference": "logprobs", "actor": "train"}
EMBODIED_CALLS = {"env": "interact", "rollout": "act", "actor": "train"}
REASONING_PLACEMENTS = {"collocated": [], "disaggregated": ["placement.mode=disaggregated"],
                        "two_ahead": ["placement.mode=disaggregated", "runner.max_staleness=2", "rollout.partial=true"]}
# (collocated, the embodied rollout runs inside the env workers: it has no call of its own)
EMBODIED_PLACEMENTS = {"hybrid": ["placement.mode=hybrid"],
                       "disaggregated": ["placement.mode=custom", "placement.components.env=0",
                                         "placement.components.rollout=1", "placement.components.actor=2-3"],
                       "two_ahead": ["placement.mode=custom", "placement.components.env=0",
                                     "placement.components.rollout=1", "placement.components.actor=2-3",
                                     "runner.max_staleness=2"]}


def failing(cls: type, method: str) -> type:
    """``cls`` whose ``method`` works once, then raises (after a second, so that the other
    components are waiting by then)."""
    work = getattr(cls, method)

    @functools.wraps(work)  # the same signature and dispatch
    def fail(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 1:
            return work(self, *args, **kwargs)
        time.sleep(1.0)
        raise ValueError(f"{method} failed on call {self.calls}")

    return type(f"Failing{cls.__name__}", (cls,), {method: fail})


def cases(flow: str, placements: dict, calls: dict, by_default: str = "") -> list:
    """Every (placement, component) of ``flow``; all but ``by_default`` ("placement-component") slow."""
    return [pytest.param(flow, placement, component, id=f"{flow}-{placement}-{component}",
                         marks=() if f"{placement}-{component}" == by_default else (pytest.mark.slow,))
            for placement in placements for component in calls]


@pytest.mark.parametrize("flow, placement, component",
                         cases("reasoning", REASONING_PLACEMENTS, REASONING_CALLS)
                         + cases("embodied", EMBODIED_PLACEMENTS, EMBODIED_CALLS, by_default="disaggregated-actor"))
def test_a_component_that_raises_fails_the_run_which_then_closes(cluster, tmp_path, flow, placement, component):
    if flow == "reasoning":
        spec, preset, calls = reasoning.FLOW, "reasoning/grpo_arith_tiny", REASONING_CALLS
        length, overrides = "runner.steps=4", REASONING_PLACEMENTS[placement]
    else:
        spec, preset, calls = embodied.FLOW, "embodied/ppo_cartpole", EMBODIED_CALLS
        length, overrides = "runner.total_env_steps=2048", EMBODIED_PLACEMENTS[placement]
    spec = dataclasses.replace(spec, workers={**spec.workers, component: failing(spec.workers[component],
                                                                                  calls[component])})
    cfg = load_config(preset, [f"runner.out_dir={tmp_path}", "runner.progress=false", "runner.hang_timeout_s=120",
                               length, *overrides])
    runner = spec.runner(cfg, cluster=cluster, flow=spec)
    try:
        with pytest.raises(WorkerError, match=rf"{component}-\w+ rank \d failed in {calls[component]}\(\): "
                                              rf"ValueError: {calls[component]} failed on call 2"):
            runner.train()
    finally:
        closing = threading.Thread(target=runner.close, daemon=True)
        started = time.monotonic()
        closing.start()
        closing.join(timeout=60)
    assert not closing.is_alive(), "close() still waits after 60 s"
    assert time.monotonic() - started < 30
