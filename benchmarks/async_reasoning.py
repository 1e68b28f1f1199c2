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
             (``algorithm.off_policy=tis``; ``--async-override`` changes any of it). The
             planner prices a plan ahead by the learning its lag costs
             (``placement.staleness_cost``), so it may pick an on-policy plan here;
             ``--async-override placement.staleness_cost=[]`` picks by step time alone

Each side that plans profiles its configuration once per seed (a profile is of one config, seed
included), in its first repeat; the later repeats reuse it. On GPUs the two sides share one
profile, made by the side that runs first: their configs differ only in running ahead and
truncated importance sampling, which change no probe's cost. On CPU slots the async side
makes its own, with the probe that measures contention. Profiling times are reported apart,
with the run that profiled (``profiling_s``; null where a stored profile was reused), counted
in neither side's time.

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
profiling excluded. Each side also reports how it learned, per step (``learning``): its training
reward, its policy's entropy and its completions' mean length (what tells a run that learned
less per step from one that only ran slower).

``--control`` adds a third run to each pair, after the async one: on-policy
(``runner.max_staleness=0``, no correction, no weights taken in flight) in the plan the async
side ran (the plan file its scheduler wrote, run ahead 0; or its given placement). Two plans
give the arithmetic other round-off (a component on one CPU slot computes on one thread, on
two on two), and at this size one run's curve turns that into 10-25 points; the async run
less the control is the lag's effect with the round-off of the same devices
(``final_accuracy_difference_vs_control_points``), and the control less the on-policy run
the plan's (``control_less_on_policy_points``). Over the pairs with a control the summary
estimates what running ahead costs a step's learning (``staleness_cost``: the entry of the
planner's ``placement.staleness_cost`` for the async runs' run-ahead): the steps they took to
their final mean accuracy over the control's, by the mean curves, less 1.

Each side's run folder (``runner.out_dir``, in a temporary folder whose name the log gives)
keeps its ``metrics.csv``, log and trace; its checkpoints (the preset's at step 20 and the
last, 3.4 GB a side for SmolLM2) are deleted once the side ends.

``--seed`` takes several seeds: a pair of runs per seed (and repeat), the sides' order
alternating from pair to pair. One run's held-out curve at this size varies more than the
effect measured (the same seed's on-policy run ended 16 points apart under two plans), so the
summary gives, over the pairs, the spread of each criterion, how many pairs met both, and the
mean accuracy difference with its standard error. ``--journal FILE`` appends each finished
side and each finished pair to FILE (JSON lines) and, run again with the same settings on a
machine of the same kind (its cores and GPUs), runs only the sides it lacks (the sides'
profiles are kept beside it): the pairs of several shorter runs add up, and a pair cut short
(a time limit, a lost machine) is finished by running its missing sides alone.

    python benchmarks/async_reasoning.py [--steps 24] [--eval-every 4] [--eval deferred] [--repeats 1]
        [--seed 0 1 2] [--control] [--journal pairs.jsonl]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (Run, append_jsonl, json_safe, loaded, log, read_jsonl, run_child,  # noqa: E402
                    side_order, spread)

PRESET = "reasoning/grpo_arith_smollm2"
ASYNC = ["placement=auto", "runner.max_staleness=2", "rollout.partial=true", "algorithm.off_policy=tis"]
LEARNING = ("reward", "entropy", "completion_length")  # per step, from each side's metrics


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
    json.dump({"curve": curve, "final_accuracy": curve[-1]["accuracy"], "time_s": curve[-1]["time_s"],
               "policy_lag": [r["policy_lag"] for r in steps],
               "stale_dropped": sum(r.get("stale_dropped", 0) for r in steps),
               "learning": {k: [r.get(k) for r in steps] for k in LEARNING}}, open(spec["result"], "w"))


def machine_kind() -> dict:
    """What makes two machines alike for this benchmark's times: their cores and GPUs."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"cpus": os.cpu_count(), "gpus": gpus}


def first_reaching(curve: list[dict], accuracy: float) -> float | None:
    """The wall time of the first evaluation at or above ``accuracy`` (None: never)."""
    return next((p["time_s"] for p in curve if p["accuracy"] >= accuracy - 1e-9), None)


def _stamp(path: Path) -> int | None:
    """When ``path`` was last written (None: it does not exist)."""
    return path.stat().st_mtime_ns if path.exists() else None


def points(a: dict, b: dict) -> float:
    """Run ``a``'s final held-out accuracy less ``b``'s, in points."""
    return round(100 * (a["final_accuracy"] - b["final_accuracy"]), 1)


def pair_result(on: dict, asy: dict) -> dict:
    """The acceptance's two figures for one pair of runs."""
    reached = first_reaching(asy["curve"], on["final_accuracy"])
    return {"time_to_on_policy_accuracy_s": reached,
            "time_to_on_policy_accuracy_ratio": None if reached is None else round(reached / on["time_s"], 3),
            "final_accuracy_difference_points": points(asy, on)}


def control_result(on: dict, asy: dict, control: dict) -> dict:
    """The async run against on-policy in its own plan, and that against the on-policy run."""
    return {"final_accuracy_difference_vs_control_points": points(asy, control),
            "control_less_on_policy_points": points(control, on)}


def control_overrides(async_overrides: list[str], async_out: Path, plan_file: Path) -> list[str]:
    """The control side's overrides: the async side's, made on-policy, in the plan it ran. A
    plan its scheduler wrote (``plan.yaml``) is run again as it is, but not ahead."""
    from m2flow.flow import Plan

    on_policy = [*async_overrides, "runner.max_staleness=0", "rollout.partial=false", "algorithm.off_policy=none"]
    written = async_out / "plan.yaml"
    if not written.exists():  # a placement given, not planned: the same overrides place it alike
        return on_policy
    plan = Plan.load(written)
    plan.run_ahead = 0
    return [*on_policy, "placement.mode=collocated", f"placement=@{plan.save(plan_file)}"]  # a plan file wins


def _mean_sem(values: list[float]) -> dict:
    mean = statistics.fmean(values) if values else None
    sem = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return {"mean": None if mean is None else round(mean, 1), "sem": None if sem is None else round(sem, 1),
            "n": len(values)}


def staleness_cost(pairs: list[dict]) -> dict | None:
    """What running ahead costs a step's learning (an entry of ``placement.staleness_cost``),
    from the pairs run with a control (the async run's plan, on-policy): over their mean
    held-out curves, the control reached the async runs' final mean accuracy at step s (the
    first crossing, linear between evaluations) of the N steps both ran, so the async runs took
    N / s the steps to it: the entry for their run-ahead (the most versions their data lagged)
    is N / s - 1. Where the control never reached it, running ahead cost nothing measurable (at
    most 0). From three pairs on, its jackknife standard error (``cost_se``; None where leaving
    a pair out leaves no finite estimate). None without such pairs, with curves evaluated at
    other steps, or with no lag."""
    runs = [p for p in pairs if isinstance(p.get("control"), dict) and isinstance(p.get("async"), dict)]
    if not runs:
        return None
    steps = [pt["step"] for pt in runs[0]["control"]["curve"]]
    if len(steps) < 2 or any([pt["step"] for pt in p[side]["curve"]] != steps for p in runs
                             for side in ("async", "control")):
        return None
    lags = [lag for p in runs for lag in p["async"].get("policy_lag", [])]
    if not lags or not max(lags):
        return None
    control, asy = ([statistics.fmean(p[side]["curve"][i]["accuracy"] for p in runs) for i in range(len(steps))]
                    for side in ("control", "async"))
    target = asy[-1]
    out = {"pairs": len(runs), "run_ahead": max(lags), "mean_policy_lag": round(statistics.fmean(lags), 3),
           "async_final_mean": round(asy[-1], 4), "control_final_mean": round(control[-1], 4)}
    if control[0] >= target:  # the async runs ended where the runs started: no finite count of steps
        return out | {"control_step_reaching": 0, "steps_ratio": None, "cost": None}
    reached = next((i for i in range(1, len(steps)) if control[i] >= target), None)
    if reached is None:
        return out | {"control_step_reaching": None, "steps_ratio": None, "cost_at_most": 0.0}
    a, b = control[reached - 1], control[reached]
    at = steps[reached - 1] + (steps[reached] - steps[reached - 1]) * (target - a) / (b - a)
    ratio = steps[-1] / at
    out |= {"control_step_reaching": round(at, 2), "steps_ratio": round(ratio, 3), "cost": round(ratio - 1, 3),
            "cost_se": None}
    if len(runs) >= 3:  # the jackknife: the estimate again without each pair in turn
        rest = [staleness_cost(runs[:i] + runs[i + 1:]) for i in range(len(runs))]
        if all(r and r.get("cost") is not None for r in rest):
            values, n = [r["cost"] for r in rest], len(rest)
            mean = statistics.fmean(values)
            out["cost_se"] = round(math.sqrt((n - 1) / n * sum((v - mean) ** 2 for v in values)), 3)
    return out


def summary(pairs: list[dict], max_ratio: float = 0.67, min_difference: float = -3.0) -> dict:
    """Over the pairs: each criterion's spread, the pairs that met both (the time ratio at most
    ``max_ratio``, the accuracy difference at least ``min_difference`` points), and the mean
    difference with its standard error (None from one pair)."""
    ratios = [p["time_to_on_policy_accuracy_ratio"] for p in pairs]
    diffs = [p["final_accuracy_difference_points"] for p in pairs]
    met = sum(r is not None and r <= max_ratio and d >= min_difference for r, d in zip(ratios, diffs))
    diff = _mean_sem(diffs)
    out = {"pairs": len(pairs), "met_both": met, "never_reached": sum(r is None for r in ratios),
           "ratio": spread(ratios, 3), "accuracy_difference_points": spread(diffs, 1),
           "accuracy_difference_mean_points": diff["mean"], "accuracy_difference_sem_points": diff["sem"]}
    controlled = [p for p in pairs if "final_accuracy_difference_vs_control_points" in p]
    if controlled:  # the pairs run with --control
        out["vs_control_points"] = _mean_sem([p["final_accuracy_difference_vs_control_points"] for p in controlled])
        out["control_less_on_policy_points"] = _mean_sem([p["control_less_on_policy_points"] for p in controlled])
        out["staleness_cost"] = staleness_cost(controlled)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval", choices=("deferred", "inline"), default="deferred",
                   help="evaluate saved weights after training (deferred) or in the run, draining it (inline)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, nargs="+", default=[0], help="one pair of runs per seed (and repeat)")
    p.add_argument("--on-policy-placement", default="placement=auto", help="placement=... for the on-policy side")
    p.add_argument("--async-override", nargs="*", default=[], help="key=value for the async side")
    p.add_argument("--override", nargs="*", default=[], help="key=value for both sides")
    p.add_argument("--control", action="store_true",
                   help="a third run per pair: on-policy in the plan the async side ran (see above)")
    p.add_argument("--journal", help="append each side and pair here (JSON lines); the sides it holds are not run again")
    args = p.parse_args()
    if args.child:
        return child(json.loads(args.child))
    bench = Run()
    # what makes two pairs comparable: everything but the seeds, the repeats and the journal
    settings = {k: v for k, v in vars(args).items() if k not in ("child", "seed", "repeats", "journal")
                and (k != "control" or v)}  # journals from before --control stay comparable without it
    journal = [r for r in read_jsonl(args.journal) if r.get("settings") == settings]
    done = {(r["seed"], r["repeat"]): r for r in journal if "side" not in r}
    machine = machine_kind()  # a side is reused only from a machine of the same kind
    sides_done = {(r["seed"], r["repeat"], r["side"]): r for r in journal
                  if "side" in r and r.get("machine") == machine}
    tmp = Path(tempfile.mkdtemp(prefix="m2flow-async-"))
    keep = Path(args.journal).with_suffix(".profiles") if args.journal else tmp  # the sides' profiles
    keep.mkdir(parents=True, exist_ok=True)
    log(f"run folders in {tmp}")
    sides = {"on-policy": ["runner.max_staleness=0", args.on_policy_placement],
             "async": [*ASYNC, *args.async_override]}
    runs = []
    for n, (seed, r) in enumerate((seed, r) for seed in args.seed for r in range(args.repeats)):
        if (seed, r) in done:
            log(f"== seed {seed}, repeat {r + 1}: in {args.journal}")
            runs.append(done[(seed, r)])
            continue
        common = [f"seed={seed}", f"runner.steps={args.steps}", f"runner.eval_every={args.eval_every}",
                  f"runner.eval_deferred={args.eval == 'deferred'}", "runner.progress=false", *args.override]
        got = {}
        order = side_order(list(sides), n) + (["control"] if args.control else [])  # the control after the async
        for side in order:
            # made by the seed's first repeat, reused by the later ones; on GPUs one profile for
            # both sides (the async config's probes are the on-policy one's: it measures no
            # contention there), on CPU slots the async side's has its contention probe
            profile = keep / (f"seed{seed}.json" if machine["gpus"] else f"{side}-seed{seed}.json")
            out_dir = tmp / f"{side}-seed{seed}-{r}"
            if (seed, r, side) in sides_done:
                log(f"== seed {seed}, repeat {r + 1}: {side}, in {args.journal}")
                record = sides_done[(seed, r, side)]
                got[side] = record["result"]
                if record.get("plan"):  # the control runs in the plan the async side ran
                    out_dir.mkdir(parents=True, exist_ok=True)
                    (out_dir / "plan.yaml").write_text(record["plan"])
                continue
            log(f"== seed {seed}, repeat {r + 1}: {side}")
            overrides = sides[side] if side in sides else control_overrides(
                sides["async"], tmp / f"async-seed{seed}-{r}", tmp / f"control-seed{seed}-{r}.yaml")
            spec = {"overrides": [*common, *overrides, f"placement.profile={profile}", f"runner.out_dir={out_dir}"]}
            before = _stamp(profile)
            got[side], load = loaded(lambda: run_child(__file__, spec))
            shutil.rmtree(out_dir / "checkpoints", ignore_errors=True)  # 3.4 GB a side; metrics.csv and the log stay
            profiled = _stamp(profile) != before  # a side with a plan given never writes it
            got[side] |= load | {"profiling_s": json.loads(profile.read_text()).get("profiling_s") if profiled else None}
            plan = out_dir / "plan.yaml"
            append_jsonl(args.journal, {"seed": seed, "repeat": r, "settings": settings, "machine": machine,
                                        "side": side, "result": got[side],
                                        "plan": plan.read_text() if plan.exists() else None})
        runs.append({"seed": seed, "repeat": r, "settings": settings, **got,
                     **pair_result(got["on-policy"], got["async"]),
                     **(control_result(got["on-policy"], got["async"], got["control"]) if args.control else {})})
        append_jsonl(args.journal, runs[-1])
    out = {"benchmark": "async_reasoning", "args": vars(args), "runs": runs, "summary": summary(runs),
           **bench.finish()}
    print(json.dumps(json_safe(out), indent=1))


if __name__ == "__main__":
    main()
