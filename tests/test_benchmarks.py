"""The benchmarks' own bookkeeping (not their figures): what a cut-short planner run's journal
gives the run that resumes it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _planner():
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("planner_bench", BENCH / "planner.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_journal_resume_reads_profile_rows_and_sides(tmp_path):
    planner = _planner()
    base = ["rollout.n=8", "placement.profile=/tmp/new/smollm2-profile.json"]
    plan_a, plan_b = {"mode": "collocated", "granularity": 16}, {"granularity": 1, "mode": "hybrid"}
    records = [
        {"workload": "smollm2", "preset": "p", "overrides": ["rollout.n=8", "placement.profile=/tmp/old/x.json"],
         "profile": {"points": []}, "profiling_wall_s": 300.0},
        {"workload": "ant", "row": {"plan_file": plan_a, "measured_s": 9.0}},  # another workload's
        {"workload": "smollm2", "row": {"plan_file": plan_a, "measured_s": 91.5}},
        {"workload": "smollm2", "row": {"plan_file": plan_b, "measured_s": 78.9}},
        {"workload": "smollm2", "side": "auto", "repeat": 0, "step_s": 80.0},
    ]
    path = tmp_path / "journal.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + '\n{"workload": "smollm2", "row": {"plan')
    done = planner.journaled(str(path), "smollm2", base)
    assert done["profile"]["profiling_wall_s"] == 300.0
    # a plan is found whatever the order of its keys
    assert done["rows"][planner.plan_key({"granularity": 16, "mode": "collocated"})]["measured_s"] == 91.5
    assert done["rows"][planner.plan_key(plan_b)]["measured_s"] == 78.9
    assert len(done["rows"]) == 2  # not the other workload's, not the cut line
    assert set(done["sides"]) == {("auto", 0)}
    assert planner.journaled(None, "smollm2", base) == {"rows": {}, "sides": {}}


def test_journal_of_other_overrides_is_refused(tmp_path):
    planner = _planner()
    path = tmp_path / "journal.jsonl"
    path.write_text(json.dumps({"workload": "smollm2", "preset": "p", "overrides": ["rollout.n=4"],
                                "profile": {"points": []}}) + "\n")
    with pytest.raises(SystemExit, match="rollout.n=4"):
        planner.journaled(str(path), "smollm2", ["rollout.n=8"])
