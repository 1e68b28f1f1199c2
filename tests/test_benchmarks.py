"""The benchmarks' own bookkeeping (not their figures): what a cut-short planner run's journal
gives the run that resumes it; the asynchronous reasoning benchmark's criteria over pairs and
its journal of sides."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench(name: str):
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def _planner():
    return _bench("planner")


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


def test_async_pairs_criteria_by_hand():
    bench = _bench("async_reasoning")
    on = {"curve": [{"step": 0, "time_s": 0.0, "accuracy": 0.19}, {"step": 4, "time_s": 100.0, "accuracy": 0.4},
                    {"step": 8, "time_s": 200.0, "accuracy": 0.62}], "final_accuracy": 0.62, "time_s": 200.0}
    asy = {"curve": [{"step": 0, "time_s": 0.0, "accuracy": 0.19}, {"step": 4, "time_s": 60.0, "accuracy": 0.61},
                     {"step": 8, "time_s": 120.0, "accuracy": 0.68}], "final_accuracy": 0.68, "time_s": 120.0}
    # first at or above 0.62 at 120 s of the on-policy run's 200 s; 68 - 62 points
    assert bench.pair_result(on, asy) == {"time_to_on_policy_accuracy_s": 120.0, "time_to_on_policy_accuracy_ratio": 0.6,
                                          "final_accuracy_difference_points": 6.0}
    behind = asy | {"curve": asy["curve"][:2], "final_accuracy": 0.61}
    assert bench.pair_result(on, behind)["time_to_on_policy_accuracy_ratio"] is None  # never reached
    pairs = [{"time_to_on_policy_accuracy_ratio": 0.5, "final_accuracy_difference_points": 6.0},
             {"time_to_on_policy_accuracy_ratio": None, "final_accuracy_difference_points": -14.0},
             {"time_to_on_policy_accuracy_ratio": 0.7, "final_accuracy_difference_points": 2.0},
             {"time_to_on_policy_accuracy_ratio": 0.6, "final_accuracy_difference_points": -4.0}]
    got = bench.summary(pairs)
    # met both: 0.5 / +6 only (0.7 is slower than 0.67x; -4 is more than 3 points under)
    assert (got["pairs"], got["met_both"], got["never_reached"]) == (4, 1, 1)
    # mean (6 - 14 + 2 - 4) / 4 = -2.5; deviations 8.5, -11.5, 4.5, -1.5: variance 227 / 3, sem sqrt(227 / 3) / 2
    assert got["accuracy_difference_mean_points"] == -2.5
    assert got["accuracy_difference_sem_points"] == 4.3
    assert got["ratio"] == {"min": 0.5, "median": 0.6, "max": 0.7, "n": 3}
    assert bench.summary(pairs[:1])["accuracy_difference_sem_points"] is None  # one pair: no spread to go by


def test_async_control_runs_on_policy_in_the_async_plan(tmp_path):
    """--control: the async side's overrides made on-policy; a plan its scheduler wrote is run
    again as it is but not ahead (and not planned again); the differences by hand."""
    from m2flow.config import load_config
    from m2flow.flow import Plan
    from m2flow.runners.reasoning import WORKFLOW

    bench = _bench("async_reasoning")
    async_out = tmp_path / "async"
    async_out.mkdir()
    given = ["placement.mode=disaggregated", "runner.max_staleness=2", "rollout.partial=true"]
    # a placement given: nothing was planned, the same overrides place the control alike
    plain = bench.control_overrides(given, async_out, tmp_path / "control.yaml")
    cfg = load_config("reasoning/grpo_arith_tiny", plain)
    assert (cfg.placement.mode, cfg.placement.plan, cfg.runner.max_staleness) == ("disaggregated", None, 0)
    assert (cfg.rollout.partial, cfg.algorithm.off_policy) == (False, "none")
    planned = Plan.for_mode(WORKFLOW, "disaggregated", 2, granularity=4, run_ahead=2)
    planned.save(async_out / "plan.yaml")
    cfg = load_config("reasoning/grpo_arith_tiny",
                      bench.control_overrides([*bench.ASYNC, "algorithm.off_policy=decoupled"], async_out,
                                              tmp_path / "control.yaml"))
    assert cfg.placement.mode != "auto" and cfg.placement.plan == str(tmp_path / "control.yaml")
    assert (cfg.runner.max_staleness, cfg.rollout.partial, cfg.algorithm.off_policy) == (0, False, "none")
    control = Plan.load(cfg.placement.plan)
    assert control.run_ahead == 0 and control.to_dict() == {**planned.to_dict(), "run_ahead": 0}
    on, asy, ctl = ({"final_accuracy": a} for a in (0.51, 0.23, 0.26))
    assert bench.control_result(on, asy, ctl) == {"final_accuracy_difference_vs_control_points": -3.0,
                                                  "control_less_on_policy_points": -25.0}
    pairs = [{"time_to_on_policy_accuracy_ratio": None, "final_accuracy_difference_points": -28.0,
              "final_accuracy_difference_vs_control_points": -3.0, "control_less_on_policy_points": -25.0},
             {"time_to_on_policy_accuracy_ratio": 0.6, "final_accuracy_difference_points": 18.0,
              "final_accuracy_difference_vs_control_points": 14.0, "control_less_on_policy_points": 4.0}]
    got = bench.summary(pairs)
    assert got["vs_control_points"] == {"mean": 5.5, "sem": 8.5, "n": 2}  # stdev of -3, 14: 17 / sqrt 2
    assert got["control_less_on_policy_points"] == {"mean": -10.5, "sem": 14.5, "n": 2}
    assert "vs_control_points" not in bench.summary([{k: p[k] for k in list(p)[:2]} for p in pairs])


def test_staleness_cost_from_controlled_pairs_by_hand():
    bench = _bench("async_reasoning")

    def side(accuracies, lag=None):
        curve = [{"step": 4 * i, "time_s": 10.0 * i, "accuracy": a} for i, a in enumerate(accuracies)]
        return {"curve": curve, "final_accuracy": accuracies[-1], "policy_lag": lag or []}

    lag = [0, 1, 2, 2, 2, 2, 2, 2]  # two ahead
    pairs = [{"async": side([0.2, 0.25, 0.3], lag), "control": side([0.2, 0.3, 0.4])},
             {"async": side([0.2, 0.2, 0.3], lag), "control": side([0.2, 0.2, 0.4])}]
    got = bench.staleness_cost(pairs)
    # mean curves: control 0.2, 0.25, 0.4; async ends at 0.3, which the control crosses between
    # steps 4 (0.25) and 8 (0.4): at 4 + 4 x 0.05 / 0.15 = 5.33; 8 / 5.33 = 1.5 the steps:
    # two ahead costs 0.5
    assert got["control_step_reaching"] == pytest.approx(5.33, abs=0.01)
    assert (got["steps_ratio"], got["cost"], got["run_ahead"], got["mean_policy_lag"]) == (1.5, 0.5, 2, 1.625)
    assert got["cost_se"] is None  # two pairs: no jackknife
    third = {"async": side([0.2, 0.3, 0.35], lag), "control": side([0.2, 0.3, 0.4])}
    got3 = bench.staleness_cost([*pairs, third])
    # all three: control 0.2, 0.267, 0.4; async ends at 0.317, reached at 4 + 4 x 0.05 / 0.133 = 5.5:
    # 8 / 5.5 = 1.455. Leaving each out: without the first, control 0.25 -> 0.4, async 0.325, at 6:
    # cost 0.333; without the second, control 0.3 -> 0.4, at 5: 0.6; without the third: 0.5 (above).
    # Jackknife: mean 0.4777, sqrt(2/3 x (0.1447^2 + 0.1223^2 + 0.0223^2)) = 0.156
    assert (got3["steps_ratio"], got3["cost"]) == (1.455, 0.455)
    assert got3["cost_se"] == pytest.approx(0.156, abs=1e-3)
    ahead = [{"async": side([0.2, 0.35, 0.5], lag), "control": side([0.2, 0.3, 0.4])}]
    assert bench.staleness_cost(ahead)["cost_at_most"] == 0.0  # the control never got there
    stuck = [{"async": side([0.2, 0.1, 0.15], lag), "control": side([0.2, 0.3, 0.4])}]
    assert bench.staleness_cost(stuck)["cost"] is None  # under the start: no finite count of steps
    assert bench.staleness_cost([{"async": side([0.2, 0.3, 0.4]), "control": side([0.2, 0.3, 0.4])}]) is None  # no lag
    other_steps = [pairs[0], {"async": side([0.2, 0.3], lag), "control": side([0.2, 0.3])}]
    assert bench.staleness_cost(other_steps) is None
    # through summary: only the pairs run with a control
    pairs = [p | {"time_to_on_policy_accuracy_ratio": None, "final_accuracy_difference_points": -10.0,
                  "final_accuracy_difference_vs_control_points": -10.0, "control_less_on_policy_points": 0.0}
             for p in pairs]
    assert bench.summary(pairs)["staleness_cost"]["steps_ratio"] == 1.5


def test_precision_benchmark_smoke():
    """benchmarks/precision.py on the tiny model: both sides ran, the same tokens trained on,
    and each ratio is the float32 time over the bfloat16 time of its repetition."""
    import subprocess

    out = subprocess.run([sys.executable, str(BENCH / "precision.py"), "--model", "tiny-llama", "--prompts", "2",
                          "--samples", "2", "--max-new-tokens", "8", "--repeats", "2"],
                         capture_output=True, text=True, timeout=240, cwd=BENCH.parent)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    gen, train = result["generate"], result["train"]
    for side in ("float32", "bfloat16"):
        assert gen[side]["s"]["n"] == train[side]["s"]["n"] == 2
        assert all(4 <= t <= 32 for t in gen[side]["tokens"])  # 2 prompts x 2 samples, 1-8 tokens each
    assert len(gen["ratio_per_row"]) == len(train["ratio"]) == 2 and all(r > 0 for r in train["ratio"])
    assert train["rows"] == 4 and train["tokens"] > 4
    assert train["ratio_spread"]["min"] == min(train["ratio"])


def test_thread_numerics_smoke():
    """benchmarks/thread_numerics.py on the tiny model: both dtypes compared completion by
    completion, every differing one with the position where it parts."""
    import subprocess

    out = subprocess.run([sys.executable, str(BENCH / "thread_numerics.py"), "--model", "tiny-llama", "--prompts", "2",
                          "--samples", "3", "--max-new-tokens", "8"],
                         capture_output=True, text=True, timeout=240, cwd=BENCH.parent)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["threads"] == [1, 2]
    for dtype in ("float32", "bfloat16"):
        got = result[dtype]
        assert got["completions"] == 6 and 0 <= got["identical"] <= 6
        assert all(0 <= i <= 8 for i in got["first_difference_at_token"])
    first = _bench("thread_numerics").first_difference
    assert (first([5, 6, 7], [5, 6, 8]), first([5, 6], [5, 6, 7]), first([9], [8])) == (2, 2, 0)


def test_async_journal_finishes_a_cut_pair_by_its_missing_side(tmp_path, monkeypatch, capsys):
    """--journal keeps each side as it ends: a pair cut short after its first side (a time
    limit, a lost machine) runs only the missing side when run again on a machine of the same
    kind, and the pair's figures use both; on another kind of machine both sides run again."""
    bench = _bench("async_reasoning")
    calls = []

    def side_run(script, spec):
        side = "async" if "runner.max_staleness=2" in spec["overrides"] else "on-policy"
        calls.append(side)
        if len(calls) == 2 and cut:
            raise RuntimeError("the machine went away")
        final, time_s = (0.6, 100.0) if side == "on-policy" else (0.7, 60.0)
        return {"curve": [{"step": 0, "time_s": 0.0, "accuracy": 0.2}, {"step": 4, "time_s": time_s, "accuracy": final}],
                "final_accuracy": final, "time_s": time_s, "ran": len(calls)}

    class QuietRun:  # no machine-speed measurements
        def finish(self):
            return {}

    monkeypatch.setattr(bench, "run_child", side_run)
    monkeypatch.setattr(bench, "loaded", lambda fn: (fn(), {"load_start": 1.0}))
    monkeypatch.setattr(bench, "Run", QuietRun)
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))  # the run folders
    journal = tmp_path / "pairs.jsonl"
    monkeypatch.setattr(sys, "argv", ["async_reasoning.py", "--seed", "3", "--journal", str(journal),
                                      "--on-policy-placement", "placement=collocated"])
    cut = True
    with pytest.raises(RuntimeError, match="went away"):
        bench.main()
    first = calls[0]
    (record,) = [json.loads(line) for line in journal.read_text().splitlines()]
    assert record["side"] == first and record["result"]["ran"] == 1
    other_kind = tmp_path / "other.jsonl"
    other_kind.write_text(journal.read_text().replace('"cpus": ', '"cpus": 1000'))

    cut, calls[:] = False, []
    bench.main()
    assert calls == [s for s in ("on-policy", "async") if s != first]  # only the missing side ran
    pair = json.loads(capsys.readouterr().out)["runs"][0]
    assert pair[first]["ran"] == 1  # the journal's
    assert pair["time_to_on_policy_accuracy_ratio"] == 0.6 and pair["final_accuracy_difference_points"] == 10.0
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [r.get("side") for r in records] == [first, calls[0], None]  # each side, then the pair

    calls[:] = []
    monkeypatch.setattr(sys, "argv", ["async_reasoning.py", "--seed", "3", "--journal", str(other_kind),
                                      "--on-policy-placement", "placement=collocated"])
    bench.main()
    assert sorted(calls) == ["async", "on-policy"]  # a side from another kind of machine is not reused


def test_continuous_rollout_summary_by_hand():
    """benchmarks/continuous_rollout.py: a side's figures over its runs, the warm-up steps left out."""
    mod = _bench("continuous_rollout")
    runs = [{"step_s": [9.0, 4.0, 2.0], "rollout_busy_s": [5.0, 3.0, 1.0], "actor_idle_s": [1.0, 0.5, 0.0],
             "completion_tokens": [100, 60, 40], "policy_lag": [0, 1, 2], "prompts_joined_early": [0, 4, 4],
             "stale_dropped": [0, 0, 0], "reward": [0.1, 0.2, 0.3]},
            {"step_s": [8.0, 6.0, 3.0], "rollout_busy_s": [4.0, 2.0, 2.0], "actor_idle_s": [1.0, 0.2, 0.1],
             "completion_tokens": [90, 50, 50], "policy_lag": [0, 2, 2], "prompts_joined_early": [0, 0, 4],
             "stale_dropped": [0, 0, 0], "reward": [0.1, 0.2, 0.3]}]
    got = mod.side_summary(runs, warmup=1)
    assert got["step_s"] == {"min": 2.0, "median": 3.5, "max": 6.0, "n": 4}
    assert got["rollout_tokens_per_busy_s"] == round(200 / 8.0, 1)  # (60 + 40 + 50 + 50) / (3 + 1 + 2 + 2)
    assert got["policy_lag"] == {"1": 1, "2": 3} and got["prompts_joined_early"] == 12
    assert got["actor_idle_s"]["median"] == 0.15 and got["stale_dropped"] == 0


@pytest.mark.parametrize("gpus", [[], ["NVIDIA H200"]], ids=["cpu", "gpu"])
def test_async_sides_share_a_profile_on_gpus_only(tmp_path, monkeypatch, capsys, gpus):
    """On GPUs the two sides of a pair plan from one profile (their configs share its key, and
    the async config needs no contention probe there); on CPU slots each has its own."""
    bench = _bench("async_reasoning")
    profiles = {}

    def side_run(script, spec):
        side = "async" if "runner.max_staleness=2" in spec["overrides"] else "on-policy"
        profiles[side] = next(o for o in spec["overrides"] if o.startswith("placement.profile="))
        return {"curve": [{"step": 0, "time_s": 0.0, "accuracy": 0.2}], "final_accuracy": 0.2, "time_s": 1.0}

    class QuietRun:
        def finish(self):
            return {}

    monkeypatch.setattr(bench, "run_child", side_run)
    monkeypatch.setattr(bench, "loaded", lambda fn: (fn(), {}))
    monkeypatch.setattr(bench, "Run", QuietRun)
    monkeypatch.setattr(bench, "machine_kind", lambda: {"cpus": 16, "gpus": gpus})
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["async_reasoning.py", "--seed", "3", "--journal", str(tmp_path / "p.jsonl")])
    bench.main()
    capsys.readouterr()
    assert set(profiles) == {"on-policy", "async"}
    assert (profiles["on-policy"] == profiles["async"]) == bool(gpus)
