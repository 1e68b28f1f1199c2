"""The policy-gradient surrogate per element, with the off-policy corrections for data that
older weights sampled (``algorithm.off_policy``). Both slices' losses build on it:
``tokens.policy_loss`` (language models, per token) and ``losses.ppo_policy_loss`` (embodied,
per action).

Three log-probabilities of an action can differ once sampling runs ahead of training:
``behaviour`` (the weights that sampled it, recorded at sampling time), ``old`` (the loss's
reference: the sampling log-probs, or those the inference worker recomputes) and ``logp`` (the
weights being trained). Corrections, with ``rho = exp(logp - behaviour)`` and cap ``C``:

- ``none``: PPO's clipped surrogate against ``old``, ``-min(r A, clip(r) A)``,
  ``r = exp(logp - old)``. On-policy (``old`` = ``behaviour`` = the weights at the step's
  start) this is PPO; with stale data the ratio starts away from 1 and clipping silences
  tokens before any update.
- ``tis``: truncated importance sampling (as IMPALA's truncated weight ``min(rho, C)``): the
  loss is ``-sg(min(rho, C)) * A * rho / sg(rho)``: its value is ``-min(rho, C) A`` and its
  gradient ``-min(rho, C) A grad(logp)``. Below the cap that is the unbiased importance-sampled
  policy gradient; above it the weight is cut to bound the variance. It needs nothing but the
  sampling log-probs (no recompute) and has no trust region: meant for one pass over the data
  (``epochs=1, mini_batches=1``).
- ``decoupled``: the decoupled PPO objective (Hilton et al. 2022, "Batch size-invariance for
  policy optimization"; as in AReaL): the trust region is taken around a *proximal* policy,
  ``old`` = the log-probs the newest weights give (``algorithm.old_logprobs=recompute``: the
  inference worker; embodied: the actor before its first epoch), and the clipped surrogate is
  weighted by ``w = sg(exp(old - behaviour))``; tokens with ``w > C`` are dropped (weight 0).
  On-policy ``w = 1`` up to round-off and this is PPO.
"""

from __future__ import annotations

import torch
from torch import Tensor

CORRECTIONS = ("none", "tis", "decoupled")


def surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_low: float, clip_high: float,
              *, correction: str = "none", behaviour_logp: Tensor | None = None, cap: float = 2.0,
              mask: Tensor | None = None, max_log_ratio: float | None = None) -> dict[str, Tensor]:
    """Per-element loss ``loss`` (to be aggregated by the caller) and what its stats need:
    ``log_ratio``/``ratio`` (against ``old_logp``; ``tis``: against the behaviour), ``outside``
    (the clip range, or ``tis``: above the cap), ``weight`` (the importance weight, 1 without a
    correction), ``capped`` (``tis``: truncated, ``decoupled``: dropped) and ``adv`` (the
    advantages as the loss took them: detached, in ``logp``'s dtype, 0 outside ``mask``).

    ``mask`` (bool): elements outside it hold 0 in every output, whatever the inputs hold.
    ``max_log_ratio``: log-ratios are clamped to ``+-max_log_ratio`` (an element beyond gets no
    gradient instead of an inf/NaN loss). ``behaviour_logp`` defaults to ``old_logp``."""
    if correction not in CORRECTIONS:
        raise ValueError(f"off-policy correction {correction!r}: one of {', '.join(CORRECTIONS)}")
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)

    def diff(a: Tensor, b: Tensor) -> Tensor:
        d = a - b if mask is None else torch.where(mask, a - b, zero)
        return d if max_log_ratio is None else d.clamp(-max_log_ratio, max_log_ratio)

    adv = advantages.detach().to(logp.dtype)
    if mask is not None:
        adv = torch.where(mask, adv, zero)
    behaviour = old_logp if behaviour_logp is None else behaviour_logp
    if correction == "tis":
        log_ratio = diff(logp, behaviour.detach())
        ratio = log_ratio.exp()
        with torch.no_grad():
            weight = ratio.clamp(max=cap)
            capped = ratio > cap
        loss = -weight * adv * (ratio / ratio.detach())
        return {"loss": loss, "log_ratio": log_ratio, "ratio": ratio, "outside": capped, "weight": weight,
                "capped": capped, "adv": adv}
    log_ratio = diff(logp, old_logp.detach())
    ratio = log_ratio.exp()
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.max(-ratio * adv, -clipped * adv)  # the pessimistic objective
    out = {"log_ratio": log_ratio, "ratio": ratio, "outside": ratio != clipped, "weight": torch.ones_like(adv),
           "capped": torch.zeros_like(adv, dtype=torch.bool), "adv": adv}
    if correction == "decoupled":
        with torch.no_grad():
            w = diff(old_logp, behaviour).exp()
            out["capped"] = w > cap
            out["weight"] = torch.where(out["capped"], zero, w)
        loss = loss * out["weight"]
    return out | {"loss": loss}
