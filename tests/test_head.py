"""The Ray cluster's head lost during a run: the run notices it within seconds, finishes the
update in progress, writes a checkpoint and ends with one paragraph, before Ray's core ends the
driver (60 s after the loss) with no Python code run; a head that answers again lets it go on."""

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from m2flow.config import load_config
from m2flow.runners import checkpoint as checkpoints
from m2flow.runners import status
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.runners.status import RunFailed
from m2flow.runtime.head import HeadMonitor


def _listen(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _until(condition, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_the_monitor_takes_the_head_for_lost_after_its_time_and_back_when_it_answers():
    server = _listen()
    port = server.getsockname()[1]
    changes = []
    head = HeadMonitor(f"127.0.0.1:{port}", poll_s=0.05, lost_after_s=0.5,
                       on_change=lambda h: changes.append((h.lost, time.monotonic())))
    try:
        time.sleep(0.3)
        assert not head.lost and changes == []
        server.close()
        closed = time.monotonic()
        _until(lambda: head.lost)
        assert changes[0][0] is True and changes[0][1] - closed >= 0.45  # not before lost_after_s
        assert "127.0.0.1" in head.describe() and "has not answered since" in head.describe()
        server = _listen(port)
        _until(lambda: not head.lost)
        assert [lost for lost, _ in changes] == [True, False]
    finally:
        head.stop()
        server.close()
    assert not HeadMonitor(None).lost  # nothing to watch: never lost


class _FlakyHead:
    """A head taken for lost while update ``at`` starts, answering again before it ends unless
    ``stays_lost``."""

    def __init__(self, runner, at, stays_lost=False):
        self.runner, self.at, self.stays_lost, self.on_change = runner, at, stays_lost, None

    @property
    def lost(self):
        done = self.runner.progress.done
        if self.stays_lost:
            return done >= self.at
        return done == self.at and self.runner.progress.last_checkpoint is None

    def describe(self):
        return "the Ray cluster's head (its GCS at nowhere) has not answered since now"

    def stop(self):
        pass


def test_a_head_that_answers_again_leaves_a_checkpoint_and_the_run_goes_on(cluster, pool, tmp_path, monkeypatch):
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", [
        "placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
        "placement.components.actor=0-1", "runner.total_env_steps=1536", f"runner.out_dir={tmp_path}", "runner.progress=false"]),
        cluster, pool)
    monkeypatch.setattr(cluster, "head", _FlakyHead(runner, at=2))
    try:
        history = runner.train()
    finally:
        runner.close()
    assert len(history) == 6  # every update
    kept = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert kept == ["update_000003.safetensors", "update_000006.safetensors"]  # the head's, then the last
    assert "the Ray cluster's head answers again: the run goes on after update 3" in (tmp_path / "log.txt").read_text()
    assert status.read(tmp_path)["state"] == "finished"


def test_a_head_that_stays_lost_ends_the_run_after_the_update_in_progress_with_a_checkpoint(cluster, pool, tmp_path,
                                                                                             monkeypatch):
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", [
        "placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
        "placement.components.actor=0-1", "runner.total_env_steps=1536", f"runner.out_dir={tmp_path}",
        "runner.progress=false"]), cluster, pool)
    monkeypatch.setattr(cluster, "head", _FlakyHead(runner, at=2, stays_lost=True))
    try:
        with pytest.raises(RunFailed) as failed:
            runner.train()
    finally:
        runner.close()
    checkpoint = tmp_path / "checkpoints" / "update_000003.safetensors"
    assert str(failed.value) == ("the run failed after 3 of 6 updates: the Ray cluster's head (its GCS at nowhere) "
                                 f"has not answered since now; the last checkpoint: {checkpoint}; continue with "
                                 "runner.resume=auto")
    assert not failed.value.traced  # no traceback behind it: the command line names no log for one
    assert checkpoints.load(checkpoint)["done"] == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [checkpoint.name]
    ended = status.read(tmp_path)
    assert (ended["state"], ended["done"], ended["message"]) == ("failed", 3, str(failed.value))


@pytest.mark.slow
def test_a_lost_head_ends_the_run_with_a_checkpoint_and_leaves_no_process(tmp_path):
    """The embedded Ray's GCS killed (SIGKILL) at update 3 of a CartPole run that takes no
    checkpoint of its own: the run ends in about 17 s with exit status 1, a checkpoint of the
    updates it did and no process of its Ray left (35 s in all: slow-marked; the runner's part
    runs by default above)."""
    out = tmp_path / "run"
    ray_tmp = Path(tempfile.mkdtemp(prefix="m2h-", dir="/tmp"))  # Ray's socket paths must stay short
    env = {**os.environ, "M2FLOW_RAY_TMP": str(ray_tmp)}
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as f:  # a pipe nobody reads would stop the driver once full
        driver = subprocess.Popen([sys.executable, "-m", "m2flow.cli", "train", "embodied/ppo_cartpole",
                                   "runner.total_env_steps=2000000", f"runner.out_dir={out}", "runner.progress=false"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=f)
    try:
        def progressed():
            assert driver.poll() is None, stderr.read_text()
            try:
                return status.read(out).get("done", 0) >= 3
            except (OSError, ValueError):
                return False

        _until(progressed, timeout_s=120)
        gcs = [p for p in psutil.Process(driver.pid).children(recursive=True) if p.name().startswith("gcs_server")]
        assert len(gcs) == 1, gcs
        gcs[0].kill()
        killed = time.monotonic()
        driver.wait(timeout=55)  # Ray's core would end the driver at 60 s
    finally:
        if driver.poll() is None:
            driver.kill()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    took = time.monotonic() - killed
    err = stderr.read_text()
    assert driver.returncode == 1, err
    last = err.strip().splitlines()[-1]
    ended = status.read(out)
    done = ended["done"]
    checkpoint = out / "checkpoints" / f"update_{done:06d}.safetensors"
    assert re.fullmatch(rf"m2flow: the run failed after {done} of 7812 updates: the Ray cluster's head \(its GCS at "
                        rf"127\.0\.0\.1:\d+\) has not answered since \d\d:\d\d:\d\d; the last checkpoint: "
                        rf"{re.escape(str(checkpoint))}; continue with runner.resume=auto", last), err
    assert checkpoints.load(checkpoint)["done"] == done
    assert (ended["state"], ended["message"], ended["last_checkpoint"]) == ("failed", last[len("m2flow: "):],
                                                                              str(checkpoint))
    assert ended["warning"].endswith("Ray ends this driver and its workers 60 s after that: a checkpoint follows "
                                     "the update in progress") and ended["warning"] in err
    assert took < 45, took

    def ours(p):
        try:
            return any(f.path.startswith(str(ray_tmp)) for f in p.open_files())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return False

    left = [p for p in psutil.process_iter() if ours(p)]
    assert not left, [(p.pid, p.name()) for p in left]
