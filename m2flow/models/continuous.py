"""Networks for off-policy continuous control: an ensemble of Q critics evaluated as one
batched computation (weights [E, in, out], one ``baddbmm`` a layer, not a loop over critics),
with LayerNorm per critic as an option (RLPD), and a tanh-squashed Gaussian actor scaled to
the action bounds (SAC)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2flow.algorithms.sac import squashed_gaussian

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


class EnsembleLinear(nn.Module):
    """``members`` linear layers applied at once: x [E, B, in] -> [E, B, out]. Each member is
    initialised as ``nn.Linear`` would be."""

    def __init__(self, members: int, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(members, in_dim, out_dim))
        self.bias = nn.Parameter(torch.empty(members, 1, out_dim))
        for e in range(members):
            layer = nn.Linear(in_dim, out_dim)
            with torch.no_grad():
                self.weight[e].copy_(layer.weight.T)
                self.bias[e, 0].copy_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class EnsembleLayerNorm(nn.Module):
    """LayerNorm over the features with each member's own gain and bias: [E, B, H]."""

    def __init__(self, members: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(members, 1, dim))
        self.bias = nn.Parameter(torch.zeros(members, 1, dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, x.shape[-1:]) * self.weight + self.bias


class QEnsemble(nn.Module):
    """``members`` critics Q(s, a), each an MLP over ``[obs, action]`` (ReLU; LayerNorm after
    each hidden layer with ``layer_norm``): ``forward(obs, actions) -> [E, B]``."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: Sequence[int] = (256, 256), members: int = 2,
                 layer_norm: bool = False):
        super().__init__()
        self.members = members
        layers: list[nn.Module] = []
        width = obs_dim + action_dim
        for h in hidden:
            layers.append(EnsembleLinear(members, width, h))
            if layer_norm:
                layers.append(EnsembleLayerNorm(members, h))
            layers.append(nn.ReLU())
            width = h
        layers.append(EnsembleLinear(members, width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: Tensor, actions: Tensor) -> Tensor:
        x = torch.cat([obs, actions], -1)
        return self.net(x.unsqueeze(0).expand(self.members, *x.shape)).squeeze(-1)


class SquashedGaussianActor(nn.Module):
    """The SAC policy: an MLP (ReLU) to a mean and a log standard deviation (bounded to
    [LOG_STD_MIN, LOG_STD_MAX] through a tanh), the action ``tanh(u)`` scaled to
    [``low``, ``high``]. ``forward(obs, deterministic=False) -> (actions, logp)``."""

    def __init__(self, obs_dim: int, low: Sequence[float], high: Sequence[float], hidden: Sequence[int] = (256, 256)):
        super().__init__()
        low_t, high_t = torch.as_tensor(low, dtype=torch.float32), torch.as_tensor(high, dtype=torch.float32)
        if not (torch.isfinite(low_t).all() and torch.isfinite(high_t).all() and (high_t > low_t).all()):
            raise ValueError(f"a squashed Gaussian policy needs finite action bounds low < high, got {low} and {high}")
        action_dim = low_t.numel()
        layers: list[nn.Module] = []
        width = obs_dim
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.trunk = nn.Sequential(*layers)
        self.mean = nn.Linear(width, action_dim)
        self.log_std = nn.Linear(width, action_dim)
        self.register_buffer("scale", (high_t - low_t) / 2.0)
        self.register_buffer("bias", (high_t + low_t) / 2.0)

    def forward(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        h = self.trunk(obs)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(self.log_std(h)) + 1.0)
        return squashed_gaussian(self.mean(h), log_std, self.scale, self.bias, deterministic)
