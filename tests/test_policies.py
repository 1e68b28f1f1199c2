"""Policies: shapes, log-probs and entropies against torch.distributions and closed forms,
build_policy's choices, and gradient flow."""

import copy
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from torch.distributions import Categorical, Normal

from m2flow.models import CategoricalMLPPolicy, GaussianMLPPolicy, NatureCNN, build_policy

B, OBS, ACT = 5, 7, 3


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def gaussian_params(policy: GaussianMLPPolicy, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = policy.pi(obs).view(obs.shape[0], *policy.action_shape)
    return mean, policy.log_std.exp().expand_as(mean)


@pytest.mark.parametrize("chunk", [1, 4])
def test_gaussian_shapes_logp_entropy(chunk):
    policy = GaussianMLPPolicy(OBS, ACT, log_std_init=-0.5, chunk=chunk)
    obs = torch.randn(B, OBS)
    with torch.no_grad():
        actions, logp = policy.act(obs)
    assert actions.shape == ((B, ACT) if chunk == 1 else (B, chunk, ACT))
    assert logp.shape == (B,)

    new_logp, entropy, values = policy.evaluate(obs, actions)
    assert new_logp.shape == entropy.shape == values.shape == policy.value(obs).shape == (B,)
    torch.testing.assert_close(new_logp, logp)
    reference = Normal(*gaussian_params(policy, obs))
    torch.testing.assert_close(new_logp, reference.log_prob(actions).reshape(B, -1).sum(1))
    # H of a diagonal Gaussian: sum over dims of 0.5 * log(2 pi e sigma^2), sigma = e^-0.5
    closed_form = chunk * ACT * (0.5 * math.log(2 * math.pi * math.e) - 0.5)
    torch.testing.assert_close(entropy, torch.full((B,), closed_form))


@pytest.mark.parametrize("chunk", [1, 4])
def test_categorical_shapes_logp_entropy(chunk):
    policy = CategoricalMLPPolicy(OBS, 6, chunk=chunk)
    obs = torch.randn(B, OBS)
    with torch.no_grad():
        actions, logp = policy.act(obs)
    assert actions.dtype == torch.int64
    assert actions.shape == ((B,) if chunk == 1 else (B, chunk))

    new_logp, entropy, values = policy.evaluate(obs, actions)
    assert new_logp.shape == entropy.shape == values.shape == (B,)
    torch.testing.assert_close(new_logp, logp)
    reference = Categorical(logits=policy.pi(obs).view(B, *policy.action_shape, 6))
    torch.testing.assert_close(new_logp, reference.log_prob(actions).reshape(B, -1).sum(1))
    torch.testing.assert_close(entropy, reference.entropy().reshape(B, -1).sum(1))


def test_deterministic_act_is_mean_and_argmax():
    obs = torch.randn(B, OBS)
    gaussian = GaussianMLPPolicy(OBS, ACT)
    actions, logp = gaussian.act(obs, deterministic=True)
    mean, std = gaussian_params(gaussian, obs)
    torch.testing.assert_close(actions, mean)
    torch.testing.assert_close(logp, Normal(mean, std).log_prob(mean).sum(1))

    categorical = CategoricalMLPPolicy(OBS, 6, chunk=2)
    actions, _ = categorical.act(obs, deterministic=True)
    assert torch.equal(actions, categorical.pi(obs).view(B, 2, 6).argmax(-1))


def test_samples_follow_the_distribution():
    n = 20_000
    obs = torch.randn(1, OBS).expand(n, OBS)
    gaussian = GaussianMLPPolicy(OBS, ACT, log_std_init=math.log(0.5))
    with torch.no_grad():
        actions, _ = gaussian.act(obs)
        mean, _ = gaussian_params(gaussian, obs[:1])
    torch.testing.assert_close(actions.mean(0), mean[0], atol=0.02, rtol=0)
    torch.testing.assert_close(actions.std(0), torch.full((ACT,), 0.5), atol=0.02, rtol=0)

    categorical = CategoricalMLPPolicy(OBS, 4)
    with torch.no_grad():
        categorical.pi[-1].weight.mul_(100)  # away from uniform, so that a wrong sampler shows
        actions, _ = categorical.act(obs)
        probs = categorical.pi(obs[:1]).softmax(-1)[0]
    torch.testing.assert_close(torch.bincount(actions, minlength=4) / n, probs, atol=0.015, rtol=0)


def test_orthogonal_init_gains():
    policy = GaussianMLPPolicy(OBS, ACT)
    # A [out, in] orthogonal matrix with out <= in has orthonormal rows, times the gain.
    pi_head, vf_head = policy.pi[-1].weight / 0.01, policy.vf[-1].weight
    torch.testing.assert_close(pi_head @ pi_head.T, torch.eye(ACT))
    torch.testing.assert_close(vf_head @ vf_head.T, torch.eye(1))
    assert all(torch.all(m.bias == 0) for m in policy.modules() if isinstance(m, torch.nn.Linear))


def test_gradients_reach_log_std_and_both_heads():
    policy = GaussianMLPPolicy(OBS, ACT, chunk=2)
    obs = torch.randn(B, OBS)
    with torch.no_grad():
        actions, _ = policy.act(obs)
    logp, entropy, values = policy.evaluate(obs, actions)
    (-(logp * torch.randn(B)).mean() - 0.01 * entropy.mean() + values.square().mean()).backward()
    heads = (policy.pi[0], policy.pi[-1], policy.vf[0], policy.vf[-1])
    for param in (policy.log_std, *(layer.weight for layer in heads)):
        assert param.grad is not None and param.grad.abs().sum() > 0


CFG = {"hidden": [32, 32], "activation": "relu", "log_std_init": -1.0, "chunk": 1}


def test_build_policy_box_and_discrete():
    obs_space = gym.spaces.Box(-np.inf, np.inf, (OBS,), np.float64)
    gaussian = build_policy(obs_space, gym.spaces.Box(-1, 1, (ACT,), np.float32), CFG)
    assert isinstance(gaussian, GaussianMLPPolicy) and gaussian.encoder is None
    assert torch.equal(gaussian.log_std.data, torch.full((ACT,), -1.0))
    assert [m.out_features for m in gaussian.pi if isinstance(m, torch.nn.Linear)] == [32, 32, ACT]
    assert isinstance(gaussian.pi[1], torch.nn.ReLU)
    obs = torch.as_tensor(np.stack([obs_space.sample() for _ in range(2)]))  # float64 from the env
    assert gaussian.act(obs)[0].shape == (2, ACT)

    categorical = build_policy(obs_space, gym.spaces.Discrete(5), {**CFG, "chunk": 3})
    assert isinstance(categorical, CategoricalMLPPolicy)
    assert categorical.act(obs)[0].shape == (2, 3)


@pytest.mark.parametrize("shape", [(3, 40, 48), (40, 48, 3)])
def test_build_policy_pixels(shape):
    obs_space = gym.spaces.Box(0, 255, shape, np.uint8)
    policy = build_policy(obs_space, gym.spaces.Discrete(4), CFG)
    assert isinstance(policy.encoder, NatureCNN)
    assert policy.pi[0].in_features == policy.encoder.out_dim == 512
    obs = torch.as_tensor(np.stack([obs_space.sample() for _ in range(2)]))
    actions, logp = policy.act(obs)
    logp2, _, values = policy.evaluate(obs, actions)
    torch.testing.assert_close(logp2, logp)
    assert values.shape == (2,)
    values.sum().backward()  # the shared encoder learns from the value loss too
    assert policy.encoder.convs[0].weight.grad.abs().sum() > 0


def test_build_policy_rejects_unsupported_spaces():
    with pytest.raises(NotImplementedError):
        build_policy(gym.spaces.Discrete(3), gym.spaces.Discrete(2), CFG)
    with pytest.raises(NotImplementedError):
        build_policy(gym.spaces.Box(0, 1, (4,)), gym.spaces.MultiBinary(3), CFG)


def test_flat_parameters_are_views_that_train_like_the_module():
    from m2flow.models import flatten_parameters

    torch.manual_seed(0)
    a = build_policy(gym.spaces.Box(-1, 1, (OBS,)), gym.spaces.Box(-1, 1, (ACT,)), CFG)
    b = copy.deepcopy(a)
    flat = flatten_parameters(b)
    assert flat.numel() == sum(p.numel() for p in a.parameters())
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam([flat], lr=1e-2)
    obs, actions = torch.randn(32, OBS), torch.randn(32, ACT)
    for _ in range(3):
        for policy, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=False) if policy is a else flat.grad.zero_()
            logp, _, values = policy.evaluate(obs, actions)
            (values.square().mean() - logp.mean()).backward()
            opt.step()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, msg=name)
        assert pb.grad.untyped_storage().data_ptr() == flat.grad.untyped_storage().data_ptr()  # a view of the flat one
    b.load_state_dict(a.state_dict())  # loads in place: the views stay views
    assert next(b.parameters()).data_ptr() == flat.data_ptr()
