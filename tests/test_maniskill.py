"""ManiSkill 3 through make_env and EnvBatch: CPU simulation, state observations.

Needs the `maniskill` extra and a software Vulkan (scripts/setup_maniskill.sh; `make test`
runs it). The first env costs a few seconds (imports, Vulkan); later ones ~0.4 s.
"""


import numpy as np
import pytest

pytest.importorskip("mani_skill", reason="needs the maniskill extra: scripts/setup_maniskill.sh")

from m2flow.config import load_config
from m2flow.envs import EnvBatch, make_env
from m2flow.runners import checkpoint as checkpoints

TASK = "maniskill:PushCube-v1"
# ManiSkill 3.0.1 calls np.isnan on torch tensors; NumPy 2 deprecates that path, once per step.
pytestmark = pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")


@pytest.fixture(scope="module")
def env():
    env = make_env(TASK)
    yield env
    env.close()


def test_spaces_obs_reward_and_success_info(env):
    assert env.observation_space.shape == (35,) and env.action_space.shape == (8,)
    obs, info = env.reset(seed=0)
    assert obs.shape == (35,) and obs.dtype == np.float32
    assert info["success"] in (True, False)
    obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
    assert obs.shape == (35,) and obs.dtype == np.float32 and np.isfinite(obs).all()
    assert isinstance(reward, float) and 0.0 <= reward <= 1.0  # normalized_dense
    assert isinstance(terminated, bool) and isinstance(truncated, bool)
    assert "success" in info and info["elapsed_steps"] == 1


def test_truncates_at_the_time_limit(env):
    env.reset(seed=1)
    still = np.zeros(env.action_space.shape, dtype=np.float32)  # the cube stays put: no success
    for t in range(1, 51):
        _, _, terminated, truncated, _ = env.step(still)
        assert not terminated and truncated == (t == 50), t  # PushCube-v1: max_episode_steps 50
    short = make_env(TASK, max_episode_steps=5)
    short.reset(seed=1)
    assert [short.step(still)[3] for _ in range(5)] == [False] * 4 + [True]
    short.close()


def test_same_seed_same_episodes_across_auto_resets():
    """Later episodes reset unseeded: their seeds come from each env's own RNG, so batches
    with the same seed repeat (torch's global RNG, used by the policy, plays no part)."""
    import torch

    kwargs = {"env_kwargs": {"max_episode_steps": 6}, "seed": 3}
    a, b = EnvBatch(TASK, 2, **kwargs), EnvBatch(TASK, 2, **kwargs)
    obs_a, obs_b = a.reset(), b.reset()
    np.testing.assert_array_equal(obs_a, obs_b)
    assert not np.array_equal(obs_a[0], obs_a[1]), "env indices must start differently"
    actions = np.random.default_rng(0).uniform(-1, 1, size=(14, 2, 8))
    ended = 0
    for act in actions:
        torch.rand(3)  # the policy's sampling between steps must not change the episodes
        ra, rb = a.step(act), b.step(act)
        for field in ("obs", "rewards", "terminated", "truncated", "final_obs"):
            np.testing.assert_array_equal(getattr(ra, field), getattr(rb, field))
        ended += len(ra.episode_returns)
        assert all(np.isfinite(r) for _, r in ra.episode_returns)
        assert all(s in (True, False) for s in ra.episode_successes)  # the success rate's source
    assert ended == 4, "two time-limit resets per env"
    first = EnvBatch(TASK, 1, seed=3, env_kwargs={"max_episode_steps": 6}).reset()
    np.testing.assert_array_equal(first[0], obs_a[0])
    a.close(), b.close()


def test_snapshot_restore_continues(tmp_path):
    """Checkpoints: a restored batch continues the original's episodes, through a time-limit
    reset. SAPIEN's API sets poses in float32 through the centre of mass, so the continuation
    matches to round-off, and two restores of one snapshot match each other exactly."""
    kwargs = {"env_kwargs": {"max_episode_steps": 8}}
    original = EnvBatch(TASK, 2, 0, **kwargs)
    original.reset()
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(12, 2, 8))
    for act in actions[:5]:
        original.step(act)
    checkpoints.save(tmp_path / "snap.safetensors", original.snapshot())
    snap = checkpoints.load(tmp_path / "snap.safetensors")  # as a checkpoint stores it
    restored = [EnvBatch(TASK, 2, 99, **kwargs) for _ in range(2)]
    for batch in restored:
        batch.reset()
        batch.restore(snap)
        np.testing.assert_array_equal(batch.observations(), original.observations())
    truncations = 0
    for act in actions[5:]:
        x, y, z = original.step(act), *(batch.step(act) for batch in restored)
        truncations += x.truncated.sum()
        np.testing.assert_allclose(y.obs, x.obs, atol=1e-4)
        np.testing.assert_allclose(y.rewards, x.rewards, atol=1e-4)
        np.testing.assert_array_equal(y.truncated, x.truncated)
        for field in ("obs", "rewards", "terminated", "truncated"):
            np.testing.assert_array_equal(getattr(y, field), getattr(z, field))
    assert truncations == 2, "both envs reach the time limit after the restore"


@pytest.mark.parametrize("ignore", [False, True])
def test_success_ends_the_episode_unless_terminations_are_ignored(ignore):
    from mani_skill.utils.structs.pose import Pose

    env = make_env(TASK, ignore_terminations=ignore)
    env.reset(seed=0)
    base = env.unwrapped
    at_goal = base.obj.pose.p.clone()
    at_goal[..., :2] = base.goal_region.pose.p[..., :2]  # the cube pushed onto the goal
    base.obj.set_pose(Pose.create_from_pq(at_goal, base.obj.pose.q))
    _, reward, terminated, truncated, info = env.step(np.zeros(env.action_space.shape, np.float32))
    assert info["success"] and reward == 1.0 and not truncated
    assert terminated is (not ignore)
    env.close()


def test_a_control_mode_it_lacks_is_a_config_error():
    from m2flow.config import ConfigError
    from m2flow.runners.embodied import probe_spaces

    cfg = load_config("embodied/ppo_maniskill_pushcube", ["env.kwargs.control_mode=bogus"])
    with pytest.raises(ConfigError, match=r"^env.kwargs: cannot make 'maniskill:PushCube-v1' with env.kwargs "
                                          r".*AssertionError: bogus not in supported modes"):
        probe_spaces(cfg)


def test_no_vulkan_driver_is_one_line_saying_what_to_install(tmp_path):
    """SAPIEN's own error is a RuntimeError from deep inside ManiSkill; a run names the fix."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VK_ICD_FILENAMES": str(tmp_path / "none.json"), "VK_DRIVER_FILES": str(tmp_path / "none.json")}
    out = subprocess.run([sys.executable, "-m", "m2flow.cli", "train", "embodied/ppo_maniskill_pushcube",
                          f"runner.out_dir={tmp_path}"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines()[-1].startswith(
        "m2flow: error: env.id: cannot make 'maniskill:PushCube-v1': SAPIEN found no usable Vulkan driver "
        "(vk::createInstanceUnique: "), out.stderr
    assert "make maniskill" in out.stderr.splitlines()[-1]
