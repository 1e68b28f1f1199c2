"""Rewards for reasoning RL: math-verify on the final answer, a format reward, the peer
benchmark's last-number reward, and custom rewards by import path, scored by
``RewardScorer`` (math-verify in a worker process, with a deadline per item)."""

from m2flow.rewards.math import (final_answer, format_reward, in_process, last_boxed, last_number, last_number_reward,
                                 math_reward)
from m2flow.rewards.scorer import BUILTIN, RewardError, RewardScorer, Scores, resolve_reward

__all__ = ["BUILTIN", "RewardError", "RewardScorer", "Scores", "final_answer", "format_reward", "in_process",
           "last_boxed", "last_number", "last_number_reward", "math_reward", "resolve_reward"]
