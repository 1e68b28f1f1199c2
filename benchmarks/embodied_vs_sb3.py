"""Embodied benchmark: m2flow PPO against Stable-Baselines3 PPO, side by side in one run.

Both systems get the same hyperparameters, from one of three sets (``--hparams``):

  peers  the protocol of /work/shared/PEERS.md, for throughput: 8 envs, 2048 env steps per
         update (256 per env), 8 minibatches of 256, 10 epochs, lr 3e-4 constant, gamma 0.99,
         lambda 0.95, clip 0.2, ent 0, vf 0.5, grad norm 0.5, separate pi/vf MLPs [64, 64]
         with tanh, on CPU (``--normalize`` adds observation and reward normalisation);
  tuned  ``peers`` (same batch shape, learning rate, network and cost per env step) with RL
         Baselines3 Zoo's HalfCheetah choices for exploration and credit assignment: log std
         -2 (less action noise), PyTorch's default init, gamma 0.98, lambda 0.92, and
         observation and reward normalisation;
  zoo    RL Baselines3 Zoo's tuned PPO settings for HalfCheetah, for learning: 1 env, 512
         steps per update, minibatches of 64, 20 epochs, lr 2.0633e-5, gamma 0.98, lambda
         0.92, clip 0.1, ent 0.000401762, vf 0.58096, grad norm 0.8, pi/vf MLPs [256, 256]
         with ReLU, PyTorch's default init, log std -2, observation and reward normalisation.
         m2flow runs it on one slot (env, fused rollout and actor on device 0), as SB3 runs
         on one thread.

m2flow's side is the preset ``embodied/ppo_halfcheetah`` (its env id replaced by ``--env``) with
the set's values as overrides, one run per placement mode (``MODES``): ``hybrid`` runs with
``runner.stages=2`` (elastic pipelining); ``ahead`` puts the env workers (rollout fused) on
slot 0 and the actor on slot 1 with ``runner.collect_ahead=true``, so each update's rollout
overlaps the training on the previous one (off-policy by one version); ``collocated-compiled``
is ``collocated`` with ``algorithm.compile=true`` (the compile counted in its time).

For every seed, SB3 runs first and then each m2flow mode, so slow drifts of the machine
touch both. Reported per system/mode and seed:

  env_steps_per_s   env steps / wall time of the training call, training included. SB3:
                    ``model.learn`` timed (env construction excluded); m2flow: the
                    history's ``time_s`` of the last update (Ray start-up and worker
                    construction excluded, the first update included)
  final_return      SB3: mean of the last 10 episodes of ``model.ep_info_buffer``;
                    m2flow: mean over the episodes that ended in the last updates, going
                    back until at least 10 episodes are covered (HalfCheetah's episodes end
                    8 at a time, so this is usually 16)
  collect_s/train_s SB3 only: time inside rollouts vs the rest of ``learn``
  first_update_s,   m2flow only: the first update's wall time, and steps/s over the
  env_steps_per_s_after_first  updates after it (a diagnostic, not the headline)
  components        m2flow only: busy and idle seconds per component (env, rollout,
                    actor; each averaged over the component's ranks), summed over
                    updates; weight_sync_s likewise

Then the medians over seeds of m2flow/SB3 steps/s per mode, of the final returns per
system, and hybrid/collocated steps/s (the M2Flow acceptance ratio).

    python benchmarks/embodied_vs_sb3.py --env HalfCheetah-v5 --steps 200000 --seeds 1 2 3 \
        --modes collocated hybrid [--hparams peers|tuned|zoo] [--quick] [--override cluster.cpu_slots=3 ...]

``disaggregated`` needs three devices: on a 2-core machine add ``--override cluster.cpu_slots=3``.

Prints one JSON object on stdout (everything else goes to stderr). Needs
``pip install stable-baselines3`` (a benchmark-only dependency, not one of m2flow's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

MIN_FINAL_EPISODES = 10

# The hyperparameter sets, in SB3's names; m2flow's overrides are derived from them.
HPARAMS = {
    "peers": dict(n_envs=8, n_steps=256, batch_size=256, n_epochs=10, learning_rate=3e-4, gamma=0.99, gae_lambda=0.95,
                  clip_range=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5, net_arch=[64, 64], activation="tanh",
                  log_std_init=0.0, ortho_init=True, normalize=False),
    "tuned": dict(n_envs=8, n_steps=256, batch_size=256, n_epochs=10, learning_rate=3e-4, gamma=0.98, gae_lambda=0.92,
                  clip_range=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=0.5, net_arch=[64, 64], activation="tanh",
                  log_std_init=-2.0, ortho_init=False, normalize=True),
    "zoo": dict(n_envs=1, n_steps=512, batch_size=64, n_epochs=20, learning_rate=2.0633e-05, gamma=0.98, gae_lambda=0.92,
                clip_range=0.1, ent_coef=0.000401762, vf_coef=0.58096, max_grad_norm=0.8, net_arch=[256, 256],
                activation="relu", log_std_init=-2.0, ortho_init=False, normalize=True),
}


def m2flow_overrides(hp: dict) -> list[str]:
    out = [f"env.num_envs={hp['n_envs']}", f"runner.rollout_steps={hp['n_steps']}",
           f"algorithm.minibatch_size={hp['batch_size']}", f"algorithm.epochs={hp['n_epochs']}",
           f"algorithm.lr={hp['learning_rate']}", f"algorithm.gamma={hp['gamma']}", f"algorithm.gae_lambda={hp['gae_lambda']}",
           f"algorithm.clip={hp['clip_range']}", f"algorithm.ent_coef={hp['ent_coef']}", f"algorithm.vf_coef={hp['vf_coef']}",
           f"algorithm.max_grad_norm={hp['max_grad_norm']}", f"policy.hidden={hp['net_arch']}",
           f"policy.activation={hp['activation']}", f"policy.log_std_init={hp['log_std_init']}",
           f"policy.ortho_init={str(hp['ortho_init']).lower()}",
           f"env.obs_norm={str(hp['normalize']).lower()}", f"env.reward_scale={str(hp['normalize']).lower()}"]
    if hp["n_envs"] == 1:  # one env cannot be split over env ranks: everything on device 0
        out += ["placement.mode=custom", "placement.components.env=0", "placement.components.rollout=0",
                "placement.components.actor=0", "placement.actor_devices_per_proc=1"]
    return out

# SB3 runs in this process. One torch thread: measured here (HalfCheetah-v5, 16k steps,
# 2-core machine) 1 thread ran 5,500 and 2,500 steps/s, 2 threads 300 and 1,300. PPO's
# tensors (256 x 17 inputs, 64-wide layers) are too small for intra-op parallelism to pay,
# and with a second thread the pool's synchronisation (spinning while the other core is
# busy) costs far more than it saves. --sb3-threads lets a quiet machine re-check it.
SB3_DEFAULT_THREADS = 1

# m2flow's placement per benchmark mode, as config overrides.
MODES = {
    "collocated": ["placement.mode=collocated", "runner.stages=1"],
    # The same with the minibatch loss compiled (torch.compile; its compile time is counted).
    "collocated-compiled": ["placement.mode=collocated", "runner.stages=1", "algorithm.compile=true"],
    "hybrid": ["placement.mode=hybrid", "runner.stages=2"],  # elastic pipelining
    "disaggregated": ["placement.mode=disaggregated", "runner.stages=1"],
    # Env with the fused rollout on slot 0, the actor on slot 1; each update's rollout runs
    # while the actor trains on the previous one (its data one policy version old).
    "ahead": ["placement.mode=custom", "placement.components.env=0", "placement.components.rollout=0",
              "placement.components.actor=1", "placement.actor_devices_per_proc=1", "runner.collect_ahead=true"],
}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- Stable-Baselines3 ---------------------------------------------------------------
def import_sb3():
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/embodied_vs_sb3.py needs Stable-Baselines3, a benchmark-only dependency:\n"
                 f"    {sys.executable} -m pip install stable-baselines3")
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv

    return PPO, BaseCallback, make_vec_env, DummyVecEnv


def run_sb3(env_id: str, steps: int, seed: int, threads: int, hp: dict) -> dict:
    import torch
    from torch import nn

    PPO, BaseCallback, make_vec_env, DummyVecEnv = import_sb3()

    class PhaseTimer(BaseCallback):
        """Time spent collecting rollouts; the rest of ``learn`` is training."""

        def __init__(self):
            super().__init__()
            self.collect_s = 0.0
            self._t0 = 0.0

        def _on_rollout_start(self) -> None:
            self._t0 = time.perf_counter()

        def _on_rollout_end(self) -> None:
            self.collect_s += time.perf_counter() - self._t0

        def _on_step(self) -> bool:
            return True

    torch.set_num_threads(threads)
    env = make_vec_env(env_id, n_envs=hp["n_envs"], seed=seed, vec_env_cls=DummyVecEnv)
    if hp["normalize"]:  # observation and reward normalisation; Monitor inside still logs raw returns
        from stable_baselines3.common.vec_env import VecNormalize

        env = VecNormalize(env, gamma=hp["gamma"])
    model = PPO(
        "MlpPolicy", env, n_steps=hp["n_steps"], batch_size=hp["batch_size"], n_epochs=hp["n_epochs"],
        learning_rate=hp["learning_rate"], gamma=hp["gamma"], gae_lambda=hp["gae_lambda"], clip_range=hp["clip_range"],
        ent_coef=hp["ent_coef"], vf_coef=hp["vf_coef"], max_grad_norm=hp["max_grad_norm"], normalize_advantage=True,
        policy_kwargs=dict(net_arch=dict(pi=hp["net_arch"], vf=hp["net_arch"]),
                           activation_fn={"tanh": nn.Tanh, "relu": nn.ReLU}[hp["activation"]],
                           log_std_init=hp["log_std_init"], ortho_init=hp["ortho_init"]),
        device="cpu", seed=seed, verbose=0,
    )
    timer = PhaseTimer()
    start = time.perf_counter()
    model.learn(total_timesteps=steps, callback=timer)
    wall = time.perf_counter() - start
    episodes = [ep["r"] for ep in list(model.ep_info_buffer)[-MIN_FINAL_EPISODES:]]
    env.close()
    return {
        "env_steps": int(model.num_timesteps), "wall_s": wall, "env_steps_per_s": model.num_timesteps / wall,
        "final_return": statistics.fmean(episodes) if episodes else math.nan, "final_episodes": len(episodes),
        "collect_s": timer.collect_s, "train_s": wall - timer.collect_s, "torch_threads": threads,
    }


# -- m2flow --------------------------------------------------------------------------
def final_return(history: list[dict]) -> tuple[float, int]:
    """Mean return over the episodes of the last updates, back until >= 10 episodes."""
    total = count = 0
    for row in reversed(history):
        if row["episodes"]:
            total += row["episode_return"] * row["episodes"]
            count += row["episodes"]
        if count >= MIN_FINAL_EPISODES:
            break
    return (total / count if count else math.nan), count


def run_m2flow(env_id: str, steps: int, seed: int, mode: str, out_dir: Path, extra: list[str]) -> dict:
    from m2flow.config import load_config
    from m2flow.runners import run

    overrides = [f"env.id={env_id}", f"seed={seed}", f"runner.total_env_steps={steps}", *MODES[mode],
                 "runner.progress=false", f"runner.out_dir={out_dir}", *extra]
    cfg = load_config("embodied/ppo_halfcheetah", overrides)
    with contextlib.redirect_stdout(sys.stderr):  # the runner's notes and Ray's worker logs
        history = run(cfg)
    last = history[-1]
    ret, episodes = final_return(history)
    components = {f"{c}_{k}": sum(row[f"{c}_{k}"] for row in history)
                  for c in ("env", "rollout", "actor") for k in ("busy_s", "idle_s")}
    return {
        "env_steps": int(last["env_steps"]), "wall_s": last["time_s"], "env_steps_per_s": last["env_steps"] / last["time_s"],
        "final_return": ret, "final_episodes": episodes, "updates": len(history),
        # Diagnostic: without the first update, which carries m2flow's one-off warm-up.
        "first_update_s": history[0]["update_s"],
        "env_steps_per_s_after_first": ((last["env_steps"] - history[0]["env_steps"]) / (last["time_s"] - history[0]["time_s"])
                                        if len(history) > 1 else math.nan),
        "components": components | {"weight_sync_s": sum(row["weight_sync_s"] for row in history)},
    }


# -- report --------------------------------------------------------------------------
def median(values: list[float]) -> float | None:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else None


def summarise(results: dict[str, dict[int, dict]], modes: list[str]) -> dict:
    sb3 = results["sb3"]
    out: dict = {"median_env_steps_per_s": {}, "median_final_return": {}, "m2flow_over_sb3_steps_per_s": {}}
    for system, runs in results.items():
        out["median_env_steps_per_s"][system] = median([r["env_steps_per_s"] for r in runs.values()])
        out["median_final_return"][system] = median([r["final_return"] for r in runs.values()])
    for mode in modes:
        ratios = [results[mode][s]["env_steps_per_s"] / sb3[s]["env_steps_per_s"] for s in sb3]
        out["m2flow_over_sb3_steps_per_s"][mode] = {"per_seed": ratios, "median": median(ratios)}
    if "hybrid" in modes and "collocated" in modes:
        ratios = [results["hybrid"][s]["env_steps_per_s"] / results["collocated"][s]["env_steps_per_s"] for s in sb3]
        out["hybrid_over_collocated_steps_per_s"] = {"per_seed": ratios, "median": median(ratios)}
    return out


def json_safe(x):
    """NaN (no episode ended) becomes null, so the output is strict JSON."""
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--steps", type=int, default=200_000, help="env steps per run, rounded down to whole updates")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--modes", nargs="+", default=["collocated", "hybrid"], choices=list(MODES))
    p.add_argument("--sb3-threads", type=int, default=SB3_DEFAULT_THREADS)
    p.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra m2flow config overrides for every mode (e.g. cluster.cpu_slots=3); SB3 is unaffected")
    p.add_argument("--hparams", default="peers", choices=sorted(HPARAMS), help="the hyperparameter set of both systems")
    p.add_argument("--normalize", action="store_true",
                   help="observation and reward normalisation in both (SB3 VecNormalize; m2flow env.obs_norm, env.reward_scale)")
    p.add_argument("--out", default=None, help="m2flow run directories (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="smoke run: 20k steps, the first seed only")
    args = p.parse_args()
    if args.quick:
        args.steps, args.seeds = 20_000, args.seeds[:1]
    hp = HPARAMS[args.hparams] | ({"normalize": True} if args.normalize else {})
    per_update = hp["n_envs"] * hp["n_steps"]
    steps = max(1, args.steps // per_update) * per_update  # both systems run whole updates
    import_sb3()  # fail before anything runs
    out_root = Path(args.out or tempfile.mkdtemp(prefix="m2flow-embodied-vs-sb3-"))

    import gymnasium
    import ray
    import stable_baselines3
    import torch

    results: dict[str, dict[int, dict]] = {"sb3": {}, **{m: {} for m in args.modes}}
    began = time.perf_counter()
    for seed in args.seeds:
        log(f"[seed {seed}] SB3 PPO on {args.env}, {steps} env steps")
        results["sb3"][seed] = r = run_sb3(args.env, steps, seed, args.sb3_threads, hp)
        log(f"  {r['env_steps_per_s']:,.0f} env steps/s, return {r['final_return']:.1f}")
        for mode in args.modes:
            log(f"[seed {seed}] m2flow {mode} on {args.env}, {steps} env steps")
            out_dir = out_root / f"{mode}-seed{seed}"
            results[mode][seed] = r = run_m2flow(args.env, steps, seed, mode, out_dir, m2flow_overrides(hp) + args.override)
            log(f"  {r['env_steps_per_s']:,.0f} env steps/s, return {r['final_return']:.1f}")
            time.sleep(2.0)  # let Ray's processes exit before the next run starts timing
    report = {
        "benchmark": "embodied_vs_sb3",
        "env": args.env, "env_steps": steps, "seeds": args.seeds, "modes": args.modes, "quick": args.quick,
        "m2flow_overrides": args.override, "sb3_torch_threads": args.sb3_threads, "hparams": args.hparams, "hyperparameters": hp,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "ray": ray.__version__, "gymnasium": gymnasium.__version__,
                    "stable_baselines3": stable_baselines3.__version__},
        "runs": {system: {str(s): r for s, r in runs.items()} for system, runs in results.items()},
        "summary": summarise(results, args.modes),
        "m2flow_out": str(out_root),
        "total_s": time.perf_counter() - began,
    }
    print(json.dumps(json_safe(report), indent=1, default=float))


if __name__ == "__main__":
    main()
