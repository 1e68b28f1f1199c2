"""Networks for off-policy continuous control: an ensemble of Q critics evaluated as one
batched computation (weights [E, in, out], one ``baddbmm`` a layer, not a loop over critics),
with LayerNorm (RLPD) or batch renormalisation (CrossQ) per critic as options, and a
tanh-squashed Gaussian actor scaled to the action bounds (SAC; batch renormalisation for
CrossQ)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m2flow.algorithms.sac import squashed_gaussian

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0  # the log standard deviation's clamp, as Stable-Baselines3's
CROSSQ_RENORM = {"momentum": 0.01, "eps": 1e-3, "warmup_steps": 100_000}  # sb3-contrib's CrossQ defaults


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


class BatchRenorm(nn.Module):
    """Batch renormalisation (Ioffe 2017) as CrossQ uses it (sb3-contrib's ``BatchRenorm1d``):
    in training, the batch's mean and (unbiased) variance, corrected towards the running ones
    after ``warmup_steps`` (``r`` clipped to [1/3, 3], ``d`` to [-5, 5]), update the running
    statistics; in evaluation, the running statistics normalise. Statistics are over the batch
    dimension, the one before the features: x [B, H], or [E, B, H] with ``members=E`` (each
    member's own statistics, gain and bias)."""

    def __init__(self, dim: int, members: int | None = None, momentum: float = 0.01, eps: float = 1e-3,
                 warmup_steps: int = 100_000, r_max: float = 3.0, d_max: float = 5.0):
        super().__init__()
        shape = (dim,) if members is None else (members, 1, dim)
        self.weight = nn.Parameter(torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape))
        self.register_buffer("running_mean", torch.zeros(shape))
        self.register_buffer("running_var", torch.ones(shape))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.momentum, self.eps, self.warmup_steps, self.r_max, self.d_max = momentum, eps, warmup_steps, r_max, d_max

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            keep = x.dim() > 2  # [E, B, H]: statistics [E, 1, H]
            batch_mean, batch_var = x.mean(-2, keepdim=keep), x.var(-2, keepdim=keep)
            mean, var = batch_mean, batch_var
            if self.steps > self.warmup_steps:
                running_std = (self.running_var + self.eps).sqrt()
                r = ((batch_var + self.eps).sqrt() / running_std).detach().clamp(1 / self.r_max, self.r_max)
                d = ((batch_mean - self.running_mean) / running_std).detach().clamp(-self.d_max, self.d_max)
                mean, var = batch_mean - d * batch_var.sqrt() / r, batch_var / r.pow(2)
            with torch.no_grad():
                self.running_mean.lerp_(batch_mean, self.momentum)
                self.running_var.lerp_(batch_var, self.momentum)
                self.steps += 1
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / (var + self.eps).sqrt() * self.weight + self.bias


class QEnsemble(nn.Module):
    """``members`` critics Q(s, a), each an MLP over ``[obs, action]`` (ReLU; LayerNorm after
    each hidden layer with ``layer_norm``; batch renormalisation before each linear layer with
    ``batch_renorm``, CrossQ's): ``forward(obs, actions) -> [E, B]``."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: Sequence[int] = (256, 256), members: int = 2,
                 layer_norm: bool = False, batch_renorm: dict | None = None):
        super().__init__()
        self.members = members
        layers: list[nn.Module] = []
        widths = [obs_dim + action_dim, *hidden]
        for width, h in zip(widths, hidden):
            if batch_renorm is not None:
                layers.append(BatchRenorm(width, members, **batch_renorm))
            layers.append(EnsembleLinear(members, width, h))
            if layer_norm:
                layers.append(EnsembleLayerNorm(members, h))
            layers.append(nn.ReLU())
        if batch_renorm is not None:
            layers.append(BatchRenorm(widths[-1], members, **batch_renorm))
        layers.append(EnsembleLinear(members, widths[-1], 1))
        self.net = nn.Sequential(*layers)

    def forward(self, obs: Tensor, actions: Tensor) -> Tensor:
        x = torch.cat([obs, actions], -1)
        return self.net(x.unsqueeze(0).expand(self.members, *x.shape)).squeeze(-1)


class SquashedGaussianActor(nn.Module):
    """The SAC policy: an MLP (ReLU) to a mean and a log standard deviation (clamped to
    [LOG_STD_MIN, LOG_STD_MAX]), the action ``tanh(u)`` scaled to [``low``, ``high``];
    ``batch_renorm``: batch renormalisation before each linear layer of the trunk and after it
    (CrossQ's). ``forward(obs, deterministic=False) -> (actions, logp)``."""

    def __init__(self, obs_dim: int, low: Sequence[float], high: Sequence[float], hidden: Sequence[int] = (256, 256),
                 batch_renorm: dict | None = None):
        super().__init__()
        low_t, high_t = (torch.tensor(np.asarray(b, dtype=np.float32)) for b in (low, high))
        if not (torch.isfinite(low_t).all() and torch.isfinite(high_t).all() and (high_t > low_t).all()):
            raise ValueError(f"a squashed Gaussian policy needs finite action bounds low < high, got {low} and {high}")
        action_dim = low_t.numel()
        layers: list[nn.Module] = []
        widths = [obs_dim, *hidden]
        for width, h in zip(widths, hidden):
            if batch_renorm is not None:
                layers.append(BatchRenorm(width, **batch_renorm))
            layers += [nn.Linear(width, h), nn.ReLU()]
        if batch_renorm is not None:
            layers.append(BatchRenorm(widths[-1], **batch_renorm))
        self.trunk = nn.Sequential(*layers)
        self.mean = nn.Linear(widths[-1], action_dim)
        self.log_std = nn.Linear(widths[-1], action_dim)
        self.register_buffer("scale", (high_t - low_t) / 2.0)
        self.register_buffer("bias", (high_t + low_t) / 2.0)

    def forward(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        h = self.trunk(obs)
        log_std = self.log_std(h).clamp(LOG_STD_MIN, LOG_STD_MAX)
        return squashed_gaussian(self.mean(h), log_std, self.scale, self.bias, deterministic)

    def act(self, obs: Tensor, deterministic: bool = False) -> tuple[Tensor, Tensor]:
        """An embodied policy's interface (``models.policies``): actions and their log-density."""
        return self(obs.float(), deterministic)
