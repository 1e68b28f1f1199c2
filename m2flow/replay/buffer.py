"""A replay buffer of transitions for off-policy RL, stored once: each observation is kept in
one slot, so that a transition's next observation is the observation of the slot after it.

The buffer has ``lanes`` rings, one per env of the vector env that feeds it (an env's steps
follow each other in its lane). ``add`` takes one step of every env: the slot written holds
the observation, the action, the reward and whether the episode terminated. When an episode
ends (terminated or truncated), the final observation goes into a slot of its own after it
(a *pad*: no action, never the start of a transition), and the env's next observation, the
first of its next episode, into the slot after that. A transition is a slot that is not a pad
and whose next slot is written; its next observation is that slot's. One pad per episode is
all the overhead there is: HalfCheetah's 1,000-step episodes make it 0.1% of the slots.

``sample`` draws transitions uniformly (n-step returns optional: the rewards of up to ``n``
steps of the same episode, discounted, and the observation after them), as numpy arrays;
observations come back as they were stored (raw), for the learner to normalise. With
``prioritized``, in proportion to ``priority ** alpha`` instead (Schaul et al. 2016: a new
transition gets the highest priority yet, ``update_priorities`` sets them from TD errors), with
importance weights ``(P / P_min) ** -beta`` over the batch.
``sample_mixed`` draws from several buffers at set shares (RLPD's half online, half
demonstrations). ``save``/``load`` write and read the whole content as safetensors (no
pickle), so that a run resumed from a checkpoint samples exactly what it would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from m2flow.replay.priorities import SumTree

ARRAYS = ("obs", "actions", "rewards", "terminated", "starts")


@dataclass
class Transitions:
    """A batch of transitions (numpy arrays, the batch first). ``discounts``: what multiplies
    the value of ``next_obs`` in the TD target, ``gamma ** steps`` for an n-step return of
    ``steps`` rewards, 0 where the episode terminated within them."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    discounts: np.ndarray
    weights: np.ndarray | None = None  # prioritised: each transition's importance weight (at most 1)
    slots: np.ndarray | None = None  # prioritised: where they are, for ``update_priorities``

    def __len__(self) -> int:
        return len(self.rewards)

    @staticmethod
    def concat(parts: Sequence[Transitions]) -> Transitions:
        """The parts one after the other (weights and slots only where every part has them)."""
        return Transitions(**{f.name: None if any(getattr(p, f.name) is None for p in parts)
                              else np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(Transitions)})


class ReplayBuffer:
    """Transitions of ``lanes`` envs, ``capacity`` slots in all (module docstring); the oldest
    slots of a lane are overwritten once it is full. ``n_step`` and ``gamma`` set what
    ``sample`` returns."""

    def __init__(self, capacity: int, lanes: int, obs_shape: Sequence[int], action_shape: Sequence[int],
                 obs_dtype: np.dtype | str = np.float32, action_dtype: np.dtype | str = np.float32,
                 n_step: int = 1, gamma: float = 0.99, prioritized: bool = False, alpha: float = 0.6,
                 beta: float = 0.4):
        if lanes < 1 or capacity < 2 * lanes:
            raise ValueError(f"replay buffer: capacity {capacity} cannot hold 2 slots for each of {lanes} lane(s)")
        if n_step < 1:
            raise ValueError(f"replay buffer: n_step must be >= 1, got {n_step}")
        self.lanes, self.size = lanes, capacity // lanes  # slots per lane
        self.n_step, self.gamma = n_step, float(gamma)
        self.obs = np.zeros((lanes, self.size, *obs_shape), obs_dtype)
        self.actions = np.zeros((lanes, self.size, *action_shape), action_dtype)
        self.rewards = np.zeros((lanes, self.size), np.float32)
        self.terminated = np.zeros((lanes, self.size), bool)
        self.starts = np.zeros((lanes, self.size), bool)  # the slot begins a transition (not a pad)
        self.head = np.zeros(lanes, np.int64)  # slots written to each lane so far
        self._expected: np.ndarray | None = None  # the next observations the last add announced
        self._ended = np.ones(lanes, bool)  # each lane's last step ended its episode (or none came yet)
        # prioritised: priority ** alpha of every slot (lane-major), 0 for one that begins no
        # transition (a pad, or the newest slot of a lane: its next observation not yet written)
        self.priorities = SumTree(lanes * self.size) if prioritized else None
        self.alpha, self.beta, self.max_priority = alpha, beta, 1.0

    # -- filling ---------------------------------------------------------------------
    def add(self, obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray,
            truncated: np.ndarray, next_obs: np.ndarray) -> None:
        """One step of every lane's env: ``obs`` [lanes, ...] the observations the actions were
        taken on, ``next_obs`` the observations they led to (the final ones where an episode
        ended, not the next episode's first). Where an episode goes on, the next step's ``obs``
        must be this step's ``next_obs``: the buffer keeps each observation once."""
        obs, next_obs = np.asarray(obs), np.asarray(next_obs)
        terminated = np.asarray(terminated, bool)
        ended = terminated | np.asarray(truncated, bool)
        if obs.shape[0] != self.lanes:
            raise ValueError(f"replay buffer: a step of {obs.shape[0]} envs, the buffer has {self.lanes} lanes")
        going_on = ~self._ended
        expected = self._expected
        if expected is not None and going_on.any() and not np.array_equal(obs[going_on], expected[going_on]):
            raise ValueError("replay buffer: an env's observation is not the next observation its last step gave "
                             "(pass the final observation as next_obs where an episode ends, and step every lane)")
        lanes = np.arange(self.lanes)
        if self.priorities is not None and going_on.any():  # the last step's next observation is this one
            e = lanes[going_on]
            self.priorities.set(e * self.size + (self.head[e] - 1) % self.size, self.max_priority ** self.alpha)
        slot = self.head % self.size
        if self.priorities is not None:  # sampleable once its next observation is written (a pad: now)
            self.priorities.set(lanes * self.size + slot, np.where(ended, self.max_priority ** self.alpha, 0.0))
        self.obs[lanes, slot] = obs
        self.actions[lanes, slot] = actions
        self.rewards[lanes, slot] = rewards
        self.terminated[lanes, slot] = terminated
        self.starts[lanes, slot] = True
        self.head += 1
        if ended.any():  # the final observation in a pad of its own
            e = lanes[ended]
            pad = self.head[e] % self.size
            self.obs[e, pad] = next_obs[e]
            self.actions[e, pad] = 0
            self.rewards[e, pad] = 0.0
            self.terminated[e, pad] = False
            self.starts[e, pad] = False
            if self.priorities is not None:
                self.priorities.set(e * self.size + pad, 0.0)
            self.head[e] += 1
        self._expected, self._ended = next_obs.copy(), ended

    def add_trajectory(self, trajectory) -> None:
        """Every row of an embodied flow's ``Trajectory`` (``m2flow.envs.trajectory``: its envs
        are the lanes, in order): each row's next observations are the next row's, the final
        ones where an episode ended, ``last_obs`` after the last row. Padding rows (no weights
        acted: version -1) are left out; action chunks are not transitions (a one-line error)."""
        if trajectory.executed is not None:
            raise ValueError("replay buffer: a trajectory of action chunks (policy.chunk > 1) holds no transitions")
        rows = len(trajectory.obs)
        for t in range(rows):
            if (trajectory.versions[t] < 0).all():
                continue
            following = trajectory.obs[t + 1] if t + 1 < rows and (trajectory.versions[t + 1] >= 0).all() \
                else trajectory.last_obs
            ended = (trajectory.terminated[t] | trajectory.truncated[t]).reshape(-1, *[1] * (following.ndim - 1))
            self.add(trajectory.obs[t], trajectory.actions[t], trajectory.rewards[t], trajectory.terminated[t],
                     trajectory.truncated[t], np.where(ended, trajectory.final_obs[t], following))

    # -- reading ---------------------------------------------------------------------
    def _stored(self) -> np.ndarray:
        return np.minimum(self.head, self.size)

    def __len__(self) -> int:
        """Transitions that can be sampled: slots that are no pad and whose next slot is written
        (counted over the whole buffer: for reports, not for every step)."""
        total, stored = 0, self._stored()
        for e in range(self.lanes):
            first, last = int(self.head[e] - stored[e]), int(self.head[e]) - 2  # positions
            if last >= first:
                total += int(self.starts[e, np.arange(first, last + 1) % self.size].sum())
        return total

    def sample(self, n: int, rng: np.random.Generator) -> Transitions:
        """``n`` transitions drawn (with replacement) from all that can be sampled: uniformly, or
        prioritised (module docstring)."""
        if self.priorities is not None:
            return self._sample_prioritized(n, rng)
        lanes, positions = self._draw(n, rng)
        return self._gather(lanes, positions)

    def _sample_prioritized(self, n: int, rng: np.random.Generator) -> Transitions:
        tree = self.priorities
        if tree.total <= 0:
            raise ValueError("replay buffer: no transition to sample yet")
        slots = tree.find(rng.uniform(0.0, tree.total, size=n))
        for _ in range(100):  # a draw rounded onto a slot of priority 0: drawn again
            zero = tree.values()[slots] <= 0
            if not zero.any():
                break
            slots[zero] = tree.find(rng.uniform(0.0, tree.total, size=int(zero.sum())))
        lanes, slot = slots // self.size, slots % self.size
        positions = self.head[lanes] - 1 - (self.head[lanes] - 1 - slot) % self.size
        batch = self._gather(lanes, positions)
        p = tree.values()[slots]
        batch.weights = ((p / p.min()) ** -self.beta).astype(np.float32)
        batch.slots = slots
        return batch

    def update_priorities(self, slots: np.ndarray, td_errors: np.ndarray, eps: float = 1e-6) -> None:
        """Priorities ``|td_error| + eps`` for the transitions a prioritised ``sample`` gave
        (``Transitions.slots``); a slot overwritten since is left as it is."""
        priority = np.abs(np.asarray(td_errors, np.float64)) + eps
        keep = self.priorities.values()[slots] > 0
        self.max_priority = max(self.max_priority, float(priority.max(initial=0.0)))
        if keep.any():
            self.priorities.set(np.asarray(slots)[keep], priority[keep] ** self.alpha)

    def _draw(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Lanes and absolute positions of ``n`` transitions: uniform over every (lane, position)
        whose next slot is written, pads rejected (which keeps it uniform over transitions)."""
        stored = self._stored()
        candidates = np.maximum(stored - 1, 0)
        total = int(candidates.sum())
        if total == 0:
            raise ValueError("replay buffer: no transition to sample yet")
        bounds = np.cumsum(candidates)
        got_lanes, got_positions, need = [], [], n
        for _ in range(1000):  # pads are at most half the candidates: this ends long before
            if need <= 0:
                break
            flat = rng.integers(0, total, size=need + need // 4 + 8)
            lane = np.searchsorted(bounds, flat, side="right")
            position = self.head[lane] - stored[lane] + (flat - (bounds[lane] - candidates[lane]))
            keep = self.starts[lane, position % self.size]
            lane, position = lane[keep][:need], position[keep][:need]
            got_lanes.append(lane)
            got_positions.append(position)
            need -= len(lane)
        if need > 0:
            raise ValueError("replay buffer: no transition to sample yet")
        return np.concatenate(got_lanes), np.concatenate(got_positions)

    def _gather(self, lanes: np.ndarray, positions: np.ndarray) -> Transitions:
        size = self.size
        rewards = self.rewards[lanes, positions % size].astype(np.float32)
        discounts = np.where(self.terminated[lanes, positions % size], 0.0, self.gamma).astype(np.float32)
        steps = np.ones_like(positions)
        # n-step: add the rewards of the same episode's next steps while it goes on (the next
        # slot begins a transition: not a pad), nothing has terminated, and the slot after is written
        going = discounts > 0
        for k in range(1, self.n_step):
            at = positions + k
            going &= (at + 1 < self.head[lanes]) & self.starts[lanes, at % size]
            if not going.any():
                break
            rewards = np.where(going, rewards + discounts * self.rewards[lanes, at % size], rewards)
            terminal = self.terminated[lanes, at % size]
            discounts = np.where(going, discounts * np.where(terminal, 0.0, self.gamma), discounts).astype(np.float32)
            steps = np.where(going, k + 1, steps)
            going &= ~terminal
        return Transitions(obs=self.obs[lanes, positions % size], actions=self.actions[lanes, positions % size],
                           rewards=rewards.astype(np.float32), next_obs=self.obs[lanes, (positions + steps) % size],
                           discounts=discounts.astype(np.float32))

    @property
    def nbytes(self) -> int:
        tree = 0 if self.priorities is None else self.priorities.tree.nbytes
        return sum(getattr(self, name).nbytes for name in ARRAYS) + self.head.nbytes + tree

    # -- checkpoints -----------------------------------------------------------------
    def state(self) -> dict[str, np.ndarray]:
        """The content as arrays (the slots written so far, every lane's): what ``save`` writes."""
        used = int(self._stored().max())
        state = {name: np.ascontiguousarray(getattr(self, name)[:, :used]) for name in ARRAYS}
        state["head"] = self.head.copy()
        state["ended"] = self._ended.copy()
        if self._expected is not None:
            state["expected"] = self._expected
        if self.priorities is not None:
            values = self.priorities.values().reshape(self.lanes, self.size)
            state["priorities"] = np.ascontiguousarray(values[:, :used])
            state["max_priority"] = np.array(self.max_priority)
        return state

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        used = state["obs"].shape[1]
        if self.priorities is not None and "priorities" not in state:
            raise ValueError("replay buffer: the saved buffer was not prioritised; this one is")
        if (state["head"] > used).any() and used != self.size:  # wrapped: positions map to slots modulo its size
            raise ValueError(f"replay buffer: the saved buffer wrapped around {used} slots a lane; this one has "
                             f"{self.size}: load it into a buffer of the same capacity")
        for name in ARRAYS:
            mine, theirs = getattr(self, name), state[name]
            if theirs.shape[0] != mine.shape[0] or theirs.shape[2:] != mine.shape[2:] or used > self.size:
                raise ValueError(f"replay buffer: the saved {name} are {theirs.shape[0]} lane(s) x {used} x "
                                 f"{list(theirs.shape[2:])}; this buffer holds {mine.shape[0]} x {self.size} x "
                                 f"{list(mine.shape[2:])}")
            mine[:, :used] = theirs
            mine[:, used:] = 0
        self.head = state["head"].astype(np.int64)
        self._ended = state["ended"].astype(bool)
        self._expected = state["expected"].copy() if "expected" in state else None
        if self.priorities is not None:
            values = np.zeros((self.lanes, self.size))
            values[:, :used] = state["priorities"]
            self.priorities.set(np.arange(self.lanes * self.size), values.reshape(-1))
            self.max_priority = float(state["max_priority"])

    def save(self, path: str | Path) -> Path:
        from safetensors.numpy import save_file

        path = Path(path)
        save_file(self.state(), str(path), metadata={"n_step": str(self.n_step), "gamma": repr(self.gamma)})
        return path

    def load(self, path: str | Path) -> ReplayBuffer:
        from safetensors.numpy import load_file

        self.load_state(load_file(str(path)))
        return self

    @classmethod
    def from_file(cls, path: str | Path, capacity: int | None = None, n_step: int = 1,
                  gamma: float = 0.99) -> ReplayBuffer:
        """A buffer holding what ``save`` wrote (a dataset of demonstrations, say), at least as
        large as that."""
        from safetensors.numpy import load_file

        state = load_file(str(path))
        lanes, used = state["obs"].shape[:2]
        wrapped = bool((state["head"] > used).any())
        slots = lanes * used if wrapped else max(capacity or 0, lanes * max(used, 2))
        buffer = cls(slots, lanes, state["obs"].shape[2:], state["actions"].shape[2:], state["obs"].dtype,
                     state["actions"].dtype, n_step=n_step, gamma=gamma)
        buffer.load_state(state)
        return buffer


def sample_mixed(sources: Sequence[tuple[ReplayBuffer, float]], n: int, rng: np.random.Generator) -> Transitions:
    """``n`` transitions drawn from several buffers at the given shares (rounded so that they
    add up to ``n``): RLPD's symmetric sampling is ``[(online, 0.5), (offline, 0.5)]``."""
    shares = np.array([share for _, share in sources], np.float64)
    if (shares < 0).any() or shares.sum() <= 0:
        raise ValueError(f"replay buffer: sampling shares must be >= 0 and not all 0, got {shares.tolist()}")
    exact = shares / shares.sum() * n
    counts = np.floor(exact).astype(int)
    counts[np.argsort(counts - exact, kind="stable")[: n - counts.sum()]] += 1  # largest remainders first
    return Transitions.concat([buffer.sample(int(c), rng) for (buffer, _), c in zip(sources, counts) if c > 0])
