"""Token-level advantages, KL and losses for language-model policy gradients.

Conventions: a batch holds B sequences. Per-token tensors are [B, T] with ``mask`` [B, T],
nonzero on the completion tokens that are trained on and 0 on prompt and padding; masked-out
positions never change a result, whatever they hold. Per-sequence scalars are [B]. The B
sequences form groups of ``group_size`` consecutive samples of the same prompt.

Signs: advantages and rewards are "higher is better"; every ``*_loss`` is to be minimised.
Advantage estimators run without autograd (their outputs are constants to the loss); losses
are differentiable in ``logp`` / ``values`` only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from m2flow.algorithms.advantages import group_normalized
from m2flow.algorithms.offpolicy import surrogate

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3", "abs", "none")
# exp() of a log-ratio above ~88 overflows float32; veRL clamps at 20 as well.
MAX_LOG_RATIO = 20.0


# --------------------------------------------------------------------------- masked reductions


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x[mask])`` over ``dim`` (all elements if None); masked-out entries count as 0
    even if they hold inf or NaN, and receive zero gradient."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim``; 0 where the mask is empty (not NaN)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  sum_over_ranks: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and variance over the masked elements; 0 on
    masked-out positions. ``var`` is the unbiased one (n - 1), as ``masked_whiten`` in veRL;
    with ``shift_mean=False`` the mean is added back (only the scale changes).

    ``sum_over_ranks``: where ``x`` is one rank's share of the batch, a function returning a
    float64 CPU tensor summed over every rank holding a share (an all-reduce; each rank calls
    this with its share, an empty one too): the mean and variance are then the whole batch's,
    computed in the same two passes."""
    m = mask.bool()
    if sum_over_ranks is None:
        mean = masked_mean(x, m)
        n = m.sum()
        var = masked_sum((x - mean) ** 2, m) / (n - 1).clamp_min(1).to(x.dtype)
    else:
        local = torch.stack([m.sum().double(), masked_sum(x, m).double()]).cpu()
        n, total = sum_over_ranks(local).tolist()
        mean = torch.tensor(total / max(n, 1.0), dtype=x.dtype, device=x.device)
        squares = sum_over_ranks(masked_sum((x - mean) ** 2, m).double().reshape(1).cpu())
        var = torch.tensor(squares.item() / max(n - 1, 1.0), dtype=x.dtype, device=x.device)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros((), dtype=x.dtype, device=x.device))


def broadcast_to_tokens(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """[B] -> [B, T]: each sequence's value on its masked tokens, 0 elsewhere."""
    values = per_sequence.unsqueeze(-1).expand(mask.shape)
    return torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


# --------------------------------------------------------------------------- outcome advantages


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """[B] -> [B // n, n], checking the shape."""
    if rewards.dim() != 1:
        raise ValueError(f"expected per-sequence rewards [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"batch of {rewards.shape[0]} sequences is not made of groups of {group_size}")
    return rewards.view(-1, group_size)


@torch.no_grad()
def grpo_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO outcome advantages (Shao et al. 2024, DeepSeekMath), [B] -> [B].

    ``A_i = (r_i - mean_g) / (std_g + eps)`` within each group g of ``group_size``; std is
    the unbiased one (n - 1), as ``torch.std`` in TRL and veRL, so the same rewards give the
    same advantages there. ``scale_by_std=False`` is Dr. GRPO (Liu et al. 2025):
    ``A_i = r_i - mean_g``, no division that favours near-unanimous groups.
    A group whose rewards are all equal gets exact zeros (it carries no signal), and so does
    every sample when ``group_size = 1``.
    """
    groups = _groups(rewards, group_size)
    if group_size == 1:  # one sample per prompt: no group to compare against (and no std)
        return torch.zeros_like(rewards)
    if scale_by_std:
        return group_normalized(rewards, group_size, eps=eps)
    centred = groups - groups.mean(dim=1, keepdim=True)
    flat = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return centred.masked_fill(flat, 0.0).view_as(rewards)


@torch.no_grad()
def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO (Ahmadian et al. 2024, after Kool et al. 2019), [B] -> [B]:
    ``A_i = r_i - (sum_g - r_i) / (n - 1)``, the mean of the other n - 1 samples of the
    group as the baseline (``= n / (n - 1) * (r_i - mean_g)``). Needs ``group_size >= 2``;
    equal-reward groups get exact zeros."""
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2, got {group_size}")
    groups = _groups(rewards, group_size)
    others = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    flat = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    return (groups - others).masked_fill(flat, 0.0).view_as(rewards)


@torch.no_grad()
def kl_shaped_rewards(outcome: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards [B, T] for REINFORCE++ and token-level PPO (Ouyang et al. 2022):
    ``r_t = -kl_coef * kl_t`` on masked tokens, plus ``outcome`` on each sequence's last
    masked token; 0 on masked-out positions. ``kl`` is a per-token estimate such as
    ``kl_penalty(logp, ref_logp, "k1")``; None means no penalty. A sequence with no masked
    token receives nothing."""
    m = mask.bool()
    outcome = outcome if outcome.is_floating_point() else outcome.float()
    rewards = torch.zeros(m.shape, dtype=outcome.dtype, device=outcome.device)
    if kl is not None and kl_coef != 0.0:
        rewards = torch.where(m, -kl_coef * kl.to(outcome.dtype), rewards)
    positions = torch.arange(m.shape[1], device=m.device).expand(m.shape)
    last = torch.where(m, positions, -1).amax(dim=1)
    has_tokens = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has_tokens]
    rewards[rows, last[has_tokens]] += outcome[has_tokens]
    return rewards


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t'}``, t' the next masked token; masked-out positions add no
    reward and no discount (prompt, padding, tool output between turns)."""
    m = mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = torch.where(m[:, t], token_rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return torch.where(m, returns, torch.zeros_like(returns))


@torch.no_grad()
def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, eps: float = 1e-8,
                            sum_over_ranks: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """REINFORCE++ (Hu 2025, OpenRLHF), [B, T] -> [B, T].

    ``G_t = sum_{s >= t} gamma^(s - t) r_s`` over the masked tokens of the sequence (the
    return-to-go of the per-token rewards from :func:`kl_shaped_rewards`), then whitened over
    all masked tokens of the batch (:func:`masked_whiten`, unbiased variance as veRL): the
    batch, not the group, is the baseline. 0 on masked-out positions. With several ranks each
    holding a share of the batch, ``sum_over_ranks`` (as in :func:`masked_whiten`) makes the
    baseline the whole batch's, not each share's.
    """
    return masked_whiten(_discounted_returns(token_rewards, mask, gamma), mask, eps=eps, sum_over_ranks=sum_over_ranks)


@torch.no_grad()
def token_gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016) over the tokens of each sequence; returns (advantages,
    returns), [B, T] each, 0 on masked-out positions.

    ``delta_t = r_t + gamma * V_{t'} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t'}``,
    t' the next masked token; past the last masked token ``V = 0`` and ``A = 0`` (the
    sequence has ended: no bootstrap). Masked-out positions are skipped, as in veRL's
    multi-turn GAE. ``returns = A + V`` are the critic's targets. The advantages are raw:
    whiten them with :func:`masked_whiten` as PPO for LMs usually does.
    """
    m = mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(m[:, t], values[:, t], next_value)
        advantages[:, t] = running
    zeros = torch.zeros_like(values)
    advantages = torch.where(m, advantages, zeros)
    return advantages, torch.where(m, advantages + values, zeros)


# --------------------------------------------------------------------------- KL


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL
    divergence", 2020); with ``d = logp - ref_logp``:

    - ``k1``: ``d`` (unbiased, can be negative; the usual reward penalty);
    - ``k2``: ``d^2 / 2`` (low variance, biased);
    - ``k3``: ``exp(-d) + d - 1`` (unbiased, never negative; GRPO's loss term). It grows
      like ``exp(-d)``, so a token far less likely under pi than pi_ref dominates;
    - ``abs``: ``|d|``;
    - ``none``: zeros.
    """
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.expm1(-d) + d
    if kind == "abs":
        return d.abs()
    if kind == "none":
        return torch.zeros_like(d)
    raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")


# --------------------------------------------------------------------------- losses


def aggregate(
    loss_tokens: Tensor,
    mask: Tensor,
    agg: str = "token-mean",
    norm_len: float | None = None,
    total_tokens: float | Tensor | None = None,
    total_seqs: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token losses [B, T] to a scalar.

    - ``token-mean`` (DAPO, Yu et al. 2025): ``sum_{i,t} l_it / N``, N the number of
      masked tokens; every token weighs the same, whatever the length of its sequence.
    - ``seq-mean-token-mean`` (GRPO, Shao et al. 2024): ``1/S sum_i (1/|o_i|) sum_t l_it``;
      every sequence weighs the same, so tokens of long ones weigh less.
    - ``seq-mean-token-sum-norm`` (Dr. GRPO, Liu et al. 2025): ``1/S sum_i sum_t l_it / L``
      with ``L = norm_len`` a constant (e.g. the maximum completion length), free of length
      bias.

    Gradient accumulation: by default N and S (= B, sequences with no masked token
    included) are counted on this batch. A micro-batch of a larger mini-batch must divide by
    the mini-batch's counts, ``total_tokens`` / ``total_seqs``, so that the micro-batch
    losses add up to the mini-batch loss. (Where data-parallel gradients are averaged over W
    ranks, pass the global count divided by W.)

    Supervised fine-tuning's loss, the negative log-likelihood of the masked tokens, is
    ``aggregate(-logp, mask, ...)`` (``logp`` [B, T]: the model's log-probs of the tokens taken).
    """
    m = mask.bool()
    if agg == "token-mean":
        count = m.sum() if total_tokens is None else total_tokens
        return masked_sum(loss_tokens, m) / torch.as_tensor(count, dtype=loss_tokens.dtype).clamp_min(1)
    if agg == "seq-mean-token-mean":
        per_seq = masked_mean(loss_tokens, m, dim=-1)
    elif agg == "seq-mean-token-sum-norm":
        if norm_len is None or norm_len <= 0:
            raise ValueError("seq-mean-token-sum-norm needs a positive norm_len (e.g. the max completion length)")
        per_seq = masked_sum(loss_tokens, m, dim=-1) / norm_len
    else:
        raise ValueError(f"unknown aggregation {agg!r}; expected one of {AGG_MODES}")
    count = per_seq.shape[0] if total_seqs is None else total_seqs
    return per_seq.sum() / torch.as_tensor(count, dtype=loss_tokens.dtype).clamp_min(1)


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_len: float | None = None,
    total_tokens: float | Tensor | None = None,
    total_seqs: float | Tensor | None = None,
    *,
    correction: str = "none",
    behaviour_logp: Tensor | None = None,
    is_cap: float = 2.0,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate (PPO, Schulman et al. 2017) per token, aggregated by
    :func:`aggregate`; returns (loss, stats). All of [B, T]; gradients reach ``logp`` only.

    ``rho = exp(logp - old_logp)`` with the log-ratio clamped to +-20 (a token beyond that
    gets no gradient instead of an inf/NaN loss); per token
    ``l = -min(rho * A, clip(rho, 1 - clip_low, 1 + clip_high) * A)``. ``clip_high`` >
    ``clip_low`` is DAPO's clip-higher (defaults to ``clip_low``). ``dual_clip = c > 1``
    (Ye et al. 2020) bounds the loss of negative-advantage tokens by ``-c * A``:
    ``l = min(l, -c * A)`` where ``A < 0``, so a huge ratio on a bad token cannot blow up.

    ``correction`` (``tis`` | ``decoupled``, cap ``is_cap``), for tokens older weights sampled
    (``behaviour_logp``, the sampling log-probs): see ``m2flow.algorithms.offpolicy``. With
    ``decoupled`` the dual-clip bound is weighted like the surrogate; ``tis`` has no clip.

    stats (floats, means over the masked tokens of this batch, whatever ``agg``):
      - ``clip_fraction``: share of tokens whose ratio lies outside the clip range (``tis``:
        above the cap);
      - ``dual_clip_fraction``: share of tokens where the dual-clip bound is the loss;
      - ``approx_kl``: mean of ``(rho - 1) - log rho``, the k3 estimate of KL(old || new);
      - ``ratio_mean``, ``ratio_max``: of rho;
      - with a correction, ``is_weight_mean`` (the importance weights) and ``is_capped_fraction``
        (tokens truncated, ``tis``, or dropped, ``decoupled``).
    """
    clip_high = clip_low if clip_high is None else clip_high
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if dual_clip is not None and correction == "tis":
        raise ValueError("dual_clip bounds a clipped surrogate; the tis correction has none")
    m = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    s = surrogate(logp, old_logp, advantages, clip_low, clip_high, correction=correction,
                  behaviour_logp=behaviour_logp, cap=is_cap, mask=m, max_log_ratio=MAX_LOG_RATIO)
    loss_tokens, ratio, log_ratio, adv = s["loss"], s["ratio"], s["log_ratio"], s["adv"]
    dual_bound = torch.zeros_like(m)
    if dual_clip is not None:
        bound = -dual_clip * adv * s["weight"]
        bounded = torch.min(loss_tokens, bound)
        dual_bound = (adv < 0) & (bounded < loss_tokens)
        loss_tokens = torch.where(adv < 0, bounded, loss_tokens)
    loss = aggregate(loss_tokens, m, agg, norm_len, total_tokens, total_seqs)

    with torch.no_grad():
        parts = [
            masked_mean(s["outside"].to(logp.dtype), m),
            masked_mean(dual_bound.to(logp.dtype), m),
            masked_mean((ratio - 1.0) - log_ratio, m),
            masked_mean(ratio, m),
            torch.where(m, ratio, zero).amax(),  # ratios are > 0: 0 only if nothing is masked
        ]
        names = ["clip_fraction", "dual_clip_fraction", "approx_kl", "ratio_mean", "ratio_max"]
        if correction != "none":
            parts += [masked_mean(s["weight"], m), masked_mean(s["capped"].to(logp.dtype), m)]
            names += ["is_weight_mean", "is_capped_fraction"]
        values = torch.stack(parts).tolist()  # one device sync for all stats
    return loss, dict(zip(names, values))


def value_loss_tokens(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float | None = None,
    agg: str = "token-mean",
    norm_len: float | None = None,
    total_tokens: float | Tensor | None = None,
    total_seqs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Critic loss per token, ``(V - R)^2``, aggregated by :func:`aggregate`; returns
    (loss, stats). No 1/2 factor, like the embodied ``value_loss``, so ``vf_coef`` means the
    same in both.

    With ``clip``, the prediction may move at most ``clip`` from ``old_values`` and the larger
    of the clipped and unclipped errors counts (PPO2):
    ``max((V - R)^2, (old_V + clip(V - old_V, -clip, clip) - R)^2)``.
    stats: ``clip_fraction``, the share of masked tokens where the clipped error is larger.
    """
    m = mask.bool()
    old_values, returns = old_values.detach(), returns.detach()
    unclipped = (values - returns) ** 2
    if clip is None:
        loss_tokens, clipped_larger = unclipped, torch.zeros_like(m)
    else:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
        loss_tokens, clipped_larger = torch.max(unclipped, clipped), clipped > unclipped
    loss = aggregate(loss_tokens, m, agg, norm_len, total_tokens, total_seqs)
    with torch.no_grad():
        stats = {"clip_fraction": masked_mean(clipped_larger.to(values.dtype), m).item()}
    return loss, stats


def kl_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kind: str = "k3",
    agg: str = "token-mean",
    norm_len: float | None = None,
    total_tokens: float | Tensor | None = None,
    total_seqs: float | Tensor | None = None,
) -> Tensor:
    """GRPO's KL term in the loss (Shao et al. 2024): ``aggregate(kl_penalty(logp, ref_logp,
    kind))``, to be added as ``beta * kl_loss``. The default k3 is unbiased and non-negative;
    its gradient vanishes at ``logp = ref_logp``. Gradients reach ``logp`` only."""
    return aggregate(kl_penalty(logp, ref_logp.detach(), kind), mask, agg, norm_len, total_tokens, total_seqs)


def inert_rows(advantages: Tensor | None, mask: Tensor, *, kl_coef: float, kl_in_reward: bool, entropy_coef: float,
               enabled: bool = True) -> Tensor:
    """bool [B], on the CPU: the rows whose loss and gradient are exactly zero, which a trainer
    need not forward: advantage 0 on every masked token (a group whose rewards are all equal,
    under grpo, dr_grpo or rloo) and no other term in the loss (no KL term, i.e. ``kl_coef``
    0 or the KL in the reward, and no entropy bonus). They still count in the loss's token
    and row totals, so the update is the one of a pass over every row. All False when not
    ``enabled`` or without ``advantages``."""
    if not enabled or advantages is None or (kl_coef > 0 and not kl_in_reward) or entropy_coef:
        return torch.zeros(mask.shape[0], dtype=torch.bool)
    signal = (advantages != 0) & mask.bool()
    return ~signal.any(dim=1).cpu()


# --------------------------------------------------------------------------- DAPO


def dynamic_sampling_keep(rewards: Tensor, group_size: int) -> Tensor:
    """DAPO's dynamic sampling (Yu et al. 2025): bool [B // n], True for the groups whose
    rewards are not all equal. An all-equal group has zero group-relative advantage on every
    sample and contributes no gradient, only noise in the token counts."""
    groups = _groups(rewards, group_size)
    return groups.amax(dim=1) != groups.amin(dim=1)


def overlong_penalty(lengths: Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), [B] -> [B] in [-factor, 0]:
    0 for ``length <= max_len - buffer_len``, then
    ``factor * ((max_len - buffer_len) - length) / buffer_len`` down to ``-factor`` at
    ``max_len`` and beyond. Added to the outcome reward."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}")
    over = (lengths.to(torch.float32) - (max_len - buffer_len)) / buffer_len
    return -factor * over.clamp(0.0, 1.0)
