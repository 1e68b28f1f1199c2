"""The critic of PPO for causal LMs: the policy's backbone with a scalar value head, and its
trainer (``LMTrainer`` with values where the actor has log-probs).

Value convention: ``values[:, t]`` is V of the state before ``input_ids[:, t]`` is generated,
read from the hidden state at ``t - 1``, the position whose logits give ``logprobs[:, t]``; so
values line up with every other per-token field of a ``SequenceBatch`` and with ``token_gae``
(``delta_t = r_t + gamma V_{t+1} - V_t``, ``r_t`` the reward for token t). 0 at position 0 and on
padding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from m2flow.engines.batch import PromptLayout, SequenceBatch, micro_batch, split_by_token_budget
from m2flow.engines.scoring import autocast
from m2flow.engines.trainer import LMTrainer


class ValueModel(nn.Module):
    """A causal LM's backbone (its ``base_model``, without the vocabulary head) and a linear
    value head. The head starts at zero: every value is 0 before the first update, a neutral
    baseline rather than random numbers the advantages would inherit."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.backbone = lm.base_model
        self.head = nn.Linear(lm.config.hidden_size, 1, device=next(lm.parameters()).device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """``[b, l]`` fp32 values in the module's convention."""
        # Explicit positions, as for log-probs: 0.. on each row's real tokens.
        positions = (attention_mask.long().cumsum(dim=1) - 1).clamp_(min=0)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                               use_cache=False).last_hidden_state
        values = self.head(hidden[:, :-1].to(self.head.weight.dtype)).squeeze(-1).float()
        valid = attention_mask[:, 1:].bool()
        return nn.functional.pad(torch.where(valid, values, values.new_zeros(())), (1, 0))


class CriticTrainer(LMTrainer):
    """Trains a ``ValueModel``: the loss callback receives values ``[b, l]`` (and no entropy)
    where the actor's receives log-probs; micro-batching, accumulation, data parallel,
    clipping, offloading and checkpoints are ``LMTrainer``'s. Every row forwards its own
    prompt: the shared-prompt forward is written for the vocabulary head's log-probs."""

    def __init__(self, model: ValueModel, lr: float, **options: Any):
        super().__init__(model, lr, share_prompts=False, **options)

    def forward_tokens(self, mb: SequenceBatch, with_entropy: bool,
                       layout: PromptLayout | None = None) -> tuple[Tensor, None]:
        return self.model(mb.input_ids, mb.attention_mask), None

    @torch.no_grad()
    def values(self, batch: SequenceBatch) -> Tensor:
        """Values ``[B, L]`` (fp32, on the batch's device) of the current critic, in eval mode,
        micro-batched by the token budget."""
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32, device=batch.input_ids.device)
        was_training = self.model.training
        self.model.eval()
        try:
            for idx in split_by_token_budget(batch, self.max_tokens):
                mb = micro_batch(batch, idx).to(self.device)
                with autocast(self.device, self.autocast_dtype):
                    values, _ = self.forward_tokens(mb, with_entropy=False)
                out[idx.to(out.device), :values.shape[1]] = values.to(out.device)
        finally:
            self.model.train(was_training)
        return out
