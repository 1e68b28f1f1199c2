"""SAC: m2flow's replay flow against Stable-Baselines3's SAC on HalfCheetah-v5, side by side.

One set of hyperparameters for both, RL Baselines3 Zoo's for SAC on MuJoCo (SB3's defaults):
1 env, a buffer of 1M, batch 256, 256x256 networks (ReLU), Adam 3e-4, gamma 0.99, tau 0.005,
automatic entropy tuning towards -|A|, ``--learning-starts`` uniform random steps (10,000),
then one gradient step per env step (``train_freq=1, gradient_steps=1``; m2flow:
``algorithm.utd_ratio=1``).

Sides, each in a fresh process, one at a time, alternating between seeds (ABAB):

  sb3/t1, sb3/t2   ``SAC("MlpPolicy")`` with 1 or 2 torch threads (m2flow is compared with
                   the faster one of each seed)
  m2flow/alternate ``replay/sac_halfcheetah`` with env and learner alternating step by step
                   (``runner.max_staleness=0``: SB3's own schedule), the env (the policy in its
                   process) on slot 0 and the learner, one process, across both slots
  m2flow/overlap   the same with ``runner.max_staleness=1``: an env step runs while the
                   learner takes the step before it (the acting weights one update behind)

Evaluation, the same schedule for both: every ``--eval-every`` env steps and at the end,
``--eval-episodes`` deterministic episodes on an env of its own with fixed seeds (SB3's
``EvalCallback``; m2flow's ``runner.eval_every``). Reported per side and seed: the final
evaluation's mean return; ``env_steps_per_s`` over the learning phase (the env steps after
``learning_starts`` over their wall time, evaluations left out), and over the whole run.
Figures: m2flow's learning-phase env steps/s over SB3's faster configuration, per mode, with the
spread over seeds; each side's median final return.

A side's result is appended to ``--journal`` as it ends; ``--resume FILE`` takes the sides
already in that journal (same steps and settings) and runs the rest (a 100k x 3-seed
comparison takes hours here).

    python benchmarks/sac_vs_sb3.py --steps 100000 --seeds 0 1 2 --journal runs/sac_vs_sb3.jsonl
    python benchmarks/sac_vs_sb3.py --steps 13000 --seeds 0 --eval-every 0   # throughput only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (Run, append_jsonl, append_record, loaded, log, ratio_figures, read_jsonl, run_child, side_order,  # noqa: E402
                    spread)

ROOT = Path(__file__).resolve().parents[1]
ENV = "HalfCheetah-v5"
SB3 = {"sb3/t1": 1, "sb3/t2": 2}
MODES = {
    "m2flow/alternate": ["runner.max_staleness=0"],
    "m2flow/overlap": ["runner.max_staleness=1"],
}
PLACEMENT = ["placement.mode=custom", "placement.components.env=0", "placement.components.rollout=0",
             "placement.components.actor={devices: 0-1, devices_per_proc: 2}"]


# -- sides (in a child process) ------------------------------------------------------------
def run_sb3(spec: dict) -> dict:
    import gymnasium as gym
    import torch
    from stable_baselines3 import SAC
    from stable_baselines3.common.callbacks import EvalCallback
    from stable_baselines3.common.monitor import Monitor

    torch.set_num_threads(spec["threads"])

    class Timed(EvalCallback):
        """``EvalCallback`` that keeps its evaluations' seconds, to leave them out of the rate."""

        eval_s = 0.0
        started_learning: float | None = None

        def _on_step(self) -> bool:
            if self.started_learning is None and self.num_timesteps > spec["learning_starts"]:
                self.started_learning = time.perf_counter() - self.eval_s
            start = time.perf_counter()
            out = super()._on_step()
            self.eval_s += time.perf_counter() - start
            return out

    eval_env = Monitor(gym.make(ENV))
    eval_env.reset(seed=10_000 + spec["seed"])
    every = spec["eval_every"] or spec["steps"]
    callback = Timed(eval_env, n_eval_episodes=spec["eval_episodes"], eval_freq=every, deterministic=True, verbose=0)
    model = SAC("MlpPolicy", gym.make(ENV), learning_starts=spec["learning_starts"], seed=spec["seed"], verbose=0,
                device="cpu")
    start = time.perf_counter()
    model.learn(spec["steps"], callback=callback)
    wall = time.perf_counter() - start - callback.eval_s
    learning = wall - (callback.started_learning - start) if callback.started_learning else math.nan
    evaluated = callback.last_mean_reward > -math.inf  # the last evaluation's mean return (EvalCallback's)
    return {"wall_s": wall, "env_steps_per_s": spec["steps"] / wall,
            "learning_env_steps_per_s": (spec["steps"] - spec["learning_starts"]) / learning,
            "final_return": float(callback.last_mean_reward) if evaluated else None, "eval_s": callback.eval_s}


def run_m2flow(spec: dict) -> dict:
    from m2flow.config import load_config
    from m2flow.runners import run

    every = max(1, (spec["eval_every"] or spec["steps"]) // 1000)  # rounds of 1,000 env steps
    overrides = [f"seed={spec['seed']}", f"runner.total_env_steps={spec['steps']}", "runner.progress=false",
                 f"algorithm.learning_starts={spec['learning_starts']}", f"runner.eval_every={every}",
                 f"runner.eval_episodes={spec['eval_episodes']}", f"runner.out_dir={spec['out_dir']}",
                 *PLACEMENT, *MODES[spec["side"]]]
    with contextlib.redirect_stdout(sys.stderr):
        history = run(load_config("replay/sac_halfcheetah", overrides))
    rows = [r for r in history if "update" in r]  # the rounds (an evaluation before the first has a row of its own)
    evals = [r for r in history if "eval_return" in r]
    # an evaluation after a round is in the next rounds' time_s (runners/loop.py)
    eval_s = lambda rs: sum(r.get("eval_s", 0.0) for r in rs)  # noqa: E731
    last = rows[-1]
    wall = last["time_s"] - eval_s(rows[:-1])
    first = next(i for i, r in enumerate(rows) if r.get("updates", 0) > 0)  # the first round that learned
    before = rows[first - 1] if first else {"time_s": 0.0, "env_steps": 0}
    learning_s = last["time_s"] - before["time_s"] - eval_s(rows[max(0, first - 1):-1])
    return {"wall_s": wall, "env_steps_per_s": last["env_steps"] / wall,
            "learning_env_steps_per_s": (last["env_steps"] - before["env_steps"]) / learning_s,
            "final_return": evals[-1]["eval_return"] if evals else None,
            "policy_lag": max(r["policy_lag"] for r in rows), "eval_s": eval_s(history)}


# -- driver ----------------------------------------------------------------------------------
def settings(args: argparse.Namespace) -> dict:
    return {"steps": args.steps, "learning_starts": args.learning_starts, "eval_every": args.eval_every,
            "eval_episodes": args.eval_episodes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--learning-starts", type=int, default=10_000)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--eval-every", type=int, default=5_000, help="env steps between evaluations (0: at the end only)")
    p.add_argument("--eval-episodes", type=int, default=10)
    p.add_argument("--sides", nargs="+", default=[*SB3, *MODES])
    p.add_argument("--journal", help="append each side's result to this JSON-lines file")
    p.add_argument("--resume", help="a journal of an earlier run of the same settings: its sides are not run again")
    p.add_argument("--record", action="store_true", help="append the run to benchmarks/record.jsonl")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        result = run_sb3(spec) if spec["side"] in SB3 else run_m2flow(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return

    run_info, base = Run(), settings(args)
    done = {(r["side"], r["seed"]): r for r in read_jsonl(args.resume) if r.get("settings") == base}
    results: dict[str, dict[int, dict]] = {side: {} for side in args.sides}
    for k, seed in enumerate(args.seeds):
        for side in side_order(args.sides, k):
            if (side, seed) in done:
                results[side][seed] = done[(side, seed)]
                continue
            with tempfile.TemporaryDirectory() as out:
                spec = base | {"side": side, "seed": seed, "out_dir": out, "threads": SB3.get(side, 0)}
                log(f"{side} seed {seed}")
                result, load = loaded(lambda: run_child(__file__, spec))
            results[side][seed] = record = {"side": side, "seed": seed, "settings": base, **result, **load}
            append_jsonl(args.journal, record)
            log(f"  {record['learning_env_steps_per_s']:.1f} env steps/s learning, return {record['final_return']}")
    sb3 = [s for s in args.sides if s in SB3]
    best = {seed: max(results[s][seed]["learning_env_steps_per_s"] for s in sb3) for seed in args.seeds} if sb3 else {}
    ratios = {f"{mode} / sb3 (faster threads), env steps/s learning":
              spread([results[mode][seed]["learning_env_steps_per_s"] / best[seed] for seed in args.seeds], 3)
              for mode in args.sides if mode in MODES and best}
    report = {"settings": base, "seeds": args.seeds, "runs": {s: list(r.values()) for s, r in results.items()},
              "learning_env_steps_per_s": {s: spread([r["learning_env_steps_per_s"] for r in rs.values()], 1)
                                           for s, rs in results.items()},
              "final_return": {s: spread([r["final_return"] for r in rs.values()], 1) for s, rs in results.items()},
              "ratios": ratios} | run_info.finish()
    print(json.dumps(report, indent=2))
    if args.record:
        cmd = "python benchmarks/sac_vs_sb3.py " + " ".join(sys.argv[1:]).replace("--record", "").strip()
        append_record(report, str(ROOT), cmd, "sac_vs_sb3/HalfCheetah-v5",
                      "SAC on HalfCheetah-v5: m2flow's replay flow against SB3's SAC, env steps/s while learning",
                      ratio_figures(ratios),
                      f"{args.steps} env steps ({args.learning_starts} random), seeds {args.seeds}; final returns "
                      + ", ".join(f"{s} {v['median'] if v else None}" for s, v in report["final_return"].items()))


if __name__ == "__main__":
    main()
