"""Advantages and losses: pure functions on tensors; nothing here knows about Ray."""

from m2flow.algorithms.advantages import (
    episode_group_advantages,
    episode_mask,
    gae,
    group_normalized,
    next_values,
    normalize,
)
from m2flow.algorithms.losses import PPO_STATS, ppo_minibatch_loss, ppo_policy_loss, value_loss
from m2flow.algorithms.tokens import (
    aggregate,
    broadcast_to_tokens,
    dynamic_sampling_keep,
    grpo_advantages,
    inert_rows,
    kl_loss,
    kl_penalty,
    kl_shaped_rewards,
    masked_mean,
    masked_sum,
    masked_whiten,
    overlong_penalty,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    token_gae,
    value_loss_tokens,
)

__all__ = ["episode_group_advantages", "episode_mask", "gae", "group_normalized", "next_values", "normalize",
           "PPO_STATS", "ppo_minibatch_loss", "ppo_policy_loss", "value_loss"]
__all__ += ["aggregate", "broadcast_to_tokens", "dynamic_sampling_keep", "grpo_advantages", "inert_rows", "kl_loss",
            "kl_penalty", "kl_shaped_rewards", "masked_mean", "masked_sum", "masked_whiten", "overlong_penalty",
            "policy_loss", "reinforce_pp_advantages", "rloo_advantages", "token_gae", "value_loss_tokens"]
