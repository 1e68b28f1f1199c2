"""A worker that dies while the run starts (its process killed, out of memory, a simulator
that crashes in its constructor) is started again, with every group, within the run's restart
budget (``runner.max_restarts``), as one that dies mid-run (tests/test_restarts.py); an
exception a worker raises while it starts ends the run at once. The env workers import
``fault_envs`` by name, as they would a user's env module: the tests folder is on the Python
path of the shared cluster's processes (conftest.py)."""

import re

import pytest

from m2flow.config import load_config
from m2flow.runners import status
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.runners.status import RunFailed
from m2flow.runtime.errors import WorkerDiedError, WorkerError


def _start_overrides(tmp_path, *more):
    return ["env.id=fault_envs:DieInWorker-v0", f"env.kwargs.marker={tmp_path / 'died'}", "env.num_envs=4",
            "runner.rollout_steps=32", "algorithm.minibatch_size=32", "placement.mode=custom",
            "placement.components.env=0-1", "placement.components.rollout=0-1", "placement.components.actor=0-1",
            "runner.total_env_steps=256", "runner.progress=false", f"runner.out_dir={tmp_path / 'run'}", *more]


def test_a_worker_that_dies_while_the_run_starts_is_started_again(cluster, pool, tmp_path):
    """An env worker's process ends in its constructor, once (a simulator that crashes as it is
    made): every group starts again, counted as a restart of the run's budget, and the run
    finishes (before, the run ended while it started)."""
    overrides = _start_overrides(tmp_path, "runner.max_restarts=1")  # 2 updates
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster, pool)
    try:
        history = runner.train()
    finally:
        runner.close()
    assert (tmp_path / "died").exists()  # it did die
    assert [row["update"] for row in history] == [0, 1]
    log = (tmp_path / "run" / "log.txt").read_text()
    assert re.search(r"restart 1 of at most 1: env-\w+ rank \d died in __init__\(\) \(\w+Error: [^\n]+\) while the "
                     r"workers started; all groups start again\n", log), log
    ended = status.read(tmp_path / "run")
    assert (ended["state"], ended["done"], ended["restarts"]) == ("finished", 2, 1)


def test_deaths_while_the_run_starts_count_against_its_restarts(cluster, tmp_path):
    """With no restart left (``runner.max_restarts=0``), a death while the workers start ends the
    run in one paragraph."""
    overrides = _start_overrides(tmp_path, "runner.max_restarts=0")
    with pytest.raises(RunFailed) as failed:
        EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster)
    message = str(failed.value)
    assert re.fullmatch(r"the run failed while it started: a worker process died, more than runner.max_restarts=0 "
                        r"allows; the last: env-\w+ rank \d failed in __init__\(\): the worker process died: [^\n]+",
                        message), message
    ended = status.read(tmp_path / "run")
    assert (ended["state"], ended["message"]) == ("failed", message)


def test_an_error_a_worker_raises_while_the_run_starts_is_not_retried(cluster, tmp_path):
    """An exception in a worker's constructor (a bad setting) would be raised again: the run ends
    at once with it, no restart tried."""
    overrides = _start_overrides(tmp_path, "env.kwargs.raise_=true")
    with pytest.raises(WorkerError) as failed:
        EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster)
    assert not isinstance(failed.value, WorkerDiedError)
    assert re.match(r"env-\w+ rank \d failed in __init__\(\): ValueError: no such arm: 'left'", str(failed.value))
    assert not (tmp_path / "died").exists()
    log = tmp_path / "run" / "log.txt"
    assert not log.exists() or "restart" not in log.read_text()
    assert status.read(tmp_path / "run")["state"] == "failed"
