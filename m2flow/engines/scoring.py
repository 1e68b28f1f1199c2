"""Log-prob scoring of causal LMs on ``SequenceBatch``es: the inference worker scores with
``compute_logprobs`` (reference and old-policy log-probs); ``LMTrainer`` trains on
``token_logprobs``. Log-probs follow the convention of ``m2flow.engines.batch``.

Shared prompts: the rows of a GRPO group share their prompt. When every row is prompt then
completion (right-padded), each distinct prompt of a micro-batch is run once and its keys and
values are reused by all its rows, which then forward only their completion; logits are
computed for completion positions only. Same log-probs and gradients as the full forward (the
prompt's gradient is the sum over its rows), for about half the FLOPs on short completions.
Micro-batches then keep a prompt's rows together.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from m2flow.engines.batch import PromptLayout, SequenceBatch, micro_batches

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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


@functools.cache
def _cache_argument(model_type: type) -> str:
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def with_kv_cache(model: nn.Module, cache: Any) -> dict[str, Any]:
    """The keyword that passes a KV cache to ``model``'s forward: ``cache`` from transformers
    5.24 on (``past_key_values`` is deprecated there and goes in 5.40), ``past_key_values``
    before."""
    return {_cache_argument(type(model)): cache}


def kv_cache_of(out: Any) -> Any:
    """The KV cache a forward returned, under either name (``with_kv_cache``)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def token_logprobs(model: nn.Module, batch: SequenceBatch, temperature: float, with_entropy: bool,
                   layout: PromptLayout | None = None) -> tuple[Tensor, Tensor | None]:
    """Per-token log-probs (and entropies of the predicting distribution), ``[b, l]`` fp32,
    in the log-prob convention of ``m2flow.engines.batch``; 0 at position 0 and on padding.
    With a ``layout`` (and a transformers model), each distinct prompt is forwarded once and
    only completion tokens are scored: 0 on prompt tokens too."""
    from transformers import PreTrainedModel  # here: importing transformers is slow and not always needed

    if layout is not None and batch.position_ids is None and isinstance(model, PreTrainedModel):
        return _shared_prompt_logprobs(model, batch, layout, temperature, with_entropy)
    ids, mask = batch.input_ids, batch.attention_mask
    if batch.position_ids is not None:
        # Packed rows: with no attention mask, transformers reads the sequences off the
        # positions (each starts again at 0) and lets a token attend to its own sequence only.
        logits = model(input_ids=ids, position_ids=batch.position_ids, use_cache=False).logits[:, :-1]
    else:
        # Explicit positions: 0.. on each row's real tokens whatever the padding side, rather
        # than relying on a model's own derivation from the mask.
        positions = (mask.long().cumsum(dim=1) - 1).clamp_(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, :-1]
    logprobs, entropy = _scores(logits, ids[:, 1:], mask[:, 1:].bool(), temperature, with_entropy)
    pad = (1, 0)
    return nn.functional.pad(logprobs, pad), None if entropy is None else nn.functional.pad(entropy, pad)


def _shared_prompt_logprobs(model: PreTrainedModel, batch: SequenceBatch, layout: PromptLayout, temperature: float,
                            with_entropy: bool) -> tuple[Tensor, Tensor | None]:
    """``token_logprobs`` with each distinct prompt forwarded once.

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
        out = model(input_ids=prefix_ids, **with_kv_cache(model, DynamicCache()), use_cache=True, logits_to_keep=1)
        # Each row's prompt's keys and values; the suffix forward appends its own to them (a
        # differentiable concatenation, so gradients reach the prompt's forward).
        cache = DynamicCache()
        for i, layer in enumerate(kv_cache_of(out).layers):
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
                   **with_kv_cache(model, cache), use_cache=True).logits
    targets = ids.gather(1, (columns + 1).clamp(max=length - 1))
    valid = steps[None, :] < completion_len[:, None]
    logprobs, entropy = _scores(logits, targets, valid, temperature, with_entropy)
    # Back to the batch's columns: suffix step j of row i scores token prompt_len[i] + j.
    at = prompt_len[:, None] + steps[None, :]

    def place(x: Tensor) -> Tensor:
        return x.new_zeros(b, length + suffix_width).scatter(1, at, x)[:, :length]

    return place(logprobs), None if entropy is None else place(entropy)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``'s type; nothing when ``dtype`` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _check_batch(batch: SequenceBatch, max_tokens: int) -> None:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    if len(batch) == 0:
        raise ValueError("empty batch: nothing to score or train on")


def learned_nll(model: nn.Module, batch: SequenceBatch, max_tokens: int,
                autocast_dtype: torch.dtype | None = None) -> tuple[float, int]:
    """``(sum, count)`` of the negative log-likelihoods (at temperature 1) of ``batch``'s
    learned tokens (``completion_mask``): a supervised held-out loss is ``sum / count``."""
    logp = compute_logprobs(model, batch, max_tokens, 1.0, autocast_dtype=autocast_dtype, share_prompts=False)
    learned = batch.completion_mask.bool()
    return float(-logp[learned].sum()), int(learned.sum())


@torch.no_grad()
def compute_logprobs(model: nn.Module, batch: SequenceBatch, max_tokens: int, temperature: float = 1.0,
                     with_entropy: bool = False, autocast_dtype: torch.dtype | None = None,
                     share_prompts: bool = True) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probs ``[B, L]`` (fp32, on the batch's device) of ``batch.input_ids`` under
    ``model`` at ``temperature``, in the log-prob convention of ``m2flow.engines.batch``; with
    ``with_entropy`` a pair ``(logprobs, entropy)``. Runs in eval mode without gradients,
    micro-batched so that no forward pass exceeds ``max_tokens`` padded tokens (bar a single
    longer row).
    ``share_prompts``: see the module docstring (then only completion tokens are scored)."""
    _check_batch(batch, max_tokens)
    device = next(model.parameters()).device
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
    ent = torch.zeros_like(out) if with_entropy else None
    was_training = model.training
    model.eval()
    try:
        for idx, mb, layout in micro_batches(batch, max_tokens, share_prompts):
            with autocast(device, autocast_dtype):
                lp, e = token_logprobs(model, mb.to(device), temperature, with_entropy, layout)
            rows = idx.to(out.device)
            out[rows, :lp.shape[1]] = lp.to(out.device)
            if ent is not None:
                ent[rows, :e.shape[1]] = e.to(out.device)
    finally:
        model.train(was_training)
    return (out, ent) if with_entropy else out
