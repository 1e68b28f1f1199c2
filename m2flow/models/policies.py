"""Actor-critic policies for embodied RL: Gaussian (continuous) and categorical (discrete)
actions, an MLP or NatureCNN trunk, and optional action chunks.

Every policy has the same interface:

- ``act(obs, deterministic=False) -> (actions, logp)``: called every env step, so it is
  written with plain tensor ops rather than ``torch.distributions`` objects, whose
  construction and argument checks cost more than the tiny MLP itself. Callers wrap it in
  ``torch.no_grad()`` / ``torch.inference_mode()``.
- ``evaluate(obs, actions) -> (logp, entropy, values)``: for the loss, each [B].
- ``value(obs) -> values``: [B].

With ``chunk=k`` the policy emits k actions per inference, as VLA models do: the chunk is
one action of the MDP, so logp and entropy sum over the chunk as well as the action dims.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn

from m2flow.config.schema import PolicyConfig
from m2flow.models.continuous import CROSSQ_RENORM, SquashedGaussianActor

ACTIVATIONS: dict[str, type[nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU}
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _orthogonal(layer: nn.Module, gain: float) -> nn.Module:
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _sum_per_sample(x: Tensor) -> Tensor:
    """Sum over everything but the batch dim: the action dims and the chunk."""
    return x.reshape(x.shape[0], -1).sum(1)


def mlp(
    in_dim: int, hidden: Sequence[int], out_dim: int, activation: str, head_gain: float, ortho_init: bool = True
) -> nn.Sequential:
    """Linear layers with orthogonal init as in SB3/CleanRL: gain sqrt(2) for hidden layers,
    ``head_gain`` for the output (0.01 for the policy so that initial actions are near
    uniform / near the mean, 1.0 for the value). ``ortho_init=False`` keeps PyTorch's default
    init, as SB3's ``ortho_init=False`` does."""
    init = _orthogonal if ortho_init else (lambda layer, gain: layer)
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [init(nn.Linear(in_dim, width), math.sqrt(2)), ACTIVATIONS[activation]()]
        in_dim = width
    layers.append(init(nn.Linear(in_dim, out_dim), head_gain))
    return nn.Sequential(*layers)


class NatureCNN(nn.Module):
    """The DQN Nature encoder (Mnih et al. 2015) as in SB3: uint8 pixels [B, C, H, W] (or
    [B, H, W, C] with ``channels_last``) scaled to [0, 1], three convolutions, a linear
    layer to ``out_dim`` features."""

    def __init__(self, obs_shape: Sequence[int], out_dim: int = 512, channels_last: bool = False):
        super().__init__()
        self.channels_last = channels_last
        channels = obs_shape[-1] if channels_last else obs_shape[0]
        self.convs = nn.Sequential(
            _orthogonal(nn.Conv2d(channels, 32, 8, stride=4), math.sqrt(2)), nn.ReLU(),
            _orthogonal(nn.Conv2d(32, 64, 4, stride=2), math.sqrt(2)), nn.ReLU(),
            _orthogonal(nn.Conv2d(64, 64, 3, stride=1), math.sqrt(2)), nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():  # the flattened size depends on H and W: measure it
            n_flat = self.convs(torch.zeros(1, *self._to_chw(obs_shape))).shape[1]
        self.linear = nn.Sequential(_orthogonal(nn.Linear(n_flat, out_dim), math.sqrt(2)), nn.ReLU())
        self.out_dim = out_dim

    def _to_chw(self, shape: Sequence[int]) -> tuple[int, ...]:
        return (shape[2], shape[0], shape[1]) if self.channels_last else tuple(shape)

    def forward(self, obs: Tensor) -> Tensor:
        if self.channels_last:
            obs = obs.permute(0, 3, 1, 2)
        return self.linear(self.convs(obs.float() / 255.0))


class _ActorCritic(nn.Module):
    """Separate policy and value MLPs (SB3's ``net_arch=dict(pi=..., vf=...)``) on top of an
    optional encoder that both share, as SB3 shares its CNN. ``pi_out`` is the size of the
    policy head's output."""

    def __init__(
        self,
        obs_dim: int,
        pi_out: int,
        hidden: Sequence[int],
        activation: str,
        encoder: nn.Module | None,
        ortho_init: bool = True,
    ):
        super().__init__()
        self.encoder = encoder
        in_dim = encoder.out_dim if encoder is not None else obs_dim
        self.pi = mlp(in_dim, hidden, pi_out, activation, head_gain=0.01, ortho_init=ortho_init)
        self.vf = mlp(in_dim, hidden, 1, activation, head_gain=1.0, ortho_init=ortho_init)

    def features(self, obs: Tensor) -> Tensor:
        return self.encoder(obs) if self.encoder is not None else obs.float()

    def value(self, obs: Tensor) -> Tensor:
        return self.vf(self.features(obs)).squeeze(-1)


class GaussianMLPPolicy(_ActorCritic):
    """Diagonal Gaussian with a state-independent ``log_std`` (shared by the steps of a
    chunk). Actions are unclipped samples; the env side clips them to the bounds, as SB3
    does, so logp stays that of the sampled action. Actions are [B, act_dim], or
    [B, chunk, act_dim] with ``chunk > 1``.

    ``obs_dim`` is the size of the flat observation; with an ``encoder`` the MLPs read its
    ``out_dim`` features instead.
    """

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        hidden: Sequence[int] = (64, 64),
        activation: str = "tanh",
        log_std_init: float = 0.0,
        chunk: int = 1,
        encoder: nn.Module | None = None,
        ortho_init: bool = True,
    ):
        super().__init__(obs_dim, chunk * act_dim, hidden, activation, encoder, ortho_init)
        self.chunk = chunk
        self.action_shape = (act_dim,) if chunk == 1 else (chunk, act_dim)
        self.log_std = nn.Parameter(torch.full((act_dim,), float(log_std_init)))

    def _mean(self, features: Tensor) -> Tensor:
        return self.pi(features).view(-1, *self.action_shape)

    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        mean = self._mean(self.features(obs))
        if deterministic:
            noise = torch.zeros_like(mean)
            actions = mean
        else:
            noise = torch.randn_like(mean)
            actions = mean + self.log_std.exp() * noise
        # log N(mean + std * noise; mean, std) needs only the noise.
        return actions, _sum_per_sample(-0.5 * noise.square() - self.log_std - _LOG_SQRT_2PI)

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        features = self.features(obs)
        mean = self._mean(features)
        z = (actions - mean) * torch.exp(-self.log_std)
        logp = _sum_per_sample(-0.5 * z.square() - self.log_std - _LOG_SQRT_2PI)
        entropy = self.chunk * (0.5 + _LOG_SQRT_2PI + self.log_std).sum()
        return logp, entropy.expand(mean.shape[0]), self.vf(features).squeeze(-1)


class CategoricalMLPPolicy(_ActorCritic):
    """Categorical over ``n_actions``; actions are int64 [B], or [B, chunk] with
    ``chunk > 1``, each step of a chunk its own categorical."""

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        hidden: Sequence[int] = (64, 64),
        activation: str = "tanh",
        chunk: int = 1,
        encoder: nn.Module | None = None,
        ortho_init: bool = True,
    ):
        super().__init__(obs_dim, chunk * n_actions, hidden, activation, encoder, ortho_init)
        self.action_shape = () if chunk == 1 else (chunk,)
        self.n_actions = n_actions

    def _log_probs(self, features: Tensor) -> Tensor:
        """Normalised log-probabilities, [B, *action_shape, n_actions]."""
        logits = self.pi(features).view(-1, *self.action_shape, self.n_actions)
        return torch.log_softmax(logits, dim=-1)

    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        log_probs = self._log_probs(self.features(obs))
        if deterministic:
            actions = log_probs.argmax(-1)
        else:
            # Gumbel-max: argmax(log p - log E), E ~ Exp(1), samples from p in a third of
            # torch.multinomial's time on small batches.
            gumbel = -torch.empty_like(log_probs).exponential_().log()
            actions = (log_probs + gumbel).argmax(-1)
        logp = log_probs.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        return actions, _sum_per_sample(logp)

    def evaluate(self, obs: Tensor, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        features = self.features(obs)
        log_probs = self._log_probs(features)
        logp = log_probs.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return _sum_per_sample(logp), _sum_per_sample(entropy), self.vf(features).squeeze(-1)


def build_policy(obs_space: gym.Space, action_space: gym.Space, cfg: Mapping) -> nn.Module:
    """A policy for gymnasium spaces.

    Observations: a flat Box feeds the MLPs; a rank-3 uint8 Box is an image and gets a
    NatureCNN trunk (channels first or last, told apart by the smallest dim as SB3 does).
    Actions: a flat Box gives a Gaussian policy, a Discrete a categorical one; with
    ``kind: squashed_gaussian``, SAC's actor (``models.continuous.SquashedGaussianActor``).
    ``cfg``: the ``policy`` config section (``config.schema.PolicyConfig``); a key it lacks
    takes that section's default (SB3's choices).
    """
    cfg = {**dataclasses.asdict(PolicyConfig()), **cfg}
    if not isinstance(obs_space, gym.spaces.Box):
        raise NotImplementedError(f"observation space {obs_space}")
    encoder = None
    if len(obs_space.shape) == 3 and obs_space.dtype == np.uint8:
        encoder = NatureCNN(obs_space.shape, channels_last=int(np.argmin(obs_space.shape)) == 2)
    elif len(obs_space.shape) != 1:
        raise NotImplementedError(f"observation space {obs_space}: flat Box or uint8 image")
    obs_dim = encoder.out_dim if encoder is not None else obs_space.shape[0]

    common = dict(
        hidden=tuple(cfg["hidden"]),
        activation=cfg["activation"],
        chunk=int(cfg["chunk"]),
        encoder=encoder,
        ortho_init=bool(cfg["ortho_init"]),
    )
    if cfg["kind"] == "squashed_gaussian":
        if not (isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1) or encoder is not None:
            raise NotImplementedError(f"a squashed Gaussian policy takes flat observations and a flat Box of "
                                      f"actions, not {obs_space} and {action_space}")
        return SquashedGaussianActor(obs_dim, action_space.low, action_space.high, tuple(cfg["hidden"]),
                                     CROSSQ_RENORM if cfg["batch_renorm"] else None)
    if isinstance(action_space, gym.spaces.Box) and len(action_space.shape) == 1:
        return GaussianMLPPolicy(
            obs_dim, action_space.shape[0], log_std_init=float(cfg["log_std_init"]), **common
        )
    if isinstance(action_space, gym.spaces.Discrete):
        return CategoricalMLPPolicy(obs_dim, int(action_space.n), **common)
    raise NotImplementedError(f"action space {action_space}")
