"""Continuous generation across steps (``rollout.continuous``) against a rollout that drains
at the end of each step, in an asynchronous GRPO run.

Both sides train ``reasoning/grpo_arith_smollm2`` (SmolLM2-135M-Instruct, the arithmetic
problems) two versions ahead with weights taken in flight and truncated importance sampling
(``runner.max_staleness=2 rollout.partial=true algorithm.off_policy=tis``), in the same given
plan (default ``placement.mode=disaggregated``: the rollout on devices of its own), with the
same seed, in fresh processes, one at a time, alternating (ABAB over ``--repeats``). They
differ only in ``rollout.continuous``. Reported per side, from each run's metrics: the step
times after ``--warmup`` steps (min, median, max), the rollout's busy time and tokens per
busy second, the actor's idle time, the policy lags, the prompts that joined the decode batch
early; and ``ratio``: the median step time of the draining side over the continuous side's
(> 1: continuous is faster), with ``ratio_tokens_per_s``: the continuous side's rollout
tokens per busy second over the other's. Evaluations are off but for the one before
training (``runner.eval_every=0``, a small held-out set); Ray start-up and model loading are
outside the step times.

A step's time follows its completions' lengths, and with in-flight updates two runs learn
apart (one run's completions shortened from 76 to 10 tokens in 12 steps, the other's stayed
near 70): to compare the generation alone, freeze the weights (``--override
algorithm.lr=1e-12``), so that both sides sample from the same policy throughout.

    python benchmarks/continuous_rollout.py [--steps 12] [--warmup 2] [--repeats 2] [--seed 0]
        [--override key=value ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import Run, json_safe, loaded, log, run_child, side_order, spread  # noqa: E402

PRESET = "reasoning/grpo_arith_smollm2"
ASYNC = ["runner.max_staleness=2", "rollout.partial=true", "algorithm.off_policy=tis", "runner.eval_every=0",
         "runner.checkpoint_every=0", "data.test_size=4", "runner.progress=false"]
SIDES = {"draining": ["rollout.continuous=false"], "continuous": ["rollout.continuous=true"]}


def child(spec: dict) -> None:
    import contextlib

    from m2flow.config import load_config
    from m2flow.runners import run

    cfg = load_config(PRESET, spec["overrides"])
    with contextlib.redirect_stdout(sys.stderr):
        history = run(cfg)
    steps = [r for r in history if r["step"] > 0]
    keys = ("step_s", "rollout_busy_s", "actor_idle_s", "completion_tokens", "policy_lag", "prompts_joined_early",
            "stale_dropped", "reward")
    json.dump({k: [r.get(k) for r in steps] for k in keys}, open(spec["result"], "w"))


def side_summary(runs: list[dict], warmup: int) -> dict:
    """Over the runs of one side, the steps after ``warmup``."""
    def after(key: str) -> list[float]:
        return [v for r in runs for v in r[key][warmup:] if v is not None]

    busy, tokens = sum(after("rollout_busy_s")), sum(after("completion_tokens"))
    return {"step_s": spread(after("step_s"), 3), "rollout_busy_s": spread(after("rollout_busy_s"), 3),
            "actor_idle_s": spread(after("actor_idle_s"), 3),
            "rollout_tokens_per_busy_s": round(tokens / busy, 1) if busy else None,
            "policy_lag": {str(k): after("policy_lag").count(k) for k in sorted(set(after("policy_lag")))},
            "prompts_joined_early": sum(after("prompts_joined_early")),
            "stale_dropped": sum(after("stale_dropped")),
            "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the times")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--placement", default="placement.mode=disaggregated", help="the plan both sides run")
    p.add_argument("--override", nargs="*", default=[], help="key=value for both sides")
    args = p.parse_args()
    if args.child:
        return child(json.loads(args.child))
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must be more than --warmup ({args.warmup})")

    bench = Run()
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    loads: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(args.repeats):
        for side in side_order(list(SIDES), r):
            with tempfile.TemporaryDirectory(prefix=f"m2flow-continuous-{side}-") as out:
                overrides = [f"runner.steps={args.steps}", f"seed={args.seed}", f"runner.out_dir={out}",
                             args.placement, *ASYNC, *args.override, *SIDES[side]]
                log(f"[{side}, repeat {r}] {' '.join(overrides)}")
                result, load = loaded(lambda: run_child(__file__, {"overrides": overrides}))
            runs[side].append(result)
            loads[side].append(load)
    sides = {side: side_summary(runs[side], args.warmup) | {"load": loads[side]} for side in SIDES}
    draining, continuous = sides["draining"], sides["continuous"]
    report = {
        "benchmark": "continuous_rollout", "preset": PRESET, "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats, "seed": args.seed, "placement": args.placement, "overrides": [*ASYNC, *args.override],
        **sides,
        "ratio": round(draining["step_s"]["median"] / continuous["step_s"]["median"], 3),
        "ratio_tokens_per_s": round(continuous["rollout_tokens_per_busy_s"] / draining["rollout_tokens_per_busy_s"], 3),
        **bench.finish(),
    }
    print(json.dumps(json_safe(report), indent=2))


if __name__ == "__main__":
    main()
