"""The rejection-sampling flow (``m2flow/runners/rejection.py``, the worked example of
docs/flows.md): it learns the toy task, keeps each prompt's best completion, and runs on the
shared machinery: a killed worker, ``placement=auto``."""

import json
import math

import pytest
import torch

from m2flow.config import load_config
from m2flow.runners import status
from m2flow.runners.rejection import FLOW, SelectWorker
from m2flow.engines.batch import SequenceBatch
from test_restarts import _run

PRESET = "rejection/rft_arith_tiny"


def _train(cluster, pool, out, *overrides):
    cfg = load_config(PRESET, ["runner.steps=8", "runner.progress=false", f"runner.out_dir={out}", *overrides])
    runner = FLOW.runner(cfg, cluster=cluster, pool=pool)
    try:
        return runner.train(trace=False), runner.metrics
    finally:
        runner.close()


def test_it_learns_the_toy_task_and_not_without_a_learning_rate(cluster, pool, tmp_path):
    """From a random model whose greedy answers hold no digit, eight steps on each prompt's best
    completion make the held-out answers digits; the same run with a learning rate of 1e-12
    leaves them as they were (the check can fail)."""
    rows, metrics = _train(cluster, pool, tmp_path / "a")
    start, end = rows[0]["eval_reward"], rows[-1]["eval_reward"]
    assert end > start + 0.5, (start, end)
    steps = rows[1:-1] if "eval_reward" in rows[-1] and math.isnan(rows[-1].get("step_s", math.nan)) else rows[1:]
    assert all(0 < row["kept"] <= 1 / 8 for row in steps)  # at most one completion of eight per prompt
    assert rows[-1]["reward"] > rows[1]["reward"]
    # every step trained on the prompts it drew, each at most once (one completion kept per prompt)
    assert all(len(ids) == len(set(ids)) > 0 for ids in metrics.trained.values())
    control, _ = _train(cluster, pool, tmp_path / "b", "algorithm.lr=1e-12")
    assert control[-1]["eval_reward"] == control[0]["eval_reward"] == start


def test_select_keeps_each_groups_best_above_the_floor():
    worker = SelectWorker.__new__(SelectWorker)
    worker.keep, worker.min_reward = 1, 0.5
    rewards = torch.tensor([0.1, 0.9, 0.3, 0.2, 0.4, 0.45])  # two groups of three
    batch = SequenceBatch(torch.zeros((6, 2), dtype=torch.long), torch.ones((6, 2)), torch.zeros((6, 2)),
                          extras={"reward": rewards, "group_size": 3, "prompt_index": [0, 0, 0, 1, 1, 1]})

    class Out:
        items = []

        def put(self, item, key, weight=1):
            self.items.append(item)

        def flush(self):
            pass

    class In:
        queue = [batch, "end-of-step"]

        def get(self, key):
            return self.queue.pop(0)

    out = Out()
    report = worker.best(In(), out, readers=2)
    kept, *ends = out.items
    assert kept.extras["reward"].tolist() == [pytest.approx(0.9)] and kept.extras["prompt_index"] == [0]
    assert ends == ["end-of-step", "end-of-step"] and (report.groups, report.kept) == (2, 1)
    worker.keep, worker.min_reward = 2, 0.0
    out.items, In.queue = [], [batch, "end-of-step"]
    worker.best(In(), out, readers=1)
    assert out.items[0].extras["reward"].tolist() == pytest.approx([0.9, 0.3, 0.45, 0.4])


def test_it_survives_a_killed_worker(cluster, pool, tmp_path):
    """The select worker (the flow's own component) killed after step 2's checkpoint: the run
    starts its groups again from it and trains steps 1-5 once each."""
    overrides = ["runner.steps=5", "runner.checkpoint_every=1"]
    history, _, killed = _run(FLOW.runner, PRESET, overrides, cluster, tmp_path,
                              kills=[("step_000002.safetensors", "select", 0)], pool=pool)
    assert killed == [("select", 0)]
    assert "restart 1 of at most 3: select-" in (tmp_path / "log.txt").read_text()
    assert [row["step"] for row in history if not math.isnan(row.get("step_s", math.nan))] == [1, 2, 3, 4, 5]
    assert status.read(tmp_path)["state"] == "finished"


def test_it_runs_under_placement_auto(cluster, pool, tmp_path):
    """Profiled (its select worker among the components measured) on the tests' cluster and
    shared processes, planned and run (``m2flow.runners.run`` profiles on a cluster of its own:
    tests/test_auto.py)."""
    from m2flow.runners.auto import auto_plan

    profile = tmp_path / "profile.json"
    cfg = load_config(PRESET, ["runner.steps=2", "runner.eval_every=0", "placement=auto", f"placement.profile={profile}",
                               "runner.progress=false", f"runner.out_dir={tmp_path / 'a'}"])
    runner = FLOW.runner(auto_plan(cfg, cluster, log=lambda *_: None, pool=pool), cluster=cluster, pool=pool)
    try:
        rows = runner.train(trace=False)
    finally:
        runner.close()
    assert [row["step"] for row in rows if not math.isnan(row.get("step_s", math.nan))] == [1, 2]
    assert status.read(tmp_path / "a")["state"] == "finished" and (tmp_path / "a" / "plan.yaml").is_file()
    points = json.loads(profile.read_text())["points"]
    assert {"rollout", "reward", "select", "actor"} <= {p["component"] for p in points}
