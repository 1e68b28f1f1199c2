"""Snapshots of an ``EnvBatch``: its exact state mid-rollout, for checkpoints and resume.

A snapshot holds arrays and plain values only (checkpoints store nothing pickled): every
simulator's state and RNG (MuJoCo's MjData, an env's own attributes, its wrappers' episode
counters; an env with ``snapshot``/``restore`` methods saves itself), the episodes under way
(``_EPISODE_STATE``), the fault count and the normalisation statistics. ``batch_restore`` of
it continues the batch bit for bit; ``regroup_snapshots`` redistributes the envs of several
snapshots over batches of other sizes. ``EnvBatch.snapshot``/``restore``/``regroup`` call
these; stepping stays in ``m2flow.envs.batch``.
"""

from __future__ import annotations

from typing import Any

import copy

import gymnasium as gym
import numpy as np

from m2flow.envs.normalize import RunningMeanStd

# EnvBatch's per-env arrays that a snapshot carries (the episodes under way).
_EPISODE_STATE = ("_obs", "_episodes_started", "_episode_return", "_episode_length", "_episode_success",
                  "_discounted_return", "_done")


# -- snapshots of a whole batch ---------------------------------------------------------
def batch_snapshot(batch: Any) -> dict[str, Any]:
    """The whole batch mid-rollout: simulators, RNGs, episode counters, statistics.
    ``restore`` of it continues exactly where this batch is (checkpoint and resume)."""
    return {"envs": [_env_snapshot(env) for env in batch.envs], "stats": batch.state_dict(),
            "training": batch.training, "reports_success": batch._reports_success, "faults": batch.faults,
            **{f: getattr(batch, f).copy() for f in _EPISODE_STATE}}


def batch_restore(batch: Any, snap: dict[str, Any]) -> None:
    if len(snap["envs"]) != batch.num_envs:
        raise ValueError(f"snapshot of {len(snap['envs'])} envs restored into a batch of {batch.num_envs}")
    batch.envs = [_env_restore(env, s) for env, s in zip(batch.envs, snap["envs"])]
    batch.load_state_dict(snap["stats"])
    batch.training = snap["training"]
    batch._reports_success = snap["reports_success"]
    batch.faults = snap.get("faults", 0)  # it seeds the next env made again (checkpoints before it: 0)
    for f in _EPISODE_STATE:
        getattr(batch, f)[...] = snap[f]


def regroup_snapshots(snaps: list[dict[str, Any]], sizes: list[int]) -> list[dict[str, Any]]:
    """``snapshot``s of batches of consecutive envs, as snapshots of batches of ``sizes``
    envs holding the same envs in the same order (a run resumed with its envs spread
    over other ranks or stages): each env's simulator, RNG and episode under way go with
    it. A new batch's statistics merge those of every batch its envs come from (the
    parallel Welford update: the moments of all the samples they saw)."""
    if sum(len(s["envs"]) for s in snaps) != sum(sizes):
        raise ValueError(f"{sum(len(s['envs']) for s in snaps)} envs cannot be regrouped into {sum(sizes)}")
    source = [b for b, s in enumerate(snaps) for _ in s["envs"]]  # each env's batch
    joined = {f: np.concatenate([s[f] for s in snaps]) for f in _EPISODE_STATE}
    envs = [e for s in snaps for e in s["envs"]]
    out, start, counted = [], 0, set()
    for size in sizes:
        origins = sorted(set(source[start:start + size]))
        faults = sum(snaps[b].get("faults", 0) for b in origins if b not in counted)  # each batch's once
        counted |= set(origins)
        out.append({"envs": envs[start:start + size], "training": snaps[origins[0]]["training"], "faults": faults,
                    "reports_success": any(snaps[b]["reports_success"] for b in origins),
                    "stats": _merged_stats([snaps[b]["stats"] for b in origins]),
                    **{f: joined[f][start:start + size].copy() for f in _EPISODE_STATE}})
        start += size
    return out


def _merged_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """``state_dict``s of several batches' statistics as one: each running statistic folded
    into the first by its moments and count."""
    merged = {}
    for name in stats[0]:
        rms = RunningMeanStd(np.shape(stats[0][name]["mean"]))
        rms.load_state_dict(stats[0][name])
        for other in stats[1:]:
            rms.update_from_moments(np.asarray(other[name]["mean"]), np.asarray(other[name]["var"]),
                                    other[name]["count"])
        merged[name] = rms.state_dict()
    return merged


# -- snapshots of single simulators ----------------------------------------------------
def _wrappers(env: gym.Env) -> list[gym.Env]:
    chain = [env]
    while isinstance(chain[-1], gym.Wrapper):
        chain.append(chain[-1].env)
    return chain


def _env_snapshot(env: gym.Env) -> dict[str, Any]:
    """An env's state as arrays and plain values (checkpoints store nothing pickled): its own
    attributes of plain types (a classic-control env's ``state``; Meta-World's step count, goal
    and previous observation), its RNG, its wrappers' episode counters and, for a MuJoCo env,
    every array of its MjData. MuJoCo envs also read derived fields that ``mj_step`` left
    behind (e.g. body positions from before the last integration), so the physics state alone
    would not continue bit for bit. An env whose state lives elsewhere saves itself through
    ``snapshot``/``restore`` methods (ManiSkill's adapter: see ``make_env``)."""
    if hasattr(env, "snapshot"):
        return {"own": env.snapshot()}
    base = env.unwrapped
    wrappers = [{k: v for k, v in vars(w).items() if k in _WRAPPER_STATE} for w in _wrappers(env)]
    attrs = {k: v for k, v in vars(base).items() if _plain(v) and not k.startswith("_ezpickle")}
    snap = {"rng": base.np_random.bit_generator.state, "wrappers": wrappers, "attrs": copy.deepcopy(attrs)}
    if hasattr(base, "data") and hasattr(base, "model"):
        data = base.data
        snap["mjdata"] = {"time": float(data.time),
                          **{k: v.copy() for k in dir(data) if not k.startswith("_")
                             and isinstance(v := getattr(data, k), np.ndarray)}}
    return snap


def _env_restore(env: gym.Env, snap: dict[str, Any]) -> gym.Env:
    if "own" in snap:
        env.restore(snap["own"])
        return env
    base = env.unwrapped
    if "mjdata" in snap:
        data = base.data
        data.time = snap["mjdata"]["time"]
        for k, v in snap["mjdata"].items():
            # The arrays sized by the contacts and constraints of the moment (efc_*, ...) are
            # rebuilt by the next mj_step before anything reads them: those of another size
            # here are left as they are.
            if k != "time" and (dst := getattr(data, k)).shape == v.shape:
                dst[...] = v
    vars(base).update(copy.deepcopy(snap["attrs"]))
    base.np_random.bit_generator.state = snap["rng"]
    for w, state in zip(_wrappers(env), snap["wrappers"]):
        vars(w).update(state)
    return env


def _plain(v: Any) -> bool:
    """Plain values, arrays and containers of them: what a checkpoint stores."""
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, (str, int)) and _plain(x) for k, x in v.items())
    return isinstance(v, _PLAIN) and not (isinstance(v, np.ndarray) and v.dtype.hasobject)


# An env's attributes saved beside its MjData: plain values, not the simulator or spaces.
_PLAIN = (bool, int, float, str, type(None), np.ndarray, np.generic, list, tuple, dict)

# Per-episode wrapper fields: TimeLimit's step count, OrderEnforcing's reset flag.
_WRAPPER_STATE = ("_elapsed_steps", "_has_reset")
