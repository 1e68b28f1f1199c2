"""A stop asked for by SIGINT or SIGTERM: the run ends after the update in progress with a
checkpoint, one line and the shell's status for the signal; a second signal stops at once.
(A run stopped so and resumed reaches the uninterrupted run's weights: test_embodied.py.)"""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m2flow.runners import checkpoint as checkpoints
from m2flow.runners import status
from m2flow.runtime import stop
from m2flow.runtime.stop import StopRequest


def test_the_first_signal_asks_the_second_stops_and_the_handlers_come_back(capfd):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in (signal.SIGINT, signal.SIGTERM):
        with StopRequest("stopping soon") as stop:
            assert stop.signum is None
            os.kill(os.getpid(), s)  # handled at once, in this thread
            assert stop.signum == s and stop.name == signal.Signals(s).name
            assert f"{stop.name}: stopping soon (send it again to stop at once)" in capfd.readouterr().err
            with pytest.raises(KeyboardInterrupt, match=f"{stop.name} again: stopped at once"):
                os.kill(os.getpid(), s)
        assert {s: signal.getsignal(s) for s in before} == before


def test_a_request_inside_another_sees_what_came_before_it_and_keeps_it(capfd):
    """A run's loop inside the command that started it: a signal while the run started (here,
    after a library put its own handler in place) is the loop's to see, and stays seen."""
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest("stopping") as outer:
        signal.signal(signal.SIGTERM, lambda *a: None)  # as Ray does when it starts
        stop.reassert()
        os.kill(os.getpid(), signal.SIGTERM)
        with StopRequest("not told") as inner:
            assert inner.signum == outer.signum == signal.SIGTERM
        assert inner.name == "SIGTERM"  # after it is left too
        assert "SIGTERM: stopping (send it again" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before


def _train(out: Path, *overrides: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "m2flow.cli", "train", "embodied/ppo_cartpole", f"runner.out_dir={out}",
            "runner.progress=false", "runner.total_env_steps=1e7", "runner.target_return=null",
            "runner.checkpoint_every=0", "cluster.cpu_slots=2", *overrides]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _rows(out: Path) -> int:
    csv = out / "metrics.csv"
    return max(0, len(csv.read_text().splitlines()) - 1) if csv.is_file() else 0


def test_sigterm_stops_a_run_after_its_update_with_a_checkpoint_of_all_it_logged(tmp_path):
    """SIGTERM to the driver alone (a container's stop, ``kill PID``): the run stops after the
    update in progress, writes its checkpoint (none was due: checkpoint_every=0) and exits with
    143 and one line; the checkpoint holds every update the run logged."""
    out = tmp_path / "run"
    proc = _train(out)
    deadline = time.monotonic() + 240
    while _rows(out) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()
    # meanwhile a second run into the same directory fails at once, naming the first
    second = subprocess.run(_train(out).args, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and second.stderr.strip() == (
        f"m2flow: error: runner.out_dir: another run (pid {proc.pid} on {socket.gethostname()} since "
        f"{second.stderr.split(' since ')[1][:19]}) writes its files there; give this one another "
        "runner.out_dir, or stop that one"), second.stderr
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("m2flow: stopped by SIGTERM after ") and "continue with runner.resume=auto" in last, err
    saved = checkpoints.latest(checkpoints.directory(out))
    assert saved is not None and saved.name in last
    done = checkpoints.load(saved)["done"]
    assert last.startswith(f"m2flow: stopped by SIGTERM after {done} of ") and done == _rows(out) >= 3
    ended = status.read(out)
    assert (ended["state"], ended["signal"], ended["message"], ended["done"], ended["last_checkpoint"], ended["pid"]) \
        == ("stopped", "SIGTERM", last.removeprefix("m2flow: "), done, str(saved), proc.pid)
