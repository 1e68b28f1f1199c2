"""GRPO for embodied tasks: envs without auto-reset, config checks, and short trainings.

GRPO plays one episode per env and rollout window, groups of envs starting from the same
seed; the advantage and mask arithmetic itself is in tests/test_algorithms.py.
"""

import math

import numpy as np
import pytest

from m2flow.config import load_config, presets
from m2flow.envs import EnvBatch
from m2flow.config.validate import check_grpo_layout, resolved, validate as check_algorithm
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.workers.layout import EnvLayout

# ------------------------------------------------------------------ EnvBatch without auto-reset


def test_without_auto_reset_ended_envs_stay_done_until_reset():
    batch = EnvBatch("CartPole-v1", 4, seed=0, group_size=2, auto_reset=False, env_kwargs={"max_episode_steps": 15})
    obs = batch.reset()
    assert np.array_equal(obs[0], obs[1]) and np.array_equal(obs[2], obs[3]) and not np.array_equal(obs[0], obs[2])
    rng = np.random.default_rng(0)
    ended: dict[int, int] = {}
    lengths: dict[int, int] = {}
    for t in range(20):
        res = batch.step(rng.integers(0, 2, size=4))
        assert res.stepped == 4 - len(ended)
        for i in ended:  # a done env is skipped: no reward, no end, its last observation kept
            assert res.rewards[i] == 0 and not res.terminated[i] and not res.truncated[i]
            assert np.array_equal(res.obs[i], obs[i])
        if t == 2:
            assert batch.unfinished_episodes() == [(i, 3.0, 3, None) for i in range(4)]
        for i in np.flatnonzero(res.terminated | res.truncated):
            ended[int(i)] = t
            assert np.array_equal(res.obs[i], res.final_obs[i])  # not reset
        lengths |= dict(res.episode_lengths)
        obs = res.obs
    assert batch.all_done and sorted(ended) == [0, 1, 2, 3]  # the 15-step limit ends every episode
    assert lengths == {i: t + 1 for i, t in ended.items()}
    assert batch.unfinished_episodes() == []
    second = batch.reset()  # every env starts its group's next episode
    assert not batch.all_done
    assert np.array_equal(second[0], second[1]) and np.array_equal(second[2], second[3])
    assert not np.array_equal(second[0], obs[0])
    assert batch.step(np.zeros(4, dtype=np.int64)).stepped == 4


def test_without_auto_reset_chunks_skip_done_envs():
    batch = EnvBatch("CartPole-v1", 2, seed=3, auto_reset=False, env_kwargs={"max_episode_steps": 6})
    batch.reset()
    alternate = np.tile([0, 1, 0, 1], (2, 1))  # keeps the pole up for the 6 steps
    first, second, third = (batch.step_chunk(alternate) for _ in range(3))
    assert first.valid.all() and not (first.truncated.any() or first.terminated.any())
    assert second.valid.tolist() == [[True, True, False, False]] * 2 and second.truncated.all()
    assert not third.valid.any() and not third.rewards.any() and not third.truncated.any()
    assert np.array_equal(third.obs, second.final_obs)


# ------------------------------------------------------------------ config


def _check(overrides, env_ranks=1, actor_ranks=1, stages=1):
    cfg = load_config("embodied/grpo_cartpole", overrides)
    check_algorithm(cfg)
    check_grpo_layout(resolved(cfg), EnvLayout.build(cfg.env.num_envs, env_ranks, 1, actor_ranks, stages, cfg.policy.chunk))


def test_grpo_config_errors():
    _check([])
    _check(["env.group_size=8"], env_ranks=2)
    with pytest.raises(ValueError, match=r"algorithm.name: must be one of ppo \| grpo, got 'a2c'"):
        _check(["algorithm.name=a2c"])
    with pytest.raises(ValueError, match="env.group_size: algorithm.name=grpo compares envs .* must be > 1, got 1"):
        _check(["env.group_size=1"])
    with pytest.raises(ValueError, match="env.num_envs: algorithm.name=grpo: 16 is not a multiple of env.group_size=3"):
        _check(["env.group_size=3"])
    with pytest.raises(ValueError, match="runner.stages: .* must sit in one env batch, but 4 stages leave 4 envs per batch"):
        _check(["env.group_size=8", "runner.stages=4"])
    with pytest.raises(ValueError, match="env.group_size: .* must sit in one env batch, but each has 4"):
        _check(["env.group_size=8"], stages=4)  # a layout check: the env batches per rank
    with pytest.raises(ValueError, match="env.group_size: .* each of the 4 actor ranks trains on 4 envs"):
        _check(["env.group_size=8"], actor_ranks=4)
    with pytest.raises(ValueError, match="algorithm.norm_adv: must be false for algorithm.name=grpo"):
        _check(["algorithm.norm_adv=true"])
    # PPO keeps accepting grouped seeds
    check_algorithm(load_config("embodied/ppo_cartpole", ["env.group_size=4"]))


@pytest.mark.parametrize("preset", [p for p in presets() if p.startswith("embodied/")])
def test_embodied_presets_split_over_one_or_two_env_and_actor_ranks(preset):
    """Each embodied preset's envs divide over one env rank or two (collocated on two slots),
    into its stages, among one or two actor ranks, and for GRPO in whole groups."""
    cfg = load_config(preset)
    for env_ranks in (1, 2):
        for actor_ranks in (1, 2):
            layout = EnvLayout.build(cfg.env.num_envs, env_ranks, 1, actor_ranks, cfg.runner.stages, cfg.policy.chunk)
            assert layout.envs_per_rank * env_ranks == cfg.env.num_envs
            assert layout.envs_per_stage * cfg.runner.stages == layout.envs_per_rank
            if cfg.algorithm.name == "grpo":
                check_grpo_layout(resolved(cfg), layout)


# ------------------------------------------------------------------ training

def _train(cluster, pool, tmp_path, overrides):
    cfg = load_config("embodied/grpo_cartpole", ["runner.progress=false", f"runner.out_dir={tmp_path}", *overrides])
    runner = EmbodiedRunner(cfg, cluster, pool)
    try:
        return runner, runner.train()
    finally:
        runner.close()


def _one(env, rollout, actor):
    return ["placement.mode=custom", f"placement.components.env={env}", f"placement.components.rollout={rollout}",
            f"placement.components.actor={actor}"]


def test_grpo_cartpole_learns(cluster, pool, tmp_path):
    """From a random policy (~22) to the 500 cap: seeds 1-6 of this preset need 10-43 windows
    (all reach 150 within 24); seed 1 (the preset's) 11, a few seconds on 2 cores."""
    _, history = _train(cluster, pool, tmp_path, _one(0, 0, 0) + ["runner.target_return=450", "runner.total_env_steps=400000"])
    first, last = history[0], history[-1]
    assert first["episode_return"] < 40
    assert last["episode_return"] >= 450, f"return {last['episode_return']:.1f} after {len(history)} windows"
    assert all(row["episodes"] == 16 for row in history)  # one episode per env and window
    assert "value_loss" not in last and "explained_variance" not in last  # no critic
    assert (tmp_path / "learning_curve.png").exists()


@pytest.mark.parametrize("fused, stages, rollout_steps, limit", [
    (True, 1, 30, 10),     # every episode ends inside the window: the fused worker stops early
    (False, 2, 20, 500),   # separate rollout, 2 stages, 2 actor ranks; the window cuts long episodes
])
def test_grpo_windows_hold_one_episode_per_env(cluster, pool, tmp_path, fused, stages, rollout_steps, limit):
    placement = _one(0, 0, 0) if fused else _one(0, 1, "0-1")
    runner, history = _train(cluster, pool, tmp_path, placement + [
        f"runner.stages={stages}", f"runner.rollout_steps={rollout_steps}", f"env.kwargs.max_episode_steps={limit}",
        f"runner.total_env_steps={3 * 16 * rollout_steps}"])
    assert runner.fused is fused and len(history) == 3
    previous = 0
    for row in history:
        assert row["episodes"] == 16 and row["episode_length"] <= min(limit, rollout_steps)
        # env steps are exactly the steps of the window's episodes, cut ones included
        assert math.isclose(row["env_steps"] - previous, 16 * row["episode_length"])
        previous = row["env_steps"]
        assert math.isfinite(row["policy_loss"])


def _grpo_weights_rank(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo actor ranks: GRPO's step weights for its envs, whose episodes end
    after 2 steps (rank 0) or 8 (rank 1)."""
    import datetime

    import torch
    import torch.distributed as dist

    from m2flow.envs.trajectory import Trajectory
    from m2flow.workers.actor import ActorWorker

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        actor = ActorWorker.__new__(ActorWorker)
        actor.world_size, actor.algo, actor.cfg = 2, {"minibatch_size": 8}, {"env": {"group_size": 2}}
        T, n = 8, 2
        terminated = torch.zeros(T, n)
        terminated[1 if rank == 0 else 7] = 1.0
        d = Trajectory(rewards=torch.ones(T, n) * (rank + 1), terminated=terminated, truncated=torch.zeros(T, n),
                       obs=torch.zeros(T, n, 4), actions=torch.zeros(T, n, dtype=torch.long), logp=torch.zeros(T, n),
                       versions=torch.zeros(T, n), final_obs=torch.zeros(T, n, 4), last_obs=torch.zeros(n, 4),
                       ids=torch.arange(n))
        batch, _ = ActorWorker._group_advantages(actor, d)
        torch.save(batch["weights"], f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_every_valid_step_weighs_alike_over_actor_ranks(tmp_path):
    """Two actor ranks whose episodes are 2 and 8 steps long (4 and 16 valid steps): each
    valid step's share of the update (its weight over the padded steps of all ranks) is
    1/20 on both, as on one rank; it was 1/(its own rank's count), rank 0's steps 4x rank 1's."""
    import torch
    import torch.multiprocessing as mp

    from test_lm_training import _free_port

    mp.spawn(_grpo_weights_rank, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    w0, w1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert len(w0) == len(w1) == 16  # padded to the larger count, in whole minibatches of 4
    assert int((w0 > 0).sum()) == 4 and int((w1 > 0).sum()) == 16
    shares = torch.cat([w0[w0 > 0], w1[w1 > 0]]) / (16 * 2)
    assert torch.allclose(shares, torch.full((20,), 1 / 20))
