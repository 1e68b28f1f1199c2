"""The cost model's fit, the planner's search and its errors, and ``m2flow plan``, on
profiles whose costs are known (no cluster)."""

import json
import math

import pytest
from omegaconf import OmegaConf

from m2flow.cli import main
from m2flow.config import load_config
from m2flow.flow import PlanError
from m2flow.flow.cost import CostModel, Point, Profile, calibrate, fit, points_from_rows
from m2flow.flow.plan import Plan
from m2flow.flow.planner import candidates, layout_of, predicted, priced, splits
from m2flow.flow.simulate import Shape
from m2flow.runners.auto import choose, plan_command
from m2flow.runners.embodied import WORKFLOW as EMBODIED
from m2flow.runners.reasoning import WORKFLOW as REASONING
from m2flow.runners.schedule import schedule_of


def test_fit_recovers_known_costs_and_reports_held_out_error():
    truth = lambda items, d: 0.05 + 0.002 * items / d + 0.01 * math.log2(d)  # noqa: E731
    pts = [Point("actor", "train", i, d, truth(i, d)) for i in (64, 256, 1024) for d in (1, 2, 4)]
    f = fit(pts)
    assert f.coef == pytest.approx((0.05, 0.002, 0.01, 0.0), rel=1e-6)
    assert f.loo_error == pytest.approx(0.0, abs=1e-6)
    assert f(512, 8) == pytest.approx(truth(512, 8))


def test_fit_tells_a_per_item_device_effect_from_a_per_call_one():
    # A process whose threads share the work less well on more devices: its device effect
    # grows with the items. Read as a cost per call, a step cut into 16 chunks of 8 would
    # cost 15 more calls' worth than one chunk of 128; per item, the same.
    truth = lambda items, d: 0.1 + 0.5 * items / d + 0.3 * items * math.log2(d) / d  # noqa: E731
    pts = [Point("actor", "train", i, d, truth(i, d)) for i, d in ((8, 1), (8, 2), (64, 2))]
    f = fit(pts)
    assert f.coef == pytest.approx((0.1, 0.5, 0.0, 0.3), rel=1e-6)
    assert 16 * f(8, 2) - f(128, 2) == pytest.approx(15 * 0.1)
    # The same device effect seen at one size on two devices: it stays a cost per call (the
    # points cannot tell; the fit has always read it so).
    f = fit(pts[:2] + [Point("actor", "train", 64, 1, truth(64, 1))])
    assert f.coef[3] == 0.0 and f.coef[2] > 0


def test_fit_at_one_device_count_gives_no_device_term():
    pts = [Point("env", "work", i, 2, 0.001 + 0.0005 * i) for i in (4, 8)]
    f = fit(pts)
    assert f.coef[2] == 0.0
    assert f(8, 2) == pytest.approx(0.005)
    assert f.loo_error is None  # two points: nothing to hold out


def test_points_from_rows_cut_busy_time_into_the_simulators_tasks():
    shape = Shape(("env", "rollout"), "actor", items=8, chunks=2, repeats=4, samples=32)
    layout = layout_of(_plan(EMBODIED, "collocated", 2, stages=2), EMBODIED)[0]
    row = {"env_busy_s": 0.8, "rollout_busy_s": 0.4, "actor_busy_s": 2.0, "weight_sync_s": 0.01}
    pts = {(p.component, p.phase): p for p in points_from_rows(shape, layout, [row])}
    assert pts["env", "work"] == Point("env", "work", 4.0, 2, 0.1)  # 4 repeats x 2 chunks
    assert pts["rollout", "work"].seconds == pytest.approx(0.05)
    assert pts["actor", "train"] == Point("actor", "train", 32, 2, 2.0)  # the samples of the step
    assert pts["actor", "sync"].seconds == 0.01


def test_points_from_rows_take_a_streamed_steps_update_apart():
    # Streamed, the actor trains on each chunk as it comes, then updates once a step: with the
    # update's time logged, a cost per step is not read as one per chunk.
    shape = Shape(("rollout", "reward", "inference"), "actor", items=32, chunks=4, batched=("rollout",),
                  trainer_streams=True)
    layout = layout_of(_plan(REASONING, "collocated", 2), REASONING)[0]
    row = {"rollout_busy_s": 8.0, "reward_busy_s": 0.1, "inference_busy_s": 0.2, "actor_busy_s": 10.0,
           "actor_update_busy_s": 2.0, "weight_sync_s": 0.0}
    pts = {(p.component, p.phase): p for p in points_from_rows(shape, layout, [row])}
    assert pts["actor", "train"] == Point("actor", "train", 8.0, 2, 2.0)  # (10 - 2) / 4 chunks
    assert pts["actor", "update"] == Point("actor", "update", 32, 2, 2.0)
    del row["actor_update_busy_s"]  # a profile of an earlier version: the update folded into the chunks
    pts = {(p.component, p.phase): p for p in points_from_rows(shape, layout, [row])}
    assert pts["actor", "train"].seconds == 2.5 and ("actor", "update") not in pts


def test_the_trainers_points_count_the_rows_it_forwarded():
    # Two steps of 32 rows, one forwarding 16 (16 inert: zero gradient, skipped), one all 32:
    # the same cost per row forwarded, where per row received one looks half as costly.
    shape = Shape(("rollout", "reward", "inference"), "actor", items=32, chunks=4, batched=("rollout",),
                  trainer_streams=True)
    layout = layout_of(_plan(REASONING, "collocated", 2), REASONING)[0]
    rows = [{"rollout_busy_s": 8.0, "reward_busy_s": 0.1, "inference_busy_s": 0.2, "weight_sync_s": 0.0,
             "actor_busy_s": 1.0 + 0.25 * forwarded, "actor_update_busy_s": 1.0, "inert_rows": 32 - forwarded}
            for forwarded in (16, 32)]
    train = [p for p in points_from_rows(shape, layout, rows) if p.phase == "train"]
    assert [(p.items, p.seconds) for p in train] == [(4.0, 1.0), (8.0, 2.0)]  # 16 / 4 chunks in 4 / 4 s
    assert [p.items for p in points_from_rows(shape, layout, [rows[0] | {"inert_rows": float("nan")}])
            if p.phase == "train"] == [8.0]  # none reported: every row counts
    assert [p.items for p in points_from_rows(shape, layout, [rows[1]]) if p.phase == "update"] == [32]


def test_the_model_predicts_training_at_the_profiles_share_of_rows(tmp_path):
    pts = [Point("actor", "train", i, d, 0.1 + 0.5 * i / d) for i in (4, 8) for d in (1, 2)]
    pts += [Point("actor", "update", 32, 1, 0.3), Point("rollout", "work", 32, 1, 5.0)]
    prof = Profile("t", {"devices": 2, "kind": "cpu", "cpu": "t", "gpus": []}, pts, trained_share=0.5)
    model = CostModel(prof)
    assert model("actor", "train", 8, 1) == pytest.approx(0.1 + 0.5 * 4)  # half of 8 rows forwarded
    assert model("actor", "update", 32, 1) == pytest.approx(0.3)  # a step's update: whatever the rows
    assert model("rollout", "work", 32, 1) == pytest.approx(5.0)
    assert model.at_share(1.0)("actor", "train", 8, 1) == pytest.approx(4.1)
    assert model("actor", "train", 8, 1) == pytest.approx(2.1)  # at_share made another model
    assert "50% of its rows" in model.share_report() and model.at_share(1.0).share_report() == ""
    loaded = Profile.load(prof.save(tmp_path / "p.json"))
    assert loaded.trained_share == 0.5
    old = json.loads((tmp_path / "p.json").read_text())
    del old["trained_share"]  # a profile of an earlier version: its points per row received
    assert Profile.from_dict(old).trained_share == 1.0


def test_calibrate_finds_the_hidden_cost():
    assert calibrate(10.0, lambda x: 4.0 + 3 * x) == pytest.approx(2.0, abs=1e-6)
    assert calibrate(3.0, lambda x: 4.0 + 3 * x) == 0.0  # already over: nothing hidden
    assert calibrate(10.0, lambda x: 4.0) == 0.0  # a cost nothing in the step pays explains no gap


def test_splits_cover_the_devices():
    assert splits(2, 4) == [(1, 3), (2, 2), (3, 1)]
    assert len(splits(3, 6)) == 10  # C(5, 2)
    big = splits(3, 1024)
    assert big and all(sum(s) == 1024 and min(s) >= 1 for s in big)
    assert splits(3, 2) == []


def _plan(workflow, mode, n, **kw):
    from m2flow.flow import Plan

    return Plan.for_mode(workflow, mode, n, "cpu", **kw)


def _embodied_profile(env_s_per_env=0.001, actor_s=0.5, devices=4, **extra) -> tuple:
    cfg = load_config("embodied/ppo_halfcheetah", [f"cluster.cpu_slots={devices}", "placement.actor_devices_per_proc=1"])
    pts = []
    for d in (1, 2):
        for items in (4, 8):
            pts.append(Point("env", "work", items, d, 0.0002 + env_s_per_env * items / d))
            pts.append(Point("rollout", "work", items, d, 0.0003 + 0.00001 * items / d))
        pts.append(Point("actor", "train", 2048, d, actor_s / d))
        pts.append(Point("actor", "sync", 2048, d, 0.002))
    prof = Profile("test", {"devices": devices, "kind": "cpu", "cpu": "test", "gpus": []}, pts,
                   switch_s={"env": 0.01, "rollout": 0.01, "actor": 0.01}, hop_s=0.0002,
                   config=OmegaConf.to_container(cfg, resolve=True), **extra)
    return cfg, prof


def test_planner_picks_the_fastest_simulated_plan_and_explains_it():
    cfg, prof = _embodied_profile()
    choice = choose(cfg, prof)
    times = [c.step_s for c in choice.ranked]
    assert times == sorted(times) and choice.best is choice.ranked[0]
    assert len(choice.ranked) >= 6
    modes = {c.mode for c in choice.ranked}
    assert {"collocated", "disaggregated", "hybrid"} <= modes
    report = choice.report()
    assert "why:" in report and "busiest process" in report and choice.best.describe() in report
    assert all(c.plan.run_ahead == 0 for c in choice.ranked)  # on-policy unless staleness allows


def test_run_ahead_only_within_the_staleness_allowed():
    # An update: 256 rollout steps, each paying 0.5 ms a call (env and rollout) however many
    # devices share the envs, and the actor's 0.4 device-seconds. On all 4 devices, in turns:
    # about 0.128 + 0.05 (envs) + 0.1 (actor) + switches = 0.31 s. Makers on 2 devices and the
    # actor on the other 2, one version ahead: they overlap, max(0.128 + 0.1, 0.2) = 0.23 s.
    cfg, prof = _embodied_profile(env_s_per_env=0.0001, actor_s=0.4)
    on_policy = choose(cfg, prof)
    cfg.runner.max_staleness = 1
    ahead = choose(cfg, prof)
    assert any(c.plan.run_ahead for c in ahead.ranked)
    assert on_policy.best.mode == "collocated" and on_policy.best.step_s == pytest.approx(0.31, rel=0.05)
    # one version ahead, makers and trainer on devices of their own overlap: strictly faster here
    assert ahead.best.plan.run_ahead == 1 and ahead.best.mode == "disaggregated"
    assert ahead.best.step_s == pytest.approx(0.24, rel=0.05)
    # CPU slots computing at once slow each other, which the model leaves out: the report says so
    assert "note: components on CPU slots of their own compute at once" in ahead.report()
    assert "note:" not in on_policy.report()  # collocated: one component computes at a time


def test_a_plan_ahead_is_priced_at_the_learning_it_costs():
    # The profile above: on-policy collocated 0.31 s a step, one version ahead 0.24 s (1.29x).
    # Where a run one ahead takes 1.2x the steps to the same learning, the plan ahead is priced
    # 0.29 s and still wins; at 1.4x, 0.34 s, and the on-policy plan wins, slower but learning
    # more a step.
    cfg, prof = _embodied_profile(env_s_per_env=0.0001, actor_s=0.4)
    cfg.runner.max_staleness = 2
    fastest = choose(cfg, prof).best
    assert fastest.plan.run_ahead >= 1 and list(cfg.placement.staleness_cost) == []  # the embodied default
    for cost, ahead in (([0.2], 1), ([0.4], 0), ([0.0, 0.5], 1)):
        cfg.placement.staleness_cost = cost
        choice = choose(cfg, prof)
        prices = [round(priced(c.step_s, c.plan.run_ahead, cost), 9) for c in choice.ranked]  # by hand: below
        assert prices == sorted(prices) and choice.best is choice.ranked[0]
        assert choice.best.plan.run_ahead == ahead, cost
        assert choice.best.step_s >= fastest.step_s
        report = choice.report()
        if ahead == 0:
            assert choice.best.mode == "collocated" and choice.best.step_s == pytest.approx(0.31, rel=0.05)
            assert "x1.4 at 1 ahead, x1.96 at 2 ahead" in report and "(priced " in report  # 1.4^2 past the list
            assert f"why: {choice.best.describe()} is the least priced: the fastest predicted" in report
    assert "x1 at 1 ahead, x1.5 at 2 ahead" in report  # the last: one ahead free, two ahead 1.5x the steps
    # the reasoning flow prices running ahead by default (measured: its GRPO two ahead learns less a step)
    assert list(load_config("reasoning/grpo_arith_smollm2").placement.staleness_cost) == [0.22, 0.34]


def test_priced_by_the_steps_to_the_same_learning():
    assert priced(2.0, 0, [0.5]) == 2.0 and priced(2.0, 3, []) == 2.0  # on-policy; no price
    assert priced(2.0, 1, [0.1, 0.44]) == pytest.approx(2.2) and priced(2.0, 2, [0.1, 0.44]) == pytest.approx(2.88)
    assert priced(2.0, 4, [0.1, 0.44]) == pytest.approx(2.0 * 1.44 ** 2)  # past the list: 1.44 every two versions
    assert priced(1.0, 2, [0.2]) == pytest.approx(1.44)


def test_what_does_not_scale_decides_the_plan():
    # Envs that do not get faster with devices (a fixed cost per call) beside an actor that
    # does: one version ahead, the best plan gives the actor devices of its own and overlaps
    # it with collection. Envs that scale and an actor that does not: everything collocated.
    def profile(env_fixed, env_per_env, actor_fixed, actor_per_sample):
        cfg, prof = _embodied_profile()
        cfg.runner.max_staleness = 1
        prof.points = [p for p in prof.points if p.component == "rollout"]
        for d in (1, 2, 4):
            for items in (4, 8):
                prof.points.append(Point("env", "work", items, d, env_fixed + env_per_env * items / d))
            prof.points.append(Point("actor", "train", 2048, d, actor_fixed + actor_per_sample * 2048 / d))
        return cfg, prof

    best = choose(*profile(0.004, 0.0, 0.0, 0.001)).best
    assert best.mode == "disaggregated" and best.plan.run_ahead == 1
    assert len(best.plan.devices("actor")) >= 2 and best.plan.devices("actor").isdisjoint(best.plan.devices("env"))
    best = choose(*profile(0.0, 0.002, 0.5, 0.0)).best
    assert best.mode == "collocated"


def test_a_plan_over_device_memory_names_the_component_and_the_shortfall():
    cfg = load_config("reasoning/grpo_arith_tiny", ["cluster.cpu_slots=2"])
    pts = [Point(c, ph, i, d, 0.01 * i / d) for c, ph in (("rollout", "work"), ("reward", "work"),
                                                         ("inference", "work"), ("actor", "train"))
           for i in (2, 4) for d in (1, 2)]
    prof = Profile("t", {"devices": 2, "kind": "cpu", "cpu": "t", "gpus": []}, pts,
                   memory_mb={"rollout": 900, "inference": 900, "actor": 3000, "reward": 10},
                   device_memory_mb=2000, config=OmegaConf.to_container(cfg, resolve=True))
    with pytest.raises(PlanError, match=r"actor alone 3,000 MB; short by [\d,]+ MB"):
        choose(cfg, prof)
    prof.memory_mb["actor"] = 1000  # collocated on CPU: 900 + 900 + 1000 > 2000, split: fits
    choice = choose(cfg, prof)
    assert choice.best.mode != "collocated" and choice.rejected


def _gpu_profile(cfg, memory_mb, **extra):
    """A reasoning profile on one 80,000 MB GPU made two devices: every cost 0.01 s an item."""
    pts = [Point(c, ph, i, d, 0.01 * i / d) for c, ph in (("rollout", "work"), ("reward", "work"),
                                                         ("inference", "work"), ("actor", "train"))
           for i in (2, 4) for d in (1, 2)]
    return Profile("t", {"devices": 2, "kind": "cuda", "cpu": "t", "gpus": ["g"]}, pts, memory_mb=memory_mb,
                   device_memory_mb=80_000, config=OmegaConf.to_container(cfg, resolve=True), **extra)


def test_the_slots_of_one_gpu_share_its_memory():
    """cluster.gpu_slots=2 on one GPU: every rank on either slot draws on the one GPU's memory.
    Rollout on slot 0 beside inference and actor taking turns on slot 1 need 50,000 + 40,000 MB
    at once (each slot alone fits in 80,000); collocated on both slots, the rollout's two
    ranks hold their turns at once (100,000 MB); collocated on one slot, one at a time. (The
    inference worker holds a model: it recomputes the log-probs.)"""
    cfg = load_config("reasoning/grpo_arith_tiny", ["cluster.gpu_slots=2", "algorithm.old_logprobs=recompute"])
    prof = _gpu_profile(cfg, {"rollout": 50_000, "inference": 20_000, "actor": 40_000, "reward": 0})
    choice = choose(cfg, prof)
    fits = {(c.mode, c.split) for c in choice.ranked}
    # hybrid: rollout on slot 0, inference on slot 1, the actor over both: 50,000 + 20,000 or 40,000
    assert fits == {("collocated", (1,)), ("hybrid", (1, 1))}, fits
    short = [c.rejected for c in choice.rejected if c.mode == "disaggregated"]
    assert short and all(r.startswith("GPU 0 (devices 0-1), used by") and "they need 90,000 MB" in r for r in short)
    assert any("they need 100,000 MB" in c.rejected for c in choice.rejected if c.split == (2,))
    assert "note: 2 devices per GPU: their ranks share its memory (counted) and its compute" in choice.report()
    prof.memory_mb["rollout"] = 30_000  # 30,000 + 40,000: the rollout beside the actor fits
    assert "disaggregated" in {c.mode for c in choose(cfg, prof).ranked}
    cfg.cluster.gpu_slots = 1  # two GPUs of 80,000 MB each: a slot's ranks alone on theirs
    prof.memory_mb["rollout"] = 50_000
    choice = choose(cfg, prof)
    assert {"disaggregated", "collocated"} <= {c.mode for c in choice.ranked} and "note:" not in choice.report()


def test_on_gpus_the_planner_keeps_memory_in_place_where_it_all_fits():
    """Components taking turns on a GPU move their memory out between turns (the rollout its
    weights and KV cache, the actor its optimizer state) only where the GPU cannot hold them
    all at once: a plan that keeps it in place (``offload`` false) is priced without the
    switch costs. On CPU slots the plans move it out, as before."""
    cfg = load_config("reasoning/grpo_arith_tiny", ["cluster.gpu_slots=2"])
    prof = _gpu_profile(cfg, {"rollout": 20_000, "inference": 10_000, "actor": 30_000, "reward": 0},
                        switch_s={"rollout": 0.5, "inference": 0.5, "actor": 0.5})
    choice = choose(cfg, prof)
    model = CostModel(prof)
    turns = [c for c in choice.ranked if any(c.layout.turns.values())]
    assert turns and all(not c.plan.offload for c in turns)  # 60,000 MB at once: fits
    for c in turns:
        moving = predicted(model, schedule_of(cfg).shape(c.plan, c.fused), c.layout, c.plan.run_ahead)
        assert c.step_s <= moving.step_s - 0.5, (c.describe(), c.step_s, moving.step_s)
    assert all(c.plan.offload for c in choice.ranked if not any(c.layout.turns.values()))
    assert Plan.from_dict(turns[0].plan.to_dict()) == turns[0].plan and "no offload" in turns[0].describe()
    assert not choice.best.plan.offload and "keep their memory on the GPU (it all fits at once)" in choice.report()
    prof.memory_mb["actor"] = 55_000  # 85,000 MB at once: the collocated plans move it out again
    collocated = [c for c in choose(cfg, prof).ranked if c.mode == "collocated"]
    assert collocated and all(c.plan.offload for c in collocated)
    cpu = load_config("reasoning/grpo_arith_tiny", ["cluster.cpu_slots=2"])
    prof.hardware = prof.hardware | {"kind": "cpu", "gpus": []}
    prof.config = OmegaConf.to_container(cpu, resolve=True)
    assert all(c.plan.offload for c in choose(cpu, prof).ranked)


def test_ranks_taking_turns_on_disjoint_devices_hold_memory_together():
    from m2flow.flow.planner import _peak_together

    assert _peak_together([]) == 0.0
    assert _peak_together([(0b01, 5.0), (0b01, 7.0)]) == 7.0  # one device: one at a time
    assert _peak_together([(0b01, 5.0), (0b10, 7.0)]) == 12.0  # two devices: both at once
    assert _peak_together([(0b01, 5.0), (0b10, 7.0), (0b11, 11.0)]) == 12.0
    assert _peak_together([(0b01, 5.0), (0b10, 5.0), (0b11, 11.0)]) == 11.0  # the rank over both is the most
    assert _peak_together([(0b011, 4.0), (0b110, 4.0), (0b100, 1.0), (0b001, 1.0)]) == 5.0


def test_reasoning_candidates_vary_granularity_and_split():
    cfg = load_config("reasoning/grpo_arith_tiny", ["cluster.cpu_slots=4"])
    s = schedule_of(cfg)
    cands = candidates(REASONING, 4, "cpu", s.components, **s.knobs())
    assert {max(c.plan.granularity.values()) for c in cands} == set(s.knobs()["granularities"])
    assert len({c.split for c in cands if c.mode == "disaggregated"}) == 3


def test_plan_for_1024_devices_from_a_profile(tmp_path, capsys):
    cfg, prof = _embodied_profile()
    path = prof.save(tmp_path / "p.json")
    out = tmp_path / "plan.yaml"
    main(["plan", "--profile", str(path), "--devices", "1024", "--nodes", "128", "--out", str(out),
          "env.num_envs=4096"])
    text = capsys.readouterr().out
    assert "1024 cpu device(s) on 128 node(s)" in text and "planning time" in text
    from m2flow.flow import Plan

    best = Plan.load(out)
    used = set().union(*(best.devices(c) for c in best.components))
    assert max(i for _, i in used) <= 1023


def test_no_process_of_a_pick_spans_two_nodes():
    """On 16 devices of 2 nodes, the plans that put one process on devices of both (an actor
    rank over all 16) are rejected, naming the rank and the nodes; the pick's ranks each sit
    on one node, so its placement can start."""
    from m2flow.runtime.placement import parse_range, rank_devices

    _, prof = _embodied_profile()
    cfg = load_config("embodied/ppo_cartpole", ["env.num_envs=64"])
    choice = choose(cfg, prof, num_devices=16, nodes=2)
    spanning = [c for c in choice.rejected if "would span devices of nodes [0, 1]" in (c.rejected or "")]
    assert spanning and all("one process runs on one node" in c.rejected for c in spanning)
    for c in choice.ranked:
        for name, p in c.plan.components.items():
            _, devices = parse_range(p.devices, name)
            assert all(len({d // 8 for d in devs}) == 1
                       for devs in rank_devices(devices, p.procs_per_device, p.devices_per_proc)), (name, p)


def test_plan_command_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--profile", str(tmp_path / "missing.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("m2flow: error: --profile: no such profile file") and "\n" not in err
    cfg, prof = _embodied_profile()
    path = prof.save(tmp_path / "p.json")
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(path), "--devices", "10", "--nodes", "3"])
    assert "do not spread evenly" in capsys.readouterr().err
    for flags, message in ((["--devices", "0"], "--devices: must be >= 1, got 0"),
                           (["--nodes", "0"], "--nodes: must be >= 1, got 0"),
                           (["--internode", "0"], "--internode: must be > 0 "),
                           (["--out", "/proc/none/plan.yaml"], "--out: cannot write '/proc/none/plan.yaml': ")):
        with pytest.raises(SystemExit):
            main(["plan", "--profile", str(path), *flags])
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"m2flow: error: {message}") and "\n" not in err, err
    bare = json.loads(path.read_text())
    del bare["config"]
    (tmp_path / "bare.json").write_text(json.dumps(bare))
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(tmp_path / "bare.json")])
    assert "bare.json holds no config of a flow: give its preset too" in capsys.readouterr().err
    assert json.loads(path.read_text())["hop_s"] == 0.0002
    assert plan_command(None, [], str(path), None, 1, 1.0, None, log=lambda *_: None).best is not None
    # a profile whose config an earlier version wrote (a key since renamed)
    old = json.loads(path.read_text())
    old["config"]["runner"]["collect_ahead"] = True
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(tmp_path / "old.json")])
    err = capsys.readouterr().err.strip()
    assert err.startswith("m2flow: error: --profile:") and "runner.collect_ahead" in err and "\n" not in err


def test_layout_turns_as_the_runner_gives_them():
    # Collocated and fused, the env workers host the policy: they take turns with the actor.
    # Unfused, the env workers hold no model: only the rollout and the actor take turns.
    fused, is_fused = layout_of(_plan(EMBODIED, "collocated", 2), EMBODIED)
    assert is_fused and fused.turns == {"env": True, "rollout": True, "actor": True}
    assert fused.process["rollout"] == "env"
    loose, is_fused = layout_of(_plan(EMBODIED, "collocated", 2, fuse=False), EMBODIED)
    assert not is_fused and loose.turns == {"env": False, "rollout": True, "actor": True}
    hybrid, _ = layout_of(_plan(REASONING, "hybrid", 2), REASONING)
    assert hybrid.turns["reward"] is False and hybrid.turns["actor"] and hybrid.turns["inference"]


def test_env_and_rollout_fused_on_devices_of_their_own_are_a_candidate():
    # On two devices the three-group split (env | rollout | actor) does not fit; with env and
    # rollout in one group it does, fused only: env workers running the rollout on device 0,
    # the actor on device 1. One version ahead allowed, it overlaps collection and training.
    cfg, prof = _embodied_profile(devices=2)
    cands = candidates(EMBODIED, 2, "cpu", ("env", "rollout", "actor"), staleness=1)
    apart = [c for c in cands if c.mode == "disaggregated"]
    assert apart and all(c.fused and c.split == (1, 1) for c in apart)
    assert {(min(i for _, i in c.plan.devices("env")), min(i for _, i in c.plan.devices("actor"))) for c in apart} == {(0, 1)}
    # envs at a fixed cost per call (no faster on two devices), an actor that scales: the
    # overlap wins
    prof.points = [p for p in prof.points if p.component == "rollout"]
    for d in (1, 2):
        prof.points += [Point("env", "work", items, d, 0.004) for items in (4, 8)]
        prof.points.append(Point("actor", "train", 2048, d, 0.0005 * 2048 / d))
    cfg.runner.max_staleness = 1
    best = choose(cfg, prof).best
    assert best.mode == "disaggregated" and best.fused and best.plan.run_ahead == 1


def test_step_scales_are_the_binomial_quantiles_of_the_groups_forwarded():
    from m2flow.flow.cost import step_scales

    # two groups, each forwarded with probability 1/2: 0, 1 or 2 of them with 1/4, 1/2, 1/4;
    # the quantiles at 1/8, 3/8, 5/8, 7/8 are 0, 1, 1, 2 (mean 1)
    scales = step_scales(0.5, 2, 4)
    assert sorted(scales) == [0.0, 1.0, 1.0, 2.0] and step_scales(0.5, 2, 4) == scales
    x = step_scales(0.59, 4, 24)
    assert sum(x) / 24 == pytest.approx(1.0) and len(set(x)) > 2
    assert step_scales(1.0, 4, 6) == [1.0] * 6 and step_scales(0.0, 4, 6) == []


def test_an_inference_worker_without_a_model_makes_no_one_take_turns():
    """GRPO with the sampling log-probs and no KL term: the inference worker holds no model, so
    on the actor's devices (disaggregated) the actor takes no device turns, and on a GPU keeps
    its optimizer state there; with a KL term (a reference model) the two take turns."""
    for overrides, actor_turns in ((["algorithm.kl_coef=0"], False), (["algorithm.kl_coef=0.05"], True),
                                   (["algorithm.old_logprobs=recompute"], True)):
        cfg = load_config("reasoning/grpo_arith_tiny", ["cluster.cpu_slots=2", *overrides])
        s = schedule_of(cfg)
        plan = Plan.for_mode(s.workflow, "disaggregated", 2, "cpu", components=s.components)
        layout, _ = layout_of(plan, s.workflow)
        assert layout.turns["actor"] is actor_turns and layout.turns["inference"] is actor_turns, overrides
        assert layout.turns["rollout"] is False  # alone on its device
        collocated, _ = layout_of(Plan.for_mode(s.workflow, "collocated", 2, "cpu", components=s.components),
                                  s.workflow)
        assert collocated.turns["rollout"] and collocated.turns["actor"]  # the two models still take turns
