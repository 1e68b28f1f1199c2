"""LM actor: policy-gradient training on the batches streaming in (or, ``algorithm.name=sft``,
supervised: the negative log-likelihood of the completions a flow chose), and weight sync out.

Advantages (``algorithm.name``): ``grpo`` (group-normalised rewards), ``dr_grpo`` (not scaled
by the group's std), ``rloo`` (leave-one-out baseline), ``reinforce_pp`` (REINFORCE++:
token returns of KL-shaped rewards, whitened over the step's batches on every rank), ``ppo``
(GAE advantages that the critic worker sets on each batch, whitened over the step). The
loss is the clipped surrogate with DAPO's knobs (clip-higher, dual clip, token-level
aggregation), an optional KL term (k1/k2/k3, in the loss or in the reward) and an entropy
bonus.

Streaming: with a group-local advantage (grpo, dr_grpo, rloo), one epoch, one mini-batch and
replicated ranks (not ``algorithm.data_parallel=fsdp``, where every forward takes all ranks),
the actor runs forward and backward on each batch the moment it arrives, while the rollout
is still generating, and takes the optimizer step once the last one is in. The loss is
accumulated as a plain sum and the gradient divided by the step's token (or sequence)
count at the end, when it is known: the same gradient as one pass over the whole batch.
Rows whose loss is exactly zero (zero advantage, e.g. a group whose rewards are all equal,
and no KL or entropy term) count in that divisor but are not forwarded.
Otherwise (ppo included: its advantages are whitened over the step) the actor gathers the
step's batches first, then trains epochs x mini-batches.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from m2flow.algorithms import (
    aggregate,
    broadcast_to_tokens,
    grpo_advantages,
    inert_rows,
    kl_loss,
    kl_penalty,
    kl_shaped_rewards,
    masked_mean,
    masked_whiten,
    policy_loss,
    reinforce_pp_advantages,
    rloo_advantages,
)
from m2flow.engines.batch import SequenceBatch, concat_batches
from m2flow.engines.scoring import learned_nll
from m2flow.engines.trainer import Accumulated, LMTrainer, LossScale
from m2flow.runtime import Channel, Clock, DeviceLock, Worker, dispatch
from m2flow.runtime.files import save_tensors
from m2flow.workers.lm_common import END, dtype_of, load_model, logprob_temperature, memory_mb, switch
from m2flow.workers.reports import LMTrainReport, WeightSync

GROUP_LOCAL = ("grpo", "dr_grpo", "rloo")
PART_COUNTS = ("loss", "tokens", "completion_tokens", "micro_batches")  # what accumulate() reports besides the stats
ALGORITHMS = (*GROUP_LOCAL, "reinforce_pp", "ppo")
# What ``LMTrainer.train_step`` reports besides the training statistics (``LMTrainReport.stats``)
TRAINER_COUNTS = ("tokens", "completion_tokens", "micro_batches", "optimizer_steps", "skipped_steps", "inert_rows",
                  "peak_memory_mb", "time_s")
# The negative log-likelihood of every completion that reaches the actor: for flows that choose
# what it trains on (rejection sampling keeps each prompt's best completions)
SUPERVISED = ("sft",)
COLLECTIVE_TIMEOUT_S = 1800.0  # how long a rank may wait in a collective (see __init__)


class LMActorWorker(Worker):
    def __init__(self, cfg: dict, take_turns: bool = False, offload: bool = True):
        self.cfg, a = cfg, cfg["algorithm"]
        self.algo = a
        model, self.tokenizer = load_model(cfg, self.device)
        if self.world_size > 1:
            # A rank may wait in a collective for as long as another waits for its devices: with
            # generation ahead, a whole rollout. A rank that dies surfaces through Ray long before.
            self.init_process_group(timeout_s=COLLECTIVE_TIMEOUT_S)
        self.trainer = LMTrainer(model, a["lr"], max_tokens_per_micro_batch=a["max_tokens_per_micro_batch"],
                                 weight_decay=a["weight_decay"], max_grad_norm=a["max_grad_norm"],
                                 autocast_dtype=dtype_of(cfg["model"]["autocast"]), device=self.device,
                                 temperature=logprob_temperature(cfg),
                                 share_prompts=a["share_prompts"],
                                 shard=a["data_parallel"] == "fsdp")
        # Sharded, every forward takes all ranks: they train together once the step's batches
        # are in, not each on a batch as it arrives.
        self.streaming = (a["name"] in (*GROUP_LOCAL, *SUPERVISED) and a["epochs"] == 1 and a["mini_batches"] == 1
                          and not self.trainer.sharded)
        self.norm_len = cfg["rollout"]["max_new_tokens"]  # Dr. GRPO's constant length
        self.shuffle = torch.Generator().manual_seed(cfg["seed"] + 1000 + self.rank)
        self.turns = self.device_turns(take_turns)  # one rank's: forward and backward of a batch
        self.together = self.device_turns(take_turns, all_ranks=True)  # all ranks': their all-reduces
        self.version = 0
        # Generated ahead (runner.max_staleness = k), a batch may be up to k versions behind the weights.
        self.max_lag = cfg["runner"]["max_staleness"]
        # The optimizer state leaves the devices between turns only where they are shared and
        # the plan moves memory out (Plan.offload); else it stays where it trains.
        self.offloads = take_turns and offload
        if self.offloads:
            self.trainer.offload_optimizer()  # until its first turn

    # -- weights ----------------------------------------------------------------------
    def push_weights(self, groups: list[str], bucket_mb: float = 256.0) -> WeightSync | None:
        """Sends the weights, in buckets of about ``bucket_mb``, tagged with their version, to
        every rank of each group in ``groups`` (``WeightReceiver.pull_weights``). Rank 0
        sends; sharded (``algorithm.data_parallel=fsdp``), every rank is called and helps
        gather the weights. A bucket goes as soon as it is full: gathered weights are never
        all held at once. Rank 0 reports the push (the others None)."""
        start = time.perf_counter()
        if self.rank != 0:
            for _ in self.trainer.named_weights():
                pass
            return None
        sent = {"buckets": 0, "bytes": 0}

        def send(bucket: dict[str, torch.Tensor], last: bool) -> None:
            message = {"tensors": bucket, "version": self.version, "last": last}
            for group in groups:
                self.broadcast(message, (self.group, self.rank), group)
            sent["buckets"] += 1
            sent["bytes"] += sum(t.nbytes for t in bucket.values())

        bucket: dict[str, torch.Tensor] = {}
        size, limit = 0, bucket_mb * 2**20
        for name, t in self.trainer.named_weights():
            if bucket and size + t.nbytes > limit:
                send(bucket, last=False)
                bucket, size = {}, 0
            bucket[name] = t
            size += t.nbytes
        send(bucket, last=True)
        return WeightSync(weight_sync_s=time.perf_counter() - start, weight_buckets=sent["buckets"],
                          weight_mb=sent["bytes"] / 2**20, weight_transport=self.comm.last_transport)

    def weights_hash(self) -> str:
        return self.trainer.weights_hash()

    def save_weights(self, path: str) -> None:
        """Saves the weights (safetensors, each tied weight once) to ``path``, to evaluate
        later (``runner.eval_deferred``). Rank 0 writes; sharded, every rank is called and
        helps gather them. Written atomically: ``path`` is whole or absent."""
        if self.rank != 0:
            for _ in self.trainer.named_weights():
                pass
            return
        save_tensors(path, {name: t.detach().to("cpu").contiguous() for name, t in self.trainer.named_weights()})

    def save_model(self, path: str) -> None:
        """The weights and the tokenizer as a transformers checkpoint directory at ``path`` (a
        later run's ``model.path``), written whole or not at all. Replicated ranks only."""
        import shutil
        import tempfile

        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        self.trainer.model.save_pretrained(tmp)
        self.tokenizer.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)

    def held_out_loss(self, batch: SequenceBatch) -> float:
        """The mean negative log-likelihood of ``batch``'s learned tokens (``completion_mask``)
        under the current weights: a supervised run's held-out loss."""
        total, count = learned_nll(self.trainer.model, batch, self.trainer.max_tokens, self.trainer.autocast_dtype)
        return total / max(1, count)

    # -- training ---------------------------------------------------------------------
    def train(self, batches_in: Channel, key: int = 0) -> LMTrainReport:
        """One policy update from the step's batches (channel key ``key``); with several ranks,
        each trains on the batches it takes (``batches_in`` must hand out one item per get:
        prefetch 1)."""
        clock = Clock()
        batches = []
        stats = Accumulated()  # streamed: the parts' statistics
        tokens = seqs = forwarded = policy_lag = inert_rows = stale_dropped = 0
        loss_sum = 0.0  # streamed: the parts' summed losses, divided by the step's count at the end
        token_lags: dict[int, int] = {}  # versions behind -> completion tokens trained on
        trained, dropped = [], []  # the ids of the completions trained on, and of those dropped as too old
        # A rank whose devices another component holds (hybrid: the rank beside the rollout)
        # takes a batch only once they are free: meanwhile the batches go to ranks that can
        # train on them at once, instead of one waiting here for the whole generation.
        wait_free = self.world_size > 1 and isinstance(self.turns, DeviceLock)
        while True:
            with clock.idle():
                if wait_free:
                    self.turns.wait_free()
                batch = batches_in.get(key)  # whichever rank is free takes the next batch
            if batch == END:
                break
            lag = self.version - batch.extras["version"]  # of its oldest token
            if lag < 0:
                raise RuntimeError(f"actor rank {self.rank} got a batch from policy version {batch.extras['version']}, "
                                   f"newer than its own {self.version}")
            if lag > self.max_lag:  # older than the algorithm allows: dropped, counted, never trained on
                stale_dropped += len(batch)
                dropped += batch.sample_ids()
                continue
            _count_lags(token_lags, batch, self.version)
            trained += batch.sample_ids()
            policy_lag = max(policy_lag, lag)
            if not self.streaming:
                batches.append(batch)
                continue
            self._advantages(batch)
            tokens += int(batch.completion_mask.sum())
            seqs += len(batch)
            inert = self._inert_rows(batch)
            inert_rows += int(inert.sum())
            if inert.all():  # counted in the step's divisor above; nothing to forward
                continue
            rows = batch.select((~inert).nonzero().squeeze(1)) if inert.any() else batch
            with clock.turn(self.turns), clock.busy():
                switch(self.trainer.onload_optimizer, self.offloads)
                raw = LossScale(tokens=self.world_size, sequences=self.world_size, world_size=self.world_size)
                part = self.trainer.accumulate(rows, self._loss, raw)
            n = int(rows.completion_mask.sum())
            forwarded += n
            loss_sum += part["loss"]
            stats.add({k: v for k, v in part.items() if k not in PART_COUNTS}, n, 0)
        with clock.turn(self.together), clock.busy():
            update_start = time.perf_counter()
            switch(self.trainer.onload_optimizer, self.offloads)
            if self.streaming:
                result = self._finish_streamed(stats, tokens, seqs, loss_sum) | {"inert_rows": inert_rows}
            else:
                result = self._train_gathered(batches)
                forwarded = result.get("completion_tokens", 0)
            peak = memory_mb(self.device)
            switch(self.trainer.offload_optimizer, self.offloads)  # context switching: the rollout gets room
            # streamed: the step's update apart from the batches' forward and backward (the
            # profiler tells a cost per step from one per batch by it); gathered: all of it
            update_s = time.perf_counter() - update_start
        self.version += 1
        return LMTrainReport(**clock.report(), peak_memory_mb=peak, version=self.version, update_busy_s=update_s,
                             stats={k: v for k, v in result.items() if k not in TRAINER_COUNTS},
                             forwarded_tokens=forwarded, optimizer_steps=result["optimizer_steps"],
                             inert_rows=result.get("inert_rows", 0), policy_lag=policy_lag, stale_dropped=stale_dropped,
                             lags=token_lags, update_end=time.time(), trained=trained, dropped=dropped)

    def _finish_streamed(self, stats: Accumulated, tokens: int, seqs: int, loss_sum: float) -> dict:
        """The step's optimizer step; ``loss``, as ``LMTrainer.train_step`` reports it, is this
        rank's share of the step's loss (the ranks' shares average to it)."""
        counts = torch.tensor([tokens, seqs], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(counts)  # CPU tensors: gloo, also beside NCCL (Worker.init_process_group)
        divisor = float(counts[0] if self.algo["loss_agg"] == "token-mean" else counts[1])
        if divisor == 0:  # every group was dropped (dynamic sampling): no update this step
            self.trainer.optimizer.zero_grad(set_to_none=True)
            return {"optimizer_steps": 0, "completion_tokens": 0}
        grad_norm = self.trainer.finish_step(grad_scale=self.world_size / divisor)
        means = {k: v for k, v in stats.result().items() if k not in PART_COUNTS}
        return {**means, "loss": loss_sum * self.world_size / divisor, "grad_norm": grad_norm,
                "optimizer_steps": int(math.isfinite(grad_norm)), "completion_tokens": tokens}

    def _train_gathered(self, batches: list[SequenceBatch]) -> dict:
        """Epochs x mini-batches over the step's batches. A rank that took none still takes
        part (with no rows) in every all-reduce of the others."""
        pad = self.tokenizer.pad_token_id or 0
        if batches:
            batch = concat_batches(batches, pad_id=pad)
        else:
            empty = torch.zeros((0, 1), dtype=torch.long)
            batch = SequenceBatch(empty + pad, empty, empty)
        self._advantages(batch)
        rows = torch.tensor([len(batch)], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(rows)
        if rows.item() == 0:  # every group was dropped (dynamic sampling): no update this step
            return {"optimizer_steps": 0, "completion_tokens": 0}
        a = self.algo
        return self.trainer.train_step(batch, self._loss, mini_batches=a["mini_batches"], epochs=a["epochs"],
                                       generator=self.shuffle, inert=self._inert_rows(batch))

    def _inert_rows(self, batch: SequenceBatch) -> torch.Tensor:
        """bool [B]: the rows the trainer need not forward (``inert_rows``) under this algorithm."""
        a = self.algo
        return inert_rows(batch.advantages, batch.completion_mask, kl_coef=a["kl_coef"], kl_in_reward=a["kl_in_reward"],
                          entropy_coef=a["entropy_coef"], enabled=a["skip_inert_rows"])

    def _advantages(self, batch: SequenceBatch) -> None:
        a, mask = self.algo, batch.completion_mask
        if not len(batch):  # this rank took no batches: it only joins the others' whitening
            if a["name"] == "reinforce_pp" and self.world_size > 1:
                masked_whiten(mask.float(), mask, sum_over_ranks=_sum_over_ranks)
            return
        if a["name"] in SUPERVISED:  # every token the same weight: none is inert
            batch.advantages = mask.float()
            return
        if a["name"] == "ppo":
            if batch.advantages is None:
                raise RuntimeError("algorithm.name=ppo: a batch reached the actor without advantages; the critic "
                                   "worker sets them, between the inference worker and the actor")
            return
        rewards, n = batch.extras["reward"].float(), batch.extras["group_size"]
        if a["name"] == "reinforce_pp":
            kl = None
            if a["kl_coef"] > 0 and a["kl_in_reward"]:
                kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, a["kl_kind"])
            # whitened over the step: every rank's batches, not only those this rank took
            batch.advantages = reinforce_pp_advantages(kl_shaped_rewards(rewards, mask, kl, a["kl_coef"]), mask,
                                                       sum_over_ranks=_sum_over_ranks if self.world_size > 1 else None)
            return
        if a["name"] == "rloo":
            adv = rloo_advantages(rewards, n)
        else:
            adv = grpo_advantages(rewards, n, scale_by_std=a["name"] == "grpo")
        batch.advantages = broadcast_to_tokens(adv, mask)

    def _loss(self, logp: torch.Tensor, entropy: torch.Tensor | None, mb: SequenceBatch,
              scale: LossScale) -> tuple[torch.Tensor, dict]:
        """This micro-batch's share of the mini-batch loss (see ``LossScale``)."""
        a, mask = self.algo, mb.completion_mask
        totals = {"agg": a["loss_agg"], "norm_len": self.norm_len, "total_tokens": scale.tokens / scale.world_size,
                  "total_seqs": scale.sequences / scale.world_size}
        if a["name"] in SUPERVISED:
            loss, stats = aggregate(-logp, mask, **totals), {}  # the negative log-likelihood
        else:
            loss, stats = policy_loss(logp, mb.old_logprobs, mb.advantages, mask, a["clip"], a["clip_high"],
                                      a["dual_clip"], **totals, correction=a["off_policy"],
                                      behaviour_logp=mb.behaviour_logprobs, is_cap=a["is_cap"])
        if a["kl_coef"] > 0 and not a["kl_in_reward"]:
            kl = kl_loss(logp, mb.ref_logprobs, mask, a["kl_kind"], **totals)
            loss = loss + a["kl_coef"] * kl
            stats["kl"] = float(masked_mean(kl_penalty(logp.detach(), mb.ref_logprobs, a["kl_kind"]), mask))
        if entropy is not None:
            if a["entropy_coef"]:
                loss = loss - a["entropy_coef"] * aggregate(entropy, mask, **totals)
            stats["entropy"] = float(masked_mean(entropy.detach(), mask))
        return loss, stats

    # -- checkpoints ------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {"trainer": self.trainer.state_dict(), "version": self.version, "shuffle": self.shuffle.get_state()}

    @dispatch(split="per_rank")
    def load_state(self, state: dict[str, Any]) -> None:
        self.trainer.onload_optimizer()
        self.trainer.load_state_dict(state["trainer"])
        if self.offloads:
            self.trainer.offload_optimizer()
        self.version = state["version"]
        self.shuffle.set_state(state["shuffle"])

    @classmethod
    def reshard(cls, states: list[dict[str, Any]], ranks: int, *args: Any) -> list[dict[str, Any]]:
        """As ``Worker.reshard``, but the trainer's state where the ranks hold it otherwise
        (another count, or sharded then and not now or the reverse): rank 0's on every rank
        (sharded, rank 0 holds it in full; replicated, every rank holds the same)."""
        cfg = args[0]
        sharded = cfg["algorithm"]["data_parallel"] == "fsdp" and ranks > 1
        spread = super().reshard(states, ranks)
        if len(states) == ranks and states[0]["trainer"].get("sharded", False) == sharded:
            return spread
        return [{**s, "trainer": states[0]["trainer"]} for s in spread]


def _count_lags(counts: dict[int, int], batch: SequenceBatch, version: int) -> None:
    """Adds the batch's completion tokens to ``counts`` by how many versions behind ``version``
    the weights that sampled each were."""
    mask = batch.completion_mask.bool()
    sampled = batch.versions[mask] if batch.versions is not None else torch.full((int(mask.sum()),),
                                                                                   batch.extras["version"])
    lags, n = torch.unique(version - sampled, return_counts=True)
    for lag, k in zip(lags.tolist(), n.tolist()):
        counts[lag] = counts.get(lag, 0) + k


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the actor's ranks (a CPU tensor: gloo, also beside NCCL)."""
    dist.all_reduce(t)
    return t
