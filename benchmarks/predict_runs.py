"""Finished runs, predicted by a profile's cost model as it is now: each run's mean step time
(its first step, the pipeline's fill, left out) against the model's prediction of its plan at
the share of rows its trainer forwarded, with and without what the simulator adds to a
plan's steps: contention (components slowed while another process computes beside them) and
steps that vary (the trainer's rows forwarded, step to step). It is no new measurement: it
shows what a change to the model does on runs already made.

    python benchmarks/predict_runs.py PROFILE.json RUN_DIR[=PLAN.yaml] ...

A run folder is one ``runner.out_dir`` (its ``metrics.csv``; its ``plan.yaml``, which
``placement=auto`` writes, unless a plan file is given after ``=``). The runs are predicted
with the config the profile was measured with. Prints JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import json_safe  # noqa: E402

VARIANTS = {  # name: (contention, steps that vary)
    "alone_alike": (False, False), "varying": (False, True), "contention": (True, False), "both": (True, True)}


def predict_runs(profile_path: Path, runs: list[tuple[Path, Path]]) -> dict:
    from omegaconf import OmegaConf

    from m2flow.config.flows import root_of
    from m2flow.flow import Plan
    from m2flow.flow.cost import CostModel, Profile, trained_rows
    from m2flow.flow.planner import layout_of
    from m2flow.flow.simulate import predict
    from m2flow.runners.profiling import refit_hidden_costs
    from m2flow.runners.schedule import schedule_of

    prof = Profile.load(profile_path)
    cfg = OmegaConf.merge(OmegaConf.structured(root_of(prof.config["flow"])), prof.config)
    refit_hidden_costs(cfg, prof)  # the hidden costs and the contention, as the model reads them now
    model = CostModel(prof)
    s = schedule_of(cfg)
    out = []
    for folder, plan_file in runs:
        rows = [r for r in csv.DictReader((folder / "metrics.csv").open()) if r.get("step_s")][1:]
        if not rows:
            raise SystemExit(f"{folder}/metrics.csv has no step after the first")
        plan = Plan.load(plan_file)
        layout, fused = layout_of(plan, s.workflow)
        shape = s.shape(plan, fused)
        share = statistics.mean(trained_rows(shape, {"inert_rows": float(r.get("inert_rows") or 0)})
                                for r in rows) / shape.batch
        measured = statistics.mean(float(r["step_s"]) for r in rows)
        at = model.at_share(share)
        predicted = {name: predict(shape, layout, at, model.switch_s, plan.run_ahead,
                                   contention=model.contention if slow else {},
                                   train_scale=at.train_scales(shape.row_groups) if vary else ()).step_s
                     for name, (slow, vary) in VARIANTS.items()}
        out.append({"run": str(folder), "mode": plan.mode(s.workflow), "run_ahead": plan.run_ahead,
                    "steps": len(rows), "trained_share": round(share, 3), "measured_step_s": round(measured, 3),
                    "predicted_s": {k: round(v, 3) for k, v in predicted.items()},
                    "error": {k: round(v / measured - 1, 3) for k, v in predicted.items()}})
    return {"profile": str(profile_path), "trained_share": round(prof.trained_share, 3),
            "contention": {k: round(v, 3) for k, v in prof.contention.items()}, "runs": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", type=Path)
    p.add_argument("runs", nargs="+", help="RUN_DIR or RUN_DIR=PLAN.yaml")
    args = p.parse_args()
    runs = []
    for item in args.runs:
        folder, _, plan = item.partition("=")
        runs.append((Path(folder), Path(plan) if plan else Path(folder) / "plan.yaml"))
    for folder, plan in runs:
        if not (folder / "metrics.csv").is_file() or not plan.is_file():
            raise SystemExit(f"{folder}: needs metrics.csv and {plan}")
    print(json.dumps(json_safe(predict_runs(args.profile, runs)), indent=1))


if __name__ == "__main__":
    main()
