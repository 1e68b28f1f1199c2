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


@pytest.mark.filterwarnings("ignore:Constant\\(s\\) may be too high")  # the scripted policy's gains
def test_success_tells_the_scripted_policy_from_random_actions():
    """Meta-World's own scripted reach policy succeeds in every 100-step episode through
    EnvBatch (two episodes per env, each with a goal of its own); random actions never do."""
    from metaworld.policies import SawyerReachV3Policy

    batch = EnvBatch(TASK, 4, seed=0, env_kwargs={"max_episode_steps": 100})
    scripted, rng = SawyerReachV3Policy(), np.random.default_rng(0)
    policies = {"scripted": lambda obs: np.stack([scripted.get_action(o) for o in obs]).astype(np.float32),
                "random": lambda obs: uniform(batch.action_space, rng, 4)}
    successes, goals = {}, set()
    for name, act in policies.items():
        obs, successes[name] = batch.reset(), []
        for _ in range(200):
            goals |= {tuple(o[-3:]) for o in obs}
            result = batch.step(act(obs))
            obs = result.obs
            successes[name] += result.episode_successes
    assert successes == {"scripted": [True] * 8, "random": [False] * 8}
    assert len(goals) >= 8


def test_ppo_raises_the_success_rate(tmp_path):
    """The preset, with 100-step episodes (long enough for the scripted policy above) and a
    rollout of one episode per env: seed 1's success rate is 0 over the first 5 updates and
    0.43 on average over updates 21-30 (24k env steps); the mean return of the last 5 updates
    is over 4x that of the first 5 (about 670 against 160)."""
    cfg = load_config("embodied/ppo_metaworld_reach", [
        "env.kwargs.max_episode_steps=100", "runner.rollout_steps=100", "runner.total_env_steps=24000",
        "algorithm.minibatch_size=200", "cluster.num_cpus=2", f"runner.out_dir={tmp_path}", "runner.progress=false"])
    runner = EmbodiedRunner(cfg)
    try:
        history = runner.train()
    finally:
        runner.close()
    assert [row["env_steps"] for row in history] == [800 * (u + 1) for u in range(30)]
    assert all(row["episodes"] == 8 and row["episode_length"] == 100 for row in history)
    success = [row["success_rate"] for row in history]
    early, late = sum(success[:5]) / 5, sum(success[-10:]) / 10
    assert late >= early + 0.25, f"success rate {early:.2f} -> {late:.2f}: {success}"
    returns = [row["episode_return"] for row in history]
    assert sum(returns[-5:]) > 2 * sum(returns[:5]), [round(r) for r in returns]
    assert "success_rate" in (tmp_path / "metrics.csv").read_text().splitlines()[0]


def test_a_task_it_lacks_is_a_config_error():
    from m2flow.config import ConfigError
    from m2flow.runners.embodied import probe_spaces

    cfg = load_config("embodied/ppo_metaworld_reach", ["env.id=metaworld:no-such-v3"])
    with pytest.raises(ConfigError, match=r"^env.id: cannot make 'metaworld:no-such-v3': ValueError: Invalid MT env"):
        probe_spaces(cfg)


@pytest.mark.filterwarnings("ignore:Constant\\(s\\) may be too high")  # the scripted policy's gains
def test_the_demonstrations_script_writes_a_buffer_of_scripted_episodes(tmp_path):
    """scripts/robot_demonstrations.py: two 100-step reach episodes of the scripted policy, both
    successful, written as a replay buffer file: 200 transitions, loaded as a dataset."""
    import sys
    from pathlib import Path

    from m2flow.replay import ReplayBuffer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import robot_demonstrations

    buffer, successes = robot_demonstrations.collect("reach-v3", 2, 100, seed=0)
    assert successes == [True, True] and len(buffer) == 200
    loaded = ReplayBuffer.from_file(buffer.save(tmp_path / "reach.safetensors"))
    batch = loaded.sample(64, np.random.default_rng(0))
    assert batch.obs.shape == (64, 39) and batch.actions.shape == (64, 4) and (np.abs(batch.actions) <= 1).all()
    assert len(loaded) == 200
