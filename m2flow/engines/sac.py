"""The SAC learner: the actor, the critic ensemble and its target copy, the entropy
coefficient, their optimiser, and one gradient step on a batch of transitions, in the order
Stable-Baselines3's SAC takes it: the entropy coefficient (its loss on the batch's actions,
the step's value taken before its update), then the critics against the soft TD target of
the target critics, then the actor against the updated critics, then the target critics'
Polyak step (the same arithmetic, the coefficient stepped together with the actor). The
losses are ``m2flow.algorithms.sac``'s. RLPD's variants are options: more critics
(``critics``), the target's minimum over a random subset of them (``target_subset``),
LayerNorm in the critics, the actor against the critics' mean.
``CrossQLearner``: CrossQ as sb3-contrib defines it (no target critics, batch renormalisation,
one joint forward pass of the critics over the batch and the next observations' actions).

Speed (the learner's step is what an off-policy run spends its time on): the critics are one
batched computation, the optimisers fused (``torch.optim.Adam(fused=True)``), the target step
one ``_foreach_lerp_``; each backward pass takes the gradients of its own parameters alone (the
critics none from the actor's loss), and the actor and the entropy coefficient share one:
three passes become two (64x64 networks, batch 64, one thread: 1.17x the gradient steps a
second, 1.05-1.33 over 9 alternating pairs; 256x256, batch 256: 1.06x, 0.89-1.14)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from m2flow.algorithms.sac import actor_loss, alpha_loss, critic_loss, polyak, subset_min, td_target
from m2flow.models.continuous import CROSSQ_RENORM, QEnsemble, SquashedGaussianActor


class SACLearner:
    """SAC's networks, optimisers and gradient step (module docstring). ``update`` takes a
    batch of tensors, ``update_from`` a ``Transitions`` batch; ``act`` is the policy's action
    for observations (``deterministic``: its mean's); ``state``/``load_state`` hold everything a
    resumed run needs to take the same next step."""

    def __init__(self, obs_dim: int, low: Sequence[float], high: Sequence[float], hidden: Sequence[int] = (256, 256),
                 critics: int = 2, target_subset: int | None = None, layer_norm: bool = False, lr: float = 3e-4,
                 tau: float = 0.005, target_entropy: float | None = None, init_alpha: float = 1.0,
                 actor_reduce: str = "min", fused: bool = True, seed: int = 0,
                 actor_hidden: Sequence[int] | None = None, batch_renorm: dict | None = None,
                 betas: tuple[float, float] = (0.9, 0.999), target_critics: bool = True, device: str = "cpu"):
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.actor = SquashedGaussianActor(obs_dim, low, high, actor_hidden or hidden, batch_renorm).eval().to(device)
        self.critic = QEnsemble(obs_dim, len(low), hidden, critics, layer_norm, batch_renorm).eval().to(device)
        self.target = copy.deepcopy(self.critic).requires_grad_(False) if target_critics else None
        self.log_alpha = torch.tensor(float(np.log(init_alpha)), requires_grad=True, device=device)
        self.target_entropy = -float(len(low)) if target_entropy is None else float(target_entropy)
        self.tau, self.target_subset, self.actor_reduce = tau, target_subset, actor_reduce
        self.generator = torch.Generator().manual_seed(seed)  # the target subsets'
        adam = dict(lr=lr, betas=betas, fused=fused) if fused else dict(lr=lr, betas=betas)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), **adam)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), **adam)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], **adam)
        self.updates = 0
        self._critic_params = list(self.critic.parameters())
        self._actor_params = [*self.actor.parameters(), self.log_alpha]
        self._target_params = list(self.target.parameters()) if self.target is not None else []

    @staticmethod
    def _step(loss: torch.Tensor, params: list[torch.Tensor], *optimizers: torch.optim.Optimizer) -> None:
        """The gradients of ``loss`` for ``params`` alone (none accumulated anywhere else), then
        a step of each of ``optimizers``."""
        for p, g in zip(params, torch.autograd.grad(loss, params)):
            p.grad = g
        for opt in optimizers:
            opt.step()

    def update(self, obs: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor, next_obs: torch.Tensor,
               discounts: torch.Tensor) -> dict[str, torch.Tensor]:
        """One gradient step of each part on a batch (``m2flow.replay.Transitions`` as
        tensors); returns its statistics as 0-dim tensors (read them when they are logged)."""
        new_actions, logp = self.actor(obs)
        # This step's entropy coefficient, taken before its own update (as SB3's). SB3 steps it
        # first; its loss reaches nothing else and its value here is taken already, so it is
        # stepped at the end with the actor, from one backward pass of the two losses.
        alpha = self.log_alpha.detach().exp()

        with torch.no_grad():
            next_actions, next_logp = self.actor(next_obs)
            next_q = subset_min(self.target(next_obs, next_actions), self.target_subset, self.generator)
            target = td_target(rewards, discounts, next_q, next_logp, alpha)
        q = self.critic(obs, actions)
        loss_q = critic_loss(q, target)
        self._step(loss_q, self._critic_params, self.critic_opt)

        # the actor's loss moves the actor alone: the critics' gradients are not taken
        loss_pi = actor_loss(self.critic(obs, new_actions), logp, alpha, self.actor_reduce)
        self._step(loss_pi + alpha_loss(self.log_alpha, logp, self.target_entropy), self._actor_params,
                   self.actor_opt, self.alpha_opt)

        polyak(self._target_params, self._critic_params, self.tau)
        self.updates += 1
        return {"critic_loss": loss_q.detach(), "actor_loss": loss_pi.detach(), "alpha": alpha,
                "entropy": -logp.detach().mean(), "q": q.detach().mean()}

    def update_from(self, batch: Any) -> dict[str, torch.Tensor]:
        """``update`` on a ``Transitions`` batch of numpy arrays (moved to the learner's device)."""
        return self.update(*(torch.from_numpy(np.ascontiguousarray(getattr(batch, k), np.float32)).to(self.device)
                             for k in ("obs", "actions", "rewards", "next_obs", "discounts")))

    @torch.no_grad()
    def act(self, obs: np.ndarray, deterministic: bool = False) -> np.ndarray:
        return self.actor(torch.as_tensor(obs, dtype=torch.float32, device=self.device), deterministic)[0].cpu().numpy()

    def state(self) -> dict[str, Any]:
        target = self.target.state_dict() if self.target is not None else None
        return {"actor": self.actor.state_dict(), "critic": self.critic.state_dict(), "target": target,
                "log_alpha": self.log_alpha.detach().clone(),
                "optimizers": [o.state_dict() for o in (self.critic_opt, self.actor_opt, self.alpha_opt)],
                "generator": self.generator.get_state(), "updates": self.updates}

    def load_state(self, state: dict[str, Any]) -> None:
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        if self.target is not None:
            self.target.load_state_dict(state["target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        for opt, s in zip((self.critic_opt, self.actor_opt, self.alpha_opt), state["optimizers"]):
            opt.load_state_dict(s)
        self.generator.set_state(state["generator"])
        self.updates = state["updates"]


class CrossQLearner(SACLearner):
    """CrossQ (Bhatt et al. 2024) as sb3-contrib's ``CrossQ`` defines it, with its defaults:
    no target critics; batch renormalisation (momentum 0.01, eps 1e-3, 100,000 warm-up steps) in
    the actor and the critics, which are wider (1024x1024); the critics' statistics taken over
    the batch and the next observations' sampled actions in one joint forward pass; Adam with
    lr 1e-3 and betas (0.5, 0.999); the actor and the entropy coefficient updated every
    ``policy_delay`` steps."""

    def __init__(self, obs_dim: int, low: Sequence[float], high: Sequence[float], hidden: Sequence[int] = (1024, 1024),
                 actor_hidden: Sequence[int] = (256, 256), lr: float = 1e-3, policy_delay: int = 3,
                 batch_renorm: dict | None = None, betas: tuple[float, float] = (0.5, 0.999), **kwargs: Any):
        renorm = CROSSQ_RENORM | (batch_renorm or {})
        # no target critics: the critics' own values of the next actions make the target
        super().__init__(obs_dim, low, high, hidden, lr=lr, actor_hidden=actor_hidden, batch_renorm=renorm,
                         betas=betas, target_critics=False, **kwargs)
        self.policy_delay = policy_delay

    def update(self, obs: torch.Tensor, actions: torch.Tensor, rewards: torch.Tensor, next_obs: torch.Tensor,
               discounts: torch.Tensor) -> dict[str, torch.Tensor]:
        self.updates += 1
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_actions, next_logp = self.actor(next_obs)  # running statistics (eval mode)
        self.critic.train()  # the joint batch's statistics, and the running ones updated
        q, next_q = self.critic(torch.cat([obs, next_obs]), torch.cat([actions, next_actions])).split(len(obs), 1)
        self.critic.eval()
        target = td_target(rewards, discounts, subset_min(next_q.detach()), next_logp, alpha)
        loss_q = critic_loss(q, target)
        self._step(loss_q, self._critic_params, self.critic_opt)
        stats = {"critic_loss": loss_q.detach(), "alpha": alpha, "q": q.detach().mean()}
        if self.updates % self.policy_delay:
            return stats
        self.actor.train()
        new_actions, logp = self.actor(obs)
        self.actor.eval()
        # as SAC's: the entropy coefficient stepped with the actor, the critics' gradients not taken
        loss_pi = actor_loss(self.critic(obs, new_actions), logp, alpha, self.actor_reduce)
        self._step(loss_pi + alpha_loss(self.log_alpha, logp, self.target_entropy), self._actor_params,
                   self.actor_opt, self.alpha_opt)
        return stats | {"actor_loss": loss_pi.detach(), "entropy": -logp.detach().mean()}
