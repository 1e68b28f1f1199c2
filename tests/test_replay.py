"""The replay buffer (``m2flow/replay/buffer.py``): each observation stored once, transitions
and n-step returns as a plain list of transitions would give them, uniform sampling, sampling
at set shares from several buffers, exact save and load, and its size against the raw bytes."""

import numpy as np
import pytest

from m2flow.replay import ReplayBuffer, Transitions, sample_mixed


def streams(lanes, steps, seed, episode_len=(3, 9), obs_dim=3, action_dim=2):
    """Steps of ``lanes`` envs whose observations are unique (lane, counter) tags: yields the
    arguments of ``add`` and the plain transitions (obs tag, action, reward, next obs tag,
    terminated) they make."""
    rng = np.random.default_rng(seed)
    counter = np.zeros(lanes, int)
    left = rng.integers(*episode_len, size=lanes)

    def tag(e):
        counter[e] += 1
        return np.array([e, counter[e], 0.5][:obs_dim] + [0.0] * (obs_dim - 3), np.float32)

    obs = np.stack([tag(e) for e in range(lanes)])
    for _ in range(steps):
        actions = rng.normal(size=(lanes, action_dim)).astype(np.float32)
        rewards = rng.normal(size=lanes).astype(np.float32)
        left -= 1
        ended = left == 0
        terminated = ended & (rng.random(lanes) < 0.5)
        truncated = ended & ~terminated
        next_obs = np.stack([tag(e) for e in range(lanes)])
        plain = [(tuple(obs[e]), tuple(actions[e]), float(rewards[e]), tuple(next_obs[e]), bool(terminated[e]))
                 for e in range(lanes)]
        yield (obs, actions, rewards, terminated, truncated, next_obs), plain
        reset = np.stack([tag(e) for e in range(lanes)])  # the next episode's first observation
        obs = np.where(ended[:, None], reset, next_obs)
        left = np.where(ended, rng.integers(*episode_len, size=lanes), left)


def fill(buffer, lanes, steps, seed=0, **kw):
    plain = []
    for args, made in streams(lanes, steps, seed, **kw):
        buffer.add(*args)
        plain += made
    return plain


def as_plain(batch: Transitions):
    return {(tuple(o), tuple(a), float(r), tuple(n), bool(d == 0))
            for o, a, r, n, d in zip(batch.obs, batch.actions, batch.rewards, batch.next_obs, batch.discounts)}


def test_sampled_transitions_are_those_a_list_of_transitions_holds_once_wrapped():
    buffer = ReplayBuffer(capacity=3 * 40, lanes=3, obs_shape=(3,), action_shape=(2,))
    plain = fill(buffer, 3, 100)  # 100 steps and their pads in 40 slots a lane: wrapped
    batch = buffer.sample(3000, np.random.default_rng(1))
    got = as_plain(batch)
    assert got <= {p for p in plain}  # every sampled transition is one that happened, next obs included
    # and only recent ones: the last 40 slots of each lane hold at most the last 39 transitions
    recent = {p for p in plain[-3 * 39:]}
    assert got <= recent and len(got) >= len(buffer) * 0.95
    # uniform: each of the transitions held drawn about equally often
    _, counts = np.unique(batch.obs[:, :2], axis=0, return_counts=True)
    assert counts.min() > 0.4 * counts.mean() and counts.max() < 1.8 * counts.mean()
    terminated = {p[0]: p[4] for p in plain}
    assert all(d == (0.0 if terminated[tuple(o)] else np.float32(0.99)) for o, d in zip(batch.obs, batch.discounts))


def test_n_step_returns_stop_at_the_end_of_an_episode():
    buffer = ReplayBuffer(capacity=20, lanes=1, obs_shape=(1,), action_shape=(1,), n_step=2, gamma=0.5)
    o = lambda x: np.array([[x]], np.float32)  # noqa: E731
    a, f = np.zeros((1, 1), np.float32), np.array([False])
    # episode 1: obs 0 -> 1 -> 2 -> 3, rewards 1, 2, 3, terminated at its third step
    buffer.add(o(0), a, [1.0], f, f, o(1))
    buffer.add(o(1), a, [2.0], f, f, o(2))
    buffer.add(o(2), a, [3.0], [True], f, o(3))
    # episode 2: obs 10 -> 11 -> 12, rewards 4, 5, truncated at its second step; then 20 -> 21
    buffer.add(o(10), a, [4.0], f, f, o(11))
    buffer.add(o(11), a, [5.0], f, [True], o(12))
    buffer.add(o(20), a, [6.0], f, f, o(21))
    assert len(buffer) == 5  # the last step's next observation is not written yet
    batch = buffer._gather(np.zeros(5, int), np.array([0, 1, 2, 4, 5]))
    assert batch.rewards.tolist() == [1 + 0.5 * 2, 2 + 0.5 * 3, 3, 4 + 0.5 * 5, 5]
    assert batch.discounts.tolist() == [0.25, 0.0, 0.0, 0.25, 0.5]  # truncated: bootstrapped from obs 12
    assert batch.next_obs[:, 0].tolist() == [2, 3, 3, 12, 12]


def test_an_observation_that_is_not_the_last_steps_next_one_is_refused():
    buffer = ReplayBuffer(capacity=8, lanes=1, obs_shape=(1,), action_shape=(1,))
    a, f = np.zeros((1, 1), np.float32), np.array([False])
    buffer.add(np.ones((1, 1)), a, [0.0], f, f, np.full((1, 1), 2.0))
    with pytest.raises(ValueError, match="not the next observation its last step gave"):
        buffer.add(np.full((1, 1), 3.0), a, [0.0], f, f, np.full((1, 1), 4.0))
    with pytest.raises(ValueError, match="no transition to sample yet"):
        ReplayBuffer(capacity=8, lanes=2, obs_shape=(1,), action_shape=(1,)).sample(4, np.random.default_rng(0))


def test_mixed_sampling_takes_each_source_at_its_share():
    online = ReplayBuffer(capacity=64, lanes=2, obs_shape=(3,), action_shape=(2,))
    offline = ReplayBuffer(capacity=64, lanes=1, obs_shape=(3,), action_shape=(2,))
    fill(online, 2, 20, seed=1)
    fill(offline, 1, 20, seed=2)
    offline.obs[..., 2] = -1.0  # marks the offline source's observations
    rng = np.random.default_rng(0)
    batch = sample_mixed([(online, 0.5), (offline, 0.5)], 256, rng)
    assert len(batch) == 256 and (batch.obs[:, 2] == -1).sum() == 128
    assert (sample_mixed([(online, 0.3), (offline, 0.7)], 10, rng).obs[:, 2] == -1).sum() == 7
    assert (sample_mixed([(online, 1.0), (offline, 0.0)], 9, rng).obs[:, 2] == -1).sum() == 0
    with pytest.raises(ValueError, match="shares must be >= 0"):
        sample_mixed([(online, -1.0), (offline, 0.5)], 8, rng)


def test_a_saved_buffer_loads_and_goes_on_exactly(tmp_path):
    a = ReplayBuffer(capacity=2 * 30, lanes=2, obs_shape=(3,), action_shape=(2,), n_step=3, gamma=0.9)
    steps = list(streams(2, 80, seed=3))
    for args, _ in steps[:50]:
        a.add(*args)
    path = a.save(tmp_path / "buffer.safetensors")
    assert b"pickle" not in path.read_bytes()[:200]
    b = ReplayBuffer(capacity=2 * 30, lanes=2, obs_shape=(3,), action_shape=(2,), n_step=3, gamma=0.9).load(path)
    for args, _ in steps[50:]:  # both go on from there alike
        a.add(*args)
        b.add(*args)
    x, y = a.sample(64, np.random.default_rng(7)), b.sample(64, np.random.default_rng(7))
    fields = ("obs", "actions", "rewards", "next_obs", "discounts")
    assert all(np.array_equal(getattr(x, k), getattr(y, k)) for k in fields)
    # a dataset loads into a buffer of its own size; a wrapped one not into another size
    assert len(ReplayBuffer.from_file(path, n_step=3, gamma=0.9)) == len(b.load(path))
    with pytest.raises(ValueError, match="wrapped around 30 slots a lane; this one has 40"):
        ReplayBuffer(capacity=2 * 40, lanes=2, obs_shape=(3,), action_shape=(2,)).load(
            a.save(tmp_path / "wrapped.safetensors"))


def test_halfcheetah_transitions_take_at_most_1_2x_their_raw_bytes(tmp_path):
    """HalfCheetah's shapes (17 observation and 6 action floats) and 1,000-step episodes: the
    buffer, and the file it saves, against one copy of each observation, action, reward and
    the two flags per transition."""
    lanes, steps = 2, 2500
    buffer = ReplayBuffer(capacity=lanes * 3000, lanes=lanes, obs_shape=(17,), action_shape=(6,))
    fill(buffer, lanes, steps, episode_len=(1000, 1001), obs_dim=17, action_dim=6)
    raw = 17 * 4 + 6 * 4 + 4 + 1 + 1
    held = len(buffer)
    assert held == lanes * (steps - 1)
    used = lanes * int(buffer.head.max())  # the slots written, pads included
    assert buffer.nbytes * used / (lanes * buffer.size) / held <= 1.2 * raw
    assert buffer.save(tmp_path / "b.safetensors").stat().st_size / held <= 1.2 * raw


def test_an_embodied_trajectory_adds_the_transitions_its_rows_hold():
    """Two trajectories of the same envs in a row (the first padded, as the embodied flow pads a
    short one) fill the buffer as the steps added one by one do; chunks of actions are refused."""
    from m2flow.envs.trajectory import Trajectory

    steps = [args for args, _ in streams(3, 20, seed=4)]

    def trajectory(part, last_obs):
        obs, actions, rewards, terminated, truncated, next_obs = (np.stack(x) for x in zip(*part))
        return Trajectory(obs=obs, actions=actions, logp=np.zeros(obs.shape[:2], np.float32),
                          versions=np.zeros(obs.shape[:2], np.int64), rewards=rewards, terminated=terminated,
                          truncated=truncated, final_obs=np.where((terminated | truncated)[..., None], next_obs, obs),
                          last_obs=last_obs, ids=np.arange(3))

    one_by_one = ReplayBuffer(capacity=3 * 64, lanes=3, obs_shape=(3,), action_shape=(2,))
    for args in steps:
        one_by_one.add(*args)
    by_trajectory = ReplayBuffer(capacity=3 * 64, lanes=3, obs_shape=(3,), action_shape=(2,))
    by_trajectory.add_trajectory(trajectory(steps[:10], steps[10][0]).padded(12))
    by_trajectory.add_trajectory(trajectory(steps[10:], steps[-1][5]))
    mine, theirs = by_trajectory.state(), one_by_one.state()
    assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine)
    chunked = trajectory(steps[:2], steps[2][0])
    chunked.executed = np.ones((2, 3), np.int64)
    with pytest.raises(ValueError, match="action chunks"):
        by_trajectory.add_trajectory(chunked)


def test_prioritised_sampling_follows_the_priorities_and_weights_them():
    """Prioritised: only transitions are drawn (never a pad, never a lane's newest slot), new
    ones at the highest priority yet; after ``update_priorities`` one transition of priority
    64 against 1 for the others is drawn about 64 / (64 + N - 1) of the time, with the
    smallest importance weight; the priorities survive a save and load."""
    buffer = ReplayBuffer(capacity=3 * 40, lanes=3, obs_shape=(3,), action_shape=(2,), prioritized=True, alpha=1.0,
                          beta=0.5)
    plain = fill(buffer, 3, 100)
    rng = np.random.default_rng(0)
    batch = buffer.sample(4000, rng)
    assert as_plain(batch) <= set(plain) and len(as_plain(batch)) == len(buffer)
    assert np.allclose(batch.weights, 1.0)  # all at the same (highest) priority
    slots = np.unique(batch.slots)
    assert len(slots) == len(buffer)
    buffer.update_priorities(slots, np.where(slots == slots[0], 64.0, 1.0))
    batch = buffer.sample(20000, rng)
    share = np.mean(batch.slots == slots[0])
    expected = 64 / (64 + len(slots) - 1)
    assert abs(share - expected) < 0.1 * expected, (share, expected)
    assert batch.weights.max() == 1.0 and np.allclose(batch.weights[batch.slots == slots[0]], (64.0) ** -0.5)
    again = ReplayBuffer(capacity=3 * 40, lanes=3, obs_shape=(3,), action_shape=(2,), prioritized=True, alpha=1.0,
                         beta=0.5)
    again.load_state(buffer.state())
    x, y = buffer.sample(64, np.random.default_rng(3)), again.sample(64, np.random.default_rng(3))
    assert np.array_equal(x.slots, y.slots) and np.array_equal(x.weights, y.weights)
    with pytest.raises(ValueError, match="was not prioritised"):
        again.load_state(ReplayBuffer(capacity=3 * 40, lanes=3, obs_shape=(3,), action_shape=(2,)).state())
