"""Inference worker: reference-model log-probs (for the KL term) and recomputed old-policy
log-probs, on each scored batch as it streams by, micro-batched by a token budget.

Its policy copy follows the actor's weights like the rollout's does. With neither a KL term
nor recomputation configured it holds no model and passes batches through.
"""

from __future__ import annotations

import torch

from m2flow.engines.scoring import compute_logprobs
from m2flow.runtime import Channel, Clock
from m2flow.workers.lm_common import END, load_model, logprob_temperature, memory_mb, until_end
from m2flow.workers.reports import InferenceReport
from m2flow.workers.weights import WeightReceiver


def holds_a_model(algorithm) -> bool:
    """Whether the inference worker holds a model under ``algorithm`` (the config section): a
    reference one for a KL term, a policy copy to recompute the old log-probs. Without either
    it passes batches through, and takes no device turns (the runner's workflow makes it light)."""
    return algorithm["kl_coef"] > 0 or algorithm["old_logprobs"] == "recompute"


class InferenceWorker(WeightReceiver):
    def __init__(self, cfg: dict, take_turns: bool = False, offload: bool = True):  # it moves nothing out
        a = cfg["algorithm"]
        self.temperature = logprob_temperature(cfg)
        self.max_tokens = a["max_tokens_per_micro_batch"]
        self.share_prompts = a["share_prompts"]
        self.ref = load_model(cfg, self.device)[0].requires_grad_(False) if a["kl_coef"] > 0 else None
        self.policy = load_model(cfg, self.device)[0].requires_grad_(False) if a["old_logprobs"] == "recompute" else None
        self.turns = self.device_turns(take_turns)  # none without a model (holds_a_model)
        self.keep_behaviour = a["off_policy"] != "none"
        self.version = -1

    def _receive_model(self) -> torch.nn.Module:
        return self.policy

    def logprobs(self, scored_in: Channel, batches_out: Channel, readers: int, key: int = 0,
                 weights_from: str | None = None) -> InferenceReport:
        """Adds ``ref_logprobs`` / ``old_logprobs`` to each batch and passes it on, to the actor
        ranks (which take batches as they become free) or the critic. Then one end marker per
        reader of ``batches_out``. In and out under ``key``, the stream's channel key.

        ``weights_from`` (the decoupled objective, data generated ahead): before each batch the
        newest pushes of that actor group are taken, so the recomputed log-probs are the
        proximal policy's (the newest weights), not the sampling ones."""
        clock = Clock()
        diffs = []
        for batch in until_end(scored_in, key, clock):
            with clock.busy():  # less the wait for the turn
                if self.ref is not None or self.policy is not None:
                    with clock.turn(self.turns):
                        if self.ref is not None:
                            batch.ref_logprobs = compute_logprobs(self.ref, batch, self.max_tokens, self.temperature,
                                                                   share_prompts=self.share_prompts)
                        if self.policy is not None:
                            if weights_from:
                                self.take_newer(weights_from)
                            same = _sampled_by(batch, self.version)
                            if not weights_from and not same:
                                raise RuntimeError(f"batch from policy version {batch.extras['version']}, the "
                                                   f"inference worker holds version {self.version}")
                            recomputed = compute_logprobs(self.policy, batch, self.max_tokens, self.temperature,
                                                          share_prompts=self.share_prompts)
                            mask = batch.completion_mask.bool()
                            if same:  # the same weights: the difference is round-off
                                diffs.append(float((recomputed - batch.old_logprobs)[mask].abs().max())
                                             if mask.any() else 0.0)
                            if self.keep_behaviour:  # the off-policy correction weighs by them
                                batch.behaviour_logprobs = batch.old_logprobs
                            batch.old_logprobs = recomputed
                batches_out.put(batch, key, weight=batch.extras["groups"])
        for _ in range(readers):  # after every batch: a rank that takes one has nothing left to take
            batches_out.put(END, key)
        batches_out.flush()
        # sampling vs recomputed log-probs of the same weights: should be round-off
        return InferenceReport(**clock.report(), peak_memory_mb=memory_mb(self.device),
                               logprob_diff_max=max(diffs) if diffs else None)


def _sampled_by(batch, version: int) -> bool:
    """Whether every completion token of ``batch`` was sampled by weights of ``version``."""
    if batch.versions is None:
        return batch.extras["version"] == version
    return bool((batch.versions[batch.completion_mask.bool()] == version).all())
