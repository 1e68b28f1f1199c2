"""Tasks that go wrong or run slow, for the tests of fault handling and of asynchrony:
importing this module registers them with gymnasium (``make_env("fault_envs:Stall-v0")``,
gymnasium's ``module:EnvId`` form).

Stall-v0: ``step`` sleeps for good after ``stall_after`` steps, as a simulator that deadlocks
would: the runner's watchdog must notice and report it; with ``stall_s``, once for that long,
as one that stalls and goes on.
Faulty-v0: counts up; ``step`` raises at the steps in ``raise_at``, returns a NaN
observation at those in ``nan_at`` and ends its episode at those in ``end_at``, and ``reset``
raises at the resets in ``reset_raise_at`` (all counted over the instance's life): the env
batch must make it again and count the fault.
Crash-v0: ends its process (``os._exit``) at the ``crash_at``-th step its process took (all
its instances together, counted afresh in each new process), as a simulator that segfaults
would: the run restarts from its last checkpoint, and dies there again as many steps later.
Slow-v0: a coin-flip task whose ``step`` takes ``step_s`` seconds: a simulator slower than
the learner, so that the actor's updates end while a rollout runs. Lopsided-v0: Slow-v0 on
some env ranks only, so that the others run whole rollouts ahead of them.
DieInWorker-v0: ends its worker's process once while the worker starts (or, with ``raise_``,
raises there every time): a worker that dies in its constructor is started again.
"""

import os
import time

import gymnasium as gym
import numpy as np


class _Blank(gym.Env):
    """Zeros to see, two actions: what Stall-v0 and Crash-v0 share."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}


class Stall(_Blank):
    def __init__(self, stall_after: int = 10, stall_s: float | None = None):
        self.stall_after, self.stall_s, self.steps = stall_after, stall_s, 0

    def step(self, action):
        self.steps += 1
        if self.stall_s is not None and self.steps == self.stall_after + 1:
            time.sleep(self.stall_s)
        while self.stall_s is None and self.steps > self.stall_after:
            time.sleep(3600)
        return np.zeros(2, np.float32), 0.0, False, False, {}


_steps_here = 0  # Crash-v0's steps in this process


class Crash(_Blank):
    def __init__(self, crash_at: int = 100):
        self.crash_at = crash_at

    def step(self, action):
        global _steps_here
        _steps_here += 1
        if _steps_here == self.crash_at:
            os._exit(1)
        return np.zeros(2, np.float32), 1.0, False, False, {}


class Faulty(gym.Env):
    observation_space = gym.spaces.Box(-np.inf, np.inf, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, raise_at=(), nan_at=(), end_at=(), reset_raise_at=()):
        self.raise_at, self.nan_at, self.end_at = set(raise_at), set(nan_at), set(end_at)
        self.reset_raise_at, self.steps, self.resets = set(reset_raise_at), 0, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.resets += 1
        if self.resets in self.reset_raise_at:
            raise RuntimeError(f"simulator would not reset (reset {self.resets})")
        return np.array([self.steps], np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.steps in self.raise_at:
            raise RuntimeError(f"simulator exploded at step {self.steps}")
        obs = np.array([np.nan if self.steps in self.nan_at else self.steps], np.float32)
        return obs, 1.0, self.steps in self.end_at, False, {}


class Slow(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, step_s: float = 0.002):
        self.step_s = step_s

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.side = self.np_random.choice([-1.0, 1.0])
        return np.array([self.side, 0.0], np.float32), {}

    def step(self, action):
        time.sleep(self.step_s)
        reward = 1.0 if (2 * action - 1) == self.side else 0.0  # the action that matches the side
        self.side = self.np_random.choice([-1.0, 1.0])
        return np.array([self.side, 0.0], np.float32), reward, False, False, {}


class Lopsided(Slow):
    """Slow-v0 whose envs of first seed below ``slow_from_seed`` step at once: the env ranks
    holding them (env i's first seed is the run's seed + i) run ahead of the others."""

    def __init__(self, step_s: float = 0.01, slow_from_seed: int = 0):
        super().__init__(step_s)
        self.slow_from_seed, self.first_seed = slow_from_seed, None

    def reset(self, *, seed=None, options=None):
        if self.first_seed is None:
            self.first_seed = seed
        if self.first_seed is not None and self.first_seed < self.slow_from_seed:
            self.step_s = 0.0
        return super().reset(seed=seed, options=options)


gym.register("Stall-v0", entry_point=Stall)
gym.register("Slow-v0", entry_point=Slow, max_episode_steps=16)
gym.register("Lopsided-v0", entry_point=Lopsided, max_episode_steps=16)
gym.register("Faulty-v0", entry_point=Faulty)
gym.register("Crash-v0", entry_point=Crash, max_episode_steps=16)


class DieInWorker(_Blank):
    """Ends its worker's process (``os._exit``) while the worker starts, once: the first time an
    instance is made in a worker process, as a simulator that segfaults in its constructor
    would; ``marker`` (a file it creates) tells later instances that it did. With ``raise_``, it
    raises instead, as a constructor given a bad setting does. The driver's probe of the env is
    made normally."""

    def __init__(self, marker: str, raise_: bool = False):
        import ray

        if not (ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None):
            return  # the driver's probe
        if raise_:
            raise ValueError("no such arm: 'left'")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os._exit(1)

    def step(self, action):
        return np.zeros(2, np.float32), 1.0, False, False, {}


gym.register("DieInWorker-v0", entry_point=DieInWorker, max_episode_steps=16)
