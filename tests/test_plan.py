"""Plans: every named mode laid out for both flows, custom ranges, YAML round trips, the
derived mode, and plans that cannot run, refused before any worker starts."""

import pytest

from m2flow.config import ConfigError, load_config
from m2flow.flow import Plan, PlanError
from m2flow.runners.start import plan_of
from m2flow.runners.embodied import WORKFLOW as EMBODIED, EmbodiedRunner, plan_options as embodied_options
from m2flow.runners.reasoning import COMPONENTS, WORKFLOW as REASONING, plan_options as reasoning_options

LM = "reasoning/grpo_arith_tiny"
NO_CRITIC = COMPONENTS[:-1]


def ranges(plan):
    return {c: p.as_dict() if p.devices_per_proc > 1 or p.procs_per_device > 1 else p.devices
            for c, p in plan.components.items()}


def embodied(mode, n, *extra):
    cfg = load_config("embodied/ppo_cartpole", [f"placement.mode={mode}", *extra])
    return plan_of(cfg, EMBODIED, n, "cpu", EMBODIED.components, **embodied_options(cfg))


def reasoning(mode, n, kind, components=NO_CRITIC, *extra):
    cfg = load_config(LM, [f"placement.mode={mode}", *extra])
    return plan_of(cfg, REASONING, n, kind, components, **reasoning_options(cfg))


def test_embodied_modes():
    collocated = embodied("collocated", 2)
    assert ranges(collocated) == {"env": "0-1", "rollout": "0-1", "actor": "0-1"}
    assert collocated.fuse == [["env", "rollout"]] and collocated.mode(EMBODIED) == "collocated"
    hybrid = embodied("hybrid", 2)
    assert ranges(hybrid) == {"env": "0-0", "rollout": "1-1", "actor": "0-1"} and hybrid.mode(EMBODIED) == "hybrid"
    with pytest.raises(PlanError, match="disaggregated needs >= 3 devices"):
        embodied("disaggregated", 2)
    disaggregated = embodied("disaggregated", 4)
    assert ranges(disaggregated) == {"env": "0-1", "rollout": "2-2", "actor": "3-3"}
    assert disaggregated.mode(EMBODIED) == "disaggregated"
    spans = embodied("collocated", 4, "placement.actor_devices_per_proc=2")
    assert spans.components["actor"].devices_per_proc == 2 and spans.world_size("actor") == 2
    assert embodied("collocated", 2, "runner.stages=2", "runner.max_staleness=1").stages == 2
    assert embodied("collocated", 2, "runner.max_staleness=1").run_ahead == 1


def test_reasoning_modes():
    collocated = reasoning("collocated", 2, "cpu")
    assert ranges(collocated)["actor"] == {"devices": "0-1", "devices_per_proc": 2} == ranges(collocated)["rollout"]
    disaggregated = reasoning("disaggregated", 4, "cuda")
    assert ranges(disaggregated)["rollout"] == "0-1" and ranges(disaggregated)["actor"] == "2-3"
    assert ranges(disaggregated)["inference"] == {"devices": "2-3", "devices_per_proc": 2}  # one rank: stream order
    assert disaggregated.mode(REASONING) == "disaggregated"  # was reported as hybrid: reward shares the actor's devices
    hybrid = reasoning("hybrid", 2, "cpu")
    assert ranges(hybrid)["rollout"] == "0-0" and ranges(hybrid)["actor"] == "0-1"  # a rank per slot
    assert hybrid.mode(REASONING) == "hybrid"
    with pytest.raises(PlanError, match="disaggregated needs >= 2 devices"):
        reasoning("disaggregated", 1, "cpu")
    critic = reasoning("disaggregated", 4, "cuda", COMPONENTS)
    assert ranges(critic)["critic"] == ranges(critic)["inference"] == {"devices": "2-3", "devices_per_proc": 2}
    custom = load_config(LM, ["placement.mode=custom", *(f"placement.components.{c}=0-0" for c in NO_CRITIC)])
    assert ranges(plan_of(custom, REASONING, 1, "cpu", NO_CRITIC)) == dict.fromkeys(NO_CRITIC, "0-0")
    with pytest.raises(ConfigError, match=r"placement.components.critic: .*missing: critic"):  # checked on load
        load_config(LM, ["placement.mode=custom", "algorithm.name=ppo", *(f"placement.components.{c}=0-0"
                                                                          for c in NO_CRITIC)])
    assert reasoning("collocated", 1, "cpu", NO_CRITIC, "placement.granularity=2").granularity["samples"] == 2


def test_plan_round_trips_through_yaml(tmp_path):
    plan = reasoning("hybrid", 4, "cuda")
    plan.granularity["samples"] = 3
    assert Plan.load(plan.save(tmp_path / "plan.yaml")) == plan
    table = plan.table(REASONING)
    assert table.startswith("plan (hybrid):") and "actor" in table and "samples granularity 3" in table
    assert "offload" not in plan.to_dict() and "no offload" not in table  # the default: written as before
    plan.offload = False
    assert Plan.load(plan.save(tmp_path / "kept.yaml")) == plan and plan.to_dict()["offload"] is False
    assert "no offload" in plan.table(REASONING)


@pytest.mark.parametrize("change, message", [
    ({"components": {"actor": "0-5"}}, "component 'actor' needs device 5 .* the cluster has 4 device"),
    ({"components": {"reward": "0-1"}}, "component 'reward' must be one process"),
    ({"components": {"critic": "0"}}, r"unknown component\(s\) \['critic'\]"),
    ({"components": {"actor": "1-0"}}, "empty device range"),
    ({"components": {"actor": {"devices": "0-2", "devices_per_proc": 2}}}, "3 device.* cannot be split into processes of 2"),
    ({"fuse": [["rollout", "actor"]]}, "cannot fuse"),
    ({"granularity": {"sample": 2}}, r"unknown channel\(s\) \['sample'\]"),
    ({"run_ahead": -1}, "run_ahead must be >= 0"),
    ({"stages": 0}, "stages must be >= 1"),
    ({"offload": "no"}, "offload must be true or false, got 'no'"),
])
def test_plans_that_cannot_run_name_the_component(change, message):
    data = reasoning("collocated", 4, "cpu").to_dict()
    for key, value in change.items():
        data[key] = data[key] | value if key == "components" else value
    with pytest.raises(PlanError, match=message):
        Plan.from_dict(data).check(REASONING, 4, NO_CRITIC)


def test_the_actors_ranks_take_a_gpu_each():
    """With cluster.gpu_slots=2 each GPU is two devices whose processes run at once: the
    actor's ranks all-reduce over NCCL, one GPU per rank, so a plan that puts two of its ranks
    on the slots of one GPU is refused; the rollout beside the actor on the other slot of a
    GPU runs; on CPU slots (gpu_slots 0) the check does not apply."""
    on_two_slots = reasoning("disaggregated", 2, "cuda")
    assert ranges(on_two_slots)["rollout"] == "0-0" and ranges(on_two_slots)["actor"] == "1-1"
    on_two_slots.check(REASONING, 2, NO_CRITIC, gpu_slots=2)
    collocated = reasoning("collocated", 4, "cuda")  # actor ranks on devices 0-3: GPUs 0, 0, 1, 1
    with pytest.raises(PlanError, match=r"'actor': ranks 0 and 1 would share GPU 0 .*one GPU per rank"):
        collocated.check(REASONING, 4, NO_CRITIC, gpu_slots=2)
    collocated.check(REASONING, 4, NO_CRITIC, gpu_slots=1)  # four GPUs
    collocated.check(REASONING, 4, NO_CRITIC, gpu_slots=0)  # CPU slots
    data = collocated.to_dict()
    data["components"]["actor"] = {"devices": "0-3", "devices_per_proc": 2}  # a rank per GPU, spanning its slots
    Plan.from_dict(data).check(REASONING, 4, NO_CRITIC, gpu_slots=2)
    data["components"]["actor"] = {"devices": "2-3", "procs_per_device": 2}  # two ranks on one GPU
    with pytest.raises(PlanError, match="ranks 0 and 1 would share GPU 2"):
        Plan.from_dict(data).check(REASONING, 4, NO_CRITIC, gpu_slots=1)
    embodied_plan = embodied("collocated", 2)  # its actor all-reduces on the CPU (gloo)
    embodied_plan.check(EMBODIED, 2, EMBODIED.components, gpu_slots=2)


def test_plan_files_refuse_unknown_keys(tmp_path):
    (tmp_path / "p.yaml").write_text("components: {actor: '0'}\nahead: 1\n")
    with pytest.raises(PlanError, match=r"unknown key\(s\) \['ahead'\]"):
        Plan.load(tmp_path / "p.yaml")
    with pytest.raises(PlanError, match="no such plan file"):
        Plan.load(tmp_path / "missing.yaml")
    (tmp_path / "cut.yaml").write_text("components: {actor: '0', rollout: [0\n")
    with pytest.raises(PlanError, match=r"^placement.plan: .*cut.yaml is not YAML \(while parsing"):
        Plan.load(tmp_path / "cut.yaml")
    (tmp_path / "list.yaml").write_text("- actor\n- rollout\n")
    with pytest.raises(PlanError, match=r"list.yaml holds a list, not a plan"):
        Plan.load(tmp_path / "list.yaml")


@pytest.mark.slow  # 15 s; plan files run by default in tests/test_auto.py (one that runs ahead) and test_reasoning.py
def test_a_plan_file_runs_as_written(cluster, tmp_path):
    """``placement=@FILE``: the envs and the rollout on slots 0-1 (one process each, fused),
    the actor on slots 2-3, two env stages; the run uses exactly that plan."""
    plan = Plan.from_dict({"components": {"env": "0-1", "rollout": "0-1", "actor": "2-3"},
                           "fuse": [["env", "rollout"]], "stages": 2})
    cfg = load_config("embodied/ppo_cartpole", [f"placement=@{plan.save(tmp_path / 'plan.yaml')}",
                                                 f"runner.out_dir={tmp_path}", "runner.progress=false",
                                                 "runner.total_env_steps=512"])
    if cluster.device_kind != "cpu":
        pytest.skip("the plan names 4 CPU slots")
    runner = EmbodiedRunner(cfg, cluster)
    try:
        assert runner.plan == plan and runner.fused and runner.plan.mode(EMBODIED) == "disaggregated"
        assert runner.layout.stages == 2 and runner.groups["actor"].world_size == 2
        history = runner.train()
    finally:
        runner.close()
    assert [row["env_steps"] for row in history] == [256, 512]
