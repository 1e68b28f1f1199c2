"""A finished ``benchmarks/planner.py`` run, predicted again by the model as it is now: the
run's own profile (its points and probes; the switch and hop costs read off the probes again
with the current simulator) predicts every plan the run measured, against what it measured.
For a change to the model, this shows what it does on measurements already taken; it is no
new measurement, and its pick is the best predicted among the plans that run measured.

    python benchmarks/planner_replay.py RESULT.json [--profile WORKLOAD=PROFILE.json ...]

RESULT may also be the journal of a run (``planner.py --journal``), finished or cut short:
the plans it measured so far.

(``planner.py`` keeps each workload's profile in its result; ``--profile`` gives one for a
result that lacks it.) Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import json_safe  # noqa: E402


def replay(result: dict, profile: dict) -> dict:
    from m2flow.config import load_config
    from m2flow.flow import Plan
    from m2flow.flow.cost import CostModel, Profile
    from m2flow.flow.planner import layout_of, predicted, preference, priced
    from m2flow.runners.profiling import refit_hidden_costs
    from m2flow.runners.schedule import schedule_of

    cfg = load_config(result["preset"], result["overrides"])
    prof = Profile.from_dict(profile)
    refit_hidden_costs(cfg, prof)
    model = CostModel(prof)
    s = schedule_of(cfg)
    rows, order = [], []
    cost = tuple(cfg.placement.staleness_cost)  # a plan ahead priced as the planner prices it
    for r in result["rows"]:
        plan = Plan.from_dict(r["plan_file"])
        layout, fused = layout_of(plan, s.workflow)
        now = predicted(model, s.shape(plan, fused), layout, plan.run_ahead).step_s
        rows.append({"plan": r["plan"], "measured_s": r["measured_s"], "predicted_then_s": r["predicted_s"],
                     "predicted_now_s": round(now, 4), "error_then": r["error"], "error_now": round(now / r["measured_s"] - 1, 3),
                     "priced_s": priced(r["measured_s"], plan.run_ahead, cost)})
        order.append(preference(plan, now, cost))
    best = min(rows, key=lambda r: r["measured_s"])
    pick = rows[order.index(min(order))]  # as the planner ranks them
    best_priced = min(rows, key=lambda r: r["priced_s"])
    return {"rows": rows, "switch_s": prof.switch_s, "hop_s": prof.hop_s,
            "median_abs_error_then": round(statistics.median(abs(r["error_then"]) for r in rows), 3),
            "median_abs_error_now": round(statistics.median(abs(r["error_now"]) for r in rows), 3),
            "pick_now": pick["plan"], "best_measured": best["plan"],
            "pick_now_over_best": round(pick["measured_s"] / best["measured_s"], 3), "staleness_cost": list(cost),
            "best_measured_priced": best_priced["plan"],
            "pick_now_over_best_priced": round(pick["priced_s"] / best_priced["priced_s"], 3)}


def load_result(path: Path) -> dict:
    """A ``planner.py`` result, or its journal (JSON lines) made into one."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    workloads: dict = {}
    for line in text.splitlines():
        record = json.loads(line)
        if "profile" in record:  # a workload's first record
            workloads[record["workload"]] = {k: record[k] for k in ("preset", "overrides", "profile")} | {"rows": []}
        elif "row" in record:
            workloads[record["workload"]]["rows"].append(record["row"])
    return {"workloads": workloads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result")
    p.add_argument("--profile", nargs="*", default=[], help="WORKLOAD=PROFILE.json")
    args = p.parse_args()
    result = load_result(Path(args.result))
    given = dict(item.split("=", 1) for item in args.profile)
    out = {}
    for name, w in result["workloads"].items():
        profile = json.loads(Path(given[name]).read_text()) if name in given else w.get("profile")
        if profile is None:
            raise SystemExit(f"{name}: the result holds no profile; give --profile {name}=FILE")
        out[name] = replay(w, profile)
    print(json.dumps(json_safe({"benchmark": "planner_replay", "result": args.result, "workloads": out}), indent=1))


if __name__ == "__main__":
    main()
