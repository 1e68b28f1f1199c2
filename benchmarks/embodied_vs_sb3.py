"""Embodied benchmark: m2flow PPO against Stable-Baselines3 PPO, side by side in one run.

Both systems get the same hyperparameters, from one of three sets (``--hparams``):

  peers  the peer protocol, for throughput: 8 envs, 2048 env steps per update (256 per
         env), 8 minibatches of 256, 10 epochs, lr 3e-4 constant, gamma 0.99, lambda 0.95,
         clip 0.2, ent 0, vf 0.5, grad norm 0.5, separate pi/vf MLPs [64, 64] with tanh, on
         CPU (``--normalize`` adds observation and reward normalisation);
  tuned  ``peers`` (same batch shape, learning rate, network and cost per env step) with RL
         Baselines3 Zoo's HalfCheetah choices for exploration and credit assignment: log std
         -2 (less action noise), PyTorch's default init, gamma 0.98, lambda 0.92, and
         observation and reward normalisation;
  zoo    RL Baselines3 Zoo's tuned PPO settings for HalfCheetah, for learning: 1 env, 512
         steps per update, minibatches of 64, 20 epochs, lr 2.0633e-5, gamma 0.98, lambda
         0.92, clip 0.1, ent 0.000401762, vf 0.58096, grad norm 0.8, pi/vf MLPs [256, 256]
         with ReLU, PyTorch's default init, log std -2, observation and reward normalisation.
         m2flow runs it on one slot (env, fused rollout and actor on device 0).

SB3 is measured in each of its configurations (``--sb3-configs``, default all four), so that
m2flow is compared with SB3's fastest one on this machine, not with one chosen for it:

  dummy-t1     ``DummyVecEnv`` (every env stepped in the training process), 1 torch thread
  dummy-t2     the same, 2 torch threads
  subproc2-t1  the envs stepped in 2 processes (4 each with 8 envs), 1 torch thread
  subproc2-t2  the same, 2 torch threads

SB3's ``SubprocVecEnv`` starts one process per env (8 processes on a 2-core machine); the
``subproc2`` configurations use ``GroupedSubprocVecEnv`` below, which is ``SubprocVecEnv``
with a ``DummyVecEnv`` of several envs in each process (one process per core).

m2flow's side is the preset ``embodied/ppo_halfcheetah`` (its env id replaced by ``--env``) with
the set's values as overrides, one run per placement mode (``MODES``): ``hybrid`` runs with
``runner.stages=2`` (elastic pipelining); ``ahead`` puts the env workers (rollout fused) on
slot 0 and the actor on slot 1 with ``runner.max_staleness=1``, so each update's rollout
overlaps the training on the previous one (off-policy by one version), ``ahead2`` the same up
to two versions ahead, ``async`` that with new weights taken between env steps
(``runner.in_flight_updates=true``) and the decoupled objective (``algorithm.off_policy=decoupled``),
``async-auto`` the scheduler's plan with up to two versions allowed
(``placement=auto runner.max_staleness=2``); ``collocated-compiled``
is ``collocated`` with ``algorithm.compile=true`` (the compile counted in its time).

Every side (each SB3 configuration, each m2flow mode) runs in a fresh process, one at a time.
The sides alternate between seeds (ABAB): for the first seed SB3's configurations run first,
then m2flow's modes; for the second the reverse order; and so on. Reported per side and seed:

  env_steps_per_s   env steps / wall time of the training call, training included. SB3:
                    ``model.learn`` timed (env construction excluded); m2flow: the
                    history's ``time_s`` of the last update (Ray start-up and worker
                    construction excluded, the first update included)
  final_return      SB3: mean of the last 10 episodes of ``model.ep_info_buffer``;
                    m2flow: mean over the episodes that ended in the last updates, going
                    back until at least 10 episodes are covered (HalfCheetah's episodes end
                    8 at a time, so this is usually 16)
  load_before/after the 1-minute load average around the side's process
  collect_s/train_s SB3 only: time inside rollouts vs the rest of ``learn``
  first_update_s,   m2flow only: the first update's wall time, and steps/s over the
  env_steps_per_s_after_first  updates after it (a diagnostic, not the headline)
  components        m2flow only: busy and idle seconds per component (env, rollout,
                    actor; each averaged over the component's ranks), summed over
                    updates; weight_sync_s likewise

The summary gives, per m2flow mode, m2flow/SB3 steps/s against the fastest SB3 configuration
of the same seed (``m2flow_over_sb3_best``) and against each configuration, per seed and as a
spread (min, median, max) over seeds; each side's steps/s and final return as spreads; and
hybrid/collocated steps/s. The machine's fp32 matmul speed is measured at the start and end.

    python benchmarks/embodied_vs_sb3.py --env HalfCheetah-v5 --steps 200000 --seeds 1 2 3 \
        --modes collocated hybrid [--sb3-configs dummy-t1 subproc2-t1] [--hparams peers|tuned|zoo] \
        [--quick] [--override cluster.cpu_slots=3 ...]

``--no-sb3`` runs m2flow's modes only (no SB3 side, no ratio against it, SB3 not needed):
for comparing m2flow with itself, as ``benchmarks/versions.py`` does (two commits' code).

``disaggregated`` needs three devices: on a 2-core machine add ``--override cluster.cpu_slots=3``.

Prints one JSON object on stdout (everything else goes to stderr). Needs
``pip install stable-baselines3`` (a benchmark-only dependency, not one of m2flow's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import Run, json_safe, loaded, log, run_child, side_order, spread

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


# SB3's configurations: where the envs step (in the training process, or in that many
# processes) and the training process's torch threads.
SB3_CONFIGS = {
    "dummy-t1": {"env_processes": 0, "torch_threads": 1},
    "dummy-t2": {"env_processes": 0, "torch_threads": 2},
    "subproc2-t1": {"env_processes": 2, "torch_threads": 1},
    "subproc2-t2": {"env_processes": 2, "torch_threads": 2},
}

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
              "placement.components.actor=1", "placement.actor_devices_per_proc=1", "runner.max_staleness=1"],
    # The same, up to two versions ahead (asynchronous, staleness bounded by 2).
    "ahead2": ["placement.mode=custom", "placement.components.env=0", "placement.components.rollout=0",
               "placement.components.actor=1", "placement.actor_devices_per_proc=1", "runner.max_staleness=2"],
    # The same, weights taken between env steps, PPO around the newest weights (decoupled).
    "async": ["placement.mode=custom", "placement.components.env=0", "placement.components.rollout=0",
              "placement.components.actor=1", "placement.actor_devices_per_proc=1", "runner.max_staleness=2",
              "runner.in_flight_updates=true", "algorithm.off_policy=decoupled"],
    # Staleness up to 2 allowed, the plan the scheduler picks (profiled, or a reused profile).
    "async-auto": ["placement=auto", "runner.max_staleness=2"],
}


# -- Stable-Baselines3 ---------------------------------------------------------------
def import_sb3():
    try:
        import stable_baselines3  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/embodied_vs_sb3.py needs Stable-Baselines3, a benchmark-only dependency:\n"
                 f"    {sys.executable} -m pip install stable-baselines3")


def _group_worker(remote, parent_remote, env_fns) -> None:
    """One process of ``GroupedSubprocVecEnv``: a ``DummyVecEnv`` of its envs, driven over a pipe."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    parent_remote.close()
    venv = DummyVecEnv(env_fns.var)
    while True:
        try:
            cmd, data = remote.recv()
        except (EOFError, KeyboardInterrupt):
            break
        if cmd == "step":
            obs, rewards, dones, infos = venv.step(data)
            remote.send((obs, rewards, dones, infos, venv.reset_infos))
        elif cmd == "reset":
            venv._seeds, venv._options = data
            obs = venv.reset()
            remote.send((obs, venv.reset_infos))
        elif cmd == "spaces":
            remote.send((venv.observation_space, venv.action_space))
        elif cmd == "call":  # one of DummyVecEnv's per-env methods
            name, args, kwargs = data
            remote.send(getattr(venv, name)(*args, **kwargs))
        elif cmd == "close":
            venv.close()
            remote.close()
            break


def grouped_subproc_vec_env():
    """``GroupedSubprocVecEnv``, built here so that SB3 is imported only where it is used."""
    import multiprocessing as mp

    import numpy as np
    from stable_baselines3.common.vec_env.base_vec_env import CloudpickleWrapper, VecEnv

    class GroupedSubprocVecEnv(VecEnv):
        """SB3's ``SubprocVecEnv`` with several envs per process: ``processes`` worker
        processes, each stepping a ``DummyVecEnv`` of its share of the envs (SB3's own
        ``SubprocVecEnv`` is the case of one env per process)."""

        def __init__(self, env_fns: list, processes: int, start_method: str = "forkserver"):
            ctx = mp.get_context(start_method)
            processes = min(processes, len(env_fns))
            self.slices = [list(chunk) for chunk in np.array_split(np.arange(len(env_fns)), processes)]
            self.where = {int(i): (p, j) for p, chunk in enumerate(self.slices) for j, i in enumerate(chunk)}
            self.remotes, self.processes = [], []
            for chunk in self.slices:
                remote, work_remote = ctx.Pipe()
                proc = ctx.Process(target=_group_worker, daemon=True,
                                   args=(work_remote, remote, CloudpickleWrapper([env_fns[i] for i in chunk])))
                proc.start()
                work_remote.close()
                self.remotes.append(remote)
                self.processes.append(proc)
            self.remotes[0].send(("spaces", None))
            observation_space, action_space = self.remotes[0].recv()
            self.waiting = self.closed = False
            super().__init__(len(env_fns), observation_space, action_space)

        def step_async(self, actions) -> None:
            for remote, chunk in zip(self.remotes, self.slices):
                remote.send(("step", actions[chunk[0]:chunk[-1] + 1]))
            self.waiting = True

        def step_wait(self):
            results = [remote.recv() for remote in self.remotes]
            self.waiting = False
            self.reset_infos = [info for r in results for info in r[4]]
            return (np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results]),
                    np.concatenate([r[2] for r in results]), [info for r in results for info in r[3]])

        def reset(self):
            for remote, chunk in zip(self.remotes, self.slices):
                remote.send(("reset", ([self._seeds[i] for i in chunk], [self._options[i] for i in chunk])))
            results = [remote.recv() for remote in self.remotes]
            self.reset_infos = [info for r in results for info in r[1]]
            self._reset_seeds()
            self._reset_options()
            return np.concatenate([r[0] for r in results])

        def close(self) -> None:
            if self.closed:
                return
            if self.waiting:
                for remote in self.remotes:
                    remote.recv()
            for remote in self.remotes:
                remote.send(("close", None))
            for proc in self.processes:
                proc.join()
            for remote in self.remotes:
                remote.close()
            self.closed = True

        def _per_env(self, method: str, indices, *args, **kwargs) -> list:
            """Calls DummyVecEnv's ``method`` for the given envs in their processes, results in order."""
            wanted = list(self._get_indices(indices))
            local: dict[int, list[int]] = {}
            for i in wanted:
                p, j = self.where[i]
                local.setdefault(p, []).append(j)
            for p, js in local.items():
                self.remotes[p].send(("call", (method, args, kwargs | {"indices": js})))
            got = {p: iter(self.remotes[p].recv()) for p in local}
            return [next(got[self.where[i][0]]) for i in wanted]

        def get_attr(self, attr_name, indices=None):
            return self._per_env("get_attr", indices, attr_name)

        def set_attr(self, attr_name, value, indices=None) -> None:
            self._per_env("set_attr", indices, attr_name, value)

        def env_method(self, method_name, *method_args, indices=None, **method_kwargs):
            return self._per_env("env_method", indices, method_name, *method_args, **method_kwargs)

        def env_is_wrapped(self, wrapper_class, indices=None):
            return self._per_env("env_is_wrapped", indices, wrapper_class)

        def get_images(self):
            return [None] * self.num_envs

    return GroupedSubprocVecEnv


def run_sb3(spec: dict) -> dict:
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv
    from torch import nn

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

    hp, seed, config = spec["hp"], spec["seed"], SB3_CONFIGS[spec["config"]]
    torch.set_num_threads(config["torch_threads"])
    if config["env_processes"]:
        vec_env_cls = grouped_subproc_vec_env()
        vec_env_kwargs = {"processes": config["env_processes"]}
    else:
        vec_env_cls, vec_env_kwargs = DummyVecEnv, {}
    env = make_vec_env(spec["env"], n_envs=hp["n_envs"], seed=seed, vec_env_cls=vec_env_cls,
                       vec_env_kwargs=vec_env_kwargs)
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
    model.learn(total_timesteps=spec["steps"], callback=timer)
    wall = time.perf_counter() - start
    episodes = [ep["r"] for ep in list(model.ep_info_buffer)[-MIN_FINAL_EPISODES:]]
    env.close()
    return {
        "env_steps": int(model.num_timesteps), "wall_s": wall, "env_steps_per_s": model.num_timesteps / wall,
        "final_return": statistics.fmean(episodes) if episodes else math.nan, "final_episodes": len(episodes),
        "collect_s": timer.collect_s, "train_s": wall - timer.collect_s, "torch_threads": torch.get_num_threads(),
        "env_processes": min(config["env_processes"], hp["n_envs"]),
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


def run_m2flow(spec: dict) -> dict:
    from m2flow.config import load_config
    from m2flow.runners import run

    overrides = [f"env.id={spec['env']}", f"seed={spec['seed']}", f"runner.total_env_steps={spec['steps']}",
                 *MODES[spec["mode"]], "runner.progress=false", f"runner.out_dir={spec['out_dir']}", *spec["extra"]]
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


# -- driver --------------------------------------------------------------------------
def summarise(results: dict[str, dict[int, dict]], sb3_configs: list[str], modes: list[str], seeds: list[int]) -> dict:
    sps = lambda side, seed: results[side][seed]["env_steps_per_s"]  # noqa: E731
    sb3_sides = [f"sb3/{c}" for c in sb3_configs]
    out: dict = {
        "env_steps_per_s": {side: spread([r["env_steps_per_s"] for r in runs.values()], 1) for side, runs in results.items()},
        "final_return": {side: spread([r["final_return"] for r in runs.values()], 1) for side, runs in results.items()},
    }
    if sb3_sides:
        best = {seed: max(sb3_sides, key=lambda side: sps(side, seed)) for seed in seeds}
        out |= {"sb3_best": {str(seed): {"config": best[seed].removeprefix("sb3/"),
                                         "env_steps_per_s": round(sps(best[seed], seed), 1)} for seed in seeds},
                "m2flow_over_sb3_best": {}, "m2flow_over_sb3_config": {}}
    for mode in modes if sb3_sides else []:  # ratios against SB3, where it ran
        ratios = [sps(mode, seed) / sps(best[seed], seed) for seed in seeds]
        out["m2flow_over_sb3_best"][mode] = {"per_seed": [round(r, 3) for r in ratios], "spread": spread(ratios, 3)}
        out["m2flow_over_sb3_config"][mode] = {}
        for side in sb3_sides:
            ratios = [sps(mode, seed) / sps(side, seed) for seed in seeds]
            out["m2flow_over_sb3_config"][mode][side.removeprefix("sb3/")] = {
                "per_seed": [round(r, 3) for r in ratios], "spread": spread(ratios, 3)}
    if "hybrid" in modes and "collocated" in modes:
        ratios = [sps("hybrid", seed) / sps("collocated", seed) for seed in seeds]
        out["hybrid_over_collocated"] = {"per_seed": [round(r, 3) for r in ratios], "spread": spread(ratios, 3)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="HalfCheetah-v5")
    p.add_argument("--steps", type=int, default=200_000, help="env steps per run, rounded down to whole updates")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3],
                   help="one run of every side per seed; the sides' order flips from seed to seed")
    p.add_argument("--modes", nargs="+", default=["collocated", "hybrid"], choices=list(MODES))
    p.add_argument("--sb3-configs", nargs="+", default=list(SB3_CONFIGS), choices=list(SB3_CONFIGS),
                   help="SB3's configurations to run (default: all); ratios are against the fastest of them")
    p.add_argument("--no-sb3", action="store_true", help="m2flow's modes only: no SB3 side and no ratio against it")
    p.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE",
                   help="extra m2flow config overrides for every mode (e.g. cluster.cpu_slots=3); SB3 is unaffected")
    p.add_argument("--hparams", default="peers", choices=sorted(HPARAMS), help="the hyperparameter set of both systems")
    p.add_argument("--normalize", action="store_true",
                   help="observation and reward normalisation in both (SB3 VecNormalize; m2flow env.obs_norm, env.reward_scale)")
    p.add_argument("--out", default=None, help="m2flow run directories (default: a temp dir)")
    p.add_argument("--quick", action="store_true", help="smoke run: 20k steps, the first seed only")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        spec = json.loads(args.child)
        result = (run_sb3 if spec["system"] == "sb3" else run_m2flow)(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return
    if args.steps < 1:
        p.error(f"--steps must be positive, got {args.steps}")
    if len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must be distinct, got {args.seeds}")
    sb3_configs, modes = [] if args.no_sb3 else list(dict.fromkeys(args.sb3_configs)), list(dict.fromkeys(args.modes))
    if args.quick:
        args.steps, args.seeds = 20_000, args.seeds[:1]
    hp = HPARAMS[args.hparams] | ({"normalize": True} if args.normalize else {})
    per_update = hp["n_envs"] * hp["n_steps"]
    steps = max(1, args.steps // per_update) * per_update  # both systems run whole updates
    if sb3_configs:
        import_sb3()  # fail before anything runs
    out_root = Path(args.out or tempfile.mkdtemp(prefix="m2flow-embodied-vs-sb3-"))

    import gymnasium
    import ray
    import torch

    versions = {"torch": torch.__version__, "ray": ray.__version__, "gymnasium": gymnasium.__version__}
    if sb3_configs:
        import stable_baselines3

        versions["stable_baselines3"] = stable_baselines3.__version__

    bench = Run()
    sides = [("sb3", c) for c in sb3_configs] + [("m2flow", m) for m in modes]
    results: dict[str, dict[int, dict]] = {f"sb3/{c}": {} for c in sb3_configs} | {m: {} for m in modes}
    order: dict[str, list[str]] = {}
    for i, seed in enumerate(args.seeds):
        order[str(seed)] = []
        for system, name in side_order(sides, i):
            side = f"sb3/{name}" if system == "sb3" else name
            log(f"[seed {seed}] {'SB3 PPO ' + name if system == 'sb3' else 'm2flow ' + name} on {args.env}, {steps} env steps")
            spec = {"system": system, "env": args.env, "steps": steps, "seed": seed, "hp": hp}
            if system == "sb3":
                spec["config"] = name
            else:
                spec |= {"mode": name, "out_dir": str(out_root / f"{name}-seed{seed}"),
                         "extra": m2flow_overrides(hp) + args.override}
            r, load = loaded(lambda: run_child(__file__, spec))  # noqa: B023
            results[side][seed] = r | load
            order[str(seed)].append(side)
            log(f"  {r['env_steps_per_s']:,.0f} env steps/s, return {r['final_return']:.1f}, "
                f"load {load['load_before']} -> {load['load_after']}")
            if system == "m2flow":
                time.sleep(2.0)  # let Ray's processes exit before the next side starts
    report = {
        "benchmark": "embodied_vs_sb3",
        "env": args.env, "env_steps": steps, "seeds": args.seeds, "modes": modes, "sb3_configs": sb3_configs,
        "sb3_config_settings": {c: SB3_CONFIGS[c] for c in sb3_configs}, "quick": args.quick,
        "m2flow_overrides": args.override, "hparams": args.hparams, "hyperparameters": hp, "order": order,
        "runs": {side: {str(s): r for s, r in runs.items()} for side, runs in results.items()},
        "summary": summarise(results, sb3_configs, modes, args.seeds),
        "m2flow_out": str(out_root),
        **bench.finish(**versions),
    }
    print(json.dumps(json_safe(report), indent=1, default=float))


if __name__ == "__main__":
    main()
