"""A task that stops answering: importing this module registers it with gymnasium
(``make_env("stall_env:Stall-v0")``). Its ``step`` sleeps for good after ``stall_after``
steps, as a simulator that deadlocks would: the runner's watchdog must notice and report it."""

import time

import gymnasium as gym
import numpy as np


class Stall(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, stall_after: int = 10):
        self.stall_after, self.steps = stall_after, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.steps += 1
        while self.steps > self.stall_after:
            time.sleep(3600)
        return np.zeros(2, np.float32), 0.0, False, False, {}


gym.register("Stall-v0", entry_point=Stall)
