"""Fault tolerance: worker processes killed (SIGKILL) in the middle of a run. The run starts
its groups again from its last checkpoint and finishes with the same number of updates and
the same weights as an undisturbed run: the same samples, none trained twice, none lost."""

import dataclasses
import math
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from m2flow.config import load_config
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners import status
from m2flow.runners.status import RunFailed
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.runners.reasoning import ReasoningRunner
from m2flow.runtime.cluster import Node


def _pid(group, rank):
    return ray.get(group.actors[rank]._m2flow_ping.remote())


class Killer(threading.Thread):
    """Kills, in turn, each (component, rank) of ``plan`` once the run's checkpoint directory
    holds the given checkpoint file, in the run as it then is (after a restart, its new
    processes)."""

    def __init__(self, runner, out: Path, plan):
        super().__init__(daemon=True)
        self.runner, self.out, self.plan, self.killed = runner, out, plan, []

    def run(self):
        for checkpoint, component, rank in self.plan:
            restarts = len(self.killed)
            while not (self.out / "checkpoints" / checkpoint).exists() or self._restarts() < restarts:
                time.sleep(0.02)
            try:
                os.kill(_pid(self.runner.groups[component], rank), signal.SIGKILL)
            except Exception as e:  # noqa: BLE001 -- the run ended or restarted meanwhile
                self.killed.append((component, rank, f"not killed: {e}"))
                continue
            self.killed.append((component, rank))

    def _restarts(self):
        log = self.out / "log.txt"
        return log.read_text().count("restart ") if log.exists() else 0


def _run(runner_cls, preset, overrides, cluster, out, kills=(), keep=None, pool=None):
    """The run's history, its actor's weights hash and what was killed; ``keep``: a dict that
    gets the runner's metrics; ``pool``: the tests' shared processes (a killed one is replaced
    in it)."""
    runner = runner_cls(load_config(preset, [*overrides, f"runner.out_dir={out}", "runner.progress=false"]), cluster,
                        pool)
    killer = Killer(runner, out, kills)
    try:
        killer.start()
        history = runner.train()
        killer.join(timeout=5)
        if keep is not None:
            keep["metrics"] = runner.metrics
        return history, runner.groups["actor"].weights_hash().wait(), killer.killed
    finally:
        runner.close()


def test_embodied_run_survives_an_env_worker_and_an_actor_rank_killed(cluster, pool, tmp_path):
    """Two deaths, checkpoints between them: with ``runner.max_restarts=1`` the run goes on after
    both (deaths in a row end it: tests/test_embodied_runs.py)."""
    overrides = ["placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
                 "placement.components.actor=0-1", "runner.total_env_steps=2048", "runner.checkpoint_every=1",
                 "runner.max_restarts=1", "env.kwargs.max_episode_steps=20"]  # 8 updates
    straight, weights, _ = _run(EmbodiedRunner, "embodied/ppo_cartpole", overrides, cluster, tmp_path / "a",
                                pool=pool)
    history, hit, killed = _run(EmbodiedRunner, "embodied/ppo_cartpole", overrides, cluster, tmp_path / "b",
                                kills=[("update_000002.safetensors", "env", 0), ("update_000005.safetensors", "actor", 1)],
                                pool=pool)
    assert killed == [("env", 0), ("actor", 1)]
    log = (tmp_path / "b" / "log.txt").read_text()
    assert log.count("restart ") == 2 and "restart 1 of at most 1: env-" in log and " rank 0 died in " in log
    assert "restart 1 of at most 1 since the last checkpoint (2 in all): actor-" in log  # checkpoints 3-5 between
    ended = status.read(tmp_path / "b")
    assert (ended["state"], ended["done"], ended["restarts"]) == ("finished", 8, 2)
    assert [row["update"] for row in history] == list(range(8))  # each update once, in order
    assert [row["env_steps"] for row in history] == [row["env_steps"] for row in straight]
    assert hit == weights  # the same samples trained on, in the same order


def test_a_death_on_a_node_the_cluster_lost_with_no_restart_left_ends_the_run(cluster, tmp_path, monkeypatch):
    """A node gone from the cluster (here: one the cluster is made to report lost, with devices
    2-3) takes its devices: no restart can place the plan again, and with no restart left
    (``runner.max_restarts=0``) the run does not go on without them. The first death ends it,
    naming the node, its devices and the components there, and offering the devices left
    under the mode that fits them (a real node's loss: tests/test_multinode.py)."""
    overrides = ["placement.mode=disaggregated", "runner.max_restarts=0", "runner.total_env_steps=2048",
                 "runner.checkpoint_every=1", "env.kwargs.max_episode_steps=20"]  # 8 updates
    gone = Node(1, "gone", "192.0.2.9", 2, 0, devices=cluster.devices[2:])
    monkeypatch.setattr(cluster, "lost_nodes", lambda: [gone])
    with pytest.raises(RunFailed) as failed:
        _run(EmbodiedRunner, "embodied/ppo_cartpole", overrides, cluster, tmp_path,
             kills=[("update_000002.safetensors", "actor", 0)])
    message = str(failed.value)
    assert re.fullmatch(r"the run failed after [2-7] of 8 updates: the Ray cluster lost node 1 \(192.0.2.9; devices "
                        r"2-3: rollout, actor\); the last checkpoint: \S+/update_00000[2-7].safetensors; continue with "
                        r"runner.resume=auto once the cluster has its 4 devices again, or now on the 2 left with "
                        r"placement.mode=collocated", message), message
    ended = status.read(tmp_path)
    assert (ended["state"], ended["restarts"], ended["message"]) == ("failed", 0, message)
    assert "restart" not in (tmp_path / "log.txt").read_text()


def test_a_run_whose_cluster_lost_a_node_goes_on_on_the_devices_left_and_grows_back(cluster, tmp_path, monkeypatch):
    """The cluster is made to report a node with devices 2-3 lost when the actor there dies
    (disaggregated on four devices: the rollout on device 2, the actor on 3). Disaggregated
    needs three devices, so the run goes on collocated on the two left, from its last
    checkpoint (its states spread over the new ranks), counted as a restart, said in log.txt
    and status.json. The node is then listed again: at the next checkpoint the run grows back
    onto the four devices, disaggregated, not counted as a restart, and ends with every update
    once (a real node's loss and return: test_multinode.py)."""
    overrides = ["placement.mode=disaggregated", "runner.total_env_steps=2560", "runner.checkpoint_every=1",
                 "env.kwargs.max_episode_steps=20"]  # 10 updates
    everything, first = cluster.devices, cluster.nodes
    gone = Node(1, "gone", "192.0.2.9", 2, 0, devices=everything[2:])
    monkeypatch.setattr(cluster, "lost_nodes", lambda: [gone] if cluster.devices == everything else [])
    monkeypatch.setattr(cluster, "joined_nodes", lambda: [gone] if cluster.devices != everything else [])

    def rediscover():  # what Ray then lists alive: devices 0-1, then all four again
        if cluster.devices == everything:
            monkeypatch.setattr(cluster, "devices", everything[:2])
            monkeypatch.setattr(cluster, "nodes", (dataclasses.replace(first[0], devices=everything[:2]),))
            monkeypatch.setattr(cluster, "lost_nodes", lambda: [])  # gone for good: listed again as joining
        else:
            monkeypatch.setattr(cluster, "devices", everything)
            monkeypatch.setattr(cluster, "nodes", first)

    monkeypatch.setattr(cluster, "rediscover", rediscover)
    history, _, killed = _run(EmbodiedRunner, "embodied/ppo_cartpole", overrides, cluster, tmp_path,
                              kills=[("update_000002.safetensors", "actor", 0)])
    assert killed == [("actor", 0)]
    assert [row["update"] for row in history] == list(range(10))
    ended = status.read(tmp_path)
    assert (ended["state"], ended["done"], ended["restarts"], ended["warning"]) == ("finished", 10, 1, None)
    log = (tmp_path / "log.txt").read_text()
    shrunk = re.search(r"the Ray cluster lost node 1 \(192.0.2.9; devices 2-3: rollout, actor\): the run goes on on the "
                       r"2 devices left under placement.mode=collocated, from \S+/update_0000(\d\d).safetensors", log)
    grown = re.search(r"node 1 \(192.0.2.9; 2 device\(s\)\) joined the Ray cluster: the run grows onto the 4 devices "
                      r"there are now under placement.mode=disaggregated, from \S+/update_0000(\d\d).safetensors", log)
    assert shrunk and grown, log
    assert 2 <= int(shrunk[1]) < int(grown[1]) == int(shrunk[1]) + 1  # at the first checkpoint after
    assert "restart 1 of at most 3: actor-" in log and "restart 2" not in log
    assert log.count("was written on another placement") == 2
    assert log.index(shrunk[0]) < log.index("plan (collocated)") < log.index(grown[0]) < log.rindex("plan (disaggregated)")
    between = checkpoints.load(tmp_path / "checkpoints" / f"update_0000{grown[1]}.safetensors")
    assert between["config"]["placement"]["mode"] == "collocated" and len(between["states"]["actor"]) == 2
    last = checkpoints.load(tmp_path / "checkpoints" / "update_000010.safetensors")
    assert last["config"]["placement"]["mode"] == "disaggregated" and len(last["states"]["actor"]) == 1


def test_embodied_async_run_survives_a_rollout_worker_killed(cluster, pool, tmp_path):
    """Two versions ahead (runner.max_staleness=2): an env worker hosting the rollout is killed
    while the rollouts of the updates after checkpoint 4 are in flight. The run starts again
    from that checkpoint and ends as the undisturbed run: every update once, the same lags,
    the same weights (no sample lost or trained twice)."""
    overrides = ["placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
                 "placement.components.actor=0-1", "runner.total_env_steps=2048", "runner.checkpoint_every=4",
                 "runner.max_staleness=2", "env.kwargs.max_episode_steps=20"]  # 8 updates
    straight, weights, _ = _run(EmbodiedRunner, "embodied/ppo_cartpole", overrides, cluster, tmp_path / "a",
                                pool=pool)
    history, hit, killed = _run(EmbodiedRunner, "embodied/ppo_cartpole", overrides, cluster, tmp_path / "b",
                                kills=[("update_000004.safetensors", "env", 1)], pool=pool)
    assert killed == [("env", 1)]
    assert (tmp_path / "b" / "log.txt").read_text().count("restart ") == 1
    assert [row["update"] for row in history] == list(range(8))
    lags = [0, 1, 2, 2, 0, 1, 2, 2]  # nothing in flight at the checkpoint after update 4
    assert [row["policy_lag"] for row in straight] == lags and [row["policy_lag"] for row in history] == lags
    assert hit == weights


@pytest.mark.slow  # two reasoning runs and two restarts: about two minutes
def test_reasoning_run_survives_the_rollout_and_an_actor_rank_killed(cluster, pool, tmp_path):
    # the default placement; bit-exact needs the full forward (see test_reasoning.py's resume test)
    overrides = ["runner.steps=5", "runner.checkpoint_every=1", "algorithm.share_prompts=false"]
    straight, weights, _ = _run(ReasoningRunner, "reasoning/grpo_arith_tiny", overrides, cluster, tmp_path / "a",
                                pool=pool)
    history, hit, killed = _run(ReasoningRunner, "reasoning/grpo_arith_tiny", overrides, cluster, tmp_path / "b",
                                kills=[("step_000001.safetensors", "rollout", 0), ("step_000003.safetensors", "actor", 0)],
                                pool=pool)
    assert killed == [("rollout", 0), ("actor", 0)]
    log = (tmp_path / "b" / "log.txt").read_text()
    assert "restart 1 of at most 3: rollout-" in log  # then the actor's, after checkpoints or at once
    assert re.search(r"restart (2 of at most 3|1 of at most 3 since the last checkpoint \(2 in all\)): actor-", log)

    def trained(rows):
        return [row["step"] for row in rows if not math.isnan(row.get("step_s", math.nan))]

    assert trained(history) == trained(straight) == [1, 2, 3, 4, 5]
    assert hit == weights


@pytest.mark.slow  # a reasoning run and a restart: 33-57 s here
def test_reasoning_async_run_survives_the_rollout_killed(cluster, tmp_path):
    """Two versions ahead with weights taken in flight (runner.max_staleness=2,
    rollout.partial=true, disaggregated): the rollout is killed once checkpoint 4 is written,
    its streams in flight. The run starts again from the last checkpoint and trains steps 1-8
    once each, every prompt's completions once (none lost, none twice), none more than two
    versions old, none dropped. In-flight updates make which version samples which token
    depend on timing, so the weights are not compared with an undisturbed run's."""
    overrides = ["runner.steps=8", "runner.checkpoint_every=2", "runner.max_staleness=2", "rollout.partial=true",
                 "algorithm.off_policy=tis", "placement.mode=disaggregated"]
    kept = {}
    history, _, killed = _run(ReasoningRunner, "reasoning/grpo_arith_tiny", overrides, cluster, tmp_path,
                              kills=[("step_000004.safetensors", "rollout", 0)], keep=kept)
    assert killed == [("rollout", 0)]
    log = (tmp_path / "log.txt").read_text()
    assert log.count("restart ") == 1 and "restart 1 of at most 3: rollout-" in log
    steps = [row for row in history if not math.isnan(row.get("step_s", math.nan))]
    assert [row["step"] for row in steps] == list(range(1, 9))
    assert all(row["policy_lag"] <= 2 and row["stale_dropped"] == 0 for row in steps)
    trained = kept["metrics"].trained
    ids = [p for step in trained.values() for p in step]
    cfg = load_config("reasoning/grpo_arith_tiny", [])
    assert sorted(trained) == list(range(1, 9)) and all(ids.count(p) == cfg.rollout.n for p in set(ids))
    assert len(set(ids)) == 8 * cfg.data.prompts_per_step
