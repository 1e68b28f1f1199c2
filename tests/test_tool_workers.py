"""The tool workers (``m2flow/workers/tool.py``): a component of processes with no model that
run the rollout's tool calls, called by the rollout directly (``runtime.peers``), each
trajectory's calls on one rank that keeps its state; a dead tool rank is a death the run
restarts from; the planner prices the rollout <-> tool cycle."""

import math

import pytest

from m2flow.config import load_config
from m2flow.engines import SamplingParams, TorchEngine
from m2flow.flow.plan import Plan
from m2flow.flow.planner import layout_of
from m2flow.flow.simulate import Shape, predict
from m2flow.runners import status
from m2flow.runners.agentic import FLOW
from m2flow.runtime import Worker, dispatch
from m2flow.runtime.errors import PeerDiedError, WorkerDiedError
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.peers import Peer
from m2flow.runtime.placement import Placement
from m2flow.tools import Toolbox
from m2flow.tools.base import ToolCall
from m2flow.tools.episodes import ANSWERED, ToolTurns, turn_separator
from m2flow.workers.tool import RemoteTools, ToolWorker

from test_episodes import taught_model
from test_restarts import _run

PRESET = "agentic/tool_arith_tiny"


def _config(*names, timeout_s=10.0):
    return {"tools": {"names": list(names), "timeout_s": timeout_s, "max_calls": 8, "max_response_tokens": 64}}


@pytest.fixture
def tool_group(cluster, request):
    groups = []

    def start(name, *tools, ranks=2):
        placement = Placement.from_config({"tool": f"0-{ranks - 1}"}, cluster)
        groups.append(WorkerGroup(ToolWorker, placement["tool"], args=(_config(*tools),), name=name))
        return groups[-1]

    yield start
    for g in groups:
        g.kill()


def test_a_turns_calls_run_in_a_tool_worker_and_the_trajectory_is_its_conversations_template(tool_group):
    """The taught conversation (tests/test_episodes.py), its calculator call run by a tool rank:
    the same trajectory, token for token, as with the calls on the caller's threads."""
    tools = tool_group("tool-direct", "calculator")
    model, tok, conversation = taught_model()
    prompt = tok.apply_chat_template(conversation[:1], tokenize=True, add_generation_prompt=True, return_dict=False)
    remote = RemoteTools("tool-direct", 2, rollout_rank=0, call=1)
    hook = ToolTurns(Toolbox([]), tok, {tok.eos_token_id}, run=remote.run, forget=remote.forget)
    engine = TorchEngine(model, tok, max_batch_size=2)
    params = SamplingParams(n=1, temperature=0, max_new_tokens=120, max_total_tokens=400)
    (c,) = [c for g in engine.generate([prompt], params, turn_ended=hook) for c in g]
    episode = hook.take(0, 0)
    assert c.turns == 2 and episode.ended == ANSWERED and episode.results[0][0].text == "408"
    tail = tok.encode(turn_separator(tok)[1], add_special_tokens=False)
    assert prompt + c.token_ids + tail == tok.apply_chat_template(conversation, tokenize=True, return_dict=False)
    reports = tools.report().wait()
    assert sum(r.calls for r in reports) == 1 and sum(r.busy_s > 0 for r in reports) == 1


def test_a_trajectorys_calls_go_to_the_rank_that_keeps_its_state(tool_group):
    """A stateful tool (a tally of the trajectory's calls): each trajectory's three turns reach
    one rank, which counts on from its last; trajectories spread over both ranks; ``forget``
    drops a trajectory's state."""
    tool_group("tool-state", "fault_tools:Tally")
    remote = RemoteTools("tool-state", 2, rollout_rank=3, call=7)
    seen = {}
    for turn in (1, 2, 3):
        answers = {key: remote.run(key, [ToolCall(f"c{turn}", "tally", {})]) for key in [(p, 0) for p in range(8)]}
        for key, answer in answers.items():
            (result,) = answer.result(timeout=30)
            pid, count = result.text.split(":")
            assert int(count) == turn and seen.setdefault(key, pid) == pid
    assert len(set(seen.values())) == 2
    held = sum(r.trajectories for r in tool_group_reports("tool-state"))
    for done in [remote.forget(key) for key in seen]:  # sent without waiting: a report may come first
        done.result(timeout=30)
    assert held == 8 and sum(r.trajectories for r in tool_group_reports("tool-state")) == 0


def tool_group_reports(name):
    return [Peer(name, r).call("report").result(timeout=30) for r in range(2)]


class Caller(Worker):
    """Calls a tool rank directly, as a rollout does, and waits for the answer."""

    @dispatch()
    def ask(self, group: str, rank: int) -> str:
        (result,) = Peer(group, rank).call("run", (0, 0, 0, 0), [ToolCall("c", "f", {})]).result(timeout=60)
        return result.text


def test_a_call_to_a_tool_rank_that_dies_is_that_ranks_death(tool_group, cluster, tmp_path):
    """The tool kills the process it runs in: the caller's call fails with ``PeerDiedError``, and
    the driver reads the group call that failed with it as the tool rank's death (a run restarts
    on it); a call to it afterwards fails at once, never hangs."""
    tool_group("tool-dies", {"path": "fault_tools:DiesOnce", "marker": str(tmp_path / "died")}, ranks=1)
    caller = WorkerGroup(Caller, Placement.from_config({"caller": "2"}, cluster)["caller"], name="caller-dies")
    try:
        with pytest.raises(WorkerDiedError) as e:
            caller.ask("tool-dies", 0).wait(timeout=60)
        assert (e.value.group, e.value.rank, e.value.method) == ("tool-dies", 0, "run")
        assert (tmp_path / "died").exists() and "died" in str(e.value)
        with pytest.raises(PeerDiedError):
            Peer("tool-dies", 0).call("report").result(timeout=30)
    finally:
        caller.kill()


def test_the_flow_runs_its_calls_in_tool_workers_and_goes_on_after_one_is_killed(cluster, pool, tmp_path):
    """``tools.workers``: the plan places the tool component (one process per device, collocated);
    a tool rank killed after step 1's checkpoint (the driver sees it at the step's report, the
    random tiny model seldom calling a tool; a rollout's call to a dead rank: the test above):
    every group starts again from it and steps 1-3 are trained once each, on every sample of
    each (the ledger's check)."""
    overrides = ["tools.workers=true", "runner.steps=3", "runner.checkpoint_every=1", "runner.eval_every=0"]
    keep = {}
    history, _, killed = _run(FLOW.runner, PRESET, overrides, cluster, tmp_path,
                              kills=[("step_000001.safetensors", "tool", 1)], keep=keep, pool=pool)
    assert killed == [("tool", 1)]
    assert "restart 1 of at most 3: tool-" in (tmp_path / "log.txt").read_text()
    steps = [r for r in history if not math.isnan(r.get("step_s", math.nan))]
    assert [r["step"] for r in steps] == [1, 2, 3] and status.read(tmp_path)["state"] == "finished"
    assert all(r["tool_busy_s"] >= 0 and r["tool_idle_s"] >= 0 and r["turns"] >= 1 for r in steps)
    assert all(len(ids) == 8 for ids in keep["metrics"].ledger.trained.values())


def test_the_plan_places_tool_workers_and_the_tool_side_of_the_cycle_can_set_the_pace():
    """Disaggregated on 1,024 devices, the tool workers go beside the trainer (the rollout's
    devices stay its own); the simulated step is the rollout's when its tools keep up, and the
    tools' when they are the slower side of the cycle."""
    cfg = load_config(PRESET, ["tools.workers=true"])
    workflow, names = FLOW.workflow_of(cfg), FLOW.components(cfg)
    plan = Plan.for_mode(workflow, "disaggregated", 1024, components=names)
    assert plan.devices("rollout").isdisjoint(plan.devices("tool")) and plan.world_size("tool") == 512
    assert "tool" in plan.table(workflow)
    layout, fused = layout_of(plan, workflow)
    shape = FLOW.shape(cfg, plan, fused)
    assert shape.beside == {"rollout": "tool"}

    def cost(tool_s):
        return lambda comp, phase, items, devices: {("rollout", "work"): 1.0, ("tool", "work"): tool_s,
                                                    ("actor", "train"): 0.1 * items / shape.items}.get((comp, phase), 0.0)

    fast, slow = (predict(shape, layout, cost(s)).step_s for s in (0.5, 3.0))
    alone = predict(Shape(**{**shape.__dict__, "beside": {}}), layout, cost(0.0)).step_s
    assert fast == pytest.approx(alone) and slow == pytest.approx(alone + 2.0, rel=0.05)
