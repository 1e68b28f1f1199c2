"""The batch that crosses components, ``SequenceBatch``: right-padded prompt + completion rows,
and its cutting into micro-batches.

Log-prob convention: ``logprobs[:, t]`` is the log-probability of ``input_ids[:, t]`` given
``input_ids[:, :t]``. Position 0 has no such probability and is never a completion token;
it holds 0, as do padding positions. Every per-token field (``old_logprobs``, ``advantages``,
...) uses the same alignment, so ``logprobs - old_logprobs`` needs no shifting, and each is
meaningful only where ``completion_mask`` is 1.

Work is cut into micro-batches by a token budget (rows x longest row of the micro-batch),
longest rows first, each trimmed to its own longest row, so padding costs little and the
first micro-batch is the largest (an out-of-memory shows at once, not mid-step). When rows
share their prompts (``PromptLayout``), a prompt's rows come together in one micro-batch, so
that they can share its forward (see ``m2flow.engines.scoring``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "advantages", "values", "returns", "behaviour_logprobs", "versions",
                "position_ids")


@dataclass
class SequenceBatch:
    """Right-padded token rows: ``input_ids`` is prompt + completion, then padding.

    ``attention_mask`` is 1 on real tokens, ``completion_mask`` 1 on completion tokens only.
    The optional per-token fields are ``[B, L]`` and aligned with ``input_ids`` (see the module
    docstring). ``ids`` names each row's sample, for the checks that none is lost or trained
    twice (``runners.metrics.Ledger``). ``extras`` holds anything else; ``select`` indexes its
    tensors whose first dimension is ``B`` and its lists/tuples of length ``B``, and keeps the
    rest as they are.
    """

    input_ids: Tensor
    attention_mask: Tensor
    completion_mask: Tensor
    old_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    advantages: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    behaviour_logprobs: Tensor | None = None  # the sampling log-probs, kept where old_logprobs are recomputed
    versions: Tensor | None = None  # int64: the policy version that sampled each token
    # int64, packed rows only (several sequences in one row, e.g. supervised chats): each
    # sequence's positions from 0; a token attends to its own sequence's tokens only
    position_ids: Tensor | None = None
    ids: Tensor | None = None  # int64 [B, 2]: each row's sample, (its prompt's index, its index in the prompt's group)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L], got shape {tuple(self.input_ids.shape)}")
        shape = self.input_ids.shape
        for name in ("attention_mask", "completion_mask", *TOKEN_FIELDS):
            value = getattr(self, name)
            if value is not None and value.shape != shape:
                raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)} like input_ids")
        if self.ids is not None and len(self.ids) != shape[0]:
            raise ValueError(f"ids has {len(self.ids)} rows, input_ids {shape[0]}")

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

    def sample_ids(self, rows: Tensor | Sequence[int] | None = None) -> list[tuple[int, int]]:
        """The ids of every row (of ``rows``) as pairs; none where the batch has no ids."""
        if self.ids is None:
            return []
        ids = self.ids if rows is None else self.ids[torch.as_tensor(rows, dtype=torch.long)]
        return [tuple(i) for i in ids.tolist()]

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
        picked["ids"] = None if self.ids is None else self.ids[idx.to(self.ids.device)]
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
                        **{name: join(name, 0.0) for name in TOKEN_FIELDS},
                        ids=None if any(b.ids is None for b in batches) else torch.cat([b.ids for b in batches]))
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
    of similar length. With ``prompts`` (a prompt id per row) a prompt's rows come together,
    longest first within it, so that they share its forward, and join a micro-batch only all
    together: a prompt split over two micro-batches is forwarded in both, and a chunk of many
    groups would train slower than the same rows a group at a time (docs/reasoning.md). A
    prompt whose rows alone exceed the budget is cut into parts by it. Every row appears in
    exactly one micro-batch. A row longer than the budget cannot be split and gets a
    micro-batch of its own (over the budget)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    row_lengths = batch.lengths.cpu()
    order = torch.argsort(row_lengths, descending=True, stable=True)
    lengths = row_lengths.tolist()
    if prompts is None:
        runs = [[i] for i in order.tolist()]
    else:  # stable: longest first within each prompt; a run per prompt
        prompts = prompts.cpu()
        order = order[torch.argsort(prompts[order], stable=True)]
        rows = zip(order.tolist(), prompts[order].tolist())
        runs = [[i for i, _ in run] for _, run in itertools.groupby(rows, key=lambda row: row[1])]
    groups: list[list[int]] = []
    longest = 0
    for run in runs:  # longest first: its first row is its longest
        if groups and (len(groups[-1]) + len(run)) * max(longest, lengths[run[0]]) <= max_tokens:
            groups[-1] += run
            longest = max(longest, lengths[run[0]])
            continue
        for i in run:  # a micro-batch of its own, cut by the budget
            if i == run[0] or (len(groups[-1]) + 1) * longest > max_tokens:
                groups.append([i])
                longest = lengths[i]
            else:
                groups[-1].append(i)
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


def micro_batches(batch: SequenceBatch, max_tokens: int,
                  share_prompts: bool) -> Iterator[tuple[Tensor, SequenceBatch, PromptLayout | None]]:
    """``(row indices, micro-batch, its prompt layout or None)`` by token budget; with
    ``share_prompts`` and a batch laid out prompt-then-completion, a prompt's rows together."""
    layout = PromptLayout.of(batch) if share_prompts else None
    for idx in split_by_token_budget(batch, max_tokens, layout.prompts if layout else None):
        yield idx, micro_batch(batch, idx), layout.select(idx) if layout else None


def micro_batch(batch: SequenceBatch, indices: Tensor) -> SequenceBatch:
    """The rows ``indices``, without the padding columns they do not need."""
    rows = batch.select(indices)
    return rows.truncate(max(int(rows.lengths.max()), 1))
