"""Advantages and losses against numbers worked out by hand on tiny inputs."""

import math

import pytest
import torch

from m2flow.algorithms import (
    episode_group_advantages,
    episode_mask,
    gae,
    group_normalized,
    next_values,
    normalize,
    ppo_policy_loss,
    value_loss,
)


def mask(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.bool)


def test_next_values_terminated_truncated_and_rollout_end():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    last_values = torch.tensor([7.0, 8.0])
    terminated = mask([[0, 0], [1, 0], [0, 1]])
    truncated = mask([[0, 1], [0, 0], [0, 1]])  # [2, 1]: both flags -> terminated
    final_values = torch.tensor([[99.0, 10.0], [99.0, 99.0], [99.0, 11.0]])  # 99: never read
    expected = torch.tensor([[3.0, 10.0], [0.0, 6.0], [7.0, 0.0]])
    assert torch.equal(next_values(values, last_values, terminated, truncated, final_values), expected)


# Three envs, T = 3, r = 1, V = [1, 2, 4], V(after rollout) = 8, gamma = lam = 0.5:
#   env 0 terminates at t = 1; env 1 is truncated at t = 1 with V(final obs) = 6; env 2 runs on.
REWARDS = torch.ones(3, 3)
VALUES = torch.tensor([[1.0] * 3, [2.0] * 3, [4.0] * 3])
LAST_VALUES = torch.tensor([8.0, 8.0, 8.0])
TERMINATED = mask([[0, 0, 0], [1, 0, 0], [0, 0, 0]])
TRUNCATED = mask([[0, 0, 0], [0, 1, 0], [0, 0, 0]])
FINAL_VALUES = torch.tensor([[0.0, 0.0, 0.0], [0.0, 6.0, 0.0], [0.0, 0.0, 0.0]])
NEXT_VALUES = torch.tensor([[2.0, 2.0, 2.0], [0.0, 6.0, 4.0], [8.0, 8.0, 8.0]])
# deltas = r + 0.5 * next - V:   env 0: [1, -1, 1]   env 1: [1, 2, 1]   env 2: [1, 1, 1]
# A_t = delta_t + 0.25 * (1 - end_t) * A_{t+1}, backwards from t = 2:
#   env 0: A2 = 1, A1 = -1 (end),   A0 = 1 + 0.25 * -1 = 0.75
#   env 1: A2 = 1, A1 = 2 (end),    A0 = 1 + 0.25 * 2 = 1.5
#   env 2: A2 = 1, A1 = 1.25,       A0 = 1 + 0.25 * 1.25 = 1.3125
ADVANTAGES = torch.tensor([[0.75, 1.5, 1.3125], [-1.0, 2.0, 1.25], [1.0, 1.0, 1.0]])


def test_gae_termination_truncation_rollout_end():
    nv = next_values(VALUES, LAST_VALUES, TERMINATED, TRUNCATED, FINAL_VALUES)
    assert torch.equal(nv, NEXT_VALUES)
    advantages, returns = gae(REWARDS, VALUES, nv, TERMINATED | TRUNCATED, gamma=0.5, lam=0.5)
    assert torch.equal(advantages, ADVANTAGES)
    assert torch.equal(returns, ADVANTAGES + VALUES)


def test_gae_lambda_one_is_discounted_return_minus_value():
    # gamma = lam = 1, no ends: A_t = sum of rewards from t + V(after rollout) - V_t.
    rewards = torch.tensor([[1.0], [2.0], [3.0]])
    values = torch.tensor([[10.0], [20.0], [30.0]])
    nv = torch.tensor([[20.0], [30.0], [5.0]])
    advantages, returns = gae(rewards, values, nv, torch.zeros(3, 1, dtype=torch.bool), 1.0, 1.0)
    assert torch.equal(advantages, torch.tensor([[1.0], [-10.0], [-22.0]]))
    assert torch.equal(returns, torch.tensor([[11.0], [10.0], [8.0]]))


def test_group_normalized():
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1, 1.0, 2.0, 3.0, 6.0])
    s1 = math.sqrt(4 * 0.25 / 3)  # unbiased std of [0, 0, 1, 1]
    s3 = math.sqrt((4 + 1 + 0 + 9) / 3)  # [1, 2, 3, 6]: mean 3
    expected = torch.tensor(
        [-0.5 / s1, -0.5 / s1, 0.5 / s1, 0.5 / s1, 0.0, 0.0, 0.0, 0.0, -2 / s3, -1 / s3, 0.0, 3 / s3]
    )
    out = group_normalized(scores, group_size=4)
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[4:8], torch.zeros(4))  # 0.1 has no exact float mean: still zeros


# GRPO window, T = 4, six envs in two groups of 3. Rewards after an env's first episode end
# (9s, 7s) must not count: that env is done for the rest of the window.
#   env 0: [1, 3 | 5, 5], ends at t = 1               -> return 4
#   env 1: [1, 1, 1, 2], never ends (cut by the window) -> return 5
#   env 2: [0 | 7, 7, 7], ends at t = 0 (and again at 2) -> return 0
#   env 3: [1, 1 | 9, 9], ends at t = 1               -> return 2
#   env 4: [2 | 9, 9, 9], ends at t = 0               -> return 2
#   env 5: [0.5] * 4, never ends                       -> return 2
GRPO_REWARDS = torch.tensor([[1.0, 1.0, 0.0, 1.0, 2.0, 0.5],
                             [3.0, 1.0, 7.0, 1.0, 9.0, 0.5],
                             [5.0, 1.0, 7.0, 9.0, 9.0, 0.5],
                             [5.0, 2.0, 7.0, 9.0, 9.0, 0.5]])
GRPO_ENDS = mask([[0, 0, 1, 0, 1, 0],
                  [1, 0, 0, 1, 0, 0],
                  [0, 0, 1, 0, 0, 0],
                  [0, 0, 0, 0, 0, 0]])
GRPO_MASK = mask([[1, 1, 1, 1, 1, 1],
                  [1, 1, 0, 1, 0, 1],
                  [0, 1, 0, 0, 0, 1],
                  [0, 1, 0, 0, 0, 1]])


def test_episode_mask_keeps_the_first_episode_up_to_its_end():
    assert torch.equal(episode_mask(GRPO_ENDS), GRPO_MASK)


def test_episode_group_advantages():
    adv, m = episode_group_advantages(GRPO_REWARDS, GRPO_ENDS, group_size=3)
    assert torch.equal(m, GRPO_MASK)
    # group 0: returns [4, 5, 0], mean 3, unbiased std sqrt((1 + 4 + 9) / 2) = sqrt(7);
    # group 1: returns [2, 2, 2] are equal: nothing to learn, exact zeros.
    s = math.sqrt(7)
    per_env = torch.tensor([1 / s, 2 / s, -3 / s, 0.0, 0.0, 0.0])
    expected = torch.where(GRPO_MASK, per_env.expand(4, 6), torch.zeros(4, 6))
    torch.testing.assert_close(adv, expected)
    assert adv[1, 0].item() == pytest.approx(1 / s) and adv[2, 0].item() == 0.0  # env 0: steps 0-1 only


def test_ppo_policy_loss_weights():
    ratios, adv = [1.1, 1.5, 0.5], torch.ones(3)
    weights = torch.tensor([2.0, 0.0, 1.0])
    # surrogates 1.1, 1.2 (clipped), 0.5; ratios outside [0.8, 1.2]: the 2nd and 3rd
    logp = _logp(ratios)
    loss, stats = ppo_policy_loss(logp, torch.zeros(3), adv, clip_low=0.2, weights=weights)
    assert loss.item() == pytest.approx(-(2 * 1.1 + 0 * 1.2 + 1 * 0.5) / 3)
    assert stats["clip_fraction"].item() == pytest.approx((0 * 2 + 1 * 0 + 1 * 1) / 3)
    k3 = [(r - 1) - math.log(r) for r in ratios]
    assert stats["approx_kl"].item() == pytest.approx((2 * k3[0] + k3[2]) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([-2 * 1.1 / 3, 0.0, -0.5 / 3]))
    # weights of 1 are the plain mean
    plain, _ = ppo_policy_loss(_logp(ratios), torch.zeros(3), adv, clip_low=0.2)
    ones, _ = ppo_policy_loss(_logp(ratios), torch.zeros(3), adv, clip_low=0.2, weights=torch.ones(3))
    assert ones.item() == pytest.approx(plain.item())


def test_normalize():
    std = math.sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3)
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / std
    torch.testing.assert_close(normalize(torch.tensor([1.0, 2.0, 3.0, 4.0])), expected)


def _logp(ratios: list[float]) -> torch.Tensor:
    return torch.tensor(ratios).log().requires_grad_()


def test_ppo_policy_loss_clipping_both_signs():
    # clip 0.2 -> ratios in [0.8, 1.2]
    ratios = [1.1, 1.5, 0.5, 1.5, 0.5, 0.9]
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -2.0])
    # min(r * A, clip(r) * A):
    #   1.1 (inside)                1.1
    #   1.5, A > 0: clipped          1.2
    #   0.5, A > 0: unclipped, lower 0.5
    #   1.5, A < 0: unclipped, lower -1.5
    #   0.5, A < 0: clipped          -0.8
    #   0.9, A = -2 (inside)         -1.8
    logp = _logp(ratios)
    loss, stats = ppo_policy_loss(logp, torch.zeros(6), adv, clip_low=0.2)
    assert loss.item() == pytest.approx(-(1.1 + 1.2 + 0.5 - 1.5 - 0.8 - 1.8) / 6)
    assert stats["clip_fraction"].item() == pytest.approx(4 / 6)
    k3 = [(r - 1) - math.log(r) for r in ratios]
    assert stats["approx_kl"].item() == pytest.approx(sum(k3) / 6)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())
    loss.backward()
    # d(-r A / 6)/d logp = -r A / 6 where unclipped; 0 where the clip is active.
    expected_grad = [-1.1 / 6, 0.0, -0.5 / 6, 1.5 / 6, 0.0, 1.8 / 6]
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad))


def test_ppo_policy_loss_clip_high():
    ratios, adv = [1.25, 0.75], torch.tensor([1.0, -1.0])
    # symmetric 0.2: 1.25 -> 1.2, 0.75 -> 0.8 (A < 0: min(-0.75, -0.8) = -0.8)
    loss, stats = ppo_policy_loss(_logp(ratios), torch.zeros(2), adv, clip_low=0.2)
    assert loss.item() == pytest.approx(-(1.2 - 0.8) / 2)
    assert stats["clip_fraction"].item() == pytest.approx(1.0)
    # clip_high 0.28: 1.25 is inside [0.8, 1.28]; the low side is unchanged
    loss, stats = ppo_policy_loss(_logp(ratios), torch.zeros(2), adv, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-(1.25 - 0.8) / 2)
    assert stats["clip_fraction"].item() == pytest.approx(0.5)


def test_value_loss():
    values = torch.tensor([1.0, 3.0, 2.2, 1.0])
    old_values = torch.tensor([2.0, 2.0, 2.0, 2.0])
    returns = torch.tensor([0.0, 4.0, 0.0, 3.0])
    # unclipped squared errors: 1, 1, 4.84, 4
    loss = value_loss(values, old_values, returns, clip=None)
    assert loss.item() == pytest.approx((1 + 1 + 4.84 + 4) / 4)
    # clip 0.5: clipped values 1.5, 2.5, 2.2, 1.5 -> squared errors 2.25, 2.25, 4.84, 2.25;
    # the max per element: 2.25, 2.25, 4.84, 4
    loss = value_loss(values, old_values, returns, clip=0.5)
    assert loss.item() == pytest.approx((2.25 + 2.25 + 4.84 + 4) / 4)
