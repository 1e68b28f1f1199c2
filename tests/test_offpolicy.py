"""The off-policy corrections (``algorithm.off_policy``) against values computed by hand."""

import math

import pytest
import torch

from m2flow.algorithms import policy_loss, ppo_policy_loss
from m2flow.algorithms.offpolicy import surrogate

log = math.log


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def grad_of(loss_fn, logp):
    logp = logp.clone().requires_grad_(True)
    loss, stats = loss_fn(logp)
    loss.backward()
    return float(loss.detach()), logp.grad.flatten().tolist(), stats


def test_tis_truncates_the_importance_weight():
    # token 1: rho = 0.5 / 0.25 = 2, cap 1.5 -> weight 1.5, A = 2: loss -3, d/dlogp -3
    # token 2: rho = 0.25 / 0.5 = 0.5 -> weight 0.5, A = -1: loss 0.5, d/dlogp 0.5
    logp, behaviour, adv = t(log(0.5), log(0.25)), t(log(0.25), log(0.5)), t(2.0, -1.0)
    s = surrogate(logp.clone().requires_grad_(True), behaviour, adv, 0.2, 0.2, correction="tis", cap=1.5)
    assert s["loss"].tolist() == pytest.approx([-3.0, 0.5])
    assert s["weight"].tolist() == pytest.approx([1.5, 0.5])
    assert s["capped"].tolist() == [True, False]
    loss, grad, stats = grad_of(lambda lp: ppo_policy_loss(lp, behaviour, adv, 0.2, correction="tis", is_cap=1.5), logp)
    assert loss == pytest.approx(-1.25)  # the mean of -3 and 0.5
    assert grad == pytest.approx([-1.5, 0.25])
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)  # share above the cap


def test_tis_uses_the_behaviour_logprobs_not_old():
    logp, old, behaviour, adv = t(log(0.5)), t(log(0.5)), t(log(0.25)), t(1.0)
    s = surrogate(logp, old, adv, 0.2, 0.2, correction="tis", behaviour_logp=behaviour, cap=10.0)
    assert s["loss"].tolist() == pytest.approx([-2.0])  # rho = 2 against the behaviour


def test_decoupled_weights_the_surrogate_around_the_proximal_policy():
    # token 1: w = 0.4 / 0.2 = 2 (kept, cap 2.5); r = 0.5 / 0.4 = 1.25, clipped to 1.2 with A = 1:
    #          loss -2 * 1.2 = -2.4, no gradient (the clipped branch)
    # token 2: w = 0.3 / 0.1 = 3 > 2.5: dropped, loss 0, no gradient
    # token 3: w = 1; r = 0.45 / 0.5 = 0.9 inside [0.8, 1.2], A = -2: loss 1.8, d/dlogp = -w A r = 1.8
    logp = t(log(0.5), log(0.5), log(0.45))
    prox, behaviour, adv = t(log(0.4), log(0.3), log(0.5)), t(log(0.2), log(0.1), log(0.5)), t(1.0, 1.0, -2.0)
    s = surrogate(logp, prox, adv, 0.2, 0.2, correction="decoupled", behaviour_logp=behaviour, cap=2.5)
    assert s["loss"].tolist() == pytest.approx([-2.4, 0.0, 1.8])
    assert s["weight"].tolist() == pytest.approx([2.0, 0.0, 1.0])
    assert s["capped"].tolist() == [False, True, False]
    mask = torch.ones(1, 3, dtype=torch.bool)

    def lm(lp):
        return policy_loss(lp, prox.view(1, 3), adv.view(1, 3), mask, 0.2, correction="decoupled",
                           behaviour_logp=behaviour.view(1, 3), is_cap=2.5)

    loss, grad, stats = grad_of(lm, logp.view(1, 3))
    assert loss == pytest.approx(-0.2)  # token-mean over the 3 tokens: (-2.4 + 0 + 1.8) / 3
    assert grad == pytest.approx([0.0, 0.0, 0.6])
    assert stats["is_weight_mean"] == pytest.approx(1.0)  # (2 + 0 + 1) / 3
    assert stats["is_capped_fraction"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("correction", ["tis", "decoupled"])
def test_on_policy_the_corrections_are_ppo(correction):
    """Behaviour = old = the weights trained (the first gradient of an on-policy step): every
    correction gives PPO's loss and gradient."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(2, 5, generator=g, dtype=torch.float64) - 2
    adv = torch.randn(2, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 5, generator=g) > 0.3

    def run(c):
        return grad_of(lambda lp: policy_loss(lp, logp, adv, mask, 0.2, correction=c, behaviour_logp=logp), logp)

    (base, base_grad, _), (got, got_grad, stats) = run("none"), run(correction)
    assert got == pytest.approx(base)
    assert got_grad == pytest.approx(base_grad)
    assert stats["is_weight_mean"] == pytest.approx(1.0)


def test_masked_tokens_count_nothing_whatever_they_hold():
    logp = t(log(0.5), float("nan")).view(1, 2)
    behaviour = t(log(0.25), float("inf")).view(1, 2)
    mask = torch.tensor([[True, False]])
    loss, stats = policy_loss(logp, behaviour, t(2.0, 5.0).view(1, 2), mask, correction="tis", is_cap=1.5)
    assert float(loss) == pytest.approx(-3.0)
    assert stats["is_capped_fraction"] == 1.0


def test_unknown_correction_and_tis_with_dual_clip_fail():
    x = t(0.0)
    with pytest.raises(ValueError, match="off-policy correction 'vtrace'"):
        surrogate(x, x, x, 0.2, 0.2, correction="vtrace")
    with pytest.raises(ValueError, match="tis correction has none"):
        policy_loss(x.view(1, 1), x.view(1, 1), x.view(1, 1), torch.ones(1, 1), dual_clip=3.0, correction="tis")


def test_config_rules():
    from m2flow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="algorithm.off_policy: decoupled .* needs algorithm.old_logprobs=recompute"):
        load_config("reasoning/grpo_arith_tiny", ["algorithm.off_policy=decoupled"])
    with pytest.raises(ConfigError, match="algorithm.dual_clip: .*off_policy=tis has none"):
        load_config("reasoning/grpo_arith_tiny", ["algorithm.off_policy=tis", "algorithm.dual_clip=3.0"])
    with pytest.raises(ConfigError, match="algorithm.off_policy"):
        load_config("embodied/ppo_cartpole", ["algorithm.off_policy=vtrace"])
    cfg = load_config("reasoning/grpo_arith_tiny", ["algorithm.off_policy=decoupled", "algorithm.old_logprobs=recompute"])
    assert (cfg.algorithm.off_policy, cfg.algorithm.is_cap) == ("decoupled", 2.0)


def test_trained_tokens_are_counted_by_their_lag():
    import torch as th

    from m2flow.engines.batch import SequenceBatch
    from m2flow.workers.lm_actor import _count_lags

    ids = th.zeros(2, 5, dtype=th.long)
    completion = th.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    batch = SequenceBatch(ids, th.ones_like(ids), completion, versions=th.tensor([[9, 9, 3, 4, 5], [9, 5, 5, 9, 9]]))
    counts = {}
    _count_lags(counts, batch, 5)  # tokens of versions 3, 4, 5 | 5, 5: prompt and padding positions never count
    assert counts == {2: 1, 1: 1, 0: 3}
