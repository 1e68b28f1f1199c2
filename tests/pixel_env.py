"""A small pixel task, for the embodied runner's tests: importing this module registers it
with gymnasium, so ``make_env("pixel_env:BrightSide-v0")`` makes it (gymnasium's
``module:EnvId`` form, as for any user's env module on the Python path)."""

import gymnasium as gym
import numpy as np


class BrightSide(gym.Env):
    """36 x 36 RGB frames (uint8, channels last, the smallest a NatureCNN takes): one half is
    white (255), the other black. Action 0 or 1 names the white half: reward 1 if right. Each
    step draws the next frame's white half."""

    def __init__(self, size: int = 36):
        self.size = size
        self.observation_space = gym.spaces.Box(0, 255, (size, size, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self.side = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.side = int(self.np_random.integers(2))
        return self._frame(), {}

    def step(self, action):
        reward = float(int(action) == self.side)
        self.side = int(self.np_random.integers(2))
        return self._frame(), reward, False, False, {}

    def _frame(self) -> np.ndarray:
        frame = np.zeros(self.observation_space.shape, np.uint8)
        half = self.size // 2
        frame[:, half * self.side:half * (self.side + 1)] = 255
        return frame


gym.register("BrightSide-v0", entry_point=BrightSide, max_episode_steps=8)
