"""``placement=auto`` end to end on an embedded cluster: profile, plan, run; a second run
reuses the profile; a plan file that runs ahead is run as written."""

import csv
import json

import pytest
import yaml

from m2flow.config import load_config
from m2flow.flow import Plan
from m2flow.flow.cost import Profile
from m2flow.runners import run
from m2flow.runners.auto import refit_hidden_costs


def lines_of(capsys):
    return capsys.readouterr().out


@pytest.mark.parametrize("preset, overrides", [
    ("embodied/ppo_cartpole", ["runner.total_env_steps=4096", "env.num_envs=4", "runner.rollout_steps=128",
                               "algorithm.minibatch_size=128", "runner.target_return=null"]),
    pytest.param("reasoning/grpo_arith_tiny", ["runner.steps=2", "runner.eval_every=0"], marks=pytest.mark.slow),
])
def test_auto_profiles_plans_and_runs(tmp_path, capsys, preset, overrides):
    profile = tmp_path / "profile.json"
    common = [*overrides, "cluster.cpu_slots=2", "placement=auto", f"placement.profile={profile}",
              "runner.progress=false"]
    cfg = load_config(preset, [*common, f"runner.out_dir={tmp_path / 'a'}"])
    rows = run(cfg)
    out = lines_of(capsys)
    assert rows and (tmp_path / "a" / "metrics.csv").is_file()
    prof = json.loads(profile.read_text())
    probes = [r["probe"] for r in prof["runs"]]
    # the other size on one device (embodied) or on both (reasoning: its actor at two sizes on as many)
    sized = "collocated on device 0, " if preset.startswith("embodied") else "collocated, granularity "
    assert probes[0] == "collocated" and probes[1].startswith(sized) and len(probes) == 3
    assert [r["role"] for r in prof["runs"]] == ["collocated", "sized", "split"]
    # the first probe's first update warms the processes up; the later probes time all theirs
    timed = 2 if preset.startswith("embodied") else 1
    assert [(r["updates_timed"], r["updates_left_out"]) for r in prof["runs"]] == [(timed, 1), (timed, 0), (timed, 0)]
    phases = {(p["component"], p["phase"]) for p in prof["points"]}
    trainer = "actor"
    assert (trainer, "train") in phases and all(p["seconds"] >= 0 for p in prof["points"])
    assert {p["devices"] for p in prof["points"]} == {1, 2}  # seen on one device and on two
    assert prof["hardware"]["devices"] == 2 and prof["profiling_s"] > 0
    assert prof["hop_s"] >= 0 and all(v >= 0 for v in prof["switch_s"].values())
    # The share of its rows the trainer forwarded: all of them in an embodied step; the
    # profile's is over every timed update's rows, so between the probes' own.
    shares = [r["trained_share"] for r in prof["runs"]]
    assert all(0 <= x <= 1 for x in shares) and (preset.startswith("reasoning") or shares == [1.0] * 3)
    assert min(shares) - 1e-12 <= prof["trained_share"] <= max(shares) + 1e-12
    # The hidden costs read off the stored probes again come out as they were measured.
    again = Profile.load(profile)
    refit_hidden_costs(cfg, again)
    assert again.hop_s == pytest.approx(prof["hop_s"]) and again.switch_s == pytest.approx(prof["switch_s"])
    assert "cost model (held-out error" in out and "predicted step times" in out and "why:" in out
    chosen = Plan.load(tmp_path / "a" / "plan.yaml")
    assert f"plan ({chosen.mode(run_workflow(cfg))})" in out  # the run printed the plan it ran
    # A second run of the same preset on the same hardware reuses the profile.
    run(load_config(preset, [*common, f"runner.out_dir={tmp_path / 'b'}"]))
    assert "profile: reusing" in lines_of(capsys)
    assert json.loads(profile.read_text())["profiling_s"] == prof["profiling_s"]


def run_workflow(cfg):
    from m2flow.runners.schedule import schedule_of

    return schedule_of(cfg).workflow


def test_a_plan_file_that_runs_ahead_runs_as_written(tmp_path):
    plan = {"components": {"env": "0", "rollout": "0", "actor": "1"}, "fuse": [["env", "rollout"]], "stages": 1,
            "run_ahead": 1}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    cfg = load_config("embodied/ppo_cartpole", [f"placement=@{path}", "cluster.cpu_slots=2", "env.num_envs=4",
                                                "runner.rollout_steps=64", "runner.total_env_steps=1024",
                                                "algorithm.minibatch_size=64", "runner.target_return=null",
                                                f"runner.out_dir={tmp_path}", "runner.progress=false"])
    assert cfg.runner.max_staleness == 0
    rows = run(cfg)
    assert len(rows) == 4
    lags = [float(r["policy_lag"]) for r in csv.DictReader(open(tmp_path / "metrics.csv"))]
    assert max(lags) == 1  # data one version old was taken, as the plan allows


def test_embodied_probes_step_the_envs_in_batches_of_two_sizes():
    # The collocated probe gives each device half the envs, the sized one all of them on one
    # device: two batch sizes per call, so a fit can tell a fixed cost per call from a cost
    # per env (with one size, every cost reads as per env, and a fused worker's one batch of
    # 8 envs was predicted like two of 4).
    from m2flow.flow.planner import layout_of
    from m2flow.runners.auto import probes
    from m2flow.runners.schedule import schedule_of

    cfg = load_config("embodied/ppo_halfcheetah", ["cluster.cpu_slots=2"])
    s = schedule_of(cfg)
    runs = {r.role: r for r in probes(s, 2, "cpu")}
    per_call = {}
    for role in ("collocated", "sized"):
        plan = runs[role].plan
        layout, fused = layout_of(plan, s.workflow)
        shape = s.shape(plan, fused)
        per_call[role] = shape.items / shape.chunks / layout.count("env")
    assert per_call == {"collocated": cfg.env.num_envs / 2, "sized": cfg.env.num_envs}


def test_reasoning_probes_on_gpu_slots_keep_one_actor_rank_per_gpu():
    """On two GPUs the collocated probe has an actor rank per GPU; on one GPU made two devices
    (cluster.gpu_slots=2) two ranks would share it (NCCL refuses), so the probe's actor is one
    rank over both devices; the split probe puts rollout and actor on a device each."""
    from m2flow.runners.auto import probes
    from m2flow.runners.schedule import schedule_of

    def shapes(*overrides):
        s = schedule_of(load_config("reasoning/grpo_arith_tiny", list(overrides)))
        return {r.role: {c: r.plan.world_size(c) for c in ("rollout", "actor")} for r in probes(s, 2, "cuda")}

    assert shapes() == {"collocated": {"rollout": 2, "actor": 2}, "sized": {"rollout": 2, "actor": 2},
                        "split": {"rollout": 1, "actor": 1}}
    assert shapes("cluster.gpu_slots=2") == {"collocated": {"rollout": 2, "actor": 1},
                                             "sized": {"rollout": 2, "actor": 1}, "split": {"rollout": 1, "actor": 1}}
