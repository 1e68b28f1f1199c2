"""The agentic flow (``m2flow/runners/agentic.py``): its config's mistakes are one-line errors
before Ray starts, its prompts offer the tools, and a run trains on multi-turn trajectories
whose loss mask leaves the tools' tokens out."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from m2flow.config import ConfigError, load_config
from m2flow.data.prompts import load_prompts
from m2flow.models.lm import byte_tokenizer
from m2flow.runners.agentic import FLOW, ToolRolloutWorker
from m2flow.engines.batch import SequenceBatch
from m2flow.engines.generation import Completion

PRESET = "agentic/tool_arith_tiny"


def _train(cfg, cluster, pool):
    """The run's metrics rows, and the runner (closed)."""
    runner = FLOW.runner(cfg, cluster=cluster, pool=pool)
    try:
        return runner.train(trace=False), runner
    finally:
        runner.close()


@pytest.mark.parametrize("overrides, key", [
    (["tools.names=[]"], "tools.names"),
    (["tools.names=[no_such_module:tool]"], "tools.names"),
    (["tools.timeout_s=0"], "tools.timeout_s"),
    (["rollout.max_total_tokens=16"], "rollout.max_total_tokens"),
    (["tools.max_turns=0"], "tools.max_turns"),
])
def test_config_mistakes_are_one_line_errors(overrides, key, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(PRESET, [*overrides, f"runner.out_dir={tmp_path}"])
    assert err.value.key == key and "\n" not in str(err.value)


def test_the_prompts_offer_the_tools_and_a_too_small_bound_is_named(tmp_path):
    cfg = load_config(PRESET, [f"runner.out_dir={tmp_path}"])
    train, test = load_prompts(cfg)
    text = byte_tokenizer().decode(train[0]["token_ids"])
    assert '"name": "calculator"' in text and "<tool_call>" in text and len(test) == 8
    cfg = load_config(PRESET, [f"runner.out_dir={tmp_path}", "rollout.max_total_tokens=600"])
    with pytest.raises(ConfigError, match="rollout.max_total_tokens"):
        load_prompts(cfg)


def test_a_trajectorys_tool_tokens_are_out_of_the_loss_and_the_reward_reads_its_last_turn():
    worker = ToolRolloutWorker.__new__(ToolRolloutWorker)
    worker.tokenizer, worker.version, worker.calls = byte_tokenizer(), 3, {(7, 0): (3, 1, 1)}
    from m2flow.engines.generation import SamplingParams
    worker.params = SamplingParams(n=1)
    tok = worker.tokenizer
    turn1, tool, turn2 = tok.encode("<tool_call>x</tool_call>"), tok.encode("\nresult\n"), tok.encode("42")
    ids = turn1 + tool + turn2
    mask = [True] * len(turn1) + [False] * len(tool) + [True] * len(turn2)
    c = Completion(0, 0, ids, torch.full((len(ids),), -0.5), "stop", tok.decode(ids), [3] * len(ids), mask, 2)
    batch = worker._batch([({"index": 7, "token_ids": [5, 6, 7], "answer": "42"}, [c])])
    assert batch.completion_mask[0, 3:3 + len(ids)].tolist() == [int(m) for m in mask]
    assert batch.completion_mask[0, :3].sum() == 0 and batch.extras["text"] == ["42"]
    assert batch.ids.tolist() == [[7, 0]] and worker.calls == {}
    assert (batch.extras["tool_calls"], batch.extras["malformed_calls"], batch.extras["tool_errors"]) == ([3], [1], [1])


def test_the_reward_worker_takes_the_tool_penalties_off_and_counts_the_answers_solved_with_a_call():
    import numpy as np

    from m2flow.rewards import Scores
    from m2flow.runners.agentic import ToolRewardWorker

    worker = ToolRewardWorker.__new__(ToolRewardWorker)
    worker.tallies, worker.penalties = {5: [0, 0, 0, 0, 0.0]}, (0.5, 0.25)
    batch = SequenceBatch.from_completions([[1]] * 4, [[2]] * 4, pad_id=0)
    batch.extras |= {"tool_calls": [2, 0, 3, 0], "malformed_calls": [1, 0, 0, 0], "tool_errors": [0, 0, 2, 0]}
    parts = {"a": np.array([1.0, 1.0, 0.0, 0.5], np.float32), "b": np.array([1.0, 1.0, 1.0, 1.0], np.float32)}
    shaping = worker.shaping(5, batch, Scores(np.zeros(4, np.float32), parts, np.zeros(4, bool)))
    assert shaping.tolist() == [-0.5, 0.0, -0.5, 0.0]  # one malformed call; two other errors
    assert worker.tallies[5] == [2, 1, 2, 1, 1.0]  # with a call: rows 0 (solved) and 2; without: 1 (solved) and 3


def test_the_penalties_reach_the_rewards_the_advantages_are_made_of():
    from m2flow.runners.agentic import ToolRewardWorker
    from m2flow.workers.lm_common import END

    class Channel:
        def __init__(self, items=()):
            self.items = list(items)

        def get(self, key):
            return self.items.pop(0)

        def put(self, item, key, weight=None):
            self.items.append(item)

        def flush(self):
            pass

    cfg = load_config(PRESET, ["tools.malformed_penalty=0.5", "tools.error_penalty=0.25"])
    worker = ToolRewardWorker(OmegaConf.to_container(cfg, resolve=True))
    batch = SequenceBatch.from_completions([[1]] * 2, [[2]] * 2, pad_id=0)
    batch.extras |= {"groups": 1, "group_size": 2, "text": ["12", "ab"], "answer": ["", ""],
                     "tool_calls": [3, 0], "malformed_calls": [1, 0], "tool_errors": [2, 0]}
    out = Channel()
    try:
        report = worker.score(Channel([batch]), out, num_groups=1, key=4)
    finally:
        worker.close()
    assert out.items[0].extras["reward"].tolist() == [1.0 - 0.5 - 2 * 0.25, 0.0] and out.items[1] is END
    assert (report.reward, report.tool_penalty, report.with_call, report.without_call) == (0.5, 1.0, 1, 1)


@pytest.mark.parametrize("overrides", [["algorithm.old_logprobs=recompute"],
                                       ["placement.mode=disaggregated", "runner.max_staleness=1", "runner.steps=3"]],
                         ids=["collocated-recomputed", "ahead-in-flight"])
def test_it_trains_on_multi_turn_trajectories(cluster, pool, tmp_path, overrides):
    """Collocated, the inference worker recomputing the log-probs of the sampled tokens with the
    sampling weights: equal to the rollout's within 1e-4. And running one step ahead with the
    weights reaching the rollout between decode steps, where each token's version is the one
    that sampled it (the shares of tokens trained on 0 and 1 versions behind add up to all)."""
    if "placement.mode=disaggregated" in overrides and len(cluster.devices) < 2:
        pytest.skip("disaggregated needs 2 devices; on a one-GPU node the test cluster has 1 "
                    "(scripts/gpu_checks.sh runs it over the GPU made two devices)")
    cfg = load_config(PRESET, ["runner.steps=2", "runner.eval_every=0", "runner.progress=false",
                               f"runner.out_dir={tmp_path}", *overrides])
    rows, runner = _train(cfg, cluster, pool)
    steps = [r for r in rows if not math.isnan(r.get("step_s", math.nan))]
    assert [r["step"] for r in steps] == list(range(1, cfg.runner.steps + 1))
    for r in steps:
        assert r["turns"] >= 1 and 0 <= r["answered"] <= 1 and 0 <= r["tool_token_share"] < 1
        assert 0 <= r["tool_latency_p50"] <= r["tool_latency_p95"] < cfg.tools.timeout_s + 1
        assert r["tool_wait_s"] >= 0 and (r["tool_calls"] > 0 or r["tool_wait_s"] == r["tool_penalty"] == 0)
        with_call, without = r["solved_with_tool_call"], r["solved_without_tool_call"]
        assert all(0 <= x <= 1 or math.isnan(x) for x in (with_call, without))
        assert r["tool_calls"] > 0 or (math.isnan(with_call) and 0 <= without <= 1)  # no call: all are without
        assert r["completion_tokens"] > 0 and math.isfinite(r["loss"])
        assert math.isclose(sum(v for k, v in r.items() if k.startswith("staleness_")), 1.0)
        assert all(int(k.rpartition("_")[2]) <= cfg.runner.max_staleness for k in r if k.startswith("staleness_"))
        if cfg.algorithm.old_logprobs == "recompute":
            assert r["logprob_diff_max"] < 1e-4
    assert all(len(ids) == 8 for ids in runner.metrics.ledger.trained.values())  # 2 prompts x 4, each once


def test_eval_scores_the_last_turn_and_writes_each_trajectory(cluster, pool, tmp_path, capsys):
    """``m2flow eval`` of an agentic checkpoint: the held-out score the run's last evaluation gave
    (its greedy trajectories, their last turns scored), the share that called a tool, and a
    JSON line per prompt with its whole trajectory, turns and calls."""
    import json

    from m2flow.cli import main

    overrides = [f"runner.out_dir={tmp_path / 'run'}", "runner.progress=false", "runner.steps=1",
                 "placement.mode=custom", *(f"placement.components.{c}=0" for c in ("rollout", "reward", "inference",
                                                                                     "actor"))]
    history, _ = _train(load_config(PRESET, overrides), cluster, pool)
    main(["eval", PRESET, "checkpoint=auto", *overrides])
    result = json.loads((tmp_path / "run" / "checkpoints" / "step_000001.eval.json").read_text())
    lines = (tmp_path / "run" / "checkpoints" / "step_000001.eval.examples.jsonl").read_text().splitlines()
    examples = [json.loads(line) for line in lines]
    assert result["reward"] == pytest.approx(history[-1]["eval_reward"], abs=1e-6)
    assert result["prompts"] == 8 and 0 <= result["tool_call_rate"] <= 1
    called = [e for e in examples if e["tool_calls"]]
    for share, rows in ((result["accuracy_with_tool_call"], called),
                        (result["accuracy_without_tool_call"], [e for e in examples if not e["tool_calls"]])):
        assert share == (sum(e["solved"] for e in rows) / len(rows) if rows else None)
    assert [e["index"] for e in examples] == list(range(8))
    for e in examples:
        assert e["turns"] >= 1 and e["ended"] in ("answered", "max_turns", "turn_cut", "no_room")
        assert isinstance(e["trajectory"], str) and e["tool_calls"] >= e["turns"] - 1  # a turn follows calls


def test_it_runs_under_placement_auto(cluster, pool, tmp_path):
    """Profiled on the tests' cluster (the probes on its shared processes), planned, and run on
    the plan chosen."""
    import json

    from m2flow.runners.auto import auto_plan

    cfg = load_config(PRESET, ["runner.steps=2", "runner.eval_every=0", "runner.progress=false", "placement=auto",
                               f"placement.profile={tmp_path / 'profile.json'}", f"runner.out_dir={tmp_path / 'run'}"])
    rows, _ = _train(auto_plan(cfg, cluster, log=lambda *_: None, pool=pool), cluster, pool)
    steps = [r for r in rows if not math.isnan(r.get("step_s", math.nan))]
    assert [r["step"] for r in steps] == [1, 2] and all(r["turns"] >= 1 and r["completion_tokens"] > 0 for r in steps)
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert {"rollout", "reward", "inference", "actor"} <= {p["component"] for p in prof["points"]}
    assert (tmp_path / "run" / "plan.yaml").is_file() and prof["hardware"]["devices"] == len(cluster.devices)
