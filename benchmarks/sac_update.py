"""The SAC and CrossQ learners' gradient steps against Stable-Baselines3's and sb3-contrib's, on
HalfCheetah-v5's shapes.

An off-policy run spends its time in the learner's step (batch 256, two 256x256 critics, an
actor, the entropy coefficient, the target critics' Polyak step), so this is the cost that
sets its speed at a high update-to-data ratio. Both sides take their steps on the same
transitions (random actions in HalfCheetah-v5, in each side's own replay buffer), sampling
included, with the same hyperparameters (SB3's SAC defaults: Adam 3e-4, tau 0.005, automatic
entropy tuning towards -|A|):

- ``sb3``: ``SAC.train(gradient_steps, batch_size=256)`` of stable-baselines3;
- ``m2flow``: ``m2flow.engines.sac.SACLearner.update_from(buffer.sample(256))``: the critics as
  one batched computation, fused Adam, one fused Polyak call, no critic gradient from the actor;
- ``m2flow_unfused``: the same with Adam's per-parameter loop (``fused=False``): what fusing gives;
- ``sb3c_crossq``: sb3-contrib's ``CrossQ.train`` with its defaults (1024x1024 critics, batch
  renormalisation, no target critics, the actor every 3 steps);
- ``m2flow_crossq``: ``m2flow.engines.sac.CrossQLearner`` with the same defaults.

Each side runs at 1 and 2 torch threads (SB3 at its faster one counts); sides alternate, each
``--updates`` timed steps after ``--warmup`` untimed ones, repeated ``--repeats`` times, in
this process. Figures: updates per second, ``m2flow / sb3`` at each side's faster thread
count, ``fused / unfused`` and ``m2flow CrossQ / sb3-contrib CrossQ``, each with its spread over
the repetitions.

    python benchmarks/sac_update.py                      # 5 repeats of 300 updates
    python benchmarks/sac_update.py --record             # and append the run to benchmarks/record.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Run, append_record, json_safe, loaded, log, ratio_figures, side_order, spread  # noqa: E402

from m2flow.engines.sac import CrossQLearner, SACLearner  # noqa: E402
from m2flow.replay import ReplayBuffer  # noqa: E402

SIDES = ("sb3", "m2flow", "m2flow_unfused", "sb3c_crossq", "m2flow_crossq")
BATCH = 256


def transitions(env_id: str, n: int, seed: int) -> tuple[list[tuple], object]:
    """``n`` steps of random actions, (obs, action, reward, terminated, truncated, next_obs)
    each, and the env."""
    import gymnasium as gym

    env = gym.make(env_id)
    obs, _ = env.reset(seed=seed)
    env.action_space.seed(seed)
    out = []
    for _ in range(n):
        action = env.action_space.sample()
        next_obs, reward, terminated, truncated, _ = env.step(action)
        out.append((obs, action, float(reward), terminated, truncated, next_obs))
        obs = env.reset()[0] if terminated or truncated else next_obs
    return out, env


def make_sb3(env, steps: list[tuple], crossq: bool = False):
    from stable_baselines3 import SAC
    from stable_baselines3.common.logger import configure

    if crossq:
        from sb3_contrib import CrossQ as SAC  # noqa: N814
    model = SAC("MlpPolicy", env, batch_size=BATCH, learning_starts=0, buffer_size=len(steps) + 1, device="cpu",
                seed=0, verbose=0)
    model.set_logger(configure(None, []))
    for obs, action, reward, terminated, truncated, next_obs in steps:
        model.replay_buffer.add(obs[None], next_obs[None], action[None], np.array([reward]), np.array([terminated]),
                                [{"TimeLimit.truncated": truncated}])
    return lambda k: model.train(gradient_steps=k, batch_size=BATCH)


def make_m2flow(env, steps: list[tuple], fused: bool = True, crossq: bool = False):
    space = env.observation_space
    learner = (CrossQLearner if crossq else SACLearner)(space.shape[0], env.action_space.low, env.action_space.high,
                                                        fused=fused)
    buffer = ReplayBuffer(len(steps) + 16, 1, space.shape, env.action_space.shape)
    for obs, action, reward, terminated, truncated, next_obs in steps:
        buffer.add(obs[None], action[None], np.array([reward]), np.array([terminated]), np.array([truncated]),
                   next_obs[None])
    rng = np.random.default_rng(0)

    def train(k: int) -> None:
        for _ in range(k):
            learner.update_from(buffer.sample(BATCH, rng))

    return train


def timed(train, updates: int, warmup: int) -> dict:
    train(warmup)
    start = time.perf_counter()
    train(updates)
    seconds = time.perf_counter() - start
    return {"updates_per_s": round(updates / seconds, 1), "seconds": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="HalfCheetah-v5")
    parser.add_argument("--transitions", type=int, default=20_000)
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--record", action="store_true", help="append the run to benchmarks/record.jsonl")
    args = parser.parse_args()
    run = Run()
    steps, env = transitions(args.env, args.transitions, seed=0)
    trainers = {"sb3": make_sb3(env, steps), "m2flow": make_m2flow(env, steps),
                "m2flow_unfused": make_m2flow(env, steps, fused=False),
                "sb3c_crossq": make_sb3(env, steps, crossq=True), "m2flow_crossq": make_m2flow(env, steps, crossq=True)}
    runs = {f"{side}-t{t}": [] for side in SIDES for t in args.threads}
    for r in range(args.repeats):
        for t in side_order(args.threads, r):
            torch.set_num_threads(t)
            for side in side_order(SIDES, r):
                result, load = loaded(lambda: timed(trainers[side], args.updates, args.warmup))
                runs[f"{side}-t{t}"].append(result | load)
                log(f"repeat {r} {side} {t} thread(s): {result['updates_per_s']} updates/s")

    def best(side: str) -> tuple[list[float], int]:
        """Per repetition, the side's rate at its faster thread count (over the whole run), and that count."""
        t = max(args.threads, key=lambda t: np.median([x["updates_per_s"] for x in runs[f"{side}-t{t}"]]))
        return [x["updates_per_s"] for x in runs[f"{side}-t{t}"]], t

    (sb3, sb3_t), (ours, ours_t), (unfused, _) = best("sb3"), best("m2flow"), best("m2flow_unfused")
    (sb3c, sb3c_t), (crossq, crossq_t) = best("sb3c_crossq"), best("m2flow_crossq")
    ratios = {f"SAC: m2flow (t{ours_t}) / SB3 (t{sb3_t}), updates/s": [a / b for a, b in zip(ours, sb3)],
              f"CrossQ: m2flow (t{crossq_t}) / sb3-contrib (t{sb3c_t}), updates/s": [
                  a / b for a, b in zip(crossq, sb3c)],
              "SAC: fused / unfused Adam, updates/s": [a / b for a, b in zip(ours, unfused)]}
    result = {"benchmark": "sac_update", "env": args.env, "batch": BATCH, "updates": args.updates,
              "repeats": args.repeats, "threads": args.threads, "ratios": {k: spread(v, 3) for k, v in ratios.items()},
              "updates_per_s": {k: spread([x["updates_per_s"] for x in v], 1) for k, v in runs.items()},
              "runs": runs, **run.finish(torch=torch.__version__)}
    print(json.dumps(json_safe(result), indent=2))
    if args.record:
        record(result, " ".join(["python", "benchmarks/sac_update.py", *sys.argv[1:]]))


def record(result: dict, command: str) -> None:
    rates = ", ".join(f"{k} {v['median']}" for k, v in result["updates_per_s"].items())
    append_record(result, str(Path(__file__).resolve().parents[1]), command, f"sac_update/{result['env']}",
                  f"SAC and CrossQ learners' gradient steps against Stable-Baselines3's and sb3-contrib's "
                  f"({result['env']} shapes, batch {result['batch']}, each side's default networks, sampling included)",
                  ratio_figures(result["ratios"]), f"median updates/s per side and thread count: {rates}")


if __name__ == "__main__":
    main()
