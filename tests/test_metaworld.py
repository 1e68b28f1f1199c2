"""Meta-World through EnvBatch and the embodied runner. Meta-World pins mujoco 3.3, so these
run in the overlay venv of scripts/setup_metaworld.sh (``make test`` does both, with
test_envs.py's snapshot test for Meta-World); in the main venv they are skipped."""

import numpy as np
import pytest

pytest.importorskip("metaworld", reason="Meta-World lives in .venv-metaworld (scripts/setup_metaworld.sh)")

from m2flow.config import load_config  # noqa: E402
from m2flow.envs import EnvBatch  # noqa: E402
from m2flow.runners.embodied import EmbodiedRunner  # noqa: E402

TASK = "metaworld:reach-v3"
SHORT = {"max_episode_steps": 15}  # time-limit ends within a test's few steps


def uniform(space, rng, n):
    return rng.uniform(space.low, space.high, size=(n, *space.shape)).astype(np.float32)


def test_episodes_truncate_report_success_and_repeat_by_seed():
    a, b = EnvBatch(TASK, 2, seed=5, env_kwargs=SHORT), EnvBatch(TASK, 2, seed=5, env_kwargs=SHORT)
    obs_a, obs_b = a.reset(), b.reset()
    assert obs_a.shape == (2, 39) and a.action_space.shape == (4,)
    np.testing.assert_array_equal(obs_a, obs_b)
    assert not np.array_equal(obs_a[0], obs_a[1]), "env indices must start differently"
    rng, ended = np.random.default_rng(0), []
    for t in range(31):
        act = uniform(a.action_space, rng, 2)
        ra, rb = a.step(act), b.step(act)
        np.testing.assert_array_equal(ra.obs, rb.obs)
        np.testing.assert_array_equal(ra.rewards, rb.rewards)
        assert not ra.terminated.any()  # reach never terminates: time limits are truncations
        ended += [(t, i, s) for (i, _), s in zip(ra.episode_returns, ra.episode_successes)]
    assert [(t, i) for t, i, _ in ended] == [(14, 0), (14, 1), (29, 0), (29, 1)]
    assert all(s in (True, False) for *_, s in ended)


def test_runner_trains_and_logs_success_rate(tmp_path):
    cfg = load_config("embodied/ppo_metaworld_reach", [
        "env.num_envs=4", "env.kwargs.max_episode_steps=25", "runner.rollout_steps=50",
        "runner.total_env_steps=400", "algorithm.minibatch_size=100", "algorithm.epochs=2",
        "cluster.num_cpus=2", f"runner.out_dir={tmp_path}", "runner.progress=false"])
    runner = EmbodiedRunner(cfg)
    try:
        history = runner.train()
    finally:
        runner.close()
    assert [row["env_steps"] for row in history] == [200, 400]
    assert all(row["episodes"] == 8 and 0.0 <= row["success_rate"] <= 1.0 for row in history)
    assert "success_rate" in (tmp_path / "metrics.csv").read_text().splitlines()[0]
