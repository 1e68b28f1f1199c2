"""The replay flow (``runners/replay.py``: SAC, CrossQ, RLPD) end to end on Pendulum-v1: it
learns, and the same check fails with lr=0; a run resumed from its checkpoint continues
exactly (networks, optimisers, sampling streams and the replay buffer's content); collected
beside the learner, the acting weights lag by one update at most; its config errors."""

import itertools
import os
import signal
import threading
import time

import pytest
import ray

from m2flow.config import load_config
from m2flow.config.validate import ConfigError, validate
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners.replay import ReplayRunner, score
from m2flow.workers.replay import Schedule

PRESET = "replay/sac_pendulum_tiny"
ONE = ["placement.mode=custom", "placement.components.env=0", "placement.components.rollout=0",
       "placement.components.actor=0"]  # env and rollout fused, the learner on the same device
APART = [*ONE[:3], "placement.components.actor=1"]  # the learner on a device of its own


def _run(cluster, pool, out, *overrides):
    cfg = load_config(PRESET, ["runner.progress=false", f"runner.out_dir={out}", *overrides])
    runner = ReplayRunner(cfg, cluster, pool)
    try:
        history = runner.train()
        return runner.groups["actor"].weights_hash().wait()[0], history
    finally:
        runner.close()


@pytest.mark.parametrize("lr, learns", [(1e-3, True), pytest.param(0.0, False, marks=pytest.mark.slow)],
                         ids=["lr=1e-3", "lr=0"])
def test_sac_learns_pendulum_and_not_with_lr_0(cluster, pool, tmp_path, lr, learns):
    """The deterministic policy's evaluation (4 episodes on envs of their own, the same seeds
    each time) before training (about -1,400) and after 3,000 env steps (100 of them random,
    2,900 gradient steps): better by 300 at least. With lr=0 the weights do not move and the
    evaluations are the same."""
    _, history = _run(cluster, pool, tmp_path, *APART, f"algorithm.lr={lr}", "runner.total_env_steps=3000",
                      "runner.eval_every=1000")
    first, last = history[0]["eval_return"], history[-1]["eval_return"]
    assert first < -1000
    assert (last > first + 300) == learns, (first, last)
    assert history[-1]["updates"] == 2900 and history[-1]["env_steps"] == 3000
    assert {row["policy_lag"] for row in history[1:]} == {0}  # alternating: the newest weights act
    assert sum(row["episodes"] for row in history[1:]) == 2 * (1500 // 200)  # 2 envs, 200-step episodes


def test_resume_and_restarts_continue_exactly(cluster, pool, tmp_path):
    """A run resumed from its checkpoint at round N reaches the same learner at 2N, bitwise:
    networks, optimisers, entropy coefficient, the buffer's content and every sampling stream.
    So does a run whose env worker and learner are killed (SIGKILL) after checkpoint 3: the run
    restarts from it, its buffer holds what it held there, and the rounds after it are collected
    again, once (the buffer's content equal to the straight run's: nothing twice, nothing lost)."""
    common = [*ONE, "runner.total_env_steps=600", "algorithm.learning_starts=100", "env.kwargs.max_episode_steps=70",
              "runner.checkpoint_every=1", "runner.max_restarts=1"]
    straight, history = _run(cluster, pool, tmp_path / "a", *common)
    half = tmp_path / "a" / "checkpoints" / "update_000006.safetensors"
    resumed, rest = _run(cluster, pool, tmp_path / "b", *common, f"runner.resume={half}")
    assert resumed == straight
    assert [r["critic_loss"] for r in rest[-6:]] == [r["critic_loss"] for r in history[-6:]]
    assert history[-1]["updates"] == 500 and history[-1]["buffer_transitions"] == 600 + 2 * (300 // 70)  # a pad an episode
    # m2flow eval of the last checkpoint: the run's last evaluation (the same episodes, the same policy)
    last = checkpoints.load(tmp_path / "a" / "checkpoints" / "update_000012.safetensors")
    summary, _ = score(load_config(PRESET, common), last, 4)
    assert summary["mean_return"] == history[-1]["eval_return"]

    out = tmp_path / "c"
    runner = ReplayRunner(load_config(PRESET, [*common, f"runner.out_dir={out}", "runner.progress=false"]), cluster, pool)

    killed = []

    def kill_both():
        while not (out / "checkpoints" / "update_000003.safetensors").exists():
            time.sleep(0.02)
        for group in (runner.groups["env"], runner.groups["actor"]):
            killed.append(ray.get(group.actors[0]._m2flow_ping.remote()))
            os.kill(killed[-1], signal.SIGKILL)

    killer = threading.Thread(target=kill_both, daemon=True)
    try:
        killer.start()
        killed_history = runner.train()
        killer.join(timeout=5)
        hit = runner.groups["actor"].weights_hash().wait()[0]
        now = runner.groups["env"].pids() + runner.groups["actor"].pids()
    finally:
        runner.close()
    assert len(killed) == 2 and not set(killed) & set(now)  # both ran in fresh processes after the restart
    log = (out / "log.txt").read_text()
    assert log.count("restart ") == 1 and "died" in log
    assert [r["update"] for r in killed_history if "update" in r] == list(range(12))  # rounds 3-11 again, once
    assert killed_history[-1]["env_steps"] == history[-1]["env_steps"] == 600
    assert hit == straight


def test_the_learner_sends_exactly_the_weights_some_env_step_acts_with():
    """``Schedule.acted_with``: the versions the learner sends are those some row's
    ``required`` names, over envs, warm-ups, update-to-data ratios, pushes and lags; with 2 envs,
    one gradient step an env step and no lag, one of a row's two updates."""
    for envs, starts, utd, every, lag in itertools.product([1, 2, 3], [0, 5, 100], [1, 2, 5], [1, 2, 3, 7], [0, 1, 2, 5]):
        schedule = Schedule(envs, starts, utd, every, lag)
        required = {schedule.required(rows) for rows in range(400)}
        versions = range(schedule.updates_after(300))
        assert [v for v in versions if schedule.acted_with(v)] == sorted(required & set(versions))
    schedule = Schedule(num_envs=2, learning_starts=100, utd_ratio=1, weights_every=1, max_lag=0)
    assert [v for v in range(1, 11) if schedule.acted_with(v)] == [2, 4, 6, 8, 10]


@pytest.mark.parametrize("lag, every", [(1, 1), (0, 4)])
def test_the_acting_weights_lag_as_configured(cluster, pool, tmp_path, lag, every):
    """Env and rollout on one device, the learner on another (2 envs: 2 gradient steps a row).
    ``runner.max_staleness=1``: an env step may run while the learner takes the step before it,
    so it acts with weights up to one update behind (which ones arrived in time varies); at 0,
    with weights sent every 4 updates, 0 or 2 behind, in turn."""
    _, history = _run(cluster, pool, tmp_path, "placement.mode=custom", "placement.components.env=0",
                      "placement.components.rollout=0", "placement.components.actor=1", f"runner.max_staleness={lag}",
                      f"runner.weights_every={every}", "runner.total_env_steps=500", "algorithm.learning_starts=100",
                      "runner.eval_every=0")
    assert history[-1]["updates"] == 400
    assert [r["policy_lag"] for r in history[:2]] == [0, 0]  # the warm-up's two rounds
    if lag:
        assert {r["policy_lag"] for r in history[2:]} <= {0, 1} and history[-1]["staleness_1"] > 0.5
    else:
        assert [r["policy_lag"] for r in history[2:]] == [2] * 8
        shares = history[-1]["staleness_0"], history[-1]["staleness_2"]
        assert sum(shares) == 1 and abs(shares[0] - shares[1]) < 0.05  # 25 rows a round: 12 and 13


@pytest.mark.parametrize("override, message", [
    ("policy.chunk=4", "policy.chunk: the replay flow learns from transitions of one action each"),
    ("env.obs_norm=true", "env.obs_norm: the replay flow stores raw observations"),
    ("policy.batch_renorm=true", "policy.batch_renorm: must be true for algorithm.name=crossq"),
    ("algorithm.name=crossq", "policy.batch_renorm: must be true for algorithm.name=crossq"),
    ("algorithm.buffer_size=3", "algorithm.buffer_size: must hold 2 transitions per env at least"),
    ("algorithm.target_subset=3", "algorithm.target_subset: draws 3 of 2 critics"),
])
def test_config_errors_are_one_line(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(load_config(PRESET, [override]))


def test_a_missing_demonstrations_file_stops_the_run_before_it_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.demonstrations: no such file: /nonexistent\.safetensors"):
        ReplayRunner(load_config(PRESET, [f"runner.out_dir={tmp_path}", "cluster.num_cpus=1",
                                          "algorithm.demonstrations=/nonexistent.safetensors"]))


def test_plans_the_flow_cannot_run_are_refused_in_one_line():
    from m2flow.flow import Plan
    from m2flow.runners.replay import WORKFLOW, check_plan

    cfg = load_config(PRESET)
    check_plan(cfg, Plan.for_mode(WORKFLOW, "collocated", 2))  # env ranks on both devices, the learner across them
    with pytest.raises(ConfigError, match="placement: the replay flow steps its envs in one batch per env rank; "
                                          "the plan has 2 stages"):
        check_plan(cfg, Plan.for_mode(WORKFLOW, "collocated", 1, stages=2))  # 2 envs a rank: 1 a stage
    with pytest.raises(ConfigError, match="placement: the replay flow runs the rollout in the env workers"):
        check_plan(cfg, Plan.for_mode(WORKFLOW, "collocated", 2, fuse=False))


def test_the_embodied_flow_refuses_the_squashed_gaussian_policy():
    with pytest.raises(ConfigError, match="policy.kind: the embodied flow"):
        validate(load_config("embodied/ppo_cartpole", ["policy.kind=squashed_gaussian"]))
