"""Config errors of the reasoning flow that would otherwise surface deep inside a worker."""

from __future__ import annotations

from omegaconf import DictConfig

from m2flow.engines import BACKENDS
from m2flow.workers.lm_actor import ALGORITHMS

PPO_KEYS = ("gae_gamma", "gae_lambda", "critic_lr", "value_clip", "critic_epochs")


def check_config(cfg: DictConfig) -> None:
    """Config errors that would otherwise surface deep inside a worker."""
    a, r = cfg.algorithm, cfg.rollout
    if a.name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm.name {a.name!r}: {' | '.join(ALGORITHMS)}")
    if r.backend not in BACKENDS:
        raise ValueError(f"rollout.backend must be {' | '.join(BACKENDS)}, got {r.backend!r}")
    if r.backend == "vllm" and "gpu_memory_utilization" not in r:
        raise ValueError("rollout.backend=vllm needs rollout.gpu_memory_utilization (vLLM's share of the GPU, "
                         "in (0, 1])")
    if "gpu_memory_utilization" in r:
        from m2flow.engines.vllm_engine import check_memory_fraction

        check_memory_fraction(r.gpu_memory_utilization)
    if r.n < 2 and a.name not in ("reinforce_pp", "ppo"):
        raise ValueError(f"algorithm.name={a.name} compares the samples of a prompt: rollout.n must be >= 2, got {r.n}")
    if r.n < 2 and a.dynamic_sampling:
        raise ValueError("algorithm.dynamic_sampling=true drops groups whose rewards are all equal: with rollout.n=1 "
                         "that is every group")
    if a.old_logprobs not in ("rollout", "recompute"):
        raise ValueError(f"algorithm.old_logprobs must be rollout | recompute, got {a.old_logprobs!r}")
    if a.kl_in_reward and a.name not in ("reinforce_pp", "ppo"):
        raise ValueError("algorithm.kl_in_reward=true needs algorithm.name=reinforce_pp | ppo (group-relative "
                         "advantages take the KL term in the loss)")
    if a.name == "ppo":
        check_ppo_config(a)
    if a.get("data_parallel", "replicate") not in ("replicate", "fsdp"):
        raise ValueError(f"algorithm.data_parallel must be replicate | fsdp, got {a.data_parallel!r}")
    if cfg.placement.granularity < 1:
        raise ValueError(f"placement.granularity must be >= 1 group, got {cfg.placement.granularity}")
    if cfg.data.prompts_per_step < 1:
        raise ValueError(f"data.prompts_per_step must be >= 1, got {cfg.data.prompts_per_step}")


def check_ppo_config(a: DictConfig) -> None:
    """The critic's keys: there (a preset written before ppo lacks them) and in range."""
    missing = [k for k in PPO_KEYS if k not in a]
    if missing:
        raise ValueError(f"algorithm.name=ppo needs algorithm.{', algorithm.'.join(missing)} "
                         "(see examples/reasoning/ppo_arith_tiny.yaml)")
    for key in ("gae_gamma", "gae_lambda"):
        if not 0.0 <= a[key] <= 1.0:
            raise ValueError(f"algorithm.{key} must be in [0, 1], got {a[key]}")
    if a.critic_lr <= 0:
        raise ValueError(f"algorithm.critic_lr must be > 0, got {a.critic_lr}")
    if a.value_clip is not None and a.value_clip <= 0:
        raise ValueError(f"algorithm.value_clip must be > 0 or null (no clipping), got {a.value_clip}")
    if a.critic_epochs < 1:
        raise ValueError(f"algorithm.critic_epochs must be >= 1, got {a.critic_epochs}")
