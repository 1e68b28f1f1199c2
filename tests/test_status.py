"""``status.json``: rewritten after updates at most every few seconds, at once when its state
changes (the run starts training, ends)."""

import json
import os
import re
import time

import pytest

from m2flow.runners.status import FILE, RunFailed, RunStatus, continue_from, ending, read
from m2flow.runtime.stop import RunStopped


def test_updates_are_written_at_most_every_so_often_and_a_new_state_at_once(tmp_path):
    s = RunStatus(tmp_path, every_s=3600)
    first = read(tmp_path)
    assert (first["state"], first["pid"]) == ("starting", os.getpid())
    s.set("running", unit="step", total=10, done=0)
    assert (read(tmp_path)["state"], read(tmp_path)["total"]) == ("running", 10)
    s.set(done=1, last_checkpoint=tmp_path / "c1", restarts=0)
    assert read(tmp_path)["done"] == 0  # within every_s: not written
    s.set(now=True, done=1)  # a resumed run's position: at once
    assert read(tmp_path)["done"] == 1
    s.every_s = 0
    s.set(done=2, last_checkpoint=tmp_path / "c2", restarts=1)
    assert (read(tmp_path)["done"], read(tmp_path)["last_checkpoint"], read(tmp_path)["restarts"]) == (
        2, str(tmp_path / "c2"), 1)
    s.every_s = 3600
    time.sleep(1.1)  # the stamps have whole seconds
    s.failed(RunFailed("the run failed after 3 of 10 steps: ..."), done=3)
    last = read(tmp_path)
    assert (last["state"], last["message"], last["done"]) == ("failed", "the run failed after 3 of 10 steps: ...", 3)
    assert last["updated"] > first["updated"] and last["started"] == first["started"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE]  # no temporary file left
    json.loads((tmp_path / FILE).read_text())


def test_how_each_end_is_named():
    assert ending(RunStopped("stopped by SIGTERM after 4 of 9 steps; ...", 15)) == (
        "stopped", {"signal": "SIGTERM", "message": "stopped by SIGTERM after 4 of 9 steps; ..."})
    assert ending(KeyboardInterrupt("SIGINT again: stopped at once")) == (
        "stopped", {"message": "SIGINT again: stopped at once"})
    assert ending(ValueError("bad")) == ("failed", {"message": "ValueError: bad"})


def test_a_run_that_fails_while_it_profiles_says_so_and_lets_its_directory_go(tmp_path, monkeypatch):
    from m2flow.config import ConfigError, load_config
    from m2flow.runners import run, start
    from m2flow.runtime.files import DirectoryLock

    def no_cluster(cluster):
        raise ConfigError("cluster.address", "nothing answers at 10.0.0.9:6379")

    monkeypatch.setattr(start, "start_cluster", no_cluster)
    cfg = load_config("embodied/ppo_cartpole", ["placement.mode=auto", f"runner.out_dir={tmp_path}"])
    with pytest.raises(ConfigError):
        run(cfg)
    ended = read(tmp_path)
    assert (ended["state"], ended["message"]) == ("failed", "ConfigError: cluster.address: nothing answers at 10.0.0.9:6379")
    DirectoryLock(tmp_path).acquire().release()  # free again


def test_m2flow_status_tells_a_running_run_from_one_that_ended_without_a_word(tmp_path, capsys):
    import signal
    import subprocess
    import sys

    from m2flow.cli import main

    s = RunStatus(tmp_path)
    s.set("running", unit="update", total=40, done=12,
          last_checkpoint=tmp_path / "checkpoints" / "update_000010.safetensors")
    s.write()
    hold = ("import sys, time\nfrom m2flow.runtime.files import DirectoryLock\nDirectoryLock(sys.argv[1]).acquire()\n"
            "print('held', flush=True)\ntime.sleep(600)")
    driver = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "held"
        main(["status", str(tmp_path)])  # exit status 0
        out = capsys.readouterr().out
        assert out.startswith(f"{tmp_path}: running, 12 of 40 updates (pid {os.getpid()} on ") and out.rstrip().endswith(
            f"the last checkpoint: {tmp_path / 'checkpoints' / 'update_000010.safetensors'}")
        assert re.search(r"written [-+:T\d]+, \d s ago\)", out), out
    finally:
        driver.send_signal(signal.SIGKILL)  # the driver killed: its status still says running
        driver.wait()
    with pytest.raises(SystemExit) as e:
        main(["status", str(tmp_path)])
    out = capsys.readouterr().out
    assert e.value.code == 1 and out.startswith(f"{tmp_path}: ended without a word after 12 of 40 updates (its "
                                                "status says running, but no process holds the directory")
    assert out.rstrip().endswith("update_000010.safetensors; continue with runner.resume=auto")
    s.failed(RunFailed("the run failed after 13 of 40 updates: No space left on device"), done=13)
    with pytest.raises(SystemExit) as e:
        main(["status", str(tmp_path)])
    assert e.value.code == 1 and capsys.readouterr().out.rstrip().endswith(
        "): the run failed after 13 of 40 updates: No space left on device")
    with pytest.raises(SystemExit) as e:
        main(["status", str(tmp_path / "none")])
    assert e.value.code == 2 and "m2flow: error: run_dir: no status.json in " in capsys.readouterr().err
    for text in ("{", "[1, 2]", '{"state": "running"}'):
        (tmp_path / FILE).write_text(text)
        with pytest.raises(SystemExit) as e:
            main(["status", str(tmp_path)])
        assert e.value.code == 2 and "/status.json is no run status (" in capsys.readouterr().err


def test_where_a_run_continues_from():
    assert continue_from(None, "runs/a") == "no checkpoint written"
    own, other = "runs/a/checkpoints/update_000004.safetensors", "runs/b/checkpoints/update_000004.safetensors"
    assert continue_from(own, "runs/a") == f"the last checkpoint: {own}; continue with runner.resume=auto"
    assert continue_from(other, "runs/a") == f"the last checkpoint: {other}; continue with runner.resume={other}"


def test_a_run_of_another_machine_is_taken_at_its_word(tmp_path, capsys):
    from m2flow.cli import main

    s = RunStatus(tmp_path)
    s.fields["host"] = "node-that-is-not-this-one"
    s.set("running", unit="step", total=30, done=7)
    main(["status", str(tmp_path)])  # exit status 0: no lock seen, but it may not reach here
    assert "running, 7 of 30 steps, as its status says (" in capsys.readouterr().out


def test_a_warning_is_written_at_once_and_shown_while_it_runs_and_after_it_ended_without_a_word(tmp_path, capsys):
    from m2flow.cli import main
    from m2flow.runtime.files import DirectoryLock

    s = RunStatus(tmp_path, every_s=3600)
    s.set("running", unit="update", total=40, done=12)
    s.warn("the Ray cluster's head (its GCS at 10.0.0.1:6379) has not answered since 10:00:00")
    assert read(tmp_path)["warning"].startswith("the Ray cluster's head")  # not held back for every_s
    lock = DirectoryLock(tmp_path).acquire()
    try:
        main(["status", str(tmp_path)])
        assert capsys.readouterr().out.rstrip().endswith("; no checkpoint written; the Ray cluster's head (its GCS "
                                                         "at 10.0.0.1:6379) has not answered since 10:00:00")
    finally:
        lock.release()
    with pytest.raises(SystemExit):
        main(["status", str(tmp_path)])
    assert "holds the directory: pid " in (out := capsys.readouterr().out) and (
        "); it had said: the Ray cluster's head (its GCS at 10.0.0.1:6379) has not answered since 10:00:00; no "
        "checkpoint written" in out), out
    s.warn(None)
    main_out = read(tmp_path)
    assert main_out["warning"] is None


def test_a_config_error_while_a_run_starts_leaves_the_last_runs_status(tmp_path, monkeypatch):
    """A run stopped by a config error as it starts (its envs cannot be shared among the ranks
    of its plan, found once the plan is laid out; a profiled run's cluster not there) leaves
    the status.json of the run before it in that directory as it was."""
    from m2flow.config import ConfigError, load_config
    from m2flow.runners import run, start
    from m2flow.runners.status import describe

    earlier = RunStatus(tmp_path)
    earlier.set("finished", unit="update", total=40, done=40)
    before = (tmp_path / "status.json").read_bytes()
    cfg = load_config("embodied/ppo_cartpole", ["env.num_envs=6", "cluster.cpu_slots=4", f"runner.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="env.num_envs: "):
        run(cfg)
    assert (tmp_path / "status.json").read_bytes() == before

    def no_cluster(cluster):
        raise ConfigError("cluster.address", "nothing answers at 10.0.0.9:6379")

    monkeypatch.setattr(start, "start_cluster", no_cluster)
    cfg = load_config("embodied/ppo_cartpole", ["placement.mode=auto", f"runner.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="cluster.address: "):
        run(cfg)
    assert (tmp_path / "status.json").read_bytes() == before
    assert describe(tmp_path)[0].startswith(f"{tmp_path}: finished, 40 of 40 updates")
