"""PPO losses (Schulman et al. 2017), in the PPO2 / CleanRL form. Losses are means over
all elements, to be minimised."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from m2flow.algorithms.advantages import normalize
from m2flow.algorithms.offpolicy import surrogate

# The stats of ppo_minibatch_loss, in the order of the tensor it returns.
PPO_STATS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction")


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float | None = None,
    weights: Tensor | None = None,
    *,
    correction: str = "none",
    behaviour_logp: Tensor | None = None,
    is_cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate loss; returns (loss, stats).

    The ratio is clipped to ``[1 - clip_low, 1 + clip_high]``; a larger ``clip_high`` lets
    unlikely good actions grow faster (DAPO's clip-higher). ``clip_high`` defaults to
    ``clip_low``.

    ``weights`` (GRPO's masks): the loss is ``mean(weights * surrogate)``, so the caller
    decides how masked samples are normalised; the stats are means weighted by ``weights``.

    ``correction`` (``tis`` | ``decoupled``, cap ``is_cap``) for actions older weights
    sampled (``behaviour_logp``): see ``m2flow.algorithms.offpolicy``.

    stats (detached 0-dim tensors, so that the loss compiles into one graph and the caller
    reads them all at once):
      - ``clip_fraction``: share of elements whose ratio lies outside the clip range (``tis``:
        above the cap);
      - ``approx_kl``: mean of ``(ratio - 1) - log ratio``, the k3 estimator of
        KL(old || new): unbiased and never negative.
    """
    clip_high = clip_low if clip_high is None else clip_high
    s = surrogate(logp, old_logp, advantages, clip_low, clip_high, correction=correction,
                  behaviour_logp=behaviour_logp, cap=is_cap)
    with torch.no_grad():
        kl = (s["ratio"] - 1.0) - s["log_ratio"]
        outside = s["outside"].float()
        if weights is None:
            stats = {"clip_fraction": outside.mean(), "approx_kl": kl.mean()}
        else:
            total = weights.sum().clamp_min(1e-8)
            stats = {"clip_fraction": (outside * weights).sum() / total, "approx_kl": (kl * weights).sum() / total}
    loss = s["loss"].mean() if weights is None else (weights * s["loss"]).mean()
    return loss, stats


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    """``mean((values - returns) ** 2)``: weighted by ``vf_coef`` as in SB3, so the same
    ``vf_coef`` means the same loss in both.

    With ``clip``, the prediction may move at most ``clip`` from ``old_values`` and the
    larger of the clipped and unclipped squared errors counts, as in PPO2 and CleanRL.
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return unclipped.mean()
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return torch.max(unclipped, clipped).mean()


def ppo_minibatch_loss(policy: nn.Module, obs: Tensor, actions: Tensor, old_logp: Tensor, advantages: Tensor,
                       weights: Tensor | None, old_values: Tensor | None, returns: Tensor | None,
                       behaviour_logp: Tensor | None = None, *, clip: float, clip_high: float | None, ent_coef: float,
                       vf_coef: float, value_clip: float | None, norm_adv: bool, correction: str = "none",
                       is_cap: float = 2.0) -> tuple[Tensor, Tensor]:
    """The PPO loss of one minibatch of an embodied policy and its detached ``PPO_STATS``, float64.

    ``policy.evaluate(obs, actions)`` gives (log-probs, entropies, values). The loss is the
    clipped surrogate (``ppo_policy_loss``, clip range ``clip``/``clip_high``) of the
    advantages, normalised over the minibatch when ``norm_adv``, minus ``ent_coef`` times the
    mean entropy, plus ``vf_coef`` times ``value_loss`` (clipped by ``value_clip``) when
    ``returns`` are given (value loss 0 in the stats without them: GRPO has no critic).
    ``weights`` (GRPO): per-sample weights, 0 for padding. ``correction`` (cap ``is_cap``):
    ``algorithm.off_policy``, with ``behaviour_logp`` the sampling log-probs where ``old_logp``
    are the proximal ones (``decoupled``). Pure tensor code, no host syncs:
    under ``torch.compile`` it is one compiled graph, forward and backward."""
    logp, entropy, values = policy.evaluate(obs, actions)
    adv = normalize(advantages) if norm_adv else advantages
    pg_loss, st = ppo_policy_loss(logp, old_logp, adv, clip, clip_high, weights, correction=correction,
                                  behaviour_logp=behaviour_logp, is_cap=is_cap)
    with torch.set_grad_enabled(bool(ent_coef)):  # without a bonus, a statistic only
        ent = entropy.mean() if weights is None else (entropy * weights).mean()
    loss = pg_loss - ent_coef * ent if ent_coef else pg_loss
    v_loss = torch.zeros(())
    if returns is not None:
        v_loss = value_loss(values, old_values, returns, value_clip)
        loss = loss + vf_coef * v_loss
    stats = torch.stack([pg_loss, v_loss, ent, st["approx_kl"], st["clip_fraction"]]).detach()
    return loss, stats.double()
