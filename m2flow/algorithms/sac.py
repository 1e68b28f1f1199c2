"""Soft actor-critic (Haarnoja et al. 2018, with automatic entropy tuning) and the pieces RLPD
(Ball et al. 2023: a critic ensemble, a random subset of it for the target) adds, as pure
functions on tensors. Critic values come as one tensor [E, B] for an ensemble of E critics
(twin critics: E = 2), computed in one batched pass (``m2flow.models.continuous.QEnsemble``).
Losses are to be minimised."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_LOG_2 = math.log(2.0)


def squashed_gaussian(mean: Tensor, log_std: Tensor, scale: Tensor, bias: Tensor, deterministic: bool = False,
                      noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """An action ``tanh(u) * scale + bias`` with ``u ~ N(mean, exp(log_std))`` (reparameterised:
    gradients flow to ``mean`` and ``log_std``), and its log-density [B] in the action space:
    the Gaussian's, less the log of the squashing's Jacobian, ``log(scale (1 - tanh(u)^2))``,
    written as ``log scale + 2 (log 2 - u - softplus(-2u))`` (exact where ``tanh(u)`` rounds
    to 1). ``deterministic``: the mean's action (evaluation)."""
    std = log_std.exp()
    if deterministic:
        u = mean
    else:
        u = mean + std * (torch.randn_like(mean) if noise is None else noise)
    gaussian = -0.5 * ((u - mean) / std).pow(2) - log_std - _LOG_SQRT_2PI
    log_jacobian = torch.log(scale) + 2.0 * (_LOG_2 - u - F.softplus(-2.0 * u))
    return torch.tanh(u) * scale + bias, (gaussian - log_jacobian).sum(-1)


def subset_min(q: Tensor, k: int | None = None, generator: torch.Generator | None = None) -> Tensor:
    """The minimum over critics [E, B] -> [B]: over all E (SAC's twin critics), or over ``k`` of
    them drawn at random, one draw for the batch (RLPD, REDQ)."""
    if k is None or k >= q.shape[0]:
        return q.min(0).values
    chosen = torch.randperm(q.shape[0], generator=generator, device="cpu")[:k].to(q.device)
    return q.index_select(0, chosen).min(0).values


def td_target(rewards: Tensor, discounts: Tensor, next_q: Tensor, next_logp: Tensor, alpha: Tensor | float) -> Tensor:
    """The soft TD target [B]: ``r + discount * (Q'(s', a') - alpha log pi(a'|s'))``, ``Q'`` the
    target critics' value of an action the policy samples in ``s'`` (already reduced over the
    ensemble: ``subset_min``), ``discount`` 0 where the episode terminated (``Transitions``)."""
    return rewards + discounts * (next_q - alpha * next_logp)


def critic_loss(q: Tensor, target: Tensor) -> Tensor:
    """The squared TD errors of every critic [E, B] against one target [B]: half the sum over
    critics of each one's mean (Stable-Baselines3's; each critic learns as it would alone)."""
    return 0.5 * (q - target.detach().unsqueeze(0)).pow(2).mean(1).sum()


def actor_loss(q: Tensor, logp: Tensor, alpha: Tensor | float, reduce: str = "min") -> Tensor:
    """``alpha log pi(a|s) - Q(s, a)`` for actions the policy sampled, averaged: ``Q`` the
    minimum over the critics [E, B] (SAC) or their mean (``reduce="mean"``: RLPD)."""
    value = q.min(0).values if reduce == "min" else q.mean(0)
    return (alpha * logp - value).mean()


def alpha_loss(log_alpha: Tensor, logp: Tensor, target_entropy: float) -> Tensor:
    """Automatic entropy tuning: its gradient raises ``alpha`` while the policy's entropy
    (``-logp``) is below ``target_entropy`` (``-|A|`` by default) and lowers it above."""
    return -(log_alpha * (logp.detach() + target_entropy)).mean()


@torch.no_grad()
def polyak(targets: Iterable[Tensor], sources: Iterable[Tensor], tau: float) -> None:
    """``target <- (1 - tau) target + tau source``, in place, in one fused call over all of them."""
    targets, sources = list(targets), list(sources)
    if targets:
        torch._foreach_lerp_(targets, sources, tau)
