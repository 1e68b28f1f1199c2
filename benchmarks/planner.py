"""The scheduler against measurement: for each workload, profile it, predict every feasible
plan on this machine, run each for the same work, and compare; then ``placement=auto``
against the best measured plan.

Workloads (``--workloads``):
  halfcheetah  embodied/ppo_halfcheetah (2048 env steps per update)
  ant          embodied/ppo_ant
  sac_halfcheetah  replay/sac_halfcheetah with 2 envs, in rounds of 200 env steps, learning from the first
  smollm2      reasoning/grpo_arith_smollm2 with 16 prompts x 8 samples per step (64 new
               tokens at most, as in the placement runs of docs/benchmark-runs.md), every row
               forwarded (``algorithm.skip_inert_rows=false``): skipping the rows of zero
               gradient makes a step's training follow that step's rewards (3-7x apart from
               step to step), which no plan changes and no few-step profile can predict

Per workload, one run:
  1. ``m2flow profile`` in a fresh process, timed (a new profile: ``--profile-dir`` is emptied);
  2. the planner's ranked list of feasible plans (``runners.auto.choose``), within the
     staleness allowance (``--staleness``: 0, on-policy only; k, plans up to k updates ahead too);
  3. every plan (or ``--max-plans`` of them, the planner's order, then every mode's best)
     run for ``--updates`` updates in a fresh process (``m2flow train ... placement=@plan``),
     its step time the median after the first ``--warmup`` updates (default 1);
  4. ``placement=auto`` (the stored profile: no profiling) and the best measured plan, run
     alternately ``--repeats`` times each.

Reported: predicted vs measured step time per plan and the error; the median error; the
pick's measured step over the best measured; profiling time (the profile's own, from a
started cluster, which a run starts anyway; and the ``m2flow profile`` process's wall time)
against a 1M-env-step run (embodied) or a one-hour run (reasoning) at the best measured
speed; auto's throughput over the best plan's. Prints JSON on stdout (progress on stderr);
``--journal FILE`` also appends each workload's profile and each measured plan to FILE as they
come (JSON lines), so that a run cut short keeps what it measured; ``--resume FILE`` goes on from
such a journal (same workloads and overrides): its profile is used instead of a new one (or,
``--new-profile``, a new one is measured and journaled: the model changed), the plans and the
``placement=auto`` / best pairs it measured are not run again, and what is measured now is
appended to it (a sweep of SmolLM2's 25 plans takes hours: it may span runs).

    python benchmarks/planner.py --workloads halfcheetah ant smollm2 [--staleness 0 1]
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import (Run, append_jsonl, cores, json_safe, load1, log, matmul_gflops, read_jsonl,  # noqa: E402
                    side_order, spread)

WORKLOADS = {
    "halfcheetah": ("embodied/ppo_halfcheetah", []),
    "ant": ("embodied/ppo_ant", []),
    "smollm2": ("reasoning/grpo_arith_smollm2", ["data.prompts_per_step=16", "rollout.n=8", "rollout.max_new_tokens=64",
                                                  "algorithm.max_tokens_per_micro_batch=1152",
                                                  "algorithm.skip_inert_rows=false"]),
    # 2 envs (profiling runs every component on both slots first), rounds of 200 env steps (and 200
    # gradient steps), learning from the first (the profiler's runs too)
    "sac_halfcheetah": ("replay/sac_halfcheetah", ["env.num_envs=2", "runner.rollout_steps=100",
                                                   "runner.eval_every=0"]),
    "tiny": ("reasoning/grpo_arith_tiny", []),  # smoke runs
    "cartpole": ("embodied/ppo_cartpole", []),
}
M2FLOW = [sys.executable, "-m", "m2flow.cli"]


def length(cfg, updates: int) -> list[str]:
    """Overrides that make a run of ``updates`` updates (the profiler's, with evaluations
    only before the first and after the last)."""
    from m2flow.runners.schedule import schedule_of

    overrides = schedule_of(cfg).length(updates)
    extra = ["runner.eval_every=0"] if cfg.flow == "reasoning" else []
    return [f"{k}={'null' if v is None else v}" for k, v in overrides.items()] + extra


def measure(preset: str, overrides: list[str], out: Path, warmup: int = 1) -> dict:
    """Runs the preset in a fresh process; the median step time after the first ``warmup`` updates,
    with the load and the machine's fp32 matmul speed (GFLOP/s, all threads) before and after
    (this machine's speed drifts by a third within an hour: a plan measured in a slow stretch
    reads slower)."""
    start, before, speed = time.perf_counter(), load1(), matmul_gflops(cores())
    subprocess.run([*M2FLOW, "train", preset, *overrides, f"runner.out_dir={out}", "runner.progress=false",
                    "runner.checkpoint_every=0"], check=True, stdout=sys.stderr, stderr=sys.stderr)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # a SmolLM2 run's last checkpoint is ~1.6 GB
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    col = "update_s" if "update_s" in rows[0] else "step_s"
    steps = [float(r[col]) for r in rows if r.get(col) not in (None, "")]
    timed = steps[warmup:] or steps
    return {"step_s": statistics.median(timed), "steps": steps, "run_s": round(time.perf_counter() - start, 1),
            "load_before": before, "load_after": load1(), "gflops_before": speed,
            "gflops_after": matmul_gflops(cores())}


def plan_key(plan: dict) -> str:
    return json.dumps(plan, sort_keys=True)


def journaled(path: str | None, name: str, base: list[str]) -> dict:
    """What the journal at ``path`` holds of workload ``name``: its profile record, its measured
    rows by plan, its ``placement=auto`` / best sides by (side, repeat). A journal of other
    overrides fails: its figures are of another workload."""
    done: dict = {"rows": {}, "sides": {}}
    if not path:
        return done

    def settings(overrides: list[str]) -> list[str]:  # the profile's path aside: a run's own
        return [o for o in overrides if not o.startswith("placement.profile=")]

    own = settings(base)
    for record in read_jsonl(path):
        if record.get("workload") != name:
            continue
        if "profile" in record:
            theirs = settings(record["overrides"])
            if theirs != own:
                raise SystemExit(f"{path}: {name} was run with overrides {theirs}, not {own}: nothing to resume")
            done["profile"] = record
        elif "row" in record:
            done["rows"][plan_key(record["row"]["plan_file"])] = record["row"]
        elif "side" in record:
            done["sides"][(record["side"], record["repeat"])] = record
    return done


def workload(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    from m2flow.config import load_config
    from m2flow.flow.cost import CostModel, Profile
    from m2flow.flow.planner import priced
    from m2flow.runners.auto import choose

    preset, extra = WORKLOADS[name]
    staleness = [f"runner.max_staleness={args.staleness}"]
    base = [*extra, *args.override, *staleness, f"placement.profile={tmp / (name + '-profile.json')}"]
    cfg = load_config(preset, base)
    done = journaled(args.resume, name, base)
    if "profile" in done and not args.new_profile:
        log(f"== {name}: the profile of {args.resume}; {len(done['rows'])} plan(s) measured there")
        stored, profile_wall = done["profile"]["profile"], done["profile"].get("profiling_wall_s")
        Path(cfg.placement.profile).write_text(json.dumps(stored))  # placement=auto reads it
    else:
        log(f"== {name}: profiling")
        t0 = time.perf_counter()
        subprocess.run([*M2FLOW, "profile", preset, *base], check=True, stdout=sys.stderr, stderr=sys.stderr)
        profile_wall = time.perf_counter() - t0
        stored = json.loads(Path(cfg.placement.profile).read_text())  # also for benchmarks/planner_replay.py
        append_jsonl(args.journal, {"workload": name, "preset": preset, "overrides": base, "profile": stored,
                       "profiling_wall_s": round(profile_wall, 1)})
    prof = Profile.from_dict(stored)
    choice = choose(cfg, prof)
    model = CostModel(prof)
    ranked = choice.ranked
    chosen = ranked[:args.max_plans] if args.max_plans else list(ranked)
    for c in ranked:  # every mode's best too
        if all(c.mode != x.mode for x in chosen):
            chosen.append(c)
    rows = []
    for i, c in enumerate(chosen):
        path = c.plan.save(tmp / f"{name}-plan{i}.yaml")
        before = done["rows"].get(plan_key(c.plan.to_dict()))
        if before is not None:
            m = {k: before[k] for k in ("steps", "run_s", "load_before", "load_after", "gflops_before", "gflops_after")
                 if k in before} | {"step_s": before["measured_s"]}
            log(f"== {name}: plan {i + 1}/{len(chosen)}: {c.describe()}: measured {m['step_s']:.3f} s before")
        else:
            log(f"== {name}: plan {i + 1}/{len(chosen)}: {c.describe()} (predicted {c.step_s:.3f} s)")
            m = measure(preset, [*extra, *args.override, *length(cfg, args.updates), f"placement=@{path}"],
                        tmp / f"{name}-run{i}", args.warmup)
        rows.append({"plan": c.describe(), "rank": ranked.index(c) + 1, "predicted_s": round(c.step_s, 4),
                     "measured_s": round(m["step_s"], 4), "error": round(c.step_s / m["step_s"] - 1, 3), **m,
                     "plan_file": c.plan.to_dict()})
        if before is None:
            append_jsonl(args.journal, {"workload": name, "row": rows[-1]})
    best = min(rows, key=lambda r: r["measured_s"])
    pick = rows[0]
    # the pick is the least priced (a version ahead costs learning: placement.staleness_cost)
    cost = list(cfg.placement.staleness_cost)
    for r in rows:
        r["priced_s"] = round(priced(r["measured_s"], r["plan_file"].get("run_ahead", 0), cost), 4)
    best_priced = min(rows, key=lambda r: r["priced_s"])
    # placement=auto (reusing the stored profile) against the best measured plan, alternately
    auto_vs = []
    best_path = tmp / f"{name}-best.yaml"
    best_path.write_text((tmp / f"{name}-plan{rows.index(best)}.yaml").read_text())
    for r in range(args.repeats):
        got = {}
        for side in side_order(["auto", "best"], r):
            if (side, r) in done["sides"]:
                got[side] = done["sides"][side, r]
                continue
            over = ["placement=auto", *staleness, f"placement.profile={cfg.placement.profile}"] if side == "auto" \
                else [f"placement=@{best_path}"]
            got[side] = measure(preset, [*extra, *args.override, *length(cfg, args.updates), *over],
                                tmp / f"{name}-{side}{r}", args.warmup)
            append_jsonl(args.journal, {"workload": name, "side": side, "repeat": r, **got[side]})
        auto_vs.append({"auto_s": got["auto"]["step_s"], "best_s": got["best"]["step_s"],
                        "throughput_ratio": round(got["best"]["step_s"] / got["auto"]["step_s"], 3)})
    if cfg.flow == "embodied":
        from m2flow.runners.embodied import steps_per_update

        reference_s, reference = 1_000_000 / steps_per_update(cfg) * best["measured_s"], "a 1M-env-step run"
    else:
        reference_s, reference = 3600.0, "a one-hour run"
    errors = [abs(r["error"]) for r in rows]
    return {
        "preset": preset, "overrides": base, "plans_feasible": len(ranked), "plans_rejected": len(choice.rejected),
        "plans_measured": len(rows), "rows": rows,
        "pick": pick["plan"], "best_measured": best["plan"],
        "pick_over_best": round(pick["measured_s"] / best["measured_s"], 3), "staleness_cost": cost,
        "best_measured_priced": best_priced["plan"],
        "pick_over_best_priced": round(pick["priced_s"] / best_priced["priced_s"], 3),
        "median_abs_error": round(statistics.median(errors), 3),
        "profiling_s": round(prof.profiling_s, 1), "profiling_wall_s": profile_wall and round(profile_wall, 1),
        "profiling_share": round(prof.profiling_s / reference_s, 3),
        "profiling_wall_share": profile_wall and round(profile_wall / reference_s, 3), "reference": reference,
        "reference_s": round(reference_s, 1), "model_held_out_error": model.held_out_error(),
        "planning_s": round(choice.planning_s, 3),
        "auto_vs_best": auto_vs, "auto_throughput_over_best": spread([a["throughput_ratio"] for a in auto_vs], 3),
        "profile": stored,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=["halfcheetah", "ant", "smollm2"], choices=sorted(WORKLOADS))
    p.add_argument("--staleness", type=int, default=0, help="0: on-policy plans only; k: up to k updates ahead too")
    p.add_argument("--updates", type=int, default=12, help="updates per measured run")
    p.add_argument("--warmup", type=int, default=1, help="first updates of a run left out of its step time")
    p.add_argument("--journal", help="append the profile and each measured plan here (JSON lines) as they come")
    p.add_argument("--resume", help="go on from this journal (appended to unless --journal names another file)")
    p.add_argument("--new-profile", action="store_true",
                   help="with --resume: profile again (the plans measured there are kept; the predictions are the "
                        "new profile's)")
    p.add_argument("--max-plans", type=int, default=0, help="measure only the planner's first N (0: all)")
    p.add_argument("--repeats", type=int, default=2, help="auto vs best, each this many times, alternately")
    p.add_argument("--override", nargs="*", default=[], help="key=value overrides for every run")
    args = p.parse_args()
    if args.resume and not Path(args.resume).is_file():
        raise SystemExit(f"--resume {args.resume}: no such journal")
    args.journal = args.journal or args.resume
    run = Run()
    tmp = Path(tempfile.mkdtemp(prefix="m2flow-planner-"))
    try:
        out = {"benchmark": "planner", "args": vars(args),
               "workloads": {w: workload(w, args, tmp) for w in args.workloads}}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(json_safe(out | run.finish()), indent=1))


if __name__ == "__main__":
    main()
