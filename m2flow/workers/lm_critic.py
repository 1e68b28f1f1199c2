"""LM critic (``algorithm.name=ppo``): values, GAE advantages and returns for the batches on
their way from the inference worker to the actor, then a value update on the same batches.

Per batch, as it streams in: the current critic's values (``engines/critic.py`` for their
alignment), token rewards (the outcome reward on the last completion token, minus
``kl_coef * KL`` per token with ``kl_in_reward``) and ``token_gae``'s advantages and returns.
The advantages are whitened over the whole step's completion tokens, not per batch, so the
critic holds the batches until the stream ends and only then sends them on. Nothing that
could overlap is lost: the actor has to gather the step for ppo anyway (advantages whitened
over the step are not group-local), and the values are still computed while the rollout
generates. The critic then trains ``critic_epochs`` x ``mini_batches`` on the step, with the
values the advantages used as the clipping anchor (``value_clip``), before it lets the actor
start (the end markers): its devices are the actor's in every built-in mode, so they would
take turns anyway, and this way no actor rank holds a device the critic waits for.

One rank: the stream passes through it in order, and whitening needs all of it.
"""

from __future__ import annotations

from typing import Any

import torch

from m2flow.algorithms import kl_penalty, kl_shaped_rewards, masked_whiten, token_gae, value_loss_tokens
from m2flow.engines.critic import CriticTrainer, ValueModel
from m2flow.engines.batch import SequenceBatch, concat_batches
from m2flow.engines.trainer import LossScale
from m2flow.runtime import Channel, Clock, Worker, dispatch
from m2flow.workers.lm_common import END, dtype_of, load_model, memory_mb, switch, until_end
from m2flow.workers.reports import CriticReport


def add_gae(batch: SequenceBatch, values: torch.Tensor, algo: dict) -> None:
    """Sets ``values``, raw GAE ``advantages`` and ``returns`` (the critic's targets) on
    ``batch``, from its outcome ``extras["reward"]`` and, with ``kl_in_reward``, the per-token
    KL of the sampling policy to the reference."""
    mask = batch.completion_mask
    kl = None
    if algo["kl_coef"] > 0 and algo["kl_in_reward"]:
        kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, algo["kl_kind"])
    rewards = kl_shaped_rewards(batch.extras["reward"].float(), mask, kl, algo["kl_coef"])
    batch.values = values
    batch.advantages, batch.returns = token_gae(rewards, values, mask, algo["gae_gamma"], algo["gae_lambda"])


def whiten_advantages(batches: list[SequenceBatch]) -> None:
    """Whitens the advantages of ``batches`` in place over all their completion tokens
    together (one mean and variance for the step, as if they were one batch)."""
    masks = [b.completion_mask.bool() for b in batches]
    flat = torch.cat([b.advantages[m] for b, m in zip(batches, masks)])
    whitened = masked_whiten(flat, torch.ones_like(flat, dtype=torch.bool)).split([int(m.sum()) for m in masks])
    for b, m, w in zip(batches, masks, whitened):
        b.advantages = b.advantages.masked_scatter(m, w)


class LMCriticWorker(Worker):
    def __init__(self, cfg: dict, take_turns: bool = False, offload: bool = True):
        self.algo = a = cfg["algorithm"]
        model, self.tokenizer = load_model(cfg, self.device)  # the policy's initial backbone
        self.trainer = CriticTrainer(ValueModel(model), a["critic_lr"],
                                     max_tokens_per_micro_batch=a["max_tokens_per_micro_batch"],
                                     weight_decay=a["weight_decay"], max_grad_norm=a["max_grad_norm"],
                                     autocast_dtype=dtype_of(cfg["model"]["autocast"]), device=self.device)
        self.shuffle = torch.Generator().manual_seed(cfg["seed"] + 2000)
        self.turns = self.device_turns(take_turns)
        # The optimizer state leaves the devices between turns only where they are shared and
        # the plan moves memory out (Plan.offload); else it stays where it trains.
        self.offloads = take_turns and offload
        if self.offloads:
            self.trainer.offload_optimizer()  # until its first turn

    def train(self, batches_in: Channel, batches_out: Channel, actor_ranks: int, key: int = 0) -> CriticReport:
        """Adds values, advantages (whitened over the step) and returns to the step's batches
        and passes them on to the actor; trains the critic on them, then sends one end marker
        per actor rank, all under ``key``, the stream's channel key. Returns the critic's
        statistics (``value_loss``, ...)."""
        clock = Clock()
        batches = []
        for batch in until_end(batches_in, key, clock):
            with clock.turn(self.turns), clock.busy():
                values = self.trainer.values(batch)
            with clock.busy():
                add_gae(batch, values, self.algo)
                batches.append(batch)
        with clock.busy():
            if batches:  # none when dynamic sampling dropped every group
                whiten_advantages(batches)
            for batch in batches:
                batches_out.put(batch, key, weight=batch.extras["groups"])
        with clock.turn(self.turns), clock.busy():
            switch(self.trainer.onload_optimizer, self.offloads)
            stats = self._update(batches) if batches else {}
            peak = memory_mb(self.device)
            switch(self.trainer.offload_optimizer, self.offloads)  # context switching: the others get the room
        # The end markers only now: an actor rank that held one of these devices while the
        # critic waited for the rest would wait for it in the actor's all-reduce: a deadlock.
        for _ in range(actor_ranks):
            batches_out.put(END, key)
        batches_out.flush()
        return CriticReport(**clock.report(), peak_memory_mb=peak, stats=stats)

    def _update(self, batches: list[SequenceBatch]) -> dict[str, float]:
        batch = concat_batches(batches, pad_id=self.tokenizer.pad_token_id or 0)
        m = batch.completion_mask.bool()
        returns, values = batch.returns[m], batch.values[m]
        # The share of the returns' variance the values (before this update) explain: 1 is perfect.
        spread = float(returns.var()) if len(returns) > 1 else 0.0
        explained = 1 - float((returns - values).var()) / spread if spread > 0 else float("nan")
        before = {"value_mean": float(values.mean()), "return_mean": float(returns.mean()),
                  "explained_variance": explained}
        result = self.trainer.train_step(batch, self._loss, mini_batches=self.algo["mini_batches"],
                                         epochs=self.algo["critic_epochs"], with_entropy=False,
                                         generator=self.shuffle)
        return before | {"value_loss": result["loss"], "value_clip_fraction": result["clip_fraction"],
                         "critic_grad_norm": result["grad_norm"]}

    def _loss(self, values: torch.Tensor, _entropy: None, mb: SequenceBatch,
              scale: LossScale) -> tuple[torch.Tensor, dict]:
        """This micro-batch's share of the mini-batch's clipped value loss (token mean)."""
        return value_loss_tokens(values, mb.values, mb.returns, mb.completion_mask, self.algo["value_clip"],
                                 total_tokens=scale.tokens / scale.world_size)

    def weights_hash(self) -> str:
        return self.trainer.weights_hash()

    # -- checkpoints ------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"trainer": self.trainer.state_dict(), "shuffle": self.shuffle.get_state()}

    @dispatch(split="per_rank")
    def load_state(self, state: dict[str, Any]) -> None:
        self.trainer.onload_optimizer()
        self.trainer.load_state_dict(state["trainer"])
        if self.offloads:
            self.trainer.offload_optimizer()
        self.shuffle.set_state(state["shuffle"])
