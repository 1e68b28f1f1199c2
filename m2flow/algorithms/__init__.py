"""Advantages and losses: pure functions on tensors; nothing here knows about Ray."""

from m2flow.algorithms.advantages import gae, group_normalized, next_values, normalize
from m2flow.algorithms.losses import ppo_policy_loss, value_loss

__all__ = ["gae", "group_normalized", "next_values", "normalize", "ppo_policy_loss", "value_loss"]
