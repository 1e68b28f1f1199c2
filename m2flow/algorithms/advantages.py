"""Advantage estimators: GAE for embodied rollouts, group-normalised scores for GRPO.

All functions are pure and work on whatever device the inputs live on. Rollout tensors are
time-major, [T, N]: T steps of N parallel environments.
"""

from __future__ import annotations

import torch
from torch import Tensor


def next_values(
    values: Tensor,
    last_values: Tensor,
    terminated: Tensor,
    truncated: Tensor,
    final_values: Tensor,
) -> Tensor:
    """V of the observation that follows each step within the same episode, [T, N].

    An auto-resetting env hands back the next episode's first observation after an episode
    ends, so the stored ``values[t + 1]`` belongs to another episode there:

    - terminated: 0, the episode is over and nothing follows;
    - truncated (time limit): V(final observation), ``final_values``, because the task would
      have gone on and cutting the return there would bias the value towards the limit;
    - otherwise ``values[t + 1]``, or ``last_values`` (V of the observation after the
      rollout) at the last step.

    ``final_values`` is read only where ``truncated``; a step both terminated and truncated
    counts as terminated, as in gymnasium.
    """
    following = torch.cat([values[1:], last_values.unsqueeze(0)])
    following = torch.where(truncated, final_values, following)
    return torch.where(terminated, torch.zeros_like(following), following)


def gae(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    episode_ends: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016); returns (advantages, returns).

    ``delta_t = r_t + gamma * next_values_t - V_t``;
    ``A_t = delta_t + gamma * lam * (1 - episode_end_t) * A_{t+1}``; ``returns = A + V``.
    ``next_values`` (see :func:`next_values`) already carries the bootstrap, so the recursion
    only has to stop at ``episode_ends = terminated | truncated``.
    """
    deltas = rewards + gamma * next_values - values
    carry = gamma * lam * (~episode_ends).to(rewards.dtype)
    advantages = torch.empty_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in reversed(range(rewards.shape[0])):
        running = deltas[t] + carry[t] * running
        advantages[t] = running
    return advantages, advantages + values


def group_normalized(returns: Tensor, group_size: int, eps: float = 1e-8) -> Tensor:
    """GRPO advantages (Shao et al. 2024): each score against its group's mean and std.

    ``returns`` is [G * K], G groups of K consecutive samples for the same prompt. The std
    is the unbiased one, as in TRL and veRL. A group whose scores are all equal teaches
    nothing and gets exact zeros, rather than rounding noise divided by ``eps``.
    """
    groups = returns.view(-1, group_size)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    advantages = (groups - mean) / (std + eps)
    flat = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return advantages.masked_fill(flat, 0.0).view_as(returns)


def episode_mask(episode_ends: Tensor) -> Tensor:
    """[T, N] bool: the steps of each env's first episode in the rollout, up to and
    including the step that ends it (``episode_ends = terminated | truncated``).

    GRPO rolls out one episode per env and window; an env whose episode ended stays done,
    so whatever follows in its column is not part of that episode.
    """
    ends = episode_ends.long()
    return (ends.cumsum(0) - ends) == 0


def episode_group_advantages(rewards: Tensor, episode_ends: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """GRPO for embodied rollouts; returns (advantages, mask), both [T, N].

    Env n plays one episode in the window (see :func:`episode_mask`); its return is the
    undiscounted sum of its rewards there, partial if the window ended it. Returns are
    normalised within groups of ``group_size`` consecutive envs (which started from the same
    seed, :func:`group_normalized`), and every step of the episode gets its episode's
    advantage. Steps outside the episode get 0 and ``mask`` False.
    """
    mask = episode_mask(episode_ends)
    returns = torch.where(mask, rewards, torch.zeros_like(rewards)).sum(0)
    advantages = group_normalized(returns, group_size)
    return torch.where(mask, advantages.expand_as(rewards), torch.zeros_like(rewards)), mask


def normalize(x: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` over all elements, as SB3 and CleanRL do per minibatch."""
    return (x - x.mean()) / (x.std() + eps)
