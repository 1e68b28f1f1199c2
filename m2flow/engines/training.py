"""Training and scoring backend for causal LMs: the actor trains with ``LMTrainer``, the
inference worker scores with ``compute_logprobs`` (reference and old-policy log-probs).

Data crosses components as a ``SequenceBatch``: right-padded prompt + completion rows.

Log-prob convention: ``logprobs[:, t]`` is the log-probability of ``input_ids[:, t]`` given
``input_ids[:, :t]``. Position 0 has no such probability and is never a completion token;
it holds 0, as do padding positions. Every per-token field (``old_logprobs``, ``advantages``,
...) uses the same alignment, so ``logprobs - old_logprobs`` needs no shifting, and each is
meaningful only where ``completion_mask`` is 1.

Work is cut into micro-batches by a token budget (rows x longest row of the micro-batch),
longest rows first, each trimmed to its own longest row, so padding costs little and the
first micro-batch is the largest (an out-of-memory shows at once, not mid-step).

Shared prompts: the rows of a GRPO group share their prompt. When every row is prompt then
completion (right-padded), each distinct prompt of a micro-batch is run once and its keys and
values are reused by all its rows, which then forward only their completion; logits are
computed for completion positions only. Same log-probs and gradients as the full forward (the
prompt's gradient is the sum over its rows), for about half the FLOPs on short completions.
Micro-batches then keep a prompt's rows together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import resource
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor, nn

log = logging.getLogger(__name__)

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "values", "returns")


@dataclass
class SequenceBatch:
    """Right-padded token rows: ``input_ids`` is prompt + completion, then padding.

    ``attention_mask`` is 1 on real tokens, ``completion_mask`` 1 on completion tokens only.
    The optional per-token fields are ``[B, L]`` and aligned with ``input_ids`` (see the module
    docstring). ``extras`` holds anything else; ``select`` indexes its tensors whose first
    dimension is ``B`` and its lists/tuples of length ``B``, and keeps the rest as they are.
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(self.input_ids.shape)}")
        shape = self.input_ids.shape
        for name in ("attention_mask", "completion_mask", *TOKEN_FIELDS):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)} like input_ids")

    @classmethod
    def from_completions(cls, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                         pad_id: int) -> SequenceBatch:
        """Rows ``prompt + completion``, right-padded with ``pad_id`` to the longest row.
        Every prompt needs at least one token (position 0 cannot be scored)."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
        if not prompt_ids:
            raise ValueError("no sequences: prompt_ids and completion_ids are empty")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("every prompt needs at least one token: position 0 has no log-prob")
        width = max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
        ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        completion = torch.zeros_like(ids)
        for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
            n = len(p) + len(c)
            ids[i, :n] = torch.tensor([*p, *c], dtype=torch.long)
            attention[i, :n] = 1
            completion[i, len(p):n] = 1
        return cls(ids, attention, completion)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> Tensor:
        """Per row: index of the last real token + 1 (the row's length when right-padded)."""
        positions = torch.arange(1, self.input_ids.shape[1] + 1, device=self.input_ids.device)
        if len(positions) == 0:
            return torch.zeros(len(self), dtype=torch.long, device=self.input_ids.device)
        return (self.attention_mask.bool() * positions).amax(dim=1)

    def select(self, indices: Tensor | Sequence[int]) -> SequenceBatch:
        """The rows ``indices``, in that order."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.input_ids.device)
        n = len(self)
        picked = {name: getattr(self, name)[idx] for name in ("input_ids", "attention_mask", "completion_mask")}
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            picked[name] = None if value is None else value[idx.to(value.device)]
        extras = {}
        for key, value in self.extras.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == n:
                extras[key] = value[idx.to(value.device)]
            elif isinstance(value, (list, tuple)) and len(value) == n:
                extras[key] = type(value)(value[i] for i in idx.tolist())
            else:
                extras[key] = value
        return SequenceBatch(**picked, extras=extras)

    def truncate(self, length: int) -> SequenceBatch:
        """The first ``length`` columns of every per-token field (drops padding columns)."""
        cut = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("input_ids", "attention_mask", "completion_mask", *TOKEN_FIELDS):
            if cut[name] is not None:
                cut[name] = cut[name][:, :length]
        return SequenceBatch(**cut)

    def to(self, device: torch.device | str) -> SequenceBatch:
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in moved.items():
            if isinstance(value, Tensor):
                moved[name] = value.to(device)
        moved["extras"] = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in self.extras.items()}
        return SequenceBatch(**moved)


def concat_batches(batches: Sequence[SequenceBatch], pad_id: int) -> SequenceBatch:
    """The rows of ``batches`` in order, right-padded to the widest. A per-token field is kept
    if every batch has it. ``extras``: per-row lists and ``[B]`` tensors are joined; any other
    value is the first batch's (e.g. a group size all batches share)."""
    if not batches:
        raise ValueError("no batches to concatenate")
    width = max(b.input_ids.shape[1] for b in batches)

    def join(name: str, fill: float) -> Tensor | None:
        parts = [getattr(b, name) for b in batches]
        if any(p is None for p in parts):
            return None
        return torch.cat([nn.functional.pad(p, (0, width - p.shape[1]), value=fill) for p in parts])

    out = SequenceBatch(join("input_ids", pad_id), join("attention_mask", 0), join("completion_mask", 0),
                        **{name: join(name, 0.0) for name in TOKEN_FIELDS})
    for key, first in batches[0].extras.items():
        values = [b.extras.get(key) for b in batches]
        if all(isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == len(b) for v, b in zip(values, batches)):
            out.extras[key] = torch.cat(values)
        elif all(isinstance(v, (list, tuple)) and len(v) == len(b) for v, b in zip(values, batches)):
            out.extras[key] = [x for v in values for x in v]
        else:
            out.extras[key] = first
    return out


def split_by_token_budget(batch: SequenceBatch, max_tokens: int, prompts: Tensor | None = None) -> list[Tensor]:
    """Row indices of micro-batches whose padded size (rows x longest row in the micro-batch)
    is at most ``max_tokens``. Rows are taken longest first, so each micro-batch holds rows
    of similar length; with ``prompts`` (a prompt id per row) a prompt's rows come together,
    longest first within it, so that they share its forward. Every row appears in exactly one
    micro-batch. A row longer than the budget cannot be split and gets a micro-batch of its
    own (over the budget)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    lengths = batch.lengths.cpu()
    order = torch.argsort(lengths, descending=True, stable=True)
    if prompts is not None:  # stable: longest first within each prompt
        order = order[torch.argsort(prompts.cpu()[order], stable=True)]
    groups: list[list[int]] = []
    longest = 0
    for i in order.tolist():
        if groups and (len(groups[-1]) + 1) * max(longest, int(lengths[i])) <= max_tokens:
            groups[-1].append(i)
            longest = max(longest, int(lengths[i]))
        else:
            groups.append([i])
            longest = int(lengths[i])
    return [torch.tensor(g, dtype=torch.long) for g in groups]


@dataclass(frozen=True)
class PromptLayout:
    """Where each row's prompt ends: ``prompt_lengths`` and ``completion_lengths`` per row, and
    ``prompts``, an id per row that is equal for rows with the same prompt tokens."""

    prompt_lengths: Tensor
    completion_lengths: Tensor
    prompts: Tensor

    @staticmethod
    def of(batch: SequenceBatch) -> PromptLayout | None:
        """The layout when every row is prompt (at least one token) then completion, right-padded;
        else ``None`` (e.g. left padding, or completion tokens between prompt tokens)."""
        if len(batch) == 0:
            return None
        mask, lengths = batch.completion_mask.bool().cpu(), batch.lengths.cpu()
        columns = torch.arange(mask.shape[1])
        n_completion = mask.sum(dim=1)
        starts = lengths - n_completion
        completion = (columns >= starts[:, None]) & (columns < lengths[:, None])
        real = columns < lengths[:, None]
        if (starts < 1).any() or not torch.equal(completion, mask) \
                or not torch.equal(real, batch.attention_mask.bool().cpu()):
            return None
        ids = batch.input_ids.cpu()
        seen: dict[tuple[int, ...], int] = {}
        prompts = [seen.setdefault(tuple(ids[i, :starts[i]].tolist()), len(seen)) for i in range(len(batch))]
        return PromptLayout(starts, n_completion, torch.tensor(prompts, dtype=torch.long))

    def select(self, indices: Tensor) -> PromptLayout:
        return PromptLayout(self.prompt_lengths[indices], self.completion_lengths[indices], self.prompts[indices])


def _micro_batches(batch: SequenceBatch, max_tokens: int,
                   share_prompts: bool) -> Iterator[tuple[Tensor, SequenceBatch, PromptLayout | None]]:
    """``(row indices, micro-batch, its prompt layout or None)`` by token budget; with
    ``share_prompts`` and a batch laid out prompt-then-completion, a prompt's rows together."""
    layout = PromptLayout.of(batch) if share_prompts else None
    for idx in split_by_token_budget(batch, max_tokens, layout.prompts if layout else None):
        yield idx, _micro_batch(batch, idx), layout.select(idx) if layout else None


def _micro_batch(batch: SequenceBatch, indices: Tensor) -> SequenceBatch:
    """The rows ``indices``, without the padding columns they do not need."""
    rows = batch.select(indices)
    return rows.truncate(max(int(rows.lengths.max()), 1))


# Tokens per chunk of the vocabulary-sized fp32 work (log-softmax, entropy): with a 49k
# vocabulary one fp32 temporary of a chunk is 0.4 GB. On an H100 (135M Llama, bf16 autocast)
# 2048 kept training speed within 2% of 4096 and peak memory 2 GB lower; 1024 cost 18% speed.
LOGIT_CHUNK_TOKENS = 2048


def _fp32_logits(logits: Tensor, temperature: float) -> Tensor:
    logits = logits.float()  # fp32 even under bf16 autocast: log-probs are compared across models
    return logits / temperature if temperature != 1.0 else logits


def _chunk_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    logits = _fp32_logits(logits, temperature)
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(dim=-1)


def _chunk_entropy(logits: Tensor, temperature: float) -> Tensor:
    logits = _fp32_logits(logits, temperature)
    return logits.logsumexp(dim=-1) - (logits.softmax(dim=-1) * logits).sum(dim=-1)


def _scores(logits: Tensor, targets: Tensor, valid: Tensor, temperature: float,
            with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` under ``logits`` ``[b, s, V]`` (and entropies), ``[b, s]`` fp32,
    0 where not ``valid``."""
    step = max(1, LOGIT_CHUNK_TOKENS // max(logits.shape[0], 1))
    checkpointed = torch.is_grad_enabled() and logits.requires_grad
    zero = logits.new_zeros((), dtype=torch.float32)

    def chunked(fn: Callable[..., Tensor], *args: Any) -> Tensor:
        parts = []
        for start in range(0, logits.shape[1], step):
            chunk = [logits[:, start:start + step]] + [a[:, start:start + step] if isinstance(a, Tensor) else a
                                                       for a in args]
            # Checkpointed: the fp32 vocabulary-sized work is recomputed in backward, one chunk
            # at a time, instead of kept for every token. Log-probs and entropy are separate
            # checkpoints, so an entropy that the loss ignores is never recomputed or kept.
            parts.append(torch.utils.checkpoint.checkpoint(fn, *chunk, use_reentrant=False) if checkpointed
                         else fn(*chunk))
        # torch.where, not a product: a padding position can never leak NaN or gradient.
        return torch.where(valid, torch.cat(parts, dim=1), zero)

    logprobs = chunked(_chunk_logprobs, targets, temperature)
    entropy = chunked(_chunk_entropy, temperature) if with_entropy else None
    return logprobs, entropy


def _token_logprobs(model: nn.Module, batch: SequenceBatch, temperature: float, with_entropy: bool,
                    layout: PromptLayout | None = None) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropies of the predicting distribution), ``[b, l]`` fp32,
    in the module's convention; 0 at position 0 and on padding. With a ``layout`` (and a
    transformers model), each distinct prompt is forwarded once and only completion tokens
    are scored: 0 on prompt tokens too."""
    from transformers import PreTrainedModel  # here: importing transformers is slow and not always needed

    if layout is not None and isinstance(model, PreTrainedModel):
        return _shared_prompt_logprobs(model, batch, layout, temperature, with_entropy)
    ids, mask = batch.input_ids, batch.attention_mask
    # Explicit positions: 0.. on each row's real tokens whatever the padding side, rather
    # than relying on a model's own derivation from the mask.
    positions = (mask.long().cumsum(dim=1) - 1).clamp_(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, :-1]
    logprobs, entropy = _scores(logits, ids[:, 1:], mask[:, 1:].bool(), temperature, with_entropy)
    pad = (1, 0)
    return nn.functional.pad(logprobs, pad), None if entropy is None else nn.functional.pad(entropy, pad)


def _shared_prompt_logprobs(model: PreTrainedModel, batch: SequenceBatch, layout: PromptLayout, temperature: float,
                            with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``_token_logprobs`` with each distinct prompt forwarded once.

    A row's prompt minus its last token is its prefix; the suffix is the last prompt token and
    the completion minus its last token, whose logits predict exactly the completion tokens.
    The prefixes (one per distinct prompt, right-padded: causal attention never looks at the
    padding after a real token) give keys and values; each row's suffix attends to its
    prompt's prefix columns (the rest are masked) and causally to its own suffix."""
    from transformers.cache_utils import DynamicCache

    ids, device = batch.input_ids, batch.input_ids.device
    b, length = ids.shape
    prompt_len = layout.prompt_lengths.to(device)
    completion_len = layout.completion_lengths.to(device)
    prefix_len = prompt_len - 1
    distinct, which = torch.unique(layout.prompts.to(device), return_inverse=True)  # which: row -> its prompt
    rows = torch.arange(b, device=device)
    first_row = torch.full((len(distinct),), b, device=device).scatter_reduce(0, which, rows, "amin")
    width = int(prefix_len.max())
    cache = None
    if width > 0:
        prefix_ids = torch.where(torch.arange(width, device=device)[None, :] < prefix_len[first_row, None],
                                 ids[first_row, :width], ids.new_zeros(()))
        out = model(input_ids=prefix_ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        # Each row's prompt's keys and values; the suffix forward appends its own to them (a
        # differentiable concatenation, so gradients reach the prompt's forward).
        cache = DynamicCache()
        for i, layer in enumerate(out.past_key_values.layers):
            cache.update(layer.keys[which], layer.values[which], i)
    suffix_width = max(int(completion_len.max()), 1)
    steps = torch.arange(suffix_width, device=device)
    columns = (prefix_len[:, None] + steps[None, :]).clamp(max=length - 1)
    suffix_ids = ids.gather(1, columns)
    suffix_real = steps[None, :] < completion_len.clamp(min=1)[:, None]
    query, key = steps[:, None], steps[None, :]
    own = (key <= query) & (suffix_real[:, None, :] | (key == query))           # [b, s, s]
    prefix = (torch.arange(width, device=device)[None, :] < prefix_len[:, None])  # [b, width]
    allowed = torch.cat([prefix[:, None, :].expand(b, suffix_width, width), own], dim=2)
    dtype = model.dtype
    additive = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    logits = model(input_ids=suffix_ids, attention_mask=additive[:, None], position_ids=columns,
                   past_key_values=cache, use_cache=True).logits
    targets = ids.gather(1, (columns + 1).clamp(max=length - 1))
    valid = steps[None, :] < completion_len[:, None]
    logprobs, entropy = _scores(logits, targets, valid, temperature, with_entropy)
    # Back to the batch's columns: suffix step j of row i scores token prompt_len[i] + j.
    at = prompt_len[:, None] + steps[None, :]

    def place(x: Tensor) -> Tensor:
        return x.new_zeros(b, length + suffix_width).scatter(1, at, x)[:, :length]

    return place(logprobs), None if entropy is None else place(entropy)


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _check_batch(batch: SequenceBatch, max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if len(batch) == 0:
        raise ValueError("empty batch: nothing to score or train on")


@torch.no_grad()
def compute_logprobs(model: nn.Module, batch: SequenceBatch, max_tokens: int, temperature: float = 1.0,
                     with_entropy: bool = False, autocast_dtype: torch.dtype | None = None,
                     share_prompts: bool = True) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs ``[B, L]`` (fp32, on the batch's device) of ``batch.input_ids`` under
    ``model`` at ``temperature``, in the module's convention; with ``with_entropy`` a pair
    ``(logprobs, entropy)``. Runs in eval mode without gradients, micro-batched so that no
    forward pass exceeds ``max_tokens`` padded tokens (bar a single longer row).
    ``share_prompts``: see the module docstring (then only completion tokens are scored)."""
    _check_batch(batch, max_tokens)
    device = next(model.parameters()).device
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    ent = torch.zeros_like(out) if with_entropy else None
    was_training = model.training
    model.eval()
    try:
        for idx, mb, layout in _micro_batches(batch, max_tokens, share_prompts):
            with _autocast(device, autocast_dtype):
                lp, e = _token_logprobs(model, mb.to(device), temperature, with_entropy, layout)
            rows = idx.to(out.device)
            out[rows, :lp.shape[1]] = lp.to(out.device)
            if ent is not None:
                ent[rows, :e.shape[1]] = e.to(out.device)
    finally:
        model.train(was_training)
    return (out, ent) if with_entropy else out


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


def named_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for every persistent weight of ``model`` (its state dict), each
    storage once: a tied weight (e.g. ``lm_head.weight`` = embeddings) comes under its first
    name only. The tensors are the live ones, detached; copy them to keep a snapshot."""
    seen = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        yield name, tensor


def _fully_shard(model: nn.Module, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """FSDP2 over ``group``'s ranks: a unit per decoder layer (a transformers model names its
    layer classes in ``_no_split_modules``), then the root, which holds the rest (embeddings,
    final norm, head: tied weights stay in one unit)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _gathered_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``named_weights`` of a sharded model: each weight gathered in full (a collective, in
    state-dict order on every rank); a tied weight under its first name only."""
    from torch.distributed.tensor import DTensor

    seen = set()
    for name, tensor in model.state_dict(keep_vars=True).items():  # the parameters themselves: tied ones are one
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensor = tensor.detach()
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def weights_hash(weights: nn.Module | Iterable[tuple[str, Tensor]]) -> str:
    """sha256 over names, dtypes, shapes and bytes of the weights, in name order: equal for
    two models exactly when they hold identical weights (same names, tying and values)."""
    named = named_weights(weights) if isinstance(weights, nn.Module) else weights
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Linux reports ru_maxrss in KiB; it is the process's peak since it started (no reset).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


@dataclass
class _Accumulated:
    """Sums over micro-batches: the loss callback's stats weighted by completion tokens, and
    the token counts."""

    sums: dict[str, Any] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    micro_batches: int = 0
    tokens: int = 0
    completion_tokens: int = 0

    def add(self, stats: dict[str, Any], n_completion: int, n_tokens: int) -> None:
        for key, value in stats.items():
            v = value.detach().float() if isinstance(value, Tensor) else float(value)
            self.sums[key] = self.sums.get(key, 0.0) + v * n_completion
            self.weights[key] = self.weights.get(key, 0.0) + n_completion
        self.micro_batches += 1
        self.tokens += n_tokens
        self.completion_tokens += n_completion

    def result(self) -> dict[str, float]:
        out = {k: float(self.sums[k] / self.weights[k]) if self.weights[k] else float("nan") for k in self.sums}
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
            _fully_shard(self.model, self.group, self.device)
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
        tokens (this rank's); ``loss`` (the summed micro-batch losses per mini-batch, averaged
        over mini-batches: on one rank the mini-batch loss, with several ranks their mean is);
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
        acc = _Accumulated()
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
        acc = _Accumulated()
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
        if next(self.model.parameters()).device != self.device:
            raise RuntimeError("the model is offloaded: call onload_model() before training")
        if self._offloaded_state:
            raise RuntimeError("the optimizer is offloaded: call onload_optimizer() before training")

    def _backward(self, rows: SequenceBatch, loss_fn: LossFn, scale: LossScale, with_entropy: bool,
                  acc: _Accumulated) -> float:
        """Forward and backward of every micro-batch of ``rows``; returns their summed loss."""
        total: Any = 0.0
        micro = list(_micro_batches(rows, self.max_tokens, self.share_prompts)) if len(rows) else []
        if self.sharded:
            self._in_lockstep(micro)
        for _, mb, layout in micro:
            # Counted before the move: on the batch's (usually CPU) side, no device sync.
            n_completion, n_tokens = int(mb.completion_mask.sum()), int(mb.attention_mask.sum())
            mb = mb.to(self.device)
            with _autocast(self.device, self.autocast_dtype):
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
            with _autocast(self.device, self.autocast_dtype):
                out = self.forward_tokens(empty, False)[0]
            (out.sum() * 0).backward()

    def forward_tokens(self, mb: SequenceBatch, with_entropy: bool,
                       layout: PromptLayout | None = None) -> tuple[Tensor, Tensor | None]:
        """The per-token outputs the loss callback receives for micro-batch ``mb`` (on the
        device, with gradients): log-probs and entropies here; a subclass training another
        head (e.g. a critic's values) returns its own ``[b, l]`` tensor and ``None``.
        ``layout``: the rows' prompts when they may share their forward (else ``None``)."""
        return _token_logprobs(self.model, mb, self.temperature, with_entropy, layout)

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

    def offload_model(self) -> bool:
        """Move the weights to CPU memory (the optimizer keeps referring to the same
        parameters). Returns whether anything moved; a no-op on a CPU device."""
        if self.device.type == "cpu":
            log.info("offload_model: the trainer runs on the CPU, nothing to move")
            return False
        self.model.to("cpu")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def onload_model(self) -> bool:
        """Move the weights back to the trainer's device. Returns whether anything moved."""
        if next(self.model.parameters()).device == self.device:
            return False
        self.model.to(self.device)
        return True

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
        """A ``state_dict`` of a trainer sharded alike (sharded: rank 0's is broadcast)."""
        if state.get("sharded", False) != self.sharded:
            raise ValueError(f"a {'sharded' if state.get('sharded') else 'replicated'} trainer's state cannot load "
                             f"into a {'sharded' if self.sharded else 'replicated'} one: resume with the same "
                             "algorithm.data_parallel")
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
                set_optimizer_state_dict,
            )

            # Apart: set_state_dict skips the model on the ranks whose (empty) model state it gets.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(self.model, state["model"], options=options)
            if state["step"]:  # the same on every rank
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])  # casts the state to the parameters' devices
        self.step = int(state["step"])
        self._offloaded_state = []

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The model's weights for weight sync (see the module-level ``named_weights``).
        Sharded: each gathered in full, on every rank (every rank must take them all)."""
        if not self.sharded:
            return named_weights(self.model)
        return _gathered_weights(self.model)

    def weights_hash(self) -> str:
        return weights_hash(self.named_weights())
