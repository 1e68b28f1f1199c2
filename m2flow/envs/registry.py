"""One way to name an environment from any simulator: ``make_env(env_id, **kwargs)``.

- ``"HalfCheetah-v5"``, ``"CartPole-v1"``, ...: a gymnasium id, passed to ``gymnasium.make``.
- ``"maniskill:PickCube-v1"``: ManiSkill 3, state observations, CPU simulation, one scene per
  gymnasium env (the GPU-batched mode does not fit a per-env batch of gymnasium envs).
- ``"metaworld:reach-v3"``: Meta-World's MT1 single-task env (``gym.make("Meta-World/MT1")``).

The simulator packages are optional extras, imported only when such an id is made.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import gymnasium as gym


def _require(module: str, pip_name: str, env_id: str, note: str = "") -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.partition(".")[0]:
            raise  # the package is there but broken: its own error says more
        raise ImportError(f"{env_id!r} needs the optional package {pip_name!r}: "
                          f"pip install {pip_name}{note}") from exc


def _make_maniskill(task: str, **kwargs: Any) -> gym.Env:
    # Importing registers the tasks with gymnasium.
    _require("mani_skill.envs", "mani-skill", f"maniskill:{task}",
             " (on a CPU-only machine SAPIEN also needs a software Vulkan driver)")
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    kwargs = {"obs_mode": "state", "sim_backend": "cpu", **kwargs, "num_envs": 1}
    # ManiSkill envs are batched torch envs even with one scene; CPUGymWrapper unbatches
    # them into the plain gymnasium API (numpy, scalar reward and flags).
    return CPUGymWrapper(gym.make(task, **kwargs))


def _make_metaworld(task: str, **kwargs: Any) -> gym.Env:
    _require("metaworld", "metaworld", f"metaworld:{task}",
             " (metaworld 3.1 pins its own mujoco version)")  # registers "Meta-World/*"
    # The benchmark seed fixes MT1's set of goal positions; unseeded, every env of a batch
    # would draw its own set and runs would not repeat. Episode seeds come from reset().
    kwargs.setdefault("seed", 0)
    return gym.make("Meta-World/MT1", env_name=task, **kwargs)


def _route_mujoco_warnings() -> None:
    """Turn MuJoCo's warnings into Python warnings, shown once per message.

    MuJoCo's default handler prints every warning and appends it to MUJOCO_LOG.TXT in the
    working directory: with mujoco 4, each HalfCheetah/Hopper/Ant env made by gymnasium would
    leave a deprecation notice there. A handler someone else installed is left alone.
    """
    try:
        import mujoco
    except ImportError:
        return
    if mujoco.get_mju_user_warning() is None:
        mujoco.set_mju_user_warning(lambda msg: warnings.warn(f"MuJoCo: {msg}", RuntimeWarning))


_SIMULATORS: dict[str, Callable[..., gym.Env]] = {
    "maniskill": _make_maniskill,
    "metaworld": _make_metaworld,
}


def make_env(env_id: str, **kwargs: Any) -> gym.Env:
    """Create one single-agent gymnasium env; ``kwargs`` go to the simulator's constructor."""
    _route_mujoco_warnings()
    prefix, _, task = env_id.partition(":")
    if prefix in _SIMULATORS:
        return _SIMULATORS[prefix](task, **kwargs)
    # Anything else, gymnasium's own "module:EnvId" form included, is gymnasium's to resolve.
    return gym.make(env_id, **kwargs)
