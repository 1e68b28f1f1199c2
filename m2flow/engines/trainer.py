"""Training of causal LMs: ``LMTrainer`` (AdamW on ``SequenceBatch``es with a caller-supplied
loss, micro-batched by token budget, data parallel or sharded over ranks) and the
``LossScale`` by which a loss callback normalises over the whole mini-batch."""

from __future__ import annotations

import logging
import math
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from m2flow.engines.batch import PromptLayout, SequenceBatch, micro_batches
from m2flow.engines.scoring import autocast, token_logprobs
from m2flow.engines.weights import fully_shard_model, gathered_weights, named_weights, weights_hash

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossScale:
    """What a loss callback needs to normalise over the whole mini-batch, across micro-batches
    and data-parallel ranks.

    ``tokens`` and ``sequences`` count the mini-batch's completion tokens and rows on *all*
    ranks. Gradients are summed over micro-batches, then averaged over ``world_size`` ranks,
    so a micro-batch's share of a global mean is ``sum * world_size / count``: the helpers
    apply that factor, and summing their results over every micro-batch of every rank, then
    averaging over ranks, gives the mini-batch mean exactly.
    """

    tokens: int
    sequences: int
    world_size: int = 1

    def token_mean(self, values: Tensor, mask: Tensor) -> Tensor:
        """This micro-batch's share of the mean of ``values`` over the mini-batch's completion tokens."""
        return torch.where(mask.bool(), values, values.new_zeros(())).sum() * (self.world_size / max(self.tokens, 1))

    def sequence_mean(self, values: Tensor) -> Tensor:
        """This micro-batch's share of the mean of per-sequence ``values`` over the mini-batch's rows."""
        return values.sum() * (self.world_size / max(self.sequences, 1))


LossFn = Callable[[Tensor, "Tensor | None", SequenceBatch, LossScale], "tuple[Tensor, dict[str, Any]]"]


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Linux reports ru_maxrss in KiB; it is the process's peak since it started (no reset).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


@dataclass
class Accumulated:
    """Sums over micro-batches: the loss callback's stats weighted by completion tokens (a
    ``*_max`` one: the largest), and the token counts."""

    sums: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    micro_batches: int = 0
    tokens: int = 0
    completion_tokens: int = 0

    def add(self, stats: dict[str, Any], n_completion: int, n_tokens: int) -> None:
        for key, value in stats.items():
            v = value.detach().float() if isinstance(value, Tensor) else float(value)
            if key.endswith("_max"):
                self.sums[key] = max(self.sums.get(key, -math.inf), v)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + v * n_completion
            self.weights[key] = self.weights.get(key, 0.0) + n_completion
        self.micro_batches += 1
        self.tokens += n_tokens
        self.completion_tokens += n_completion

    def result(self) -> dict[str, float]:
        out = {k: float(self.sums[k] if k.endswith("_max") else self.sums[k] / self.weights[k]) if self.weights[k]
               else float("nan") for k in self.sums}
        return out | {"tokens": self.tokens, "completion_tokens": self.completion_tokens,
                      "micro_batches": self.micro_batches}


class LMTrainer:
    """AdamW training of a causal LM on ``SequenceBatch``es with a caller-supplied loss.

    Micro-batches by token budget with gradient accumulation; one optimizer step per
    mini-batch; gradient-norm clipping; optional autocast (e.g. ``torch.bfloat16``).

    Data parallel: when ``torch.distributed`` is initialised with more than one rank (or a
    ``process_group`` is given), each rank trains on its own rows and gradients are averaged
    once per mini-batch, after accumulation and before clipping, by all-reducing them in
    flat buckets. That is chosen over DDP + ``no_sync`` because ranks may run different
    numbers of micro-batches (rows differ in length), down to none at all for a rank whose
    share of a mini-batch is empty, and DDP needs a backward pass on every rank to
    synchronise; the model also keeps its own parameter names (no ``module.`` prefix), which
    weight sync and checkpoints rely on. Every rank must call ``train_step`` with the same
    ``mini_batches`` and ``epochs``, so all take the same optimizer steps.

    ``shard=True`` (with more than one rank) shards weights, gradients and optimizer state over
    the ranks instead, with FSDP2's ``fully_shard`` (one unit per decoder layer, then the
    root): each rank holds 1/world of the model's training state, and gathers a layer's
    weights only while it runs. Every forward is then a collective, so the ranks run their
    micro-batches in lockstep: one whose share of a mini-batch has fewer micro-batches runs
    empty ones (zero gradient) until the others are done; every rank must also make the same
    ``accumulate`` calls. Gradients are averaged by FSDP's reduce-scatter. Prompts are not
    shared (each row forwards its whole prompt). ``named_weights``, ``weights_hash`` and
    ``state_dict`` gather full tensors: every rank must call them.
    """

    def __init__(self, model: nn.Module, lr: float, *, max_tokens_per_micro_batch: int, weight_decay: float = 0.0,
                 max_grad_norm: float | None = 1.0, autocast_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, temperature: float = 1.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 process_group: dist.ProcessGroup | None = None, bucket_mb: float = 256.0,
                 share_prompts: bool = True, shard: bool = False):
        if max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be at least 1, got {max_tokens_per_micro_batch}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors report "cuda:N": an index-less device would never compare equal to them.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = model.to(self.device)
        self.group = process_group
        self.sharded = shard and self.world_size > 1
        if self.sharded:
            fully_shard_model(self.model, self.group, self.device)
        self.max_tokens = max_tokens_per_micro_batch
        self.max_grad_norm = max_grad_norm
        self.autocast_dtype = autocast_dtype
        self.temperature = temperature
        # Not sharded: a prompt's keys and values, computed by one call of the model and used
        # by another, reach backward outside the hooks by which FSDP gathers a layer's weights.
        self.share_prompts = share_prompts and not self.sharded
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Fused: one kernel over all parameters; the default per-tensor loop took ~5x longer
        # on a 135M model on the CPU (seconds per step).
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           fused=True)
        self.step = 0  # optimizer steps taken
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._offloaded_state: list[tuple[dict, str]] = []
        if self.device.type == "cpu" and not self.sharded:
            self._make_optimizer_state()

    def _make_optimizer_state(self) -> None:
        """Adam's state made now, exactly as the first step would make it (zero moments, step
        0), by a step of zero gradients at learning rate 0 that moves no weight. On the CPU
        the state lives in host memory either way; faulting in its pages (two copies of the
        weights) took about 1.8 s for a 135M model on a 2-core VM, paid by the first update,
        so a profile that timed a run's first update timed that too. On a GPU it is made in
        the first step, when the trainer holds its devices (beside a collocated rollout, there
        may be no room for it before)."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        for state in self.optimizer.state.values():
            state["step"].zero_()
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def world_size(self) -> int:
        if not (dist.is_available() and dist.is_initialized()):
            return 1
        return dist.get_world_size(self.group)

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    # -- training ------------------------------------------------------------------------

    def train_step(self, batch: SequenceBatch, loss_fn: LossFn, mini_batches: int = 1, epochs: int = 1,
                   with_entropy: bool = True, generator: torch.Generator | None = None,
                   inert: Tensor | None = None) -> dict[str, float]:
        """``epochs`` passes over ``batch``, each cut into ``mini_batches`` mini-batches of
        rows (shuffled per epoch when ``generator`` is given), one optimizer step each.

        For every micro-batch: ``loss, stats = loss_fn(logprobs, entropy, micro_batch, scale)``,
        where ``logprobs``/``entropy`` are ``[b, l]`` fp32 with gradients (entropy ``None``
        unless ``with_entropy``), aligned with ``micro_batch`` (its rows, trimmed to its longest
        row; mask with its ``completion_mask``), and ``scale`` is the mini-batch's ``LossScale``.
        ``loss`` is backpropagated as is: it must be this micro-batch's share of the mini-batch
        loss (use ``scale.token_mean`` / ``scale.sequence_mean``).

        ``inert`` (bool ``[B]``): rows whose loss and gradient the caller knows to be exactly
        zero (a zero advantage and no other term): they count in their mini-batch's scale
        but are not forwarded, and the stats leave them out.

        Returns: the callback's stats, averaged over micro-batches weighted by completion
        tokens (this rank's; a ``*_max`` one is the largest); ``loss`` (the summed micro-batch
        losses per mini-batch, averaged over mini-batches: on one rank the mini-batch loss,
        with several ranks their mean is);
        ``grad_norm`` (global, before clipping, averaged over steps); ``optimizer_steps``;
        ``skipped_steps`` (non-finite gradient norm: no update); ``tokens`` and
        ``completion_tokens`` forwarded here; ``micro_batches``; ``inert_rows`` (not forwarded);
        ``peak_memory_mb`` (CUDA max allocated during the step, or on CPU the process's peak
        RSS so far); ``time_s``.
        """
        if mini_batches < 1 or epochs < 1:
            raise ValueError(f"mini_batches and epochs must be at least 1, got {mini_batches} and {epochs}")
        self._check_ready()
        world = self.world_size
        if world == 1 and len(batch) == 0:
            raise ValueError("empty batch: nothing to train on")
        start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        was_training = self.model.training
        self.model.train()
        acc = Accumulated()
        loss_total = grad_norm_total = 0.0
        steps = skipped = 0
        try:
            for _ in range(epochs):
                rows = torch.randperm(len(batch), generator=generator) if generator is not None \
                    else torch.arange(len(batch))
                shares = list(torch.tensor_split(rows, mini_batches))
                scales = self._loss_scales(batch, shares, world)
                for share, scale in zip(shares, scales):
                    if inert is not None:
                        share = share[~inert[share]]
                    mini_loss = self._backward(batch.select(share), loss_fn, scale, with_entropy, acc)
                    norm = self._finish_mini_batch(world)
                    loss_total += mini_loss
                    if torch.isfinite(norm):
                        grad_norm_total += float(norm)
                        steps += 1
                    else:
                        skipped += 1
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.model.train(was_training)
        result = acc.result()
        result.update(loss=loss_total / (epochs * mini_batches), grad_norm=grad_norm_total / max(steps, 1),
                      optimizer_steps=steps, skipped_steps=skipped,
                      inert_rows=0 if inert is None else int(inert.sum()),
                      peak_memory_mb=_peak_memory_mb(self.device), time_s=time.perf_counter() - start)
        return result

    def accumulate(self, batch: SequenceBatch, loss_fn: LossFn, scale: LossScale,
                   with_entropy: bool = True) -> dict[str, float]:
        """Forward and backward over ``batch`` (micro-batched), adding to the gradients without
        a step: for a mini-batch that arrives in parts, e.g. streamed while it is generated.
        ``finish_step`` then takes the step. ``loss_fn`` and ``scale`` are as in ``train_step``;
        a ``scale`` whose counts are not known yet may count 1 per rank (plain sums), with
        ``finish_step(grad_scale=...)`` dividing by the real count. Returns the callback's stats
        (weighted by completion tokens), ``loss``, ``tokens``, ``completion_tokens`` and
        ``micro_batches`` of this part."""
        self._check_ready()
        if len(batch) == 0:
            raise ValueError("empty batch: nothing to accumulate")
        was_training = self.model.training
        self.model.train()
        acc = Accumulated()
        try:
            loss = self._backward(batch, loss_fn, scale, with_entropy, acc)
        finally:
            self.model.train(was_training)
        return acc.result() | {"loss": loss}

    def finish_step(self, grad_scale: float = 1.0) -> float:
        """The optimizer step after ``accumulate``: gradients times ``grad_scale``, averaged over
        ranks, clipped, applied (skipped on every rank if their norm is not finite), zeroed.
        Every rank calls it, with or without parts of its own. Returns the gradient norm
        before clipping (nan when the step was skipped)."""
        self._check_ready()
        if grad_scale != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(grad_scale)
        norm = self._finish_mini_batch(self.world_size)
        return float(norm) if torch.isfinite(norm) else float("nan")

    def _check_ready(self) -> None:
        if self._offloaded_state:
            raise RuntimeError("the optimizer is offloaded: call onload_optimizer() before training")

    def _backward(self, rows: SequenceBatch, loss_fn: LossFn, scale: LossScale, with_entropy: bool,
                  acc: Accumulated) -> float:
        """Forward and backward of every micro-batch of ``rows``; returns their summed loss."""
        total: Any = 0.0
        micro = list(micro_batches(rows, self.max_tokens, self.share_prompts)) if len(rows) else []
        if self.sharded:
            self._in_lockstep(micro)
        for _, mb, layout in micro:
            # Counted before the move: on the batch's (usually CPU) side, no device sync.
            n_completion, n_tokens = int(mb.completion_mask.sum()), int(mb.attention_mask.sum())
            mb = mb.to(self.device)
            with autocast(self.device, self.autocast_dtype):
                logprobs, entropy = self.forward_tokens(mb, with_entropy, layout)
            loss, stats = loss_fn(logprobs, entropy, mb, scale)
            loss.backward()
            total = total + loss.detach()
            acc.add(stats, n_completion, n_tokens)
        return float(total)

    def _in_lockstep(self, micro: list) -> None:
        """Sharded, every forward gathers weights from every rank, so all ranks run as many
        micro-batches: runs the empty ones (one row of two tokens, zero loss) this rank is
        short of."""
        most = torch.tensor([len(micro)], device=self._collective_device())
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
        ids = torch.zeros((1, 2), dtype=torch.long, device=self.device)
        empty = SequenceBatch(ids, torch.ones_like(ids), torch.tensor([[0, 1]], device=self.device))
        for _ in range(int(most) - len(micro)):
            with autocast(self.device, self.autocast_dtype):
                out = self.forward_tokens(empty, False)[0]
            (out.sum() * 0).backward()

    def forward_tokens(self, mb: SequenceBatch, with_entropy: bool,
                       layout: PromptLayout | None = None) -> tuple[Tensor, Tensor | None]:
        """The per-token outputs the loss callback receives for micro-batch ``mb`` (on the
        device, with gradients): log-probs and entropies here; a subclass training another
        head (e.g. a critic's values) returns its own ``[b, l]`` tensor and ``None``.
        ``layout``: the rows' prompts when they may share their forward (else ``None``)."""
        return token_logprobs(self.model, mb, self.temperature, with_entropy, layout)

    def _loss_scales(self, batch: SequenceBatch, shares: list[Tensor], world: int) -> list[LossScale]:
        """Completion tokens and rows per mini-batch, summed over ranks (one all-reduce)."""
        mask = batch.completion_mask
        counts = torch.tensor([[int(mask[s.to(mask.device)].sum()) if len(s) else 0, len(s)] for s in shares],
                              dtype=torch.float64)
        if world > 1:
            counts = counts.to(self._collective_device())
            dist.all_reduce(counts, group=self.group)
            counts = counts.cpu()
        # Same counts on every rank, so every rank raises here together rather than one
        # raising while the others wait in an all-reduce.
        if (counts[:, 1] == 0).any():
            raise ValueError(f"{int((counts[:, 1] == 0).sum())} of {len(shares)} mini-batches have no rows: "
                             f"the batch has fewer rows ({int(counts[:, 1].sum())}) than mini_batches")
        return [LossScale(int(t), int(s), world) for t, s in counts.tolist()]

    def _finish_mini_batch(self, world: int) -> Tensor:
        """Average gradients over ranks, clip, step (unless the norm is not finite), zero."""
        for p in self.params:
            if p.grad is None:  # unused here, or no micro-batch on this rank: still takes part
                p.grad = torch.zeros_like(p)
        if world > 1 and not self.sharded:  # sharded: FSDP's reduce-scatter averaged them
            self._all_reduce_gradients(world)
        max_norm = self.max_grad_norm if self.max_grad_norm else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if self.sharded:  # a DTensor, of sharded gradients: the same total on every rank
            norm = norm.full_tensor()
        # The norm is identical on every rank after the all-reduce, so all skip together.
        if torch.isfinite(norm):
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm.detach()

    def _all_reduce_gradients(self, world: int) -> None:
        """Mean of every gradient over ranks, one flat all-reduce per bucket of one dtype."""
        grads = [p.grad for p in self.params]
        buckets: list[list[Tensor]] = []
        size = 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if not buckets or buckets[-1][0].dtype != g.dtype or size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += nbytes
        for bucket in buckets:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=self.group)
            flat /= world
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    # -- context switching ---------------------------------------------------------------

    def offload_optimizer(self) -> bool:
        """Move the Adam state to CPU memory. Returns whether anything moved (on a CPU
        device it is already there: a no-op, logged)."""
        if self.device.type == "cpu":
            log.info("offload_optimizer: the trainer runs on the CPU, nothing to move")
            return False
        already = len(self._offloaded_state)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and value.device == self.device:
                    state[key] = value.to("cpu")
                    self._offloaded_state.append((state, key))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return len(self._offloaded_state) > already

    def onload_optimizer(self) -> bool:
        """Bring back what ``offload_optimizer`` moved. Returns whether anything moved."""
        moved = bool(self._offloaded_state)
        for state, key in self._offloaded_state:
            state[key] = state[key].to(self.device)
        self._offloaded_state = []
        return moved

    # -- checkpoints and weight sync -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and step. The tensors are the live ones: save or copy them
        before training on. Sharded: full tensors on the CPU on rank 0, none on the others
        (every rank must call it)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
                get_optimizer_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            # Before the first step there is no Adam state: asked for it, torch would make one
            # by a zero-lr step, which counts as a step in Adam's bias correction.
            optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options) if self.step else None
            return {"model": get_model_state_dict(self.model, options=options), "optimizer": optimizer,
                    "step": self.step, "sharded": True}
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A ``state_dict`` of this trainer or of one sharded otherwise (a run resumed on
        another placement). Sharded: rank 0's is broadcast (the other ranks' is not read);
        a replicated trainer's optimizer state, keyed by parameter number, is keyed by name
        first, as a sharded one's is. Replicated: a sharded trainer's full state loads by name."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        named = state.get("sharded", False)  # the optimizer state is keyed by parameter name
        if self.sharded:
            first = dist.get_rank(self.group) == 0
            model, optimizer = (state["model"], state["optimizer"]) if first else ({}, {})
            if first and state["step"] and not named:
                optimizer = self._by_name(optimizer)
            # Apart: set_state_dict skips the model on the ranks whose (empty) model state it gets.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, model, options=options)
            if state["step"]:  # the same on every rank
                set_optimizer_state_dict(self.model, self.optimizer, optimizer, options=options)
        elif named:
            self.model.load_state_dict(state["model"])
            if state["step"]:
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                         options=StateDictOptions(full_state_dict=True))
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])  # casts the state to the parameters' devices
        self.step = int(state["step"])
        self._offloaded_state = []

    def _by_name(self, optimizer: dict[str, Any]) -> dict[str, Any]:
        """A replicated trainer's optimizer ``state_dict`` (parameters numbered in the order
        the optimizer holds them) keyed by parameter name, as torch's full state dicts are."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        return {"state": {order[int(k)]: v for k, v in optimizer["state"].items()},
                "param_groups": [{**g, "params": [order[int(k)] for k in g["params"]]}
                                 for g in optimizer["param_groups"]]}

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The model's weights for weight sync (see ``m2flow.engines.weights.named_weights``).
        Sharded: each gathered in full, on every rank (every rank must take them all)."""
        if not self.sharded:
            return named_weights(self.model)
        return gathered_weights(self.model)

    def weights_hash(self) -> str:
        return weights_hash(self.named_weights())
