"""Actor worker: PPO (or GRPO) on the trajectories the env workers stream to it.

Data parallel over its ranks: every rank gets an equal share of each env rank's
environments, and gradients are averaged with one all-reduce of the flat gradient per
minibatch (gloo: the policies of this flow are small and stay on the CPU).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from m2flow.algorithms import PPO_STATS, episode_group_advantages, gae, next_values, ppo_minibatch_loss
from m2flow.envs.trajectory import Trajectory
from m2flow.models import build_policy, flatten_parameters
from m2flow.runtime import Channel, Clock, Worker, dispatch
from m2flow.runtime.dispatching import routed
from m2flow.workers.layout import EnvLayout
from m2flow.workers.reports import TrainReport, WeightSync


class ActorWorker(Worker):
    def __init__(self, cfg: dict, layout: EnvLayout, observation_space, action_space, take_turns: bool = False):
        self.cfg, self.algo, self.layout = cfg, cfg["algorithm"], layout
        self.grpo = self.algo["name"] == "grpo"
        self.turns = self.device_turns(take_turns, all_ranks=True)  # training all-reduces across the ranks
        torch.manual_seed(cfg["seed"])  # identical initial weights on every rank
        self.policy = build_policy(observation_space, action_space, cfg["policy"])
        # All weights in one flat tensor (the policy's parameters are views of it), and one
        # fused Adam kernel: for small policies, the per-tensor loops of zeroing, clipping,
        # all-reducing and stepping cost more than the arithmetic.
        self.flat = flatten_parameters(self.policy)
        self.optimizer = torch.optim.Adam([self.flat], lr=self.algo["lr"], eps=1e-5, fused=True)
        self.shuffle = torch.Generator().manual_seed(cfg["seed"] + 1000 + self.rank)
        # Compiled, the minibatch's loss (forward and backward) runs as a few fused kernels
        # instead of ~100 small ops, whose dispatch is much of a small policy's training time
        # (a quarter less actor time on HalfCheetah, after a one-off compile: docs/benchmarks.md).
        a = self.algo
        loss = partial(ppo_minibatch_loss, self.policy, clip=a["clip"], clip_high=a["clip_high"],
                       ent_coef=a["ent_coef"], vf_coef=a["vf_coef"], value_clip=a["value_clip"],
                       norm_adv=a["norm_adv"], correction=a["off_policy"], is_cap=a["is_cap"])
        self._loss = torch.compile(loss) if a["compile"] else loss
        self.version = 0
        if self.world_size > 1:
            self.init_process_group("gloo")  # the policy and its gradients live on the CPU

    # -- weights ----------------------------------------------------------------------
    def push_weights(self, groups: list[str]) -> WeightSync:
        """Broadcasts the current weights, tagged with their version, to every rank of each group."""
        start = time.perf_counter()
        for group in groups:
            self.broadcast({"weights": self.policy.state_dict(), "version": self.version}, (self.group, self.rank), group)
        return WeightSync(weight_sync_s=time.perf_counter() - start)

    def policy_weights(self) -> dict[str, Any]:
        """The policy's weights alone (an evaluation's: ``state`` holds the optimizer's too)."""
        return self.policy.state_dict()

    def state(self) -> dict[str, Any]:
        return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version,
                "shuffle": self.shuffle.get_state()}

    @dispatch(split="per_rank")
    def load_state(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = state["version"]
        self.shuffle.set_state(state["shuffle"])

    def weights_hash(self) -> str:
        """``m2flow.engines.weights.weights_hash`` of the policy: equal on two actors exactly
        when they hold identical weights."""
        # Here, not at the top: importing m2flow.engines loads transformers, which the
        # embodied flow does not otherwise need.
        from m2flow.engines.weights import weights_hash

        return weights_hash(self.policy)

    # -- training ---------------------------------------------------------------------
    def train(self, trajectories_in: Channel, stream: int, update: int, total_updates: int) -> TrainReport:
        """One update on stream ``stream``'s trajectories: a part from every env rank."""
        clock = Clock(busy_unless_idle=True)
        with clock.idle():
            parts = routed(trajectories_in, stream, self.rank, self.layout.env_ranks)  # EnvWorker.interact's
            parts.sort(key=lambda p: p.env_rank)  # arrival order varies; the batch must not
        ranks = [p.env_rank for p in parts]
        if len(set(ranks)) != len(ranks):
            raise RuntimeError(f"actor rank {self.rank} got stream {stream}'s parts from env ranks {ranks}: "
                               f"one part from each of the {self.layout.env_ranks} was expected")
        # Collected ahead (runner.max_staleness = k), each step is up to k versions behind the
        # weights: the runner launches no rollout further ahead, so an older one is a fault.
        versions = np.concatenate([p.versions.ravel() for p in parts])
        lags, counts = np.unique(self.version - versions[versions >= 0], return_counts=True)  # -1: a padding row
        if lags.min() < 0 or lags.max() > self.cfg["runner"]["max_staleness"]:
            raise RuntimeError(f"actor rank {self.rank} at policy version {self.version} got env steps "
                               f"{sorted(lags.tolist())} versions behind it, runner.max_staleness is "
                               f"{self.cfg['runner']['max_staleness']}")
        data = Trajectory.concat(parts).map(torch.as_tensor)
        if self.algo["anneal_lr"]:
            for g in self.optimizer.param_groups:
                g["lr"] = self.algo["lr"] * (1.0 - update / total_updates)
        with clock.turn(self.turns):
            batch, stats = self._group_advantages(data) if self.grpo else self._advantages(data)
            if self.algo["off_policy"] == "decoupled":
                self._proximal(batch)
            stats |= self._optimize(batch)
        self.version += 1
        return TrainReport(**clock.report(lock_wait=True), stats=stats, policy_lag=int(lags.max()),
                           lags=dict(zip(lags.tolist(), counts.tolist())), version=self.version, update_end=time.time(),
                           trained=[i for p in parts for i in p.ids.tolist()])

    def _advantages(self, d: Trajectory) -> tuple[dict[str, torch.Tensor], dict]:
        """PPO: values and GAE of the trajectory (its arrays torch tensors), flattened to the update's samples."""
        gamma, lam = self.algo["gamma"], self.algo["gae_lambda"]
        rewards = d.rewards
        # Action chunks: one decision per chunk of k actions, its rewards discounted inside it;
        # a chunk cut short at a truncation bootstraps after the actions it ran, not after k.
        bootstrap_discount = None
        if rewards.dim() == 3:
            k = rewards.shape[2]
            rewards = (rewards * gamma ** torch.arange(k, dtype=rewards.dtype)).sum(2)
            bootstrap_discount = gamma ** (d.executed.double() - k)
            gamma = gamma ** k
        T, n = rewards.shape
        flat = lambda x: x.reshape(T * n, *x.shape[2:])  # noqa: E731
        obs = flat(d.obs).float()
        with torch.no_grad():
            values = self.policy.value(obs).view(T, n)
            last_values = self.policy.value(d.last_obs.float())
            final_values = torch.zeros(T, n)
            truncated = d.truncated.bool()
            if truncated.any():  # bootstrap truncated episodes from their true last observation
                final_values[truncated] = self.policy.value(d.final_obs[truncated].float())
                if bootstrap_discount is not None:
                    final_values[truncated] *= bootstrap_discount[truncated].float()
        terminated = d.terminated.bool()
        nv = next_values(values, last_values, terminated, truncated, final_values)
        adv, ret = gae(rewards.float(), values, nv, terminated | truncated, gamma, lam)
        explained = 1 - (ret - values).var() / ret.var().clamp_min(1e-8)
        batch = {"obs": obs, "actions": flat(d.actions), "logp": flat(d.logp).float(),
                 "advantages": adv.reshape(-1), "returns": ret.reshape(-1), "values": values.reshape(-1)}
        return batch, {"explained_variance": float(explained)}

    def _group_advantages(self, d: Trajectory) -> tuple[dict[str, torch.Tensor], dict]:
        """GRPO: each env's episode return in the window, normalised within its group of envs
        (same seed), is the advantage of every step of that episode; no critic. Only the
        steps of the episodes are trained on (see ``episode_group_advantages``)."""
        rewards = d.rewards.float()
        if rewards.dim() == 3:  # action chunks: skipped actions hold 0, the return is the plain sum
            rewards = rewards.sum(2)
        T, n = rewards.shape
        ends = d.terminated.bool() | d.truncated.bool()
        adv, mask = episode_group_advantages(rewards, ends, self.cfg["env"]["group_size"])
        keep = mask.reshape(-1).nonzero().squeeze(1)
        # Every rank must run the same number of minibatches (one all-reduce each): the valid
        # steps are padded with weight-0 copies up to whole minibatches of the largest rank's
        # count. Valid steps weigh size x ranks / (the valid steps of every rank), so a
        # minibatch's weighted mean, averaged over the ranks, estimates the mean over all
        # valid steps without bias, however the episodes' lengths fall to the ranks.
        count, mb = len(keep), max(1, self.algo["minibatch_size"] // self.world_size)
        size = -(-self._max_across_ranks(count) // mb) * mb
        idx = torch.cat([keep, keep[:1].expand(size - count)])
        weights = torch.zeros(size)
        weights[:count] = size * self.world_size / self._sum_across_ranks(count)
        pick = lambda x: x.reshape(T * n, *x.shape[2:])[idx]
        batch = {"obs": pick(d.obs).float(), "actions": pick(d.actions), "logp": pick(d.logp).float(),
                 "advantages": adv.reshape(-1)[idx], "weights": weights}
        return batch, {}

    def _proximal(self, b: dict[str, torch.Tensor]) -> None:
        """The decoupled objective (``algorithm.off_policy=decoupled``): its trust region is
        around the weights this update starts from, so their log-probs of the actions become the
        loss's ``logp``, and the sampling ones its ``behaviour_logp``."""
        with torch.no_grad():
            proximal = self.policy.evaluate(b["obs"], b["actions"])[0].float()
        b["behaviour_logp"], b["logp"] = b["logp"], proximal

    def _optimize(self, b: dict[str, torch.Tensor]) -> dict:
        a = self.algo
        size = len(b["obs"])
        mb = a["minibatch_size"] // self.world_size
        if mb < 1 or size % mb:
            raise ValueError(f"{size} samples per actor rank cannot be cut into minibatches of {mb}")
        fields = [b.get(k) for k in ("obs", "actions", "logp", "advantages", "weights", "values", "returns",
                                     "behaviour_logp")]
        max_norm = a["max_grad_norm"]
        kl = PPO_STATS.index("approx_kl")
        rows: list[torch.Tensor] = []  # per minibatch: its PPO_STATS, averaged at the end
        norms: list[torch.Tensor] = []  # and its gradient norm
        for epoch in range(a["epochs"]):
            # One gather per field and epoch; a minibatch is then a slice (a view), not a gather.
            order = torch.randperm(size, generator=self.shuffle)
            shuffled = [None if f is None else f[order] for f in fields]
            first = len(rows)
            for start in range(0, size, mb):
                loss, stats = self._loss(*(None if f is None else f[start:start + mb] for f in shuffled))
                grad = self.flat.grad
                grad.zero_()  # in place: the parameters' gradients are views of it
                loss.backward()
                self._all_reduce_grads()
                # clip_grad_norm_'s arithmetic on the one flat gradient, without its per-call checks
                grad_norm = torch.linalg.vector_norm(grad)
                grad.mul_((max_norm / (grad_norm + 1e-6)).clamp_(max=1.0))
                self.optimizer.step()
                rows.append(stats)
                norms.append(grad_norm)
            if a["target_kl"] is not None:
                epoch_kl = float(torch.stack(rows[first:])[:, kl].mean())
                if self._mean_across_ranks(epoch_kl) > a["target_kl"]:
                    break  # every rank sees the same mean, so all stop together
        out = dict(zip(PPO_STATS, torch.stack(rows).mean(0).tolist()))
        out["grad_norm"] = float(torch.stack(norms).double().mean())
        if "returns" not in b:
            del out["value_loss"]  # GRPO: no critic
        out["epochs"] = epoch + 1
        return out

    def _all_reduce_grads(self) -> None:
        if self.world_size > 1:
            dist.all_reduce(self.flat.grad)
            self.flat.grad /= self.world_size

    def _max_across_ranks(self, value: int) -> int:
        return self._across_ranks(value, dist.ReduceOp.MAX)

    def _sum_across_ranks(self, value: int) -> int:
        return self._across_ranks(value, dist.ReduceOp.SUM)

    def _across_ranks(self, value: int, op: dist.ReduceOp) -> int:
        if self.world_size == 1:
            return value
        t = torch.tensor([value])
        dist.all_reduce(t, op=op)
        return int(t)

    def _mean_across_ranks(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value])
        dist.all_reduce(t)
        return float(t) / self.world_size
