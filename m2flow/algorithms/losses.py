"""PPO losses (Schulman et al. 2017), in the PPO2 / CleanRL form. Losses are means over
all elements, to be minimised."""

from __future__ import annotations

import torch
from torch import Tensor


def ppo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    clip_low: float,
    clip_high: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate loss; returns (loss, stats).

    The ratio is clipped to ``[1 - clip_low, 1 + clip_high]``; a larger ``clip_high`` lets
    unlikely good actions grow faster (DAPO's clip-higher). ``clip_high`` defaults to
    ``clip_low``.

    ``weights`` (GRPO's masks): the loss is ``mean(weights * surrogate)``, so the caller
    decides how masked samples are normalised; the stats are means weighted by ``weights``.

    stats (detached 0-dim tensors, so that the loss compiles into one graph and the caller
    reads them all at once):
      - ``clip_fraction``: share of elements whose ratio lies outside the clip range;
      - ``approx_kl``: mean of ``(ratio - 1) - log ratio``, the k3 estimator of
        KL(old || new): unbiased and never negative.
    """
    clip_high = clip_low if clip_high is None else clip_high
    log_ratio = logp - old_logp
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    # The pessimistic (smaller) objective: clipping only ever removes an incentive.
    surrogate = torch.min(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        kl = (ratio - 1.0) - log_ratio
        outside = (ratio != clipped).float()
        if weights is None:
            stats = {"clip_fraction": outside.mean(), "approx_kl": kl.mean()}
        else:
            total = weights.sum().clamp_min(1e-8)
            stats = {"clip_fraction": (outside * weights).sum() / total, "approx_kl": (kl * weights).sum() / total}
    loss = -surrogate.mean() if weights is None else -(weights * surrogate).mean()
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
