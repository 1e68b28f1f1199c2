"""``placement=auto`` end to end on an embedded cluster: profile, plan, run; a second run
reuses the profile; a plan file that runs ahead is run as written."""

import csv
import dataclasses
import json

import pytest
import yaml

from m2flow.config import ConfigError, load_config
from m2flow.flow import Plan
from m2flow.flow.cost import Profile, ProfileError
from m2flow.runners import auto, profiling, run, status
from m2flow.runners.profiling import refit_hidden_costs


def lines_of(capsys):
    return capsys.readouterr().out


@pytest.mark.parametrize("preset, overrides", [
    ("embodied/ppo_cartpole", ["runner.total_env_steps=1024", "env.num_envs=4", "runner.rollout_steps=128",
                               "algorithm.minibatch_size=128", "runner.target_return=null"]),
    pytest.param("reasoning/grpo_arith_tiny", ["runner.steps=2", "runner.eval_every=0"], marks=pytest.mark.slow),
    # may run ahead: a fourth probe, the split plan one ahead, measures the contention
    pytest.param("reasoning/grpo_arith_tiny", ["runner.steps=2", "runner.eval_every=0", "runner.max_staleness=1"],
                 marks=pytest.mark.slow),
])
def test_auto_profiles_plans_and_runs(tmp_path, capsys, preset, overrides):
    profile = tmp_path / "profile.json"
    common = [*overrides, "cluster.cpu_slots=2", "placement=auto", f"placement.profile={profile}",
              "runner.progress=false"]
    cfg = load_config(preset, [*common, f"runner.out_dir={tmp_path / 'a'}"])
    rows = run(cfg)
    out = lines_of(capsys)
    assert rows and (tmp_path / "a" / "metrics.csv").is_file()
    assert status.read(tmp_path / "a")["state"] == "finished"
    prof = json.loads(profile.read_text())
    probes = [r["probe"] for r in prof["runs"]]
    # the other size on one device (embodied) or on both (reasoning: its actor at two sizes on as many)
    sized = "collocated on device 0, " if preset.startswith("embodied") else "collocated, granularity "
    overlap = "runner.max_staleness=1" in overrides
    assert probes[0] == "collocated" and probes[1].startswith(sized) and len(probes) == 3 + overlap
    assert [r["role"] for r in prof["runs"]] == ["collocated", "sized", "split"] + ["overlap"] * overlap
    # the first probe's first update warms the processes up; the later probes time all theirs
    timed = 2 if preset.startswith("embodied") else 1
    assert [(r["updates_timed"], r["updates_left_out"]) for r in prof["runs"]] == [(timed, 1), (timed, 0), (timed, 0)] + [
        (3, 0)] * overlap
    # the contention of each heavy component, where measured
    assert set(prof["contention"]) == ({"rollout", "inference", "actor"} if overlap else set())
    assert all(x >= 0 for x in prof["contention"].values())
    if overlap:
        assert "contention" in out and all(r["busy_s"]["actor"] > 0 for r in prof["runs"])
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
    assert again.contention == pytest.approx(prof["contention"])
    assert "cost model (held-out error" in out and "predicted step times" in out and "why:" in out
    chosen = Plan.load(tmp_path / "a" / "plan.yaml")
    assert f"plan ({chosen.mode(run_workflow(cfg))})" in out  # the run printed the plan it ran
    # The planner's pick from the same profile for the devices a run has left after its
    # cluster lost a node: on two, the plan it ran; on one, a plan that fits one.
    replan = auto.replanner(cfg)
    assert replan(2).to_dict() == chosen.to_dict()
    replan(1).check(run_workflow(cfg), 1)
    # A second run of the same preset on the same hardware reuses the profile, whatever its length
    # (planned as ``run`` plans it, with no cluster: a profile to make would start one).
    short = "runner.total_env_steps=512" if preset.startswith("embodied") else "runner.steps=1"
    auto.auto_plan(load_config(preset, [*common, short, f"runner.out_dir={tmp_path / 'b'}"]))
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
    from m2flow.runners.probes import probes
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
    from m2flow.runners.probes import probes
    from m2flow.runners.schedule import schedule_of

    def shapes(*overrides):
        s = schedule_of(load_config("reasoning/grpo_arith_tiny", list(overrides)))
        return {r.role: {c: r.plan.world_size(c) for c in ("rollout", "actor")} for r in probes(s, 2, "cuda")}

    assert shapes() == {"collocated": {"rollout": 2, "actor": 2}, "sized": {"rollout": 2, "actor": 2},
                        "split": {"rollout": 1, "actor": 1}}
    assert shapes("cluster.gpu_slots=2") == {"collocated": {"rollout": 2, "actor": 1},
                                             "sized": {"rollout": 2, "actor": 1}, "split": {"rollout": 1, "actor": 1}}


def test_contention_is_read_off_the_overlap_probes_busy_times():
    """A rollout (4 s a stream) and a trainer (6 s an update alone) on a device each, one
    ahead, three updates: the trainer's first two updates run beside the next stream. 20%
    slower beside it (worked out by hand): update 0 from 4 to 10.67 (4 s at 1/1.2 do 3.33 s,
    2.67 s alone), update 1 6.67 s beside stream 2, update 2 6 s alone; 19.33 s over 3
    updates. The fit gives the trainer 0.2 and the rollout, as fast as alone, none."""
    from m2flow.flow.cost import Point
    from m2flow.flow.hidden_costs import Probe, fit_contention
    from m2flow.flow.simulate import Layout, Shape

    prof = Profile("k", {}, [Point("r", "work", 1, 1, 4.0), Point("t", "train", 1, 1, 6.0)])
    shape = Shape(chain=("r",), trainer="t", items=1, chunks=1, receivers=("r",))
    layout = Layout({"r": "r", "t": "t"}, {"r": frozenset([0]), "t": frozenset([1])}, {"r": False, "t": False})
    measured = {"r": 4.0, "t": (20 / 3 + 20 / 3 + 6) / 3}
    overlap = Probe("split, one ahead", "overlap", shape, layout, step_s=6.4, run_ahead=1, updates=3, busy_s=measured)
    fit_contention(prof, overlap, ["r", "t"])
    assert prof.contention["t"] == pytest.approx(0.2, rel=1e-6)
    assert prof.contention["r"] == 0.0
    # measured no slower than alone: none
    fit_contention(prof, dataclasses.replace(overlap, busy_s={"r": 3.9, "t": 6.0}), ["r", "t"])
    assert prof.contention == {"r": 0.0, "t": 0.0}


@pytest.mark.parametrize("kind, staleness, roles", [
    ("cpu", 0, ["collocated", "sized", "split"]),
    ("cpu", 1, ["collocated", "sized", "split", "overlap"]),
    ("cuda", 2, ["collocated", "sized", "split"]),
])
def test_the_overlap_probe_runs_the_split_plan_ahead_where_contention_is_measured(kind, staleness, roles):
    from m2flow.runners.probes import probes
    from m2flow.runners.schedule import schedule_of

    s = schedule_of(load_config("reasoning/grpo_arith_tiny", [f"runner.max_staleness={staleness}"]))
    runs = probes(s, 2, kind)
    assert [r.role for r in runs] == roles
    if "overlap" in roles:
        split, overlap = runs[2], runs[3]
        assert overlap.plan.run_ahead == 1 and overlap.updates == s.overlap_probe_updates
        assert overlap.plan.to_dict() == split.plan.to_dict() | {"run_ahead": 1}
    # the embodied flow has no such probe
    e = schedule_of(load_config("embodied/ppo_cartpole", [f"runner.max_staleness={staleness}"]))
    assert "overlap" not in [r.role for r in probes(e, 2, kind)]


def test_an_asynchronous_variant_shares_its_on_policy_configs_profile():
    """Running ahead and truncated importance sampling change no probe's cost (the probes run
    on-policy, or on CPU one ahead, where the profile is made again for its contention), so
    the on-policy preset and its async variant share a key; what changes a step's work does
    not: the decoupled objective's recomputed log-probs, another model, another batch."""
    from m2flow.runners.profiling import key_of

    def key(*overrides):
        return key_of(load_config("reasoning/grpo_arith_tiny", list(overrides)))

    on_policy = key()
    assert key("runner.max_staleness=2", "algorithm.off_policy=tis", "algorithm.is_cap=3.0",
               "runner.steps=7", "placement.mode=disaggregated") == on_policy
    recomputed = ("runner.max_staleness=1", "algorithm.old_logprobs=recompute", "rollout.partial=false")
    assert key(*recomputed, "algorithm.off_policy=tis") == key(*recomputed)
    assert key(*recomputed, "algorithm.off_policy=decoupled") != key(*recomputed)
    assert key("rollout.max_new_tokens=8") != on_policy and key("data.prompts_per_step=2") != on_policy
    assert key("seed=1") != on_policy  # a profile is of one seed's data


def test_a_stored_profile_that_does_not_load_is_measured_again(tmp_path, monkeypatch):
    """A profile file cut short (or not one at all) is named and replaced by a new
    measurement; ``m2flow plan --profile`` names it as a config error. Writes are whole."""
    path = tmp_path / "profile.json"
    cfg = load_config("embodied/ppo_cartpole", ["cluster.cpu_slots=2", f"placement.profile={path}"])
    fresh = Profile(key="k", hardware={"cpu": "x"}, points=[], profiling_s=1.5)
    monkeypatch.setattr(profiling, "profile", lambda cfg, cluster, log, pool=None: dataclasses.replace(fresh))
    for text in ('{"key": "k", "hardware": {"cp', '{"points": 3}', "[]"):
        path.write_text(text)
        with pytest.raises(ProfileError, match="profile.json holds no profile"):
            Profile.load(path)
        said = []
        prof, where = profiling.load_or_profile(cfg, None, log=said.append)
        assert where == path and prof.profiling_s == 1.5
        assert "holds no profile" in said[0] and said[0].endswith("profiling again"), said
        assert Profile.load(path).key == "k"  # the new one, written whole
        assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]  # no temporary file left
    path.write_text("not json")
    with pytest.raises(ConfigError, match="--profile: .*profile.json holds no profile"):
        auto.plan_command(None, [], str(path), None, 1, 4.0, None)
