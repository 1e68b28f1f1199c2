"""Micro-benchmarks of two hot paths, kept out of the test suite (wall-clock thresholds fail
on a loaded machine):

- ``flatten``: ``m2flow.runtime.payload.flatten`` of a dict of 10 small tensors (every
  channel message and weight push goes through it); target below 50 us a call.
- ``env_step``: ``EnvBatch.step`` against gymnasium's ``SyncVectorEnv`` (same-step
  auto-reset), 8 envs, the same actions; best of interleaved rounds, so that load from other
  processes cancels out; target ``ratio`` (EnvBatch / SyncVectorEnv time per step) below 1.1.

Prints one JSON object; ``ok`` says whether every target was met; ``machine_speed`` gives
the load and the fp32 matmul speed at the start and the end (``benchmarks/common.py``).

    python benchmarks/micro.py
    python benchmarks/micro.py --envs CartPole-v1 --rounds 5   # a quick look
"""

from __future__ import annotations

import argparse
import json
import time
import timeit

import numpy as np

from common import Run

FLATTEN_TARGET_US = 50.0
ENV_STEP_TARGET_RATIO = 1.1


def bench_flatten(repeat: int) -> dict:
    import torch

    from m2flow.runtime.payload import flatten

    d = {f"k{i}": torch.zeros(4) for i in range(10)}
    runs = [round(t / 1000 * 1e6, 2) for t in timeit.repeat(lambda: flatten(d), number=1000, repeat=repeat)]
    return {"us_per_call_best": min(runs), "us_per_call_runs": runs, "target_us": FLATTEN_TARGET_US,
            "ok": min(runs) < FLATTEN_TARGET_US}


def bench_env_step(env_id: str, steps: int, rounds: int) -> dict:
    import gymnasium as gym

    from m2flow.envs import EnvBatch, make_env

    ours = EnvBatch(env_id, 8, seed=0)
    theirs = gym.vector.SyncVectorEnv([lambda: make_env(env_id)] * 8, autoreset_mode="SameStep")
    ours.reset()
    theirs.reset(seed=0)
    theirs.action_space.seed(0)
    actions = [theirs.action_space.sample() for _ in range(steps)]
    best = {"EnvBatch": np.inf, "SyncVectorEnv": np.inf}
    for _ in range(rounds):
        for name, step in (("EnvBatch", ours.step), ("SyncVectorEnv", theirs.step)):
            start = time.perf_counter()
            for a in actions:
                step(a)
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
    ratio = best["EnvBatch"] / best["SyncVectorEnv"]
    return {"us_per_step_best": {k: round(v * 1e6, 1) for k, v in best.items()}, "ratio": round(ratio, 3),
            "target_ratio": ENV_STEP_TARGET_RATIO, "ok": ratio < ENV_STEP_TARGET_RATIO}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--envs", nargs="+", default=["HalfCheetah-v5", "CartPole-v1"])
    p.add_argument("--steps", type=int, default=200, help="env steps per round")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds of env steps")
    p.add_argument("--repeat", type=int, default=5, help="rounds of 1000 flatten calls")
    a = p.parse_args()
    if a.steps < 1 or a.rounds < 1 or a.repeat < 1:
        p.error("--steps, --rounds and --repeat must be >= 1")
    run = Run()
    result = {"flatten": bench_flatten(a.repeat),
              "env_step": {env_id: bench_env_step(env_id, a.steps, a.rounds) for env_id in a.envs}}
    result["ok"] = result["flatten"]["ok"] and all(r["ok"] for r in result["env_step"].values())
    print(json.dumps(result | run.finish(), indent=2))


if __name__ == "__main__":
    main()
