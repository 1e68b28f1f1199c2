"""EnvBatch against plain gymnasium envs and against reference statistics computed in numpy."""

import copy
import math
import importlib.util
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m2flow.envs import EnvBatch, RunningMeanStd, make_env
from m2flow.runners import checkpoint as checkpoints


def random_actions(batch: EnvBatch, rng: np.random.Generator, *lead: int) -> np.ndarray:
    """Actions for every env; continuous ones deliberately exceed the bounds."""
    space = batch.action_space
    if isinstance(space, gym.spaces.Discrete):
        return rng.integers(0, space.n, size=(batch.num_envs, *lead))
    return rng.normal(0.0, 2.0 * space.high, size=(batch.num_envs, *lead, *space.shape))


def pooled_moments(samples: np.ndarray, prior_count: float = 1e-4) -> tuple[np.ndarray, ...]:
    """Mean and variance of ``samples`` pooled with RunningMeanStd's prior (mean 0, var 1)."""
    n = samples.shape[0] + prior_count
    mean = samples.sum(axis=0) / n
    m2 = prior_count * (1.0 + mean**2) + ((samples - mean) ** 2).sum(axis=0)
    return mean, m2 / n


class RecordActions(gym.Wrapper):
    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.actions: list[np.ndarray] = []

    def step(self, action):
        self.actions.append(np.array(action))
        return self.env.step(action)


# ------------------------------------------------------------------------ seeding


def test_same_seed_same_trajectory_and_envs_differ():
    rng_a, rng_b = np.random.default_rng(0), np.random.default_rng(0)
    a, b = EnvBatch("CartPole-v1", 4, seed=3), EnvBatch("CartPole-v1", 4, seed=3)
    obs_a, obs_b = a.reset(), b.reset()
    np.testing.assert_array_equal(obs_a, obs_b)
    assert len({row.tobytes() for row in obs_a}) == 4, "env indices must start differently"
    ended = 0
    for _ in range(100):
        ra, rb = a.step(random_actions(a, rng_a)), b.step(random_actions(b, rng_b))
        for field in ("obs", "rewards", "terminated", "truncated"):
            np.testing.assert_array_equal(getattr(ra, field), getattr(rb, field))
        assert ra.episode_returns == rb.episode_returns
        ended += len(ra.episode_returns)
    assert ended > 4, "the trajectories should cover auto-resets"


def test_groups_start_every_episode_identically():
    batch = EnvBatch("CartPole-v1", 6, seed=0, group_size=2)
    obs = batch.reset()
    starts: list[list[bytes]] = [[row.tobytes()] for row in obs]
    rng = np.random.default_rng(1)
    for _ in range(200):  # members act differently, so their episodes end at different times
        res = batch.step(random_actions(batch, rng))
        # CartPole draws randomness only at reset; a member whose dynamics are stochastic
        # would drift off its group's RNG stream, so let every second member do so.
        for env in batch.envs[1::2]:
            env.unwrapped.np_random.random()
        for i in np.flatnonzero(res.terminated | res.truncated):
            starts[i].append(res.obs[i].tobytes())
    for g in range(3):
        first, second = starts[2 * g], starts[2 * g + 1]
        shared = min(len(first), len(second))
        assert shared >= 3
        assert first[:shared] == second[:shared]
        assert len(set(first)) == len(first), "each episode of a group starts anew"
    assert len({starts[2 * g][0] for g in range(3)}) == 3, "groups differ"


# ------------------------------------------------------------------------ auto-reset


def test_auto_reset_and_truncation_match_plain_envs():
    """Env 0 pushes right until the pole falls (terminated); env 1 alternates (truncated)."""
    limit = 12
    batch = EnvBatch("CartPole-v1", 2, seed=7, env_kwargs={"max_episode_steps": limit})
    plain = [gym.make("CartPole-v1", max_episode_steps=limit) for _ in range(2)]
    expected_obs = [env.reset(seed=7 + i)[0] for i, env in enumerate(plain)]
    np.testing.assert_array_equal(batch.reset(), expected_obs)
    totals, lengths = [0.0, 0.0], [0, 0]
    seen = {"terminated": 0, "truncated": 0}
    for t in range(40):
        actions = np.array([1, t % 2])
        res = batch.step(actions)
        for i, env in enumerate(plain):
            obs, reward, term, trunc, _ = env.step(int(actions[i]))
            totals[i] += reward
            lengths[i] += 1
            assert res.rewards[i] == reward
            assert (res.terminated[i], res.truncated[i]) == (term, trunc)
            if term or trunc:
                seen["terminated" if term else "truncated"] += 1
                np.testing.assert_array_equal(res.final_obs[i], obs)  # the true last obs
                assert (i, totals[i]) in res.episode_returns
                assert (i, lengths[i]) in res.episode_lengths
                totals[i], lengths[i] = 0.0, 0
                obs, _ = env.reset()  # unseeded: gymnasium's RNG continues
            else:
                np.testing.assert_array_equal(res.final_obs[i], obs)  # equals obs elsewhere
            np.testing.assert_array_equal(res.obs[i], obs)
        assert len(res.episode_returns) == (res.terminated | res.truncated).sum()
    assert seen["terminated"] >= 2 and seen["truncated"] >= 2


def test_continuous_actions_are_clipped_to_bounds():
    batch = EnvBatch("Pendulum-v1", 3, seed=0)
    batch.envs = [RecordActions(env) for env in batch.envs]
    batch.reset()
    actions = np.array([[5.0], [-7.0], [0.5]])
    batch.step(actions)
    batch.step_chunk(actions[:, None])
    for env, expected in zip(batch.envs, [[2.0], [-2.0], [0.5]]):
        for sent in env.actions:
            np.testing.assert_allclose(sent, expected)
            assert sent.dtype == np.float32


# ------------------------------------------------------------------------ chunks


def test_chunks_stop_at_episode_end_like_plain_envs():
    limit, n, k = 10, 3, 4
    batch = EnvBatch("CartPole-v1", n, seed=5, env_kwargs={"max_episode_steps": limit})
    plain = [gym.make("CartPole-v1", max_episode_steps=limit) for _ in range(n)]
    expected_obs = [env.reset(seed=5 + i)[0] for i, env in enumerate(plain)]
    np.testing.assert_array_equal(batch.reset(), expected_obs)
    rng = np.random.default_rng(2)
    early_stops = 0
    for _ in range(12):
        actions = random_actions(batch, rng, k)
        res = batch.step_chunk(actions)
        assert res.rewards.shape == res.valid.shape == (n, k)
        for i, env in enumerate(plain):
            rewards, valid = np.zeros(k, np.float32), np.zeros(k, bool)
            for j in range(k):
                obs, reward, term, trunc, _ = env.step(int(actions[i, j]))
                rewards[j], valid[j] = reward, True
                if term or trunc:
                    np.testing.assert_array_equal(res.final_obs[i], obs)
                    obs, _ = env.reset()
                    early_stops += j < k - 1
                    break
            np.testing.assert_array_equal(res.rewards[i], rewards)
            np.testing.assert_array_equal(res.valid[i], valid)
            assert (res.terminated[i], res.truncated[i]) == (term, trunc)
            np.testing.assert_array_equal(res.obs[i], obs)
        for (i, ret), (i2, length) in zip(res.episode_returns, res.episode_lengths):
            assert i == i2 and res.terminated[i] | res.truncated[i]
            assert ret == length  # CartPole pays 1 per step
    assert early_stops >= 2


# ------------------------------------------------------------------------ normalisation


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=6), st.integers(0, 2**16))
def test_running_mean_std_matches_pooled_numpy(batch_sizes, seed):
    rng = np.random.default_rng(seed)
    batches = [rng.normal(3.0, 2.0, size=(b, 3)) for b in batch_sizes]
    rms = RunningMeanStd((3,))
    for b in batches:
        rms.update(b)
    mean, var = pooled_moments(np.concatenate(batches))
    np.testing.assert_allclose(rms.mean, mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(rms.var, var, rtol=1e-10, atol=1e-12)
    assert rms.count == pytest.approx(sum(batch_sizes) + 1e-4)


def normalized(raw: np.ndarray, mean: np.ndarray, var: np.ndarray, clip: float) -> np.ndarray:
    return np.clip((raw - mean) / np.sqrt(var + 1e-8), -clip, clip).astype(np.float32)


def test_reward_scale_stays_finite_once_every_episode_of_a_window_is_over():
    """Without auto-reset (GRPO windows) a step of a batch whose episodes are all over steps
    no env: the return statistics take nothing in, and the next window's rewards are scaled
    by the same finite variance (an empty update made them NaN for the rest of the run)."""
    batch = EnvBatch("CartPole-v1", 2, seed=0, group_size=2, auto_reset=False, reward_scale=True,
                     env_kwargs={"max_episode_steps": 6})
    batch.reset()
    for _ in range(8):  # 6 steps end both episodes; 2 more step nothing
        batch.step(np.zeros(2, dtype=np.int64))
    before = batch.state_dict()["ret_rms"]
    assert batch.all_done and math.isfinite(before["var"]) and before["count"] == pytest.approx(12, abs=1e-3)
    batch.reset()
    step = batch.step(np.zeros(2, dtype=np.int64))
    assert np.isfinite(step.rewards).all() and batch.state_dict()["ret_rms"]["count"] == pytest.approx(14, abs=1e-3)


def test_obs_norm_and_reward_scale_match_reference_and_round_trip():
    kwargs = dict(env_kwargs={"max_episode_steps": 25}, gamma=0.9)
    norm_kwargs = dict(obs_norm=True, reward_scale=True, clip_obs=3.0, **kwargs)
    norm = EnvBatch("Pendulum-v1", 4, seed=1, **norm_kwargs)
    raw = EnvBatch("Pendulum-v1", 4, seed=1, **kwargs)
    close = dict(rtol=1e-5, atol=1e-5)
    seen_obs = [raw.reset()]
    np.testing.assert_allclose(norm.reset(), normalized(seen_obs[0], *pooled_moments(seen_obs[0]), 3.0),
                               **close)
    rng = np.random.default_rng(0)
    discounted, seen_returns, ended = np.zeros(4), [], 0
    for _ in range(60):
        actions = random_actions(raw, rng)
        r, n = raw.step(actions), norm.step(actions)
        seen_obs.append(r.obs)
        mean, var = pooled_moments(np.concatenate(seen_obs))
        np.testing.assert_allclose(n.obs, normalized(r.obs, mean, var, 3.0), **close)
        np.testing.assert_allclose(n.final_obs, normalized(r.final_obs, mean, var, 3.0), **close)
        discounted = 0.9 * discounted + r.rewards.astype(np.float64)
        seen_returns.append(discounted.copy())
        _, ret_var = pooled_moments(np.concatenate(seen_returns))
        expected = np.clip(r.rewards / np.sqrt(ret_var + 1e-8), -10, 10)
        np.testing.assert_allclose(n.rewards, expected, rtol=1e-5)
        discounted[r.terminated | r.truncated] = 0.0
        assert n.episode_returns == r.episode_returns  # raw, not scaled
        ended += len(r.episode_returns)
    assert ended == 8, "two truncated episodes per env: discounted returns restart"

    # Checkpoint and resume: the statistics come back exactly, and frozen ones stay frozen.
    state = copy.deepcopy(norm.state_dict())
    resumed = EnvBatch("Pendulum-v1", 4, seed=1, **norm_kwargs)
    resumed.load_state_dict(state)
    for name in ("obs_rms", "ret_rms"):
        for key, value in getattr(norm, name).state_dict().items():
            np.testing.assert_array_equal(getattr(resumed, name).state_dict()[key], value)
    resumed.training = False
    raw_obs = EnvBatch("Pendulum-v1", 4, seed=1, **kwargs).reset()
    mean, var = state["obs_rms"]["mean"], state["obs_rms"]["var"]
    np.testing.assert_allclose(resumed.reset(), normalized(raw_obs, mean, var, 3.0), **close)
    for _ in range(10):
        resumed.step(random_actions(resumed, rng))
    for name in ("obs_rms", "ret_rms"):
        for key, value in state[name].items():
            np.testing.assert_array_equal(getattr(resumed, name).state_dict()[key], value)
    with pytest.raises(ValueError):
        raw.load_state_dict(state)


# ------------------------------------------------------------------------ registry


@pytest.mark.parametrize("env_id, package", [("maniskill:PickCube-v1", "mani-skill"),
                                             ("metaworld:reach-v3", "metaworld")])
def test_optional_simulators_name_their_package(env_id, package):
    module = {"mani-skill": "mani_skill", "metaworld": "metaworld"}[package]
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    with pytest.raises(ImportError, match=f"pip install {package}"):
        make_env(env_id)


def test_group_size_must_divide_num_envs():
    with pytest.raises(ValueError):
        EnvBatch("CartPole-v1", 6, seed=0, group_size=4)


# ------------------------------------------------------------------------ against SyncVectorEnv


@pytest.mark.parametrize("env_id", ["HalfCheetah-v5", "CartPole-v1"])
def test_steps_like_sync_vector_env(env_id):
    """8 envs, the same seeds and actions: EnvBatch steps as gymnasium's SyncVectorEnv with
    same-step auto-reset does, auto-resets included, in float32 (their speed: benchmarks/micro.py)."""
    f32 = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731
    ours = EnvBatch(env_id, 8, seed=0)
    theirs = gym.vector.SyncVectorEnv([lambda: make_env(env_id)] * 8, autoreset_mode="SameStep")
    np.testing.assert_array_equal(ours.reset(), f32(theirs.reset(seed=0)[0]))
    theirs.action_space.seed(0)
    ended = 0
    for _ in range(200):
        action = theirs.action_space.sample()
        res = ours.step(action)
        obs, rewards, terminated, truncated, info = theirs.step(action)
        np.testing.assert_array_equal(res.obs, f32(obs))
        np.testing.assert_array_equal(res.rewards, f32(rewards))
        np.testing.assert_array_equal(res.terminated, terminated)
        np.testing.assert_array_equal(res.truncated, truncated)
        for i in np.flatnonzero(terminated | truncated):
            np.testing.assert_array_equal(res.final_obs[i], f32(info["final_obs"][i]))
            ended += 1
    if env_id == "CartPole-v1":  # random actions end its episodes after ~22 steps: auto-resets compared too
        assert ended >= 40, ended


@pytest.mark.parametrize("env_id", [
    "CartPole-v1", "Pendulum-v1", "HalfCheetah-v5", "Ant-v5",
    # Keeps episode state outside MjData (step count, goal, previous observation). Meta-World
    # lives in its own venv: `make test` runs this case there.
    pytest.param("metaworld:reach-v3", marks=pytest.mark.skipif(importlib.util.find_spec("metaworld") is None,
                                                                reason="Meta-World lives in .venv-metaworld")),
])
def test_snapshot_restore_continues_bit_for_bit(env_id, tmp_path):
    """Checkpoints: a batch restored from a snapshot mid-episode, stored in a checkpoint file
    and read back, steps exactly like the original, through a time-limit reset (the resumed RNG
    and step counters matter there)."""
    kwargs = {"max_episode_steps": 15}
    original = EnvBatch(env_id, 3, 0, obs_norm=True, env_kwargs=kwargs)
    original.reset()
    rng = np.random.default_rng(0)

    def actions():
        space = original.action_space
        if isinstance(space, gym.spaces.Discrete):
            return rng.integers(space.n, size=3)
        return rng.uniform(space.low, space.high, size=(3, *space.shape)).astype(np.float32)

    for _ in range(10):
        original.step(actions())
    restored = EnvBatch(env_id, 3, 99, obs_norm=True, env_kwargs=kwargs)
    restored.reset()
    checkpoints.save(tmp_path / "envs.safetensors", original.snapshot())
    restored.restore(checkpoints.load(tmp_path / "envs.safetensors"))
    np.testing.assert_array_equal(restored.observations(), original.observations())
    for _ in range(12):
        a = actions()
        x, y = original.step(a), restored.step(a)
        np.testing.assert_array_equal(x.obs, y.obs)
        np.testing.assert_array_equal(x.rewards, y.rewards)
        np.testing.assert_array_equal(x.truncated, y.truncated)
        assert x.episode_returns == y.episode_returns and x.episode_successes == y.episode_successes


@pytest.mark.parametrize("env_id", ["CartPole-v1", "HalfCheetah-v5"])
def test_regrouped_snapshots_continue_every_env(env_id):
    """A run resumed with its envs spread otherwise (two batches of 3 as three of 2): every
    env continues exactly where it was (simulator, RNG, episode under way, the seeds of its
    later episodes), and each new batch's statistics are those of the batches its envs came
    from, merged (by hand: the pooled mean and variance of all their samples)."""
    kwargs = {"max_episode_steps": 15}
    rng = np.random.default_rng(0)
    old = [EnvBatch(env_id, 3, 7 + first, obs_norm=True, reward_scale=True, env_kwargs=kwargs) for first in (0, 3)]
    for b in old:
        b.reset()
    space = old[0].action_space

    def actions(n):
        if isinstance(space, gym.spaces.Discrete):
            return rng.integers(space.n, size=n)
        return rng.uniform(space.low, space.high, size=(n, *space.shape)).astype(np.float32)

    for _ in range(10):
        a = actions(6)
        old[0].step(a[:3]), old[1].step(a[3:])
    snaps = [b.snapshot() for b in old]
    new = [EnvBatch(env_id, 2, 99, obs_norm=True, reward_scale=True, env_kwargs=kwargs) for _ in range(3)]
    for b in new:
        b.reset()
    for b, snap in zip(new, EnvBatch.regroup(snaps, [2, 2, 2]), strict=True):
        b.restore(snap)
    for _ in range(12):  # through time-limit resets
        a = actions(6)
        x = [old[0].step(a[:3]), old[1].step(a[3:])]  # raw observations compared: the statistics differ
        y = [b.step(a[2 * i:2 * i + 2]) for i, b in enumerate(new)]
        np.testing.assert_array_equal(np.concatenate([b._obs for b in old]), np.concatenate([b._obs for b in new]))
        for f in ("terminated", "truncated"):
            np.testing.assert_array_equal(np.concatenate([getattr(r, f) for r in x]),
                                          np.concatenate([getattr(r, f) for r in y]))
        ended = sorted((3 * k + i, ret) for k, r in enumerate(x) for i, ret in r.episode_returns)
        assert ended == sorted((2 * k + i, ret) for k, r in enumerate(y) for i, ret in r.episode_returns)
    # statistics: new batch 1 holds env 2 (old batch 0) and env 3 (old batch 1)
    merged = EnvBatch.regroup(snaps, [2, 2, 2])
    a, b = (s["stats"]["obs_rms"] for s in snaps)
    n = a["count"] + b["count"]
    mean = (a["count"] * a["mean"] + b["count"] * b["mean"]) / n
    var = (a["count"] * (a["var"] + (a["mean"] - mean) ** 2) + b["count"] * (b["var"] + (b["mean"] - mean) ** 2)) / n
    np.testing.assert_allclose(merged[1]["stats"]["obs_rms"]["mean"], mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(merged[1]["stats"]["obs_rms"]["var"], var, rtol=1e-12, atol=1e-12)
    assert merged[1]["stats"]["obs_rms"]["count"] == n
    for k in (0, 2):  # each of a single old batch: its statistics as they were
        np.testing.assert_array_equal(merged[k]["stats"]["obs_rms"]["mean"], snaps[k // 2]["stats"]["obs_rms"]["mean"])
    with pytest.raises(ValueError, match="6 envs cannot be regrouped into 4"):
        EnvBatch.regroup(snaps, [2, 2])


class ScriptedSuccess(gym.Env):
    """Episodes of 4 steps (truncated); ``info["success"]`` is true exactly at the step where
    the action is 1, as ManiSkill and Meta-World report it."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(1, np.float32), 0.0, False, self.t == 4, {"success": np.array([action == 1])}


gym.register("ScriptedSuccess-v0", entry_point=ScriptedSuccess)


def test_success_is_any_step_of_the_episode_and_none_without_reports():
    batch = EnvBatch("ScriptedSuccess-v0", 2, seed=0)
    batch.reset()
    # env 0 succeeds at its 2nd step only, env 1 never; then env 1 at the 1st step of episode 2.
    plan = [[0, 0], [1, 0], [0, 0], [0, 0], [0, 1], [0, 0], [0, 0], [0, 0]]
    ended = []
    for t, actions in enumerate(plan):
        res = batch.step(np.array(actions))
        assert len(res.episode_successes) == len(res.episode_returns)
        ended += [(t, i, s) for (i, _), s in zip(res.episode_returns, res.episode_successes)]
        if t == 5:  # mid-episode: the success so far is in the snapshot and continues from it
            snap = batch.snapshot()
    assert ended == [(3, 0, True), (3, 1, False), (7, 0, False), (7, 1, True)]
    batch.restore(snap)
    res = [batch.step(np.zeros(2, dtype=np.int64)) for _ in range(2)][-1]
    assert res.episode_successes == [False, True]
    cartpole = EnvBatch("CartPole-v1", 1, seed=0)
    cartpole.reset()
    res = cartpole.step_chunk(np.zeros((1, 40), dtype=np.int64))  # CartPole falls within 40 steps
    assert res.episode_successes == [None]


def test_an_env_that_raises_or_gives_nan_is_made_again_and_counted(monkeypatch):
    """A fault truncates that env's episode at its last good observation, with reward 0; the
    env is made again; the batch goes on and counts it (the env_faults metric)."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    zeros = np.zeros(2, dtype=np.int64)
    for kwargs in ({"raise_at": [3]}, {"nan_at": [3]}):
        batch = EnvBatch("fault_envs:Faulty-v0", 2, seed=0, env_kwargs=kwargs)
        batch.reset()
        first = batch.envs[0]
        results = [batch.step(zeros) for _ in range(4)]
        assert batch.faults == 2, kwargs  # both envs fail at their 3rd step
        third = results[2]
        assert third.truncated.tolist() == [True, True] and third.rewards.tolist() == [0.0, 0.0]
        assert third.final_obs[:, 0].tolist() == [2.0, 2.0]  # the last good observation
        assert [ret for _, ret in third.episode_returns] == [2.0, 2.0]
        assert batch.envs[0] is not first
        assert all(np.isfinite(r.obs).all() and np.isfinite(r.rewards).all() for r in results)
        assert results[3].obs[:, 0].tolist() == [1.0, 1.0]  # the new env's first step
    # The count seeds the next env made again: a checkpoint keeps it, a regrouping counts each batch's once.
    restored = EnvBatch("fault_envs:Faulty-v0", 2, seed=0, env_kwargs=kwargs)
    restored.restore(batch.snapshot())
    assert restored.faults == 2
    halves = EnvBatch.regroup([batch.snapshot(), restored.snapshot()], [1, 3])
    assert [h["faults"] for h in halves] == [2, 2]


def test_an_env_that_will_not_reset_at_an_episodes_end_is_made_again(monkeypatch):
    """Its episode had ended: it keeps its end and return; the env is made again, counted as a
    fault, and starts the next episode. A new env that will not reset either is the run's error."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    zeros = np.zeros(2, dtype=np.int64)
    batch = EnvBatch("fault_envs:Faulty-v0", 2, seed=0, env_kwargs={"end_at": [2, 4], "reset_raise_at": [3]})
    batch.reset()  # each env's reset 1; 2 at the end of step 2; 3, at the end of step 4, raises
    first = batch.envs[0]
    results = [batch.step(zeros) for _ in range(5)]
    assert batch.faults == 2 and batch.envs[0] is not first
    assert results[3].terminated.tolist() == [True, True] and results[3].rewards.tolist() == [1.0, 1.0]
    assert [ret for _, ret in results[3].episode_returns] == [2.0, 2.0]  # steps 3 and 4
    assert results[3].obs[:, 0].tolist() == [0.0, 0.0]  # the new env's first observation
    assert results[4].obs[:, 0].tolist() == [1.0, 1.0]
    stuck = EnvBatch("fault_envs:Faulty-v0", 1, seed=0, env_kwargs={"end_at": [1], "reset_raise_at": [2, 3]})
    stuck.reset()  # a new env's resets: 1 in _fault, 2 for the episode; the old one's reset 2 raised
    with pytest.raises(RuntimeError, match=r"would not reset \(reset 2\)"):
        stuck.step(zeros[:1])
