"""Embodied PPO end to end: the same runner loop learns CartPole in every placement mode."""

import csv
import errno
import math
import os
import shutil
import signal

import pytest

from m2flow.config import ConfigError, load_config
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners import status
from m2flow.runners.checkpointer import Checkpointer
from m2flow.runners.status import RunFailed
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.runtime.stop import RunStopped


# On the shared cluster (conftest.py): 4 devices, disaggregated needs one per component.


def train_cartpole(cluster, pool, overrides):
    """The ppo_cartpole preset with ``overrides``, trained to the end; its history."""
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster, pool)
    try:
        return runner.train()
    finally:
        runner.close()


def assert_reaches_target(history, target=450, within=40_000, ahead=0):
    """The run stopped at the first update whose mean return reached ``target`` (collecting
    ``ahead``: after training on the updates collected ahead of it), after at most ``within``
    env steps (the preset's budget is 100k: a run that stops there fails); every update took
    rollout_steps x num_envs = 32 x 8 env steps."""
    returns = [row["episode_return"] for row in history]
    reached = len(history) - 1 - ahead
    assert returns[reached] >= target and all(r < target for r in returns[:reached]), \
        f"returns {[round(r) for r in returns]}"
    assert [row["env_steps"] for row in history] == [256 * (u + 1) for u in range(len(history))]
    assert history[reached]["env_steps"] <= within, \
        f"{target} first reached after {history[reached]['env_steps']} env steps"


def assert_times_add_up(history, fused):
    """Each component's busy and idle time lies within the update that reported it (with the
    rollout fused into the env workers, env stepping, inference and the lock wait they share,
    together); the actor's call spans most of the update, and trains in a real share of it."""
    for row in history:
        spans = {"actor": row["actor_busy_s"] + row["actor_idle_s"]}
        if fused:
            assert row["rollout_idle_s"] == row["env_idle_s"]  # the one lock wait, reported for both
            spans["env+rollout"] = row["env_busy_s"] + row["rollout_busy_s"] + row["env_idle_s"]
        else:
            spans |= {c: row[f"{c}_busy_s"] + row[f"{c}_idle_s"] for c in ("env", "rollout")}
        assert all(0 < span <= row["update_s"] + 1e-3 for span in spans.values()), (row["update_s"], spans)
        assert row["env_busy_s"] > 0 and row["rollout_busy_s"] > 0
    steady = history[1:]  # the first update also warms the workers up
    total = sum(row["update_s"] for row in steady)
    actor = sum(row["actor_busy_s"] + row["actor_idle_s"] for row in steady)
    assert actor >= 0.5 * (total - sum(row["weight_sync_s"] for row in steady)), (actor, total)
    assert sum(row["actor_busy_s"] for row in steady) >= 0.2 * total, (actor, total)


# Seed 1 (the preset's) reaches 450 after 13-18k env steps in these modes.
@pytest.mark.parametrize("mode, stages, env, rollout, actor", [
    ("collocated", 1, "0-1", "0-1", "0-1"),
    ("disaggregated", 1, "0", "1", "2"),
    pytest.param("hybrid", 2, "0", "1", "0-1", marks=pytest.mark.slow),  # 18 s; the other two learn by default
])
def test_ppo_cartpole_learns_in_every_mode(cluster, pool, tmp_path, mode, stages, env, rollout, actor):
    overrides = ["placement.mode=custom", f"placement.components.env={env}", f"placement.components.rollout={rollout}",
                 f"placement.components.actor={actor}", f"runner.stages={stages}", "runner.progress=false",
                 f"runner.out_dir={tmp_path}", "runner.target_return=450"]
    cfg = load_config("embodied/ppo_cartpole", overrides)
    runner = EmbodiedRunner(cfg, cluster, pool)
    try:
        assert runner.plan.mode(runner.workflow) == mode
        fused = runner.fused
        history = runner.train()
    finally:
        runner.close()
    assert fused is (mode == "collocated")
    assert_reaches_target(history)
    assert_times_add_up(history, fused)
    assert (tmp_path / "metrics.csv").exists() and (tmp_path / "learning_curve.png").exists()


@pytest.mark.parametrize("rollout,correction", [("0", "decoupled"), ("1", "none")], ids=["fused", "separate"])
def test_collect_ahead_learns(cluster, pool, tmp_path, rollout, correction):
    """Env on one device (the rollout fused into it, or on a device of its own), the actor on
    another; each update's rollout is collected while the actor trains on the previous one:
    the data is one version old, and PPO still learns CartPole (fused: with the decoupled
    objective, the actor's own proximal log-probs)."""
    overrides = ["placement.mode=custom", "placement.components.env=0", f"placement.components.rollout={rollout}",
                 "placement.components.actor=2", "placement.actor_devices_per_proc=1", "runner.max_staleness=1",
                 f"algorithm.off_policy={correction}",
                 "runner.progress=false", f"runner.out_dir={tmp_path}", "runner.target_return=450"]
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster, pool)
    try:
        assert runner.fused is (rollout == "0")
        history = runner.train()
    finally:
        runner.close()
    assert_reaches_target(history, ahead=1)
    # The first update's data was collected with its own weights; every later one's ahead of them.
    assert [row["policy_lag"] for row in history] == [0] + [1] * (len(history) - 1)


def test_a_run_stopped_at_its_target_trains_on_what_it_collected_ahead(cluster, pool, tmp_path):
    """Two versions ahead, a target every update reaches: the run trains on the two updates
    collected ahead before it stops, so its last checkpoint holds the envs where the trained
    data left them: every observation they made (the normalisation's count) is one the run
    counted, none of a rollout dropped untrained."""
    overrides = ["placement.mode=custom", "placement.components.env=0", "placement.components.rollout=0",
                 "placement.components.actor=2", "placement.actor_devices_per_proc=1", "runner.max_staleness=2",
                 "env.obs_norm=true", "runner.target_return=1", "runner.progress=false", f"runner.out_dir={tmp_path}"]
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster, pool)
    try:
        history = runner.train()
    finally:
        runner.close()
    assert [row["policy_lag"] for row in history] == [0, 1, 2]  # reached at the first; the two ahead trained on
    state = checkpoints.load(checkpoints.latest(tmp_path / "checkpoints"))
    (env,) = state["states"]["env"]
    observed = sum(b["stats"]["obs_rms"]["count"] for b in env["batches"])
    assert state["done"] == 3 and round(observed) == history[-1]["env_steps"] + 8  # and the 8 first resets


def test_bad_overrides_are_clear_errors():
    with pytest.raises(ValueError, match="runner.totl_env_steps: no such key; did you mean runner.total_env_steps"):
        load_config("embodied/ppo_cartpole", ["runner.totl_env_steps=5"])
    with pytest.raises(ValueError, match="no preset or file 'embodied/nope'; presets:.*embodied/ppo_cartpole"):
        load_config("embodied/nope")


# Collecting ahead also runs in test_collect_ahead_learns; its resume variant is slow, and
# so is the on-policy one: two versions ahead resumes the same state, with streams besides.
def test_checkpoints_by_time_roll_and_those_by_count_stay(cluster, pool, tmp_path, monkeypatch):
    """Every update due by time (a checkpoint a microsecond): each such checkpoint replaces the
    one by time before it; those every 3 updates and the last stay."""
    written = []
    save = Checkpointer.save

    def counted(self, done, log, rolling=False):
        written.append((done, rolling))
        return save(self, done, log, rolling)

    monkeypatch.setattr(Checkpointer, "save", counted)
    train_cartpole(cluster, pool, [
        "placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
        "placement.components.actor=0-1", "runner.stages=2", "runner.progress=false", "runner.total_env_steps=2048",
        "runner.checkpoint_every=3", "runner.checkpoint_every_min=1e-8", f"runner.out_dir={tmp_path}"])
    assert written == [(1, True), (2, True), (3, False), (4, True), (5, True), (6, False), (7, True), (8, False)]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "update_000003.safetensors", "update_000006.safetensors", "update_000008.safetensors"]
    ended = status.read(tmp_path)
    assert (ended["state"], ended["done"], ended["total"], ended["unit"], ended["restarts"], ended["pid"]) == (
        "finished", 8, 8, "update", 0, os.getpid())
    assert ended["last_checkpoint"] == str(tmp_path / "checkpoints" / "update_000008.safetensors")


def test_a_full_disk_stops_the_run_with_one_paragraph_naming_the_last_checkpoint(cluster, pool, tmp_path,
                                                                                  monkeypatch):
    """The third checkpoint finds the disk full: the run ends with ``RunFailed``, which says how
    far it got and names the second checkpoint (left in place); the traceback is in log.txt."""
    save = checkpoints.save

    def full_at_3(path, state):
        if state["done"] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return save(path, state)

    monkeypatch.setattr(checkpoints, "save", full_at_3)
    with pytest.raises(RunFailed) as e:
        train_cartpole(cluster, pool, [
            "placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
            "placement.components.actor=0-1", "runner.stages=2", "runner.progress=false",
            "runner.total_env_steps=2048", "runner.checkpoint_every=1", f"runner.out_dir={tmp_path}"])
    kept = tmp_path / "checkpoints" / "update_000002.safetensors"
    assert str(e.value) == (f"the run failed after 3 of 8 updates: No space left on device: "
                            f"'{tmp_path / 'checkpoints' / 'update_000003.safetensors'}'; the last checkpoint: "
                            f"{kept}; continue with runner.resume=auto once that is fixed")
    assert checkpoints.load(kept)["done"] == 2
    assert "in full_at_3" in (tmp_path / "log.txt").read_text()  # the traceback
    ended = status.read(tmp_path)
    assert (ended["state"], ended["message"], ended["done"], ended["total"], ended["last_checkpoint"]) == (
        "failed", str(e.value), 3, 8, str(kept))


@pytest.mark.parametrize("ahead, updates, lags", [
    pytest.param(0, 4, [0] * 4, marks=pytest.mark.slow),
    pytest.param(1, 4, [0, 1, 0, 1], marks=pytest.mark.slow),
    # two versions ahead, but nothing in flight at the checkpoint after update 4
    (2, 8, [0, 1, 2, 2, 0, 1, 2, 2])], ids=["on-policy", "ahead", "two-ahead"])
def test_resume_continues_exactly(cluster, pool, tmp_path, monkeypatch, ahead, updates, lags):
    """A run resumed from its checkpoint at update N reaches the same weights at 2N as
    the uninterrupted run: simulators, sampling RNGs, optimizer and shuffling all restored.
    Collecting ahead, no rollout runs past a checkpoint. So does one stopped by SIGTERM after
    its second update (two ahead: the collections in flight are trained on first)."""
    common = ["placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
              "placement.components.actor=0-1", "runner.stages=2", "runner.progress=false",
              f"runner.total_env_steps={256 * updates}", "env.kwargs.max_episode_steps=20",  # truncations too
              f"runner.max_staleness={ahead}"]

    def run(out, *extra):
        runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", common + [f"runner.out_dir={out}", *extra]), cluster, pool)
        try:
            history = runner.train()
            return runner.groups["actor"].weights_hash().wait(), history
        finally:
            runner.close()

    straight, history = run(tmp_path / "a", f"runner.checkpoint_every={updates // 2}")
    assert len(history) == updates and len(set(straight)) == 1  # both actor ranks hold the same weights
    # resume=auto in a copy of the run whose last checkpoint was cut short: it takes the one before
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    last = tmp_path / "b" / "checkpoints" / f"update_{updates:06d}.safetensors"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    pool.close()  # resumed in fresh processes: nothing the first run left in memory carries over
    resumed, rest = run(tmp_path / "b", "runner.resume=auto")
    assert [row["update"] for row in rest] == list(range(updates))  # the copied log's rows to the checkpoint, then its own
    assert "skipping" in (tmp_path / "b" / "log.txt").read_text()
    assert [row["policy_lag"] for row in history] == lags
    assert resumed == straight
    assert rest[-1]["env_steps"] == history[-1]["env_steps"]
    # a checkpoint resumed on another placement (one slot, one rank each, the rollout in
    # processes of its own): its states spread over the new ranks, the run goes on to its end
    half = tmp_path / "a" / "checkpoints" / f"update_{updates // 2:06d}.safetensors"
    _, moved = run(tmp_path / "c", f"runner.resume={half}", "placement.components.env=0",
                   "placement.components.rollout=0", "placement.components.actor=0", "placement.fuse=false")
    assert [row["update"] for row in moved] == list(range(updates // 2, updates))
    assert moved[-1]["env_steps"] == history[-1]["env_steps"]
    assert (f"checkpoint {half} was written on another placement (env 2 rank(s) then, 1 now; rollout fused then, "
            "in processes of its own now; actor 2 rank(s) then, 1 now)") in (tmp_path / "c" / "log.txt").read_text()
    with pytest.raises(ConfigError, match=r"runner.resume: .* was written with policy.hidden=\[64, 64\], this run has "
                                          r"policy.hidden=\[32, 32\]: resume with the same policy.hidden"):
        run(tmp_path / "c", f"runner.resume={half}", "policy.hidden=[32,32]")
    with pytest.raises(ConfigError, match=r"runner.resume: .* was written with runner.rollout_steps=32, this run has "
                                          r"runner.rollout_steps=64: resume with the same runner.rollout_steps"):
        run(tmp_path / "c", f"runner.resume={half}", "runner.rollout_steps=64")
    if ahead != 2:
        return
    # a checkpoint as far in as the run is long: nothing left to train, and it is the run's last
    # checkpoint; one further in than the run is long: a config error naming the key
    shorter = f"runner.total_env_steps={256 * updates // 2}"
    _, rows = run(tmp_path / "e", f"runner.resume={half}", shorter)
    assert len(rows) == 0 and "nothing left to train" in (tmp_path / "e" / "log.txt").read_text()
    ended = status.read(tmp_path / "e")
    assert (ended["state"], ended["done"], ended["last_checkpoint"]) == ("finished", updates // 2, str(half))
    assert not (tmp_path / "e" / "trace.json").exists()  # no update ran: nothing to trace
    with pytest.raises(ConfigError, match=rf"runner.total_env_steps: checkpoint .*update_{updates:06d}.safetensors is "
                                          rf"{updates} updates in, past the {updates // 2} of this run"):
        run(tmp_path / "f", f"runner.resume={tmp_path / 'a' / 'checkpoints' / last.name}", shorter)
    asked = EmbodiedRunner.stop_early

    def stop_early(self, row, log):
        if row["update"] == 1 and not self.cfg.runner.resume:
            os.kill(os.getpid(), signal.SIGTERM)  # handled here, at once: the run stops at its next safe point
        return asked(self, row, log)

    monkeypatch.setattr(EmbodiedRunner, "stop_early", stop_early)
    with pytest.raises(RunStopped, match="stopped by SIGTERM after 4 of 8 updates; the last checkpoint: .*"
                                         "update_000004.safetensors") as stopped:
        run(tmp_path / "d")
    assert stopped.value.signum == signal.SIGTERM
    # streams 2 and 3 were in flight when the signal came: trained on, then the checkpoint
    assert [p.name for p in (tmp_path / "d" / "checkpoints").iterdir()] == ["update_000004.safetensors"]
    resumed, rest = run(tmp_path / "d", "runner.resume=auto")
    assert resumed == straight and [row["policy_lag"] for row in rest] == lags


def test_action_chunks_and_normalisation_run_end_to_end(cluster, pool, tmp_path):
    """A policy that emits 4 actions per inference, on a continuous task with observation
    normalisation and reward scaling: every action a chunk ran counts as an env step."""
    overrides = ["env.id=Pendulum-v1", "env.kwargs.max_episode_steps=30",  # episodes end inside a chunk
                 "policy.chunk=4", "env.obs_norm=true", "env.reward_scale=true",
                 "runner.rollout_steps=16", "runner.total_env_steps=1024", "algorithm.minibatch_size=64",
                 "placement.mode=custom", "placement.components.env=0", "placement.components.rollout=1",
                 "placement.components.actor=0-1", "runner.progress=false", f"runner.out_dir={tmp_path}"]
    history = train_cartpole(cluster, pool, overrides)
    # 16 decisions x 4 actions x 8 envs per update, less the actions skipped after an episode
    # ended inside a chunk: 30-step episodes end 2 actions into every 8th chunk, so each env
    # runs 60 of its 64 actions per update
    assert [row["env_steps"] for row in history] == [480, 960]
    assert [(row["episodes"], row["episode_length"]) for row in history] == [(16, 30), (16, 30)]  # 2 per env
    assert all(math.isfinite(row["policy_loss"]) and math.isfinite(row["value_loss"]) for row in history)


@pytest.mark.parametrize("target_kl, epochs", [(1e-9, 1), (1e9, 4)])
def test_target_kl_stops_the_epochs(cluster, pool, tmp_path, target_kl, epochs):
    """An update's epochs stop after the first whose mean approx KL exceeds algorithm.target_kl.
    Four minibatches per epoch: a lone one would run at the sampling policy, with KL 0."""
    overrides = [f"algorithm.target_kl={target_kl}", "algorithm.epochs=4", "algorithm.minibatch_size=64",
                 "runner.total_env_steps=512", "placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
                 "placement.components.actor=0-1", "runner.progress=false", f"runner.out_dir={tmp_path}"]
    history = train_cartpole(cluster, pool, overrides)
    assert [row["epochs"] for row in history] == [epochs] * len(history) and len(history) == 2


def test_fused_rollout_matches_separate_rollout(cluster, pool, tmp_path):
    """Env and rollout on the same devices run fused (inference inside the env workers);
    with the same seeds the weights after training equal those of separate rollout workers."""
    common = ["placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
              "placement.components.actor=0-1", "runner.progress=false", "runner.total_env_steps=768"]
    hashes = []
    for fuse in (True, False):
        cfg = load_config("embodied/ppo_cartpole", common + [f"placement.fuse={fuse}", f"runner.out_dir={tmp_path / str(fuse)}"])
        runner = EmbodiedRunner(cfg, cluster, pool)
        try:
            assert runner.fused is fuse and (runner.groups["rollout"] is runner.groups["env"]) is fuse
            history = runner.train()
            hashes.append(runner.groups["actor"].weights_hash(ranks=[0]).wait())
        finally:
            runner.close()
        assert len(history) == 3
        assert_times_add_up(history, fuse)
    assert hashes[0] == hashes[1]


def test_success_rate_is_logged_where_envs_report_success(tmp_path):
    from m2flow.runners.embodied import EmbodiedMetrics
    from m2flow.runners.metrics import RunLog
    from m2flow.workers.reports import EnvReport, RolloutReport, TrainReport, WeightSync

    def report(episodes):
        env = [EnvReport(env_steps=10, episodes=episodes, env_faults=0, busy_s=1.0, idle_s=0.0)]
        return {"env": env, "rollout": [RolloutReport(busy_s=1.0, idle_s=0.0)],
                "actor": [TrainReport(busy_s=1.0, idle_s=0.0, lags={0: 10})], "sync": WeightSync(weight_sync_s=0.0)}

    metrics, log = EmbodiedMetrics(30), RunLog(tmp_path / "with", 30, x="env_steps", y="episode_return", progress=False)
    rows = [log.record(metrics.row(u, report(eps), 1.0, u + 1.0), "")
            for u, eps in enumerate([[(1.0, 5, True), (0.0, 5, False), (2.0, 5, True), (0.0, 5, True)], [],
                                     [(0.0, 5, False)]])]
    log.close()
    assert [r["success_rate"] for r in rows] == [0.75, 0.75, 0.0]  # kept while no episode ends
    assert all(r["staleness_0"] == 1.0 and "weight_latency_s" not in r for r in rows)  # on-policy, no loads
    assert "success_rate" in (tmp_path / "with" / "metrics.csv").read_text().splitlines()[0]
    assert "success_rate" not in EmbodiedMetrics(10).row(0, report([(1.0, 5, None)]), 1.0, 1.0)


def test_metrics_csv_reads_back_as_written(tmp_path):
    """metrics.csv: rows appended as they come give the file written whole; a resumed run
    rewrites it from the rows it reads back: ints stay ints (they came back as floats,
    2048.0), NaN stays nan, floats keep every digit: the same text."""
    from m2flow.runners.metrics import RunLog

    log = RunLog(tmp_path, 4, x="update", y="episode_return", progress=False)
    for u in range(4):  # rows appended; update 2 adds a column (the file is rewritten), 3 lacks it
        log.record({"update": u, "env_steps": 2048 * (u + 1), "episode_return": 0.1 + u / 3,
                    "explained_variance": float("nan")} | ({"eval_return": 7.5} if u == 2 else {}), "")
    appended = (tmp_path / "metrics.csv").read_text()
    log._write_csv()  # the whole file at once
    log.close()
    written = (tmp_path / "metrics.csv").read_text()
    assert appended == written and written.splitlines()[0].endswith(",eval_return")
    assert [line.endswith(",7.5") for line in written.splitlines()[1:]] == [False, False, True, False]
    resumed = RunLog(tmp_path, 4, x="update", y="episode_return", progress=False)
    resumed.history = resumed.read_csv()
    resumed._write_csv()
    resumed.close()
    assert (tmp_path / "metrics.csv").read_text() == written
    assert ",2048," in written and ",nan" in written
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("4,10240,0.")  # a row cut short by a crash mid-write
    assert [r["update"] for r in resumed.read_csv()] == [0, 1, 2, 3]


# PPO (slow: 18 s), and GRPO's weighted loss without a critic (the same compile path, by default)
@pytest.mark.parametrize("critic", [pytest.param(True, marks=pytest.mark.slow), False])
def test_compiled_minibatch_loss_matches_eager(critic):
    """algorithm.compile: the compiled minibatch loss gives the eager one's loss, stats and
    gradients (same policy, same minibatch)."""
    import gymnasium as gym
    import torch

    from m2flow.algorithms import PPO_STATS, ppo_minibatch_loss
    from m2flow.models import build_policy, flatten_parameters

    torch.manual_seed(0)
    policy = build_policy(gym.spaces.Box(-1, 1, (17,)), gym.spaces.Box(-1, 1, (6,)), {})
    flat = flatten_parameters(policy)
    coefs = {"clip": 0.2, "clip_high": 0.28, "ent_coef": 0.01, "vf_coef": 0.5, "value_clip": 0.2, "norm_adv": critic}
    n = 64
    obs, actions = torch.randn(n, 17), torch.randn(n, 6)
    with torch.no_grad():
        old_logp = policy.evaluate(obs, actions)[0] + 0.3 * torch.randn(n)  # ratios away from 1: some clipped
    batch = (obs, actions, old_logp, torch.randn(n),
             None if critic else torch.rand(n).round(),  # GRPO's padding weights
             torch.randn(n) if critic else None, torch.randn(n) if critic else None)

    def run(loss_fn):
        flat.grad.zero_()
        loss, stats = loss_fn(policy, *batch, **coefs)
        loss.backward()
        return loss.detach(), stats, flat.grad.clone()

    eager = run(ppo_minibatch_loss)
    compiled = run(torch.compile(ppo_minibatch_loss))
    assert 0 < float(eager[1][PPO_STATS.index("clip_fraction")]) < 1
    assert (float(eager[1][PPO_STATS.index("value_loss")]) > 0) == critic
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def test_a_resumed_runs_logs_hold_each_update_once(tmp_path, monkeypatch):
    """A run starting again from a checkpoint logs the updates after it again: TensorBoard's
    readers drop the scalars logged before at those steps (each step once, the new value),
    and metrics.csv, written whole, is replaced only once the new file is on disk (a full
    disk midway leaves the rows there were)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from m2flow.runners.metrics import RunLog

    log = RunLog(tmp_path, 4, x="update", y="episode_return", progress=False)
    for u in range(4):
        log.record({"update": u, "episode_return": float(u)}, "")
    log.close()
    resumed = RunLog(tmp_path, 4, x="update", y="episode_return", progress=False)  # a checkpoint at update 2
    resumed.history = [row for row in resumed.read_csv() if row["update"] <= 1]
    for u in (2, 3):
        resumed.record({"update": u, "episode_return": 10.0 * u}, "")
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert [(e.step, e.value) for e in events.Scalars("episode_return")] == [(0, 0.0), (1, 1.0), (2, 20.0), (3, 30.0)]
    assert [r["episode_return"] for r in resumed.read_csv()] == [0.0, 1.0, 20.0, 30.0]

    def full(writer, rows):  # the disk fills up as the rows are written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerows", full)
    again = RunLog(tmp_path, 4, x="update", y="episode_return", progress=False)
    again.history = again.read_csv()
    with pytest.raises(OSError, match="No space left"):
        again.record({"update": 4, "episode_return": 40.0}, "")
    again.close()
    assert [r["update"] for r in again.read_csv()] == [0, 1, 2, 3]
