"""Sampling a batch's next tokens, with the log-probs of the full temperature-scaled
distribution (what the trainer recomputes), from one random stream or one per row."""

from __future__ import annotations

import torch

from m2flow.engines.generation import SamplingParams


def sample_tokens(logits: torch.Tensor, params: SamplingParams,
                  generator: torch.Generator | list[torch.Generator] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens for a [rows, vocab] float32 batch of logits, and their log-probs under the
    full temperature-scaled distribution (top-k/top-p only narrow what can be drawn).
    ``generator``: one for the batch, or one per row."""
    if params.greedy:
        tokens = logits.argmax(-1)
        logprobs = torch.log_softmax(logits, -1)
    else:
        scaled = logits / params.temperature
        logprobs = torch.log_softmax(scaled, -1)
        if params.top_k and params.top_k < scaled.shape[-1]:
            kth = scaled.topk(params.top_k, -1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if params.top_p < 1:
            sorted_logits, order = scaled.sort(-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            drop_sorted = sorted_probs.cumsum(-1) - sorted_probs > params.top_p  # mass above it already enough
            scaled = scaled.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        tokens = draw(scaled.softmax(-1), generator)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def draw(probs: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None) -> torch.Tensor:
    """One token per row of [rows, vocab] probabilities, by inverting the cumulative
    distribution: on CPU, torch.multinomial took a quarter of a SmolLM2 decode step at 32 rows
    (a 49k vocabulary), this takes a few percent. Float64 keeps the cumulative sums exact
    enough; ``right=True`` never lands on a zero-probability token. ``generator``: one for the
    batch, or one per row (each row's draw from its own stream)."""
    cdf = probs.double().cumsum(-1)
    if isinstance(generator, list):
        u = torch.cat([torch.rand(1, 1, generator=g, dtype=torch.float64, device=probs.device) for g in generator])
    else:
        u = torch.rand(len(probs), 1, generator=generator, dtype=torch.float64, device=probs.device)
    u = u * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
