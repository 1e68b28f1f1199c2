"""Token-level LM algorithms against numbers worked out by hand on tiny inputs."""

import math

import pytest
import torch

from m2flow.algorithms import (
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

LN2 = math.log(2.0)


def mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


# --------------------------------------------------------------------------- masked reductions


def test_masked_sum_and_mean_ignore_padding_even_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0], [7.0, 8.0, 9.0]])
    m = mask([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert masked_sum(x, m).item() == 7.0
    assert masked_mean(x, m).item() == pytest.approx(7 / 3)
    # per row: [1.5, 4, 0]; an empty row is 0, not NaN
    assert torch.equal(masked_mean(x, m, dim=-1), torch.tensor([1.5, 4.0, 0.0]))
    assert torch.equal(masked_sum(x, m, dim=-1), torch.tensor([3.0, 4.0, 0.0]))


def test_masked_whiten_unbiased_over_masked_elements():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, -99.0]])
    m = mask([[1, 1, 0], [1, 1, 0]])
    # kept 1, 2, 3, 4: mean 2.5, unbiased var (2.25 + 0.25 + 0.25 + 2.25) / 3 = 5 / 3
    s = math.sqrt(5 / 3)
    expected = torch.tensor([[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 1.5 / s, 0.0]])
    torch.testing.assert_close(masked_whiten(x, m), expected)
    scaled_only = expected + 2.5 * m
    torch.testing.assert_close(masked_whiten(x, m, shift_mean=False), scaled_only)


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([2.0, -3.0]), mask([[0, 1, 1], [1, 0, 0]]))
    assert torch.equal(out, torch.tensor([[0.0, 2.0, 2.0], [-3.0, 0.0, 0.0]]))


# --------------------------------------------------------------------------- outcome advantages

# three groups of 4: [0, 0, 0, 1], [0.1] * 4, [1, 1, 0, 0]
REWARDS = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1, 1.0, 1.0, 0.0, 0.0])


def test_grpo_advantages_unbiased_std_and_dr_grpo():
    # g0: mean 0.25, unbiased var (3 * 0.0625 + 0.5625) / 3 = 0.25 -> std 0.5
    # g1: all equal -> exact zeros (0.1 has no exact float mean)
    # g2: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 1 / sqrt 3
    h = 0.5 * math.sqrt(3.0)
    expected = torch.tensor([-0.5, -0.5, -0.5, 1.5, 0, 0, 0, 0, h, h, -h, -h])
    out = grpo_advantages(REWARDS, group_size=4, eps=0.0)
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[4:8], torch.zeros(4))
    torch.testing.assert_close(grpo_advantages(REWARDS, 4), expected, rtol=1e-5, atol=1e-5)  # eps = 1e-6
    # Dr. GRPO: only centred
    dr = grpo_advantages(REWARDS, 4, scale_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([-0.25, -0.25, -0.25, 0.75, 0, 0, 0, 0, 0.5, 0.5, -0.5, -0.5]))
    assert torch.equal(dr[4:8], torch.zeros(4))
    # one sample per prompt: nothing to compare against
    assert torch.equal(grpo_advantages(REWARDS, 1), torch.zeros(12))


def test_group_size_errors():
    for bad in (5, 0, 13):
        with pytest.raises(ValueError):
            grpo_advantages(REWARDS, bad)
        with pytest.raises(ValueError):
            dynamic_sampling_keep(REWARDS, bad)
    with pytest.raises(ValueError, match="expected per-sequence rewards"):  # 2-D, though 4 rows of 3 make groups
        grpo_advantages(REWARDS.view(4, 3), 4)
    with pytest.raises(ValueError):
        rloo_advantages(REWARDS, 1)
    with pytest.raises(ValueError):
        rloo_advantages(REWARDS, 5)


def test_rloo_advantages():
    # [1, 0, 0, 1]: 1 - 1/3 and 0 - 2/3
    out = rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4)
    torch.testing.assert_close(out, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    # [3, 1, 2]: 3 - 1.5, 1 - 2.5, 2 - 2;  [5, 5, 5]: exact zeros
    out = rloo_advantages(torch.tensor([3.0, 1.0, 2.0, 5.0, 5.0, 5.0]), 3)
    assert torch.equal(out, torch.tensor([1.5, -1.5, 0.0, 0.0, 0.0, 0.0]))
    # = n / (n - 1) * (r - mean)
    torch.testing.assert_close(rloo_advantages(REWARDS, 4), grpo_advantages(REWARDS, 4, scale_by_std=False) * 4 / 3)


def test_kl_shaped_rewards():
    outcome = torch.tensor([1.0, -1.0, 5.0])
    m = mask([[0, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]])  # prompt at 0, padding; row 2 has no completion
    kl = torch.tensor([[9.0, 0.5, 1.0, 9.0], [9.0, 2.0, 0.0, -1.0], [9.0, 9.0, 9.0, 9.0]])
    # -0.1 * kl on masked tokens, + outcome on the last masked one
    expected = torch.tensor([[0.0, -0.05, 0.9, 0.0], [0.0, -0.2, 0.0, -0.9], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(kl_shaped_rewards(outcome, m, kl, kl_coef=0.1), expected)
    expected = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(kl_shaped_rewards(outcome, m), expected)


def test_reinforce_pp_discounted_then_whitened_over_batch():
    m = mask([[1, 1, 1, 0], [1, 1, 0, 0]])
    token_rewards = torch.tensor([[0.0, 0.0, 1.0, 50.0], [0.0, 2.0, 7.0, 7.0]])  # padding holds junk
    # gamma 0.5: row 0 returns [0.25, 0.5, 1], row 1 [1, 2]
    # mean 4.75 / 5 = 0.95; deviations -0.7, -0.45, 0.05, 0.05, 1.05; sum of squares 1.8 -> var 1.8 / 4
    s = math.sqrt(0.45)
    expected = torch.tensor([[-0.7 / s, -0.45 / s, 0.05 / s, 0.0], [0.05 / s, 1.05 / s, 0.0, 0.0]])
    torch.testing.assert_close(reinforce_pp_advantages(token_rewards, m, gamma=0.5), expected)


def _reinforce_pp_ranks(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks: the actor's REINFORCE++ advantages on its share of a step,
    rows split one each, then all on rank 0 and none on rank 1."""
    import datetime
    import types

    import torch.distributed as dist

    from m2flow.engines.batch import SequenceBatch
    from m2flow.workers.lm_actor import LMActorWorker

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # mismatched collectives fail, not hang
    try:
        actor = types.SimpleNamespace(algo={"name": "reinforce_pp", "kl_coef": 0.0, "kl_in_reward": False},
                                      world_size=2)
        completion = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0]])  # a prompt token, then 3 and 2 completion tokens
        rewards = torch.tensor([1.0, 0.0])

        def share(rows: list[int]) -> SequenceBatch:
            c = completion[rows]
            batch = SequenceBatch(torch.ones_like(c), (c + torch.eye(4, dtype=torch.long)[0]).clamp_max(1), c)
            batch.extras.update(reward=rewards[rows], group_size=1)
            LMActorWorker._advantages(actor, batch)
            return batch.advantages if batch.advantages is not None else torch.zeros((0, 4))

        torch.save({"split": share([rank]), "uneven": share([0, 1] if rank == 0 else [])}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_reinforce_pp_whitened_over_every_ranks_share(tmp_path):
    """Two actor ranks each holding part of a step whiten its returns with the whole step's
    mean and variance (rank 0's row alone is all 1s and would whiten to 0), also when one
    rank holds none of it. Returns 1, 1, 1 and 0, 0: mean 0.6, variance 1.2 / 4."""
    import torch.multiprocessing as mp

    from test_lm_training import _free_port

    mp.spawn(_reinforce_pp_ranks, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    s = math.sqrt(0.3)
    expected = torch.tensor([[0.0, 0.4 / s, 0.4 / s, 0.4 / s], [0.0, -0.6 / s, -0.6 / s, 0.0]])
    torch.testing.assert_close(torch.cat([r0["split"], r1["split"]]), expected)
    torch.testing.assert_close(r0["uneven"], expected)
    assert r1["uneven"].shape == (0, 4)


def test_token_gae_stops_at_sequence_end_and_skips_unmasked_tokens():
    m = mask([[0, 1, 1, 1, 0], [1, 0, 1, 0, 0]])
    rewards = torch.tensor([[9.0, 0.0, 0.0, 1.0, 9.0], [1.0, 100.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[9.0, 0.5, 0.25, 0.5, 9.0], [1.0, 50.0, 1.0, 0.0, 0.0]])
    # gamma = lam = 0.5 (gamma * lam = 0.25); V = 0 after the last masked token
    # row 0: t3: delta = 1 - 0.5 = 0.5                 A = 0.5
    #        t2: delta = 0.5 * 0.5 - 0.25 = 0           A = 0 + 0.25 * 0.5 = 0.125
    #        t1: delta = 0.5 * 0.25 - 0.5 = -0.375      A = -0.375 + 0.25 * 0.125 = -0.34375
    # row 1 (t1 is a tool output, skipped: its reward 100 and value 50 play no part):
    #        t2: delta = 2 - 1 = 1                      A = 1
    #        t0: delta = 1 + 0.5 * V_2 - 1 = 0.5        A = 0.5 + 0.25 * 1 = 0.75
    advantages, returns = token_gae(rewards, values, m, gamma=0.5, lam=0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0, -0.34375, 0.125, 0.5, 0], [0.75, 0, 1, 0, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[0, 0.15625, 0.375, 1.0, 0], [1.75, 0, 2, 0, 0]]))
    # lam = 1, V = 0: advantages are the discounted returns-to-go over masked tokens
    adv, _ = token_gae(rewards, torch.zeros(2, 5), m, gamma=0.5, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.25, 0.5, 1, 0], [2, 0, 2, 0, 0]]))


# --------------------------------------------------------------------------- KL


def test_kl_penalty_kinds():
    # d = logp - ref = +ln 2 and -ln 2
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([LN2, -LN2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * LN2**2, 0.5 * LN2**2]))
    # k3 = exp(-d) + d - 1: 0.5 + ln 2 - 1, 2 - ln 2 - 1
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([LN2 - 0.5, 1 - LN2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), torch.tensor([LN2, LN2]))
    assert torch.equal(kl_penalty(logp, ref, "none"), torch.zeros(2))
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")


def test_kl_loss_k3_and_gradient_through_logp_only():
    logp = torch.tensor([[math.log(0.5), math.log(0.25), 3.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.5), -30.0]], requires_grad=True)
    m = mask([[1, 1, 0]])
    loss = kl_loss(logp, ref, m)
    # (ln 2 - 0.5 + 1 - ln 2) / 2 = 0.25
    assert loss.item() == pytest.approx(0.25)
    loss.backward()
    # d k3 / d logp = 1 - exp(-d): 0.5 and -1, over 2 tokens
    torch.testing.assert_close(logp.grad, torch.tensor([[0.25, -0.5, 0.0]]))
    assert ref.grad is None


# --------------------------------------------------------------------------- aggregation

LOSS_TOKENS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
AGG_MASK = mask([[1, 1, 1, 1], [1, 0, 0, 0]])


def test_aggregate_modes_differ_on_unequal_lengths():
    # token-mean: (1 + 2 + 3 + 4 + 10) / 5 tokens
    assert aggregate(LOSS_TOKENS, AGG_MASK, "token-mean").item() == pytest.approx(4.0)
    # seq-mean-token-mean: (2.5 + 10) / 2: the 1-token sequence weighs as much as the 4-token one
    assert aggregate(LOSS_TOKENS, AGG_MASK, "seq-mean-token-mean").item() == pytest.approx(6.25)
    # seq-mean-token-sum-norm, L = 4: (10 / 4 + 10 / 4) / 2
    assert aggregate(LOSS_TOKENS, AGG_MASK, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(2.5)
    with pytest.raises(ValueError):
        aggregate(LOSS_TOKENS, AGG_MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError):
        aggregate(LOSS_TOKENS, AGG_MASK, "token-sum")


def _batch(seed: int = 0):
    torch.manual_seed(seed)
    m = mask([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    logp = -torch.rand(4, 5) * 2
    old_logp = logp + 0.3 * torch.randn(4, 5)
    advantages = torch.randn(4, 5)
    return m, logp, old_logp, advantages


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_losses_add_up_to_the_full_batch(agg):
    m, logp, old_logp, adv = _batch()
    full_logp = logp.clone().requires_grad_()
    full, _ = policy_loss(full_logp, old_logp, adv, m, dual_clip=3.0, agg=agg, norm_len=5)
    full.backward()
    totals = {"total_tokens": int(m.sum()), "total_seqs": 4, "norm_len": 5}
    micro_logp = logp.clone().requires_grad_()
    summed = sum(
        policy_loss(micro_logp[rows], old_logp[rows], adv[rows], m[rows], dual_clip=3.0, agg=agg, **totals)[0]
        for rows in (slice(0, 1), slice(1, 4))  # 5 + 6 tokens: unequal micro-batches
    )
    summed.backward()
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(micro_logp.grad, full_logp.grad)
    # the micro-batch's own counts would not add up
    own = sum(aggregate(LOSS_TOKENS[r], AGG_MASK[r], agg, norm_len=4) for r in (slice(0, 1), slice(1, 2)))
    assert own.item() != pytest.approx(aggregate(LOSS_TOKENS, AGG_MASK, agg, norm_len=4).item())


# --------------------------------------------------------------------------- policy loss

# masked ratios: row 0 [1.1, 1.5, 0.5] with A = +1, row 1 [1.5, 0.5, 4.0] with A = -1; t = 3 is padding
RATIOS = [[1.1, 1.5, 0.5, 1.0], [1.5, 0.5, 4.0, 1.0]]
ADV = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, -1.0, -1.0, 0.0]])
PG_MASK = mask([[1, 1, 1, 0], [1, 1, 1, 0]])


def _logp(ratios):
    return torch.tensor(ratios).log().requires_grad_()


def test_policy_loss_clip_dual_clip_and_stats():
    # per token, max(-r A, -clip(r, 0.8, 1.2) A):
    #   A = +1: 1.1 -> -1.1; 1.5 -> -1.2 (clipped); 0.5 -> -0.5 (unclipped, lower)
    #   A = -1: 1.5 -> 1.5 (unclipped, higher); 0.5 -> 0.8 (clipped); 4.0 -> 4.0
    logp = _logp(RATIOS)
    loss, stats = policy_loss(logp, torch.zeros(2, 4), ADV, PG_MASK)
    assert loss.item() == pytest.approx((-1.1 - 1.2 - 0.5 + 1.5 + 0.8 + 4.0) / 6)
    assert stats["clip_fraction"] == pytest.approx(5 / 6)  # all but 1.1
    assert stats["dual_clip_fraction"] == 0.0
    k3 = [(r - 1) - math.log(r) for r in RATIOS[0][:3] + RATIOS[1][:3]]
    assert stats["approx_kl"] == pytest.approx(sum(k3) / 6)
    assert stats["ratio_mean"] == pytest.approx(9.1 / 6)
    assert stats["ratio_max"] == pytest.approx(4.0)
    assert all(isinstance(v, float) for v in stats.values())
    loss.backward()
    # d/d logp of -r A / 6 where unclipped, 0 where the clip is active
    expected = torch.tensor([[-1.1, 0.0, -0.5, 0.0], [1.5, 0.0, 4.0, 0.0]]) / 6
    torch.testing.assert_close(logp.grad, expected)

    # dual clip c = 3 caps the negative-advantage losses at -c A = 3: 4.0 -> 3, no gradient there
    logp = _logp(RATIOS)
    loss, stats = policy_loss(logp, torch.zeros(2, 4), ADV, PG_MASK, dual_clip=3.0)
    assert loss.item() == pytest.approx((-1.1 - 1.2 - 0.5 + 1.5 + 0.8 + 3.0) / 6)
    assert stats["dual_clip_fraction"] == pytest.approx(1 / 6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.1, 0.0, -0.5, 0.0], [1.5, 0.0, 0.0, 0.0]]) / 6)
    with pytest.raises(ValueError):
        policy_loss(logp, torch.zeros(2, 4), ADV, PG_MASK, dual_clip=1.0)


def test_policy_loss_clip_boundaries_and_clip_higher():
    # ratios exactly on the bounds 0.8 / 1.2 are inside; 1.25 is outside unless clip_high = 0.28
    m = mask([[1, 1, 1]])
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, stats = policy_loss(_logp([[1.2, 0.8, 1.25]]), torch.zeros(1, 3), adv, m)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.2) / 3)
    loss, stats = policy_loss(_logp([[1.2, 0.8, 1.25]]), torch.zeros(1, 3), adv, m, clip_high=0.28)
    assert stats["clip_fraction"] == 0.0
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.25) / 3)
    # clip-higher leaves the low side alone: 0.75 with A < 0 still counts as 0.8
    loss, _ = policy_loss(_logp([[0.75]]), torch.zeros(1, 1), torch.tensor([[-1.0]]), mask([[1]]), clip_high=0.28)
    assert loss.item() == pytest.approx(0.8)


def test_policy_loss_ignores_padding_and_grads_reach_logp_only():
    def run(pad_logp, pad_old, pad_adv):
        logp = _logp(RATIOS).detach().clone()
        old = torch.zeros(2, 4)
        adv = ADV.clone()
        logp[:, 3], old[:, 3], adv[:, 3] = pad_logp, pad_old, pad_adv
        logp.requires_grad_()
        old.requires_grad_()
        adv.requires_grad_()
        loss, stats = policy_loss(logp, old, adv, PG_MASK, dual_clip=3.0)
        loss.backward()
        assert old.grad is None and adv.grad is None
        return loss.item(), stats, logp.grad

    clean = run(0.0, 0.0, 0.0)
    junk = run(500.0, -500.0, float("nan"))
    assert junk[0] == clean[0] and junk[1] == clean[1]
    assert torch.equal(junk[2], clean[2]) and torch.equal(junk[2][:, 3], torch.zeros(2))


def test_policy_loss_huge_log_ratio_stays_finite():
    # log-ratio 200 would overflow exp; with A = 0 (an all-equal group) it must not make NaN
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-200.0, -1.0]])
    loss, stats = policy_loss(logp, old, torch.tensor([[0.0, 1.0]]), mask([[1, 1]]))
    loss.backward()
    assert loss.item() == pytest.approx(-0.5)
    assert torch.isfinite(logp.grad).all() and math.isfinite(stats["ratio_max"])


def test_inert_rows_are_those_of_zero_advantage_under_a_loss_of_the_advantage_alone():
    # Two groups of 3: the first's rewards are all equal (no signal), the second's are not.
    m = mask([[0, 0, 1, 1, 1]] * 6)
    adv = broadcast_to_tokens(grpo_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0]), 3), m)
    terms = {"kl_coef": 0.0, "kl_in_reward": False, "entropy_coef": 0.0}
    inert = lambda **changes: inert_rows(adv, m, **(terms | changes)).tolist()  # noqa: E731
    assert inert() == [True, True, True, False, False, False]
    assert inert(kl_coef=0.04) == [False] * 6  # the KL term pulls every row
    assert inert(kl_coef=0.04, kl_in_reward=True) == [True, True, True, False, False, False]
    assert inert(entropy_coef=0.01) == [False] * 6
    assert inert(enabled=False) == [False] * 6
    assert inert_rows(None, m, **terms).tolist() == [False] * 6  # no advantages yet


# --------------------------------------------------------------------------- value loss


def test_value_loss_tokens_clipped():
    values = torch.tensor([[1.0, 3.0, 2.2, 1.0, 7.0]], requires_grad=True)
    old_values = torch.tensor([[2.0, 2.0, 2.0, 2.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 4.0, 0.0, 3.0, 0.0]], requires_grad=True)
    m = mask([[1, 1, 1, 1, 0]])
    # unclipped squared errors 1, 1, 4.84, 4 (padding: 49, ignored)
    loss, stats = value_loss_tokens(values, old_values, returns, m)
    assert loss.item() == pytest.approx((1 + 1 + 4.84 + 4) / 4)
    assert stats["clip_fraction"] == 0.0
    # clip 0.5: clipped values 1.5, 2.5, 2.2, 1.5 -> errors 2.25, 2.25, 4.84, 2.25; max: 2.25, 2.25, 4.84, 4
    loss, stats = value_loss_tokens(values, old_values, returns, m, clip=0.5)
    assert loss.item() == pytest.approx((2.25 + 2.25 + 4.84 + 4) / 4)
    assert stats["clip_fraction"] == pytest.approx(2 / 4)
    loss.backward()
    # gradient only where the unclipped error counts: 2 (V - R) / 4 at t = 2, 3
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 1.1, -1.0, 0.0]]))
    assert old_values.grad is None and returns.grad is None


# --------------------------------------------------------------------------- DAPO


def test_dynamic_sampling_keep():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert torch.equal(dynamic_sampling_keep(rewards, 2), torch.tensor([False, True, False]))
    assert torch.equal(dynamic_sampling_keep(rewards, 3), torch.tensor([True, True]))


def test_overlong_penalty():
    # max 10, buffer 4: free up to 6, then -(length - 6) / 4, -1 from 10 on
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert torch.equal(overlong_penalty(lengths, max_len=10, buffer_len=4), expected)
    assert torch.equal(overlong_penalty(lengths, 10, 4, factor=0.5), expected * 0.5)
    for bad in (0, 11):
        with pytest.raises(ValueError):
            overlong_penalty(lengths, 10, bad)
