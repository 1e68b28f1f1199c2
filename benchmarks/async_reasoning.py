"""Asynchronous GRPO against on-policy GRPO: wall-clock time to the same held-out accuracy.

Both sides train ``reasoning/grpo_arith_smollm2`` (SmolLM2-135M-Instruct, the arithmetic
problems) with the same seed and data, in fresh processes, one at a time, alternating
(ABAB over ``--repeats``):

  on-policy  ``runner.max_staleness=0`` in the plan the scheduler picks for it
             (``placement=auto``), or the plan given by ``--on-policy-placement`` (such as
             ``placement=collocated`` or ``placement=@PLAN``)
  async      ``runner.max_staleness=2`` with the plan the scheduler picks for it
             (``placement=auto``), new weights taken while sequences are in flight
             (``rollout.partial=true``), truncated importance sampling
             (``algorithm.off_policy=tis``; ``--async-override`` changes any of it)

Each side that plans profiles its own configuration once (the async side's differs in
``rollout.partial`` and ``algorithm.off_policy``), in its first repeat; the later repeats reuse
it. Profiling times are reported apart (``profiling_s``), counted in neither side's time.

Each side evaluates every ``--eval-every`` steps (greedy, the held-out problems). By default
the evaluations are deferred (``runner.eval_deferred``): the actor saves its weights at those
steps (the time it takes is counted in the side's time) and they are evaluated once training
ends, so neither side pauses for them and the async side's streams keep running. ``--eval
inline`` evaluates in the run instead, between steps, with nothing in flight: the async side
then drains at each evaluation and fills its pipeline again after it. Reported:
each side's curve (step, wall time, held-out accuracy), its final accuracy, and for the async
side the wall time at which it first reaches the on-policy run's final accuracy, as a ratio of
the on-policy run's whole time (``time_to_on_policy_accuracy_ratio``; <= 0.67 is >= 1.5x
faster), and its final accuracy less the on-policy one (in points). Wall time is the runs'
``time_s`` less the inline evaluations before it (``eval_s``; both sides run the same ones,
and they are the benchmark's, not the training's), with Ray start-up, model loading and the
profiling excluded.

    python benchmarks/async_reasoning.py [--steps 24] [--eval-every 4] [--eval deferred] [--repeats 1]
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
ASYNC = ["placement=auto", "runner.max_staleness=2", "rollout.partial=true", "algorithm.off_policy=tis"]


def child(spec: dict) -> None:
    import contextlib

    from m2flow.config import load_config
    from m2flow.runners import run

    cfg = load_config(PRESET, spec["overrides"])
    with contextlib.redirect_stdout(sys.stderr):
        history = run(cfg)
    curve, evaluating = [], 0.0  # time_s less the evaluations before it: the training's own time
    for r in history:
        if "eval_reward" in r and r["eval_reward"] == r["eval_reward"]:
            curve.append({"step": int(r["step"]), "time_s": r["time_s"] - evaluating, "accuracy": r["eval_reward"]})
        evaluating += r.get("eval_s", 0.0) if r["step"] > 0 else 0.0
    steps = [r for r in history if r["step"] > 0]
    profile = Path(cfg.placement.profile) if cfg.placement.profile else None
    json.dump({"curve": curve, "final_accuracy": curve[-1]["accuracy"], "time_s": curve[-1]["time_s"],
               "policy_lag": [r["policy_lag"] for r in steps],
               "stale_dropped": sum(r.get("stale_dropped", 0) for r in steps),
               "profile": str(profile) if profile else None}, open(spec["result"], "w"))


def first_reaching(curve: list[dict], accuracy: float) -> float | None:
    """The wall time of the first evaluation at or above ``accuracy`` (None: never)."""
    return next((p["time_s"] for p in curve if p["accuracy"] >= accuracy - 1e-9), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval", choices=("deferred", "inline"), default="deferred",
                   help="evaluate saved weights after training (deferred) or in the run, draining it (inline)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--on-policy-placement", default="placement=auto", help="placement=... for the on-policy side")
    p.add_argument("--async-override", nargs="*", default=[], help="key=value for the async side")
    p.add_argument("--override", nargs="*", default=[], help="key=value for both sides")
    args = p.parse_args()
    if args.child:
        return child(json.loads(args.child))
    bench = Run()
    tmp = Path(tempfile.mkdtemp(prefix="m2flow-async-"))
    common = [f"seed={args.seed}", f"runner.steps={args.steps}", f"runner.eval_every={args.eval_every}",
              f"runner.eval_deferred={args.eval == 'deferred'}", "runner.progress=false", *args.override]
    sides = {"on-policy": ["runner.max_staleness=0", args.on_policy_placement],
             "async": [*ASYNC, *args.async_override]}
    profiles = {side: tmp / f"{side}-profile.json" for side in sides}  # one per side, kept over the repeats
    runs = []
    for r in range(args.repeats):
        got = {}
        for side in side_order(list(sides), r):
            log(f"== repeat {r + 1}: {side}")
            spec = {"overrides": [*common, *sides[side], f"placement.profile={profiles[side]}",
                                  f"runner.out_dir={tmp / f'{side}{r}'}"]}
            got[side], load = loaded(lambda: run_child(__file__, spec))
            got[side] |= load
        on, asy = got["on-policy"], got["async"]
        reached = first_reaching(asy["curve"], on["final_accuracy"])
        runs.append({**got, "time_to_on_policy_accuracy_s": reached,
                     "time_to_on_policy_accuracy_ratio": None if reached is None else round(reached / on["time_s"], 3),
                     "final_accuracy_difference_points": round(100 * (asy["final_accuracy"] - on["final_accuracy"]), 1)})
    out = {"benchmark": "async_reasoning", "args": vars(args), "runs": runs,
           "profiling_s": {side: json.loads(f.read_text()).get("profiling_s") for side, f in profiles.items() if f.exists()},
           "ratio": spread([r["time_to_on_policy_accuracy_ratio"] for r in runs], 3),
           "accuracy_difference_points": spread([r["final_accuracy_difference_points"] for r in runs], 1),
           **bench.finish()}
    print(json.dumps(json_safe(out), indent=1))


if __name__ == "__main__":
    main()
