"""Writes demonstrations of a Meta-World task, played by Meta-World's own scripted policy for it,
as a replay buffer file (safetensors) that off-policy RL loads as its offline source
(``m2flow.replay.ReplayBuffer.from_file``; RLPD samples it beside the online data). Runs in the
Meta-World venv (``make metaworld``):

    .venv-metaworld/bin/python scripts/robot_demonstrations.py push-v3 --episodes 10 --out push.safetensors

Each episode runs to its time limit (``--max-episode-steps``) from a seed of its own
(``--seed`` + its index); ``--successful-only`` keeps only the episodes that reached success.
Prints how many episodes succeeded and how many transitions were written."""

import argparse
import re

import numpy as np

from m2flow.envs import EnvBatch
from m2flow.replay import ReplayBuffer


def scripted_policy(task: str):
    """Meta-World's scripted policy for ``task`` (``push-v3`` -> ``SawyerPushV3Policy``)."""
    import metaworld.policies

    name = "Sawyer" + "".join(part.capitalize() for part in re.split(r"[-_]", task)) + "Policy"
    if not hasattr(metaworld.policies, name):
        raise SystemExit(f"Meta-World has no scripted policy {name} for the task {task!r}")
    return getattr(metaworld.policies, name)()


def collect(task: str, episodes: int, max_episode_steps: int, seed: int, successful_only: bool = False
            ) -> tuple[ReplayBuffer, list[bool]]:
    """The transitions of ``episodes`` episodes (of those that succeeded, with
    ``successful_only``) in a buffer of one lane, and each episode's success."""
    policy = scripted_policy(task)
    buffer = ReplayBuffer(capacity=episodes * (max_episode_steps + 1) + 2, lanes=1, obs_shape=(39,),
                          action_shape=(4,))
    successes = []
    for e in range(episodes):
        batch = EnvBatch(f"metaworld:{task}", 1, seed=seed + e, env_kwargs={"max_episode_steps": max_episode_steps})
        obs, steps = batch.reset(), []
        while True:
            action = np.clip(policy.get_action(obs[0]), -1.0, 1.0).astype(np.float32)[None]
            result = batch.step(action)
            steps.append((obs, action, result.rewards, result.terminated, result.truncated, result.final_obs))
            obs = result.obs
            if result.episode_successes:
                successes.append(bool(result.episode_successes[0]))
                break
        batch.close()
        if successes[-1] or not successful_only:
            for step in steps:
                buffer.add(*step)
    return buffer, successes


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", help="a Meta-World task, e.g. push-v3, pick-place-v3")
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--max-episode-steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--successful-only", action="store_true")
    parser.add_argument("--out", required=True, help="the .safetensors file to write")
    args = parser.parse_args()
    buffer, successes = collect(args.task, args.episodes, args.max_episode_steps, args.seed, args.successful_only)
    buffer.save(args.out)
    print(f"{sum(successes)} of {len(successes)} episodes succeeded; {len(buffer)} transitions -> {args.out}")
