"""Embodied runs that no other test starts: a pixel policy (NatureCNN) on a pixel task, and
the MuJoCo and ManiSkill presets, each shrunk to two short updates through the runner."""

import contextlib
import math
import re
import time

import numpy as np
import pytest
import torch

from m2flow.config import load_config
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners import status
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.runners.status import RunFailed
from m2flow.runtime.watchdog import RunHung

PIXEL_TASK = "pixel_env:BrightSide-v0"  # tests/pixel_env.py; the env workers of the shared cluster
# (conftest.py) import it by name, as they would a user's env module
# Collocated on two of the shared cluster's four slots, as on a machine of two.
TWO_SLOTS = ["placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
             "placement.components.actor=0-1"]


def train(cluster, pool, preset, overrides, out_dir):
    """Runs ``preset`` with ``overrides`` (collocated on two slots) to its end; returns its
    history and actor rank 0's state (policy weights) before and after."""
    cfg = load_config(preset, [*TWO_SLOTS, *overrides, "runner.progress=false", f"runner.out_dir={out_dir}"])
    runner = EmbodiedRunner(cfg, cluster, pool)
    try:
        (before,) = runner.groups["actor"].call("state", ranks=[0]).wait()
        before = {k: v.clone() for k, v in before["policy"].items()}
        history = runner.train()
        (after,) = runner.groups["actor"].call("state", ranks=[0]).wait()
    finally:
        runner.close()
    return history, before, after["policy"]


def check_trained(history, env_steps, before, after, keys=("policy_loss", "value_loss", "entropy", "approx_kl",
                                                          "grad_norm")):
    """The updates ran as configured, their statistics are finite, every weight tensor moved."""
    assert [row["env_steps"] for row in history] == env_steps
    for row in history:
        assert all(math.isfinite(row[k]) for k in keys), row
        assert row["grad_norm"] > 0 and row["env_busy_s"] > 0 and row["actor_busy_s"] > 0
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert not unchanged, f"weights that did not change: {unchanged}"


def test_pixel_policy_trains_end_to_end(cluster, pool, tmp_path):
    """36x36 RGB frames through the env workers into a NatureCNN policy: 4 envs x 16 steps per
    update, 8-step episodes."""
    overrides = [f"env.id={PIXEL_TASK}", "env.num_envs=4", "runner.rollout_steps=16", "runner.total_env_steps=128",
                 "algorithm.minibatch_size=32", "algorithm.epochs=2"]
    history, before, after = train(cluster, pool, "embodied/ppo_cartpole", overrides, tmp_path)
    check_trained(history, [64, 128], before, after)
    assert all(row["episodes"] == 8 and row["episode_length"] == 8 for row in history)
    assert before["encoder.convs.0.weight"].shape == (32, 3, 8, 8)  # a CNN over the 3 colour channels
    # What the env workers hand the policy (the checkpoint holds their latest observations):
    # whole frames, one half white, the other black.
    ckpt = checkpoints.load(tmp_path / "checkpoints" / "update_000002.safetensors")
    frames = np.concatenate([state["obs"][0] for state in ckpt["states"]["env"]])
    assert frames.shape == (4, 36, 36, 3)
    for frame in frames:
        halves = sorted((frame[:, :18].min(), frame[:, :18].max(), frame[:, 18:].min(), frame[:, 18:].max()))
        assert halves == [0, 0, 255, 255] and {frame[:, :18].max(), frame[:, 18:].max()} == {0, 255}


@pytest.mark.parametrize("preset, overrides, env_steps", [
    # 2 envs x 64 steps per update; minibatches of 64 as the preset's 256 are to its 2048
    ("embodied/ppo_ant", ["env.num_envs=2", "runner.rollout_steps=64", "runner.total_env_steps=256",
                          "algorithm.minibatch_size=64", "algorithm.epochs=2"], [128, 256]),
    ("embodied/ppo_halfcheetah", ["env.num_envs=2", "runner.rollout_steps=64", "runner.total_env_steps=256",
                                  "algorithm.minibatch_size=64", "algorithm.epochs=2"], [128, 256]),
], ids=["ant", "halfcheetah"])
def test_mujoco_preset_trains(cluster, pool, tmp_path, preset, overrides, env_steps):
    history, before, after = train(cluster, pool, preset, overrides, tmp_path)
    check_trained(history, env_steps, before, after)


@pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")  # ManiSkill 3.0.1
def test_maniskill_preset_trains(cluster, pool, tmp_path):
    """PushCube-v1 from its preset, 2 envs x 50 steps per update: each update runs one whole
    50-step episode per env (terminations ignored) and reports its success."""
    pytest.importorskip("mani_skill", reason="needs the maniskill extra: scripts/setup_maniskill.sh")
    overrides = ["env.num_envs=2", "runner.rollout_steps=50", "runner.total_env_steps=200",
                 "algorithm.minibatch_size=50", "algorithm.epochs=2"]
    history, before, after = train(cluster, pool, "embodied/ppo_maniskill_pushcube", overrides, tmp_path)
    check_trained(history, [100, 200], before, after)
    for row in history:
        assert row["episodes"] == 2 and row["episode_length"] == 50
        assert 0.0 <= row["success_rate"] <= 1.0 and 0.0 <= row["episode_return"] <= 50.0  # rewards in [0, 1]
    assert before["pi.0.weight"].shape == (256, 35)  # the preset's MLP on the 35-dim state


def test_a_run_whose_simulator_hangs_stops_with_a_report(cluster, tmp_path):
    """The env's step sleeps for good in the second update: no update ends, no item moves, so
    after runner.hang_timeout_s the run stops; the report and the error name the env workers
    and where they are stuck, and the run's close still works (the processes were killed)."""
    overrides = ["env.id=fault_envs:Stall-v0", "env.num_envs=4", "env.kwargs.stall_after=40", "runner.rollout_steps=32",
                 "runner.total_env_steps=256", "algorithm.minibatch_size=32", "runner.hang_timeout_s=5",
                 *TWO_SLOTS, "runner.progress=false", f"runner.out_dir={tmp_path}"]
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster)
    start = time.monotonic()
    try:
        with pytest.raises(RunHung, match=r"made progress for 5 s \(runner.hang_timeout_s\): env-\w+ rank \d busy at "
                                          r".*fault_envs.py:\d+ in step: time.sleep\(3600\).*; report: "):
            runner.train()
    finally:
        runner.close()
    assert time.monotonic() - start < 5 + 30
    (report,) = tmp_path.glob("hang-*.txt")
    text = report.read_text()
    assert "== stacks" in text and "in step\n" in text and "in interact\n" in text
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 2  # the header and the first update
    assert f"report: {report}" in (tmp_path / "log.txt").read_text()
    ended = status.read(tmp_path)
    assert (ended["state"], ended["done"]) == ("hung", 1) and ended["message"].endswith(f"report: {report}")


def test_deaths_in_a_row_end_the_run_in_a_paragraph(cluster, pool, tmp_path):
    """The env workers' processes end at the 20th step of each of their lives, in the first
    update, with ``runner.max_restarts=1``: no checkpoint comes between the deaths, so the
    second ends the run in one paragraph (deaths with checkpoints between go on:
    tests/test_restarts.py)."""
    overrides = ["env.id=fault_envs:Crash-v0", "env.kwargs.crash_at=20", "env.num_envs=4", "runner.rollout_steps=32",
                 "algorithm.minibatch_size=32", *TWO_SLOTS, "runner.total_env_steps=1024",
                 "runner.checkpoint_every=1", "runner.max_restarts=1", "runner.progress=false",
                 f"runner.out_dir={tmp_path}"]  # 8 updates
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster, pool)
    try:
        with pytest.raises(RunFailed) as failed:
            runner.train()
    finally:
        runner.close()
    message = str(failed.value)
    assert re.fullmatch(r"the run failed after 0 of 8 updates: worker processes died 2 times with no checkpoint "
                        r"written in between, more than runner.max_restarts=1 allows; the last: env-\w+ rank \d failed "
                        r"in (interact|act)\(\): the worker process died: [^\n]+; no checkpoint written", message), message
    ended = status.read(tmp_path)  # (the rollout runs in the env workers: either call may see the death first)
    assert (ended["state"], ended["restarts"], ended["message"]) == ("failed", 1, message)
    assert message in (tmp_path / "log.txt").read_text()


@pytest.mark.slow  # 11-17 s; the stall warning itself is tested by default in tests/test_watchdog.py
def test_a_stall_far_longer_than_any_before_is_told_and_the_run_goes_on(cluster, tmp_path, monkeypatch):
    """Each env's step sleeps 2 s once, in the fourth update (4 s for an env worker's two), where
    no quiet spell before lasted half a second: the stall is told (on stderr, in log.txt, as status.json's warning, with a
    report of every rank's stacks) while it lasts, cleared once the env steps again, and the
    run ends with every update (the floor of a stall, 60 s, made 1.5 s here)."""
    import threading

    from m2flow.runtime import watchdog

    monkeypatch.setattr(watchdog, "STALL_FLOOR_S", 1.5)
    overrides = ["env.id=fault_envs:Stall-v0", "env.num_envs=4", "env.kwargs.stall_after=100",
                 "env.kwargs.stall_s=2", "runner.rollout_steps=32", "runner.total_env_steps=768",
                 "algorithm.minibatch_size=32", "runner.stall_warning=2", *TWO_SLOTS,
                 "runner.progress=false", f"runner.out_dir={tmp_path}"]  # 6 updates; two envs an env worker
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster)
    warnings, ended = [], threading.Event()

    def watch():
        while not ended.is_set():
            with contextlib.suppress(OSError, ValueError):
                warning = status.read(tmp_path).get("warning")
                if warning and warning not in warnings:
                    warnings.append(warning)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        history = runner.train()
    finally:
        ended.set()
        runner.close()
    watcher.join()
    assert [row["update"] for row in history] == list(range(6))
    (report,) = tmp_path.glob("stall-*.txt")
    assert "== stacks" in report.read_text() and "in step\n" in report.read_text()
    assert len(warnings) == 1 and re.fullmatch(
        r"nothing has moved for \d+ s, where the longest quiet spell since the first step ended was \d+ s \(env-\w+ "
        rf"rank \d busy at .*fault_envs.py:\d+ in step: time.sleep\(self.stall_s\).*; stacks: {report}\); "
        r"runner.hang_timeout_s=1800 stops the run if nothing moves", warnings[0]), warnings
    log = (tmp_path / "log.txt").read_text()
    assert log.index(warnings[0]) < log.index("something moves again: the stall is over")
    assert status.read(tmp_path)["warning"] is None and status.read(tmp_path)["state"] == "finished"


@pytest.mark.parametrize("fused", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["fused", "separate"])
def test_in_flight_updates_reach_a_running_rollout(cluster, pool, tmp_path, fused):
    """Two versions ahead with in-flight updates, on a simulator slower than the learner: the
    actor's pushes reach the rollout between env steps, so an update's data holds steps of
    several versions, each recorded per step and none beyond the bound; the rollout reports
    when it took them (weight_latency_s)."""
    rollout = "0" if fused else "1"
    overrides = ["env.id=fault_envs:Slow-v0", "env.num_envs=4", "runner.rollout_steps=32", "runner.total_env_steps=1024",
                 "algorithm.minibatch_size=64", "algorithm.epochs=2", "placement.mode=custom",
                 "placement.components.env=0", f"placement.components.rollout={rollout}", "placement.components.actor=1",
                 "placement.actor_devices_per_proc=1", "runner.max_staleness=2", "runner.in_flight_updates=true",
                 "runner.progress=false", f"runner.out_dir={tmp_path}"]
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster, pool)
    try:
        assert runner.fused is fused and runner.refreshing == {"rollout"}
        history = runner.train()
    finally:
        runner.close()
    assert [row["env_steps"] for row in history] == [128 * (u + 1) for u in range(8)]
    for row in history:
        shares = {int(k.removeprefix("staleness_")): v for k, v in row.items() if k.startswith("staleness_")}
        assert set(shares) <= {0, 1, 2} and max(shares) == row["policy_lag"], row
        assert sum(shares.values()) == pytest.approx(1.0)
    mixed = [row for row in history if sum(1 for k in row if k.startswith("staleness_")) > 1]
    assert mixed, "no update trained on steps of two versions"
    latencies = [row["weight_latency_s"] for row in history if "weight_latency_s" in row]
    assert latencies and all(0 <= s < 5 for s in latencies), latencies
    assert history[0]["policy_lag"] == 0 and max(row["policy_lag"] for row in history) <= 2


def test_in_flight_streams_reach_their_own_update(cluster, pool, tmp_path):
    """Two fused env ranks two versions ahead with in-flight updates, env rank 0's simulator
    fast and env rank 1's slow: rank 0 puts whole rollouts of later streams before rank 1
    puts this one's. Each update still trains on one part of each env rank, both of its own
    stream (the actor refuses two parts of one env rank), and every stream is trained once."""
    overrides = ["env.id=fault_envs:Lopsided-v0", "env.num_envs=4", "env.kwargs={slow_from_seed: 3}",  # seeds 1-4
                 "runner.rollout_steps=16", "runner.total_env_steps=384", "algorithm.minibatch_size=64",
                 "algorithm.epochs=1", "placement.mode=custom", "placement.components.env=0-1",
                 "placement.components.rollout=0-1", "placement.components.actor=1",
                 "placement.actor_devices_per_proc=1", "runner.max_staleness=2", "runner.in_flight_updates=true",
                 "runner.progress=false", f"runner.out_dir={tmp_path}"]
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster, pool)
    try:
        assert runner.fused and runner.layout.env_ranks == 2 and runner.refreshing == {"rollout"}
        history = runner.train()
    finally:
        runner.close()
    assert [row["env_steps"] for row in history] == [64 * (u + 1) for u in range(6)]
    assert [row["policy_lag"] for row in history] == [0, 1, 2, 2, 2, 2]
    # every update trained on each env's trajectory of its own stream once (runners.metrics.Ledger)
    assert runner.metrics.ledger.trained == {u: [0, 1, 2, 3] for u in range(1, 7)}
