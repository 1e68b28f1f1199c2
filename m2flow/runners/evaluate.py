"""``m2flow eval``: scores a checkpoint, in this process (no cluster).

Reasoning: one greedy completion per prompt, scored by the config's reward functions
(``reward.functions``), the weights rounded to the rollout's dtype (``rollout.dtype``) as in
the run's own evaluations. The prompts are every row of ``data.source`` when it names a file (the
user's own set), else the generated held-out problems. Reported: the mean weighted reward,
each function's mean, and the accuracy: the share of prompts on which every reward function
scored 1 or more (with the ``math`` reward alone, the share answered right).

Embodied: ``episodes`` episodes of the env the config names, the policy acting on its mean
action (deterministic), observations normalised with the statistics the checkpoint's first
env worker had; raw returns. Reported: the mean and spread of the returns, the mean length and
the success rate (envs that report success: ManiSkill, Meta-World).
"""

from __future__ import annotations

import errno
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from m2flow.config import ConfigError
from m2flow.runners import checkpoint as checkpoints
from m2flow.runtime.files import write_text

EVAL_SEED_OFFSET = 1_000_003  # evaluation episodes start from seeds no training env used


def evaluate(cfg: DictConfig, checkpoint: str | Path, episodes: int = 10, out: str | Path | None = None) -> dict:
    """Scores ``checkpoint`` under ``cfg``; writes the result as JSON to ``out`` (default: beside
    the checkpoint, ``<name>.eval.json``) and returns it."""
    checkpoint = Path(checkpoint)
    try:
        ckpt = checkpoints.load(checkpoint)
    except checkpoints.CheckpointError as e:
        raise ConfigError("checkpoint", str(e)) from None
    written = ckpt["config"]
    if written["flow"] != cfg.flow:
        raise ConfigError("checkpoint", f"{checkpoint} is a checkpoint of the {written['flow']} flow; the config is "
                                        f"of the {cfg.flow} flow")
    out = Path(out) if out else checkpoint.with_name(checkpoint.name.removesuffix(checkpoints.SUFFIX) + ".eval.json")
    try:  # a file written and removed where the result will go: the result is not lost after the evaluation
        if out.is_dir():
            raise IsADirectoryError(errno.EISDIR, "a directory")
        with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".probe"):
            pass
    except OSError as e:
        raise ConfigError("out", f"cannot write the result to {str(out)!r}: {e.strerror}") from None
    start = time.perf_counter()
    if cfg.flow == "reasoning":
        result = _reasoning(cfg, ckpt)
    elif cfg.flow == "embodied":
        result = _embodied(cfg, ckpt, episodes)
    else:
        raise ValueError(f"unknown flow {cfg.flow!r} (known: embodied, reasoning)")
    result = {"checkpoint": str(checkpoint), "flow": cfg.flow, "trained_for": ckpt["done"], **result,
              "eval_s": round(time.perf_counter() - start, 2)}
    write_text(out, json.dumps(result, indent=2) + "\n")
    result["written_to"] = str(out)
    return result


def _trainer_weights(ckpt: dict, key: str) -> dict[str, torch.Tensor]:
    """The actor's weights (rank 0's: every rank holds them, a sharded one in full on rank 0)."""
    state = ckpt["states"]["actor"][0]
    return state["trainer"]["model"] if key == "trainer" else state[key]


# -- reasoning --------------------------------------------------------------------------------
def _reasoning(cfg: DictConfig, ckpt: dict) -> dict[str, Any]:
    from m2flow.data.prompts import eval_prompts
    from m2flow.engines import SamplingParams, build_engine
    from m2flow.rewards.scorer import RewardScorer
    from m2flow.workers.lm_common import load_model
    from m2flow.workers.lm_rollout import engine_options

    plain = OmegaConf.to_container(cfg, resolve=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(plain, device, plain["rollout"]["dtype"])  # as the run's evaluations: the rollout's
    try:
        model.load_state_dict(_trainer_weights(ckpt, "trainer"))  # rounded to the rollout's dtype as they load
    except RuntimeError as e:
        raise ConfigError("model.path", f"the checkpoint's weights do not fit {cfg.model.path}: "
                          f"{str(e).splitlines()[0]}") from None
    model.requires_grad_(False)
    prompts = eval_prompts(cfg)
    r = plain["rollout"]
    engine = build_engine(r["backend"], model, tokenizer, **engine_options(r, False))
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=r["max_new_tokens"], stop=tuple(r["stop"]), seed=0)
    texts: dict[int, str] = {}
    for (c,) in engine.generate([p["token_ids"] for p in prompts], params):
        texts[c.prompt_index] = c.text
    completions = [texts[i] for i in range(len(prompts))]
    with RewardScorer(dict(plain["reward"]["functions"]), timeout_s=plain["reward"]["timeout_s"]) as scorer:
        scores = scorer.score(completions, [p["answer"] for p in prompts])
    full = np.all(np.stack([part >= 1.0 for part in scores.parts.values()]), axis=0)
    return {"source": cfg.data.source, "prompts": len(prompts), "accuracy": float(full.mean()),
            "reward": float(scores.total.mean()), **{f"reward_{k.rpartition(':')[2]}": float(v.mean())
                                                      for k, v in scores.parts.items()},
            "timed_out": int(scores.timed_out.sum())}


# -- embodied ---------------------------------------------------------------------------------
def _embodied(cfg: DictConfig, ckpt: dict, episodes: int, max_steps: int = 1_000_000) -> dict[str, Any]:
    from m2flow.envs import EnvBatch
    from m2flow.models.policies import build_policy
    from m2flow.runners.embodied import probe_spaces

    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    probe_spaces(cfg)  # an env that cannot be made is a config error
    env = cfg.env
    n = min(episodes, env.num_envs)
    batch = EnvBatch(env.id, n, cfg.seed + EVAL_SEED_OFFSET, obs_norm=env.obs_norm,
                     env_kwargs=OmegaConf.to_container(env.kwargs, resolve=True))
    batch.training = False  # the normalisation statistics stay the checkpoint's
    env_state = ckpt["states"].get("env")
    if env_state:  # rank 0, stage 0
        batch.load_state_dict(env_state[0]["batches"][0]["stats"])
    policy = build_policy(batch.observation_space, batch.action_space, OmegaConf.to_container(cfg.policy, resolve=True))
    try:
        policy.load_state_dict(_trainer_weights(ckpt, "policy"))
    except RuntimeError as e:
        raise ConfigError("policy", f"the checkpoint's policy does not fit this config's env and policy: "
                          f"{str(e).splitlines()[0]}") from None
    policy.eval()
    # Each env runs its share of the episodes (SB3's rule: no bias towards short episodes).
    target = np.array([episodes // n + (i < episodes % n) for i in range(n)])
    done = np.zeros(n, dtype=np.int64)
    returns, lengths, successes = [], [], []
    obs = batch.reset()
    steps = 0
    while (done < target).any():
        with torch.inference_mode():
            actions, _ = policy.act(torch.as_tensor(obs), deterministic=True)
        result = batch.step_chunk(actions.numpy()) if cfg.policy.chunk > 1 else batch.step(actions.numpy())
        obs = result.obs
        steps += 1
        for (i, ret), (_, length), success in zip(result.episode_returns, result.episode_lengths,
                                                  result.episode_successes):
            if done[i] < target[i]:
                done[i] += 1
                returns.append(ret)
                lengths.append(length)
                successes.append(success)
        if steps * n >= max_steps:
            raise RuntimeError(f"{int(done.sum())} of {episodes} episodes ended within {max_steps} env steps: "
                               "give the env a time limit (env.kwargs.max_episode_steps)")
    reported = [s for s in successes if s is not None]
    return {"env": env.id, "episodes": len(returns), "mean_return": statistics.fmean(returns),
            "std_return": statistics.pstdev(returns), "min_return": min(returns), "max_return": max(returns),
            "mean_length": statistics.fmean(lengths),
            "success_rate": statistics.fmean(reported) if reported else None}  # None: the env reports none


def table(result: dict) -> str:
    """The result as two columns of text."""
    rows = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in result.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
