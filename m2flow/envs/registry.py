"""One way to name an environment from any simulator: ``make_env(env_id, **kwargs)``.

- ``"HalfCheetah-v5"``, ``"CartPole-v1"``, ...: a gymnasium id, passed to ``gymnasium.make``.
- ``"maniskill:PickCube-v1"``: ManiSkill 3, state observations, CPU simulation, one scene per
  gymnasium env (the GPU-batched mode does not fit a per-env batch of gymnasium envs). SAPIEN
  needs a Vulkan device even so: without a GPU, Mesa's lavapipe (scripts/setup_maniskill.sh).
  ``ignore_terminations=True`` runs every episode to its time limit instead of ending it on
  success (ManiSkill's own wrapper option).
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


def _make_maniskill(task: str, ignore_terminations: bool = False, **kwargs: Any) -> gym.Env:
    # Importing registers the tasks with gymnasium.
    _require("mani_skill.envs", "mani-skill", f"maniskill:{task}",
             " (on a CPU-only machine SAPIEN also needs a software Vulkan driver: scripts/setup_maniskill.sh)")
    from mani_skill.utils.wrappers.gymnasium import CPUGymWrapper

    kwargs = {
        "obs_mode": "state",
        "sim_backend": "cpu",
        # Scenes are built with render materials even for state observations, so SAPIEN needs a
        # render device; "cpu" (a software Vulkan) without first probing for CUDA and warning.
        "render_backend": "cpu",
        # An unseeded reset then draws the episode's seed from the env's own RNG instead of
        # using torch's global RNG, which the policy's sampling advances too.
        "enhanced_determinism": True,
        **kwargs,
        "num_envs": 1,
    }
    try:
        env = gym.make(task, **kwargs)
    except RuntimeError as e:
        if not str(e).startswith("vk::"):
            raise
        raise gym.error.DependencyNotInstalled(
            f"SAPIEN found no usable Vulkan driver ({e}): on a CPU-only machine it needs Mesa's "
            "software Vulkan (lavapipe): `make maniskill` (scripts/setup_maniskill.sh)") from e
    # ManiSkill envs are batched torch envs even with one scene; CPUGymWrapper unbatches
    # them into the plain gymnasium API (numpy, scalar reward and flags).
    return _ManiSkillSnapshots(CPUGymWrapper(env, ignore_terminations=ignore_terminations))


class _ManiSkillSnapshots(gym.Wrapper):
    """``snapshot``/``restore`` for checkpoints (see ``EnvBatch.snapshot``): SAPIEN scenes do not
    pickle, so the bodies' states, the controller, the step count and the RNGs are saved.
    SAPIEN sets body poses in float32 through the centre of mass, so a restored env continues
    the original to round-off (~1e-6), not bit for bit; restores of one snapshot agree exactly."""

    def snapshot(self) -> dict[str, Any]:
        from mani_skill.utils import common

        base = self.env.unwrapped
        return {
            "sim": common.to_numpy(base.get_state_dict()),
            "elapsed_steps": common.to_numpy(base._elapsed_steps).copy(),
            "main_seed": list(base._main_seed), "episode_seed": base._episode_seed.copy(),
            "rngs": [rng.get_state() for rng in _maniskill_rngs(base)],
        }

    def restore(self, snap: dict[str, Any]) -> None:
        from mani_skill.utils import common

        base = self.env.unwrapped
        base._main_seed, base._episode_seed = list(snap["main_seed"]), snap["episode_seed"].copy()
        for rng, state in zip(_maniskill_rngs(base), snap["rngs"], strict=True):
            rng.set_state(state)
        sim = common.to_tensor(snap["sim"], device=base.device)
        base.set_state_dict(sim)
        if "controller" in sim:  # set_state_dict leaves the controller alone
            base.agent.set_controller_state(sim["controller"])
        base._elapsed_steps[:] = common.to_tensor(snap["elapsed_steps"], device=base.device)
        env = self.env  # a snapshot is taken mid-episode: OrderEnforcing must let step() through
        while isinstance(env, gym.Wrapper):
            if hasattr(env, "_has_reset"):
                env._has_reset = True
            env = env.env


def _maniskill_rngs(base: Any) -> list[Any]:
    """The numpy RandomStates a ManiSkill env draws from (the episode RNG aliases one of them)."""
    return [base._main_rng, *base._batched_main_rng.rngs, *base._batched_episode_rng.rngs]


def _make_metaworld(task: str, **kwargs: Any) -> gym.Env:
    _require("metaworld", "metaworld", f"metaworld:{task}",
             " (it pins its own mujoco version: `make metaworld` sets up .venv-metaworld; run m2flow "
             "from there)")  # registers "Meta-World/*"
    # The benchmark seed fixes MT1's set of goal positions; unseeded, every env of a batch
    # would draw its own set and runs would not repeat. Episode seeds come from reset().
    kwargs.setdefault("seed", 0)
    # Its observations leave their declared bounds (hand and goal coordinates): gymnasium's
    # checker would warn about that for every env made.
    kwargs.setdefault("disable_env_checker", True)
    return _SeededTaskChoice(gym.make("Meta-World/MT1", env_name=task, **kwargs))


class _SeededTaskChoice(gym.Wrapper):
    """Meta-World picks an episode's task (its goal) from the env's RNG *before* the reset
    seeds it, so envs reset with different seeds would all start on the task that
    ``gym.make``'s seed drew. Seeding the RNG first makes the pick follow the reset's seed."""

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self.np_random, _ = gym.utils.seeding.np_random(seed)  # passed down to the base env
        return self.env.reset(seed=seed, options=options)


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
