"""SAC's pieces (``m2flow/algorithms/sac.py``, ``m2flow/models/continuous.py``): the squashed
Gaussian's density, the critic ensemble as one batched computation, the TD target, Polyak
averaging, entropy tuning; and the learner made of them (``m2flow/engines/sac.py``), which
learns (and does not with lr=0) and resumes exactly."""

import copy

import numpy as np
import pytest
import torch
from torch.distributions import AffineTransform, Normal, TanhTransform, TransformedDistribution

from m2flow.algorithms.sac import actor_loss, alpha_loss, critic_loss, polyak, squashed_gaussian, subset_min, td_target
from m2flow.engines.sac import CrossQLearner, SACLearner
from m2flow.models.continuous import BatchRenorm, EnsembleLayerNorm, EnsembleLinear, QEnsemble
from m2flow.replay import ReplayBuffer


def test_the_squashed_gaussians_density_is_torch_distributions():
    torch.manual_seed(0)
    mean, log_std = torch.randn(64, 3), torch.randn(64, 3).clamp(-2, 0.5)
    scale, bias = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0.0, 1.0, -0.25])
    action, logp = squashed_gaussian(mean, log_std, scale, bias)
    reference = TransformedDistribution(Normal(mean, log_std.exp()), [TanhTransform(), AffineTransform(bias, scale)])
    inside = ((action - bias).abs() / scale < 0.999).all(1)  # torch's tanh inverse loses digits at the bounds
    assert inside.sum() > 40
    assert torch.allclose(logp[inside], reference.log_prob(action).sum(-1)[inside], atol=2e-3)
    assert ((action - bias).abs() <= scale).all()
    greedy, _ = squashed_gaussian(mean, log_std, scale, bias, deterministic=True)
    assert torch.allclose(greedy, torch.tanh(mean) * scale + bias)
    # far in the tail the density stays finite (tanh(u) rounds to 1 there)
    _, far = squashed_gaussian(torch.full((1, 1), 30.0), torch.zeros(1, 1), torch.ones(1), torch.zeros(1))
    assert torch.isfinite(far).all()


def test_the_ensemble_is_each_critic_computed_alone():
    torch.manual_seed(0)
    q = QEnsemble(5, 2, hidden=(16, 16), members=3, layer_norm=True)
    with torch.no_grad():  # give each member's LayerNorm its own gain
        q.net[1].weight.normal_()
    obs, act = torch.randn(7, 5), torch.randn(7, 2)
    together = q(obs, act)
    assert together.shape == (3, 7)
    x = torch.cat([obs, act], -1)
    for e in range(3):
        h = x
        for layer in q.net:
            if isinstance(layer, EnsembleLinear):
                h = h @ layer.weight[e] + layer.bias[e]
            elif isinstance(layer, EnsembleLayerNorm):
                h = torch.nn.functional.layer_norm(h, h.shape[-1:]) * layer.weight[e] + layer.bias[e]
            else:
                h = layer(h)
        assert torch.allclose(together[e], h.squeeze(-1), atol=1e-5)


def test_td_target_subset_min_polyak_and_alpha():
    q = torch.tensor([[1.0, 5.0], [2.0, 3.0], [0.5, 4.0]])
    assert subset_min(q).tolist() == [0.5, 3.0]
    g = torch.Generator().manual_seed(0)
    picked = subset_min(q, 2, g)
    assert any(torch.equal(picked, q[list(pair)].min(0).values) for pair in ((0, 1), (0, 2), (1, 2)))
    target = td_target(torch.tensor([1.0, 2.0]), torch.tensor([0.9, 0.0]), torch.tensor([3.0, 7.0]),
                       torch.tensor([-1.0, -1.0]), 0.5)
    assert target.tolist() == pytest.approx([1 + 0.9 * (3 + 0.5), 2.0])
    assert critic_loss(q[:2], torch.tensor([1.0, 3.0])).item() == pytest.approx(0.5 * ((0 + 4) / 2 + (1 + 0) / 2))
    assert actor_loss(q, torch.zeros(2), 0.1).item() == pytest.approx(-(0.5 + 3.0) / 2)
    assert actor_loss(q, torch.zeros(2), 0.1, reduce="mean").item() == pytest.approx(-(3.5 / 3 + 4.0) / 2)
    a, b = [torch.ones(3), torch.zeros(2)], [torch.zeros(3), torch.ones(2)]
    polyak(a, b, 0.25)
    assert a[0].tolist() == [0.75] * 3 and a[1].tolist() == [0.25] * 2
    # entropy below the target (logp high): the gradient step raises alpha; above it lowers alpha
    for logp, rises in ((torch.full((4,), 3.0), True), (torch.full((4,), -5.0), False)):
        log_alpha = torch.zeros((), requires_grad=True)
        alpha_loss(log_alpha, logp, target_entropy=-2.0).backward()
        assert (log_alpha.grad < 0) == rises


def bandit(rng):
    """One-step episodes (every transition terminates: the target is the reward), the reward
    ``-|a - obs/2|^2``, random actions."""
    buffer = ReplayBuffer(capacity=4096, lanes=1, obs_shape=(2,), action_shape=(2,))
    for _ in range(2000):
        obs = rng.uniform(-1, 1, size=(1, 2)).astype(np.float32)
        act = rng.uniform(-1, 1, size=(1, 2)).astype(np.float32)
        reward = -((act - obs / 2) ** 2).sum(1)
        buffer.add(obs, act, reward, np.array([True]), np.array([False]), obs)
    return buffer


def bandit_error(learner, obs):
    return float(np.abs(learner.act(obs, deterministic=True) - obs / 2).mean())


@pytest.mark.parametrize("lr", [3e-3, 0.0])
def test_the_learner_learns_a_continuous_bandit_and_resumes_exactly(lr):
    """On the bandit the greedy action moves to ``obs/2`` within 300 updates at lr 3e-3 and
    stays where it began at lr 0. A learner loaded from another's state takes the same next
    step."""
    rng = np.random.default_rng(0)
    buffer = bandit(rng)
    learner = SACLearner(2, [-1, -1], [1, 1], hidden=(64, 64), lr=lr)
    test_obs = rng.uniform(-1, 1, size=(256, 2)).astype(np.float32)
    before = bandit_error(learner, test_obs)
    for _ in range(300):
        stats = learner.update_from(buffer.sample(128, rng))
    assert set(stats) == {"critic_loss", "actor_loss", "alpha", "entropy", "q"}
    if not lr:
        assert bandit_error(learner, test_obs) == before
        return
    assert bandit_error(learner, test_obs) < 0.12 < before, (before, bandit_error(learner, test_obs))
    again = SACLearner(2, [-1, -1], [1, 1], hidden=(64, 64), lr=lr, seed=1)
    again.load_state(copy.deepcopy(learner.state()))
    batch = buffer.sample(128, rng)
    torch.manual_seed(5)
    learner.update_from(batch)
    torch.manual_seed(5)
    again.update_from(batch)
    for a, b in zip([*learner.actor.parameters(), *learner.critic.parameters(), *learner.target.parameters()],
                    [*again.actor.parameters(), *again.critic.parameters(), *again.target.parameters()]):
        assert torch.equal(a, b)


def test_batch_renorm_normalises_by_the_batch_then_towards_the_running_statistics():
    torch.manual_seed(0)
    x = torch.randn(64, 5) * 3 + 1
    plain = BatchRenorm(5, warmup_steps=2).train()
    by_batch = (x - x.mean(0)) / (x.var(0) + 1e-3).sqrt()
    assert torch.allclose(plain(x), by_batch, atol=1e-5)  # warm-up: the batch's statistics
    assert torch.allclose(plain.running_mean, 0.01 * x.mean(0)) and plain.steps == 1
    # after the warm-up: the running statistics, the correction clipped (r <= 3, |d| <= 5)
    plain.steps.fill_(3)
    plain.running_mean.copy_(x.mean(0))
    plain.running_var.copy_(x.var(0))
    assert torch.allclose(plain(x), by_batch, atol=1e-5)  # running = batch: r = 1, d = 0
    plain.steps.fill_(3)
    plain.running_mean.fill_(100.0)
    plain.running_var.fill_(1e-4)
    corrected = plain(x)
    assert not torch.allclose(corrected, by_batch, atol=1e-2) and torch.isfinite(corrected).all()
    plain.eval()  # evaluation: the running statistics, not updated
    mean, var, steps = plain.running_mean.clone(), plain.running_var.clone(), int(plain.steps)
    assert torch.allclose(plain(x), (x - mean) / (var + 1e-3).sqrt())
    assert torch.equal(plain.running_mean, mean) and int(plain.steps) == steps
    # an ensemble's members each have their own statistics, as a layer each would
    xs = torch.randn(3, 64, 5) * torch.tensor([1.0, 5.0, 0.1])[:, None, None]
    ensemble = BatchRenorm(5, members=3).train()
    got = ensemble(xs)
    for e in range(3):
        assert torch.allclose(got[e], BatchRenorm(5).train()(xs[e]), atol=1e-5)


@pytest.mark.parametrize("lr", [3e-3, 0.0])
def test_crossq_learns_the_bandit_without_target_critics(lr):
    """CrossQ's learner (small networks; its batch renormalisation past the warm-up from step
    100): the greedy action reaches the bandit's optimum at lr 3e-3, not at lr 0 (where only
    the running statistics move)."""
    rng = np.random.default_rng(0)
    buffer = bandit(rng)
    learner = CrossQLearner(2, [-1, -1], [1, 1], hidden=(64, 64), actor_hidden=(64, 64), lr=lr,
                            batch_renorm={"warmup_steps": 100})
    assert learner.target is None and "target" not in dict(learner.critic.named_modules())
    test_obs = rng.uniform(-1, 1, size=(256, 2)).astype(np.float32)
    before = bandit_error(learner, test_obs)
    for _ in range(450):
        learner.update_from(buffer.sample(128, rng))
    after = bandit_error(learner, test_obs)
    assert (after < 0.12 < before) if lr else after > 0.12, (before, after)
