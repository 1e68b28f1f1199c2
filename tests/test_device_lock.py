import _thread
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray

from m2flow.runtime.device_lock import DeviceLock, LockTimeout, lock_actor, lock_state
from m2flow.runtime.trace import get_tracer

pytestmark = pytest.mark.timeout(60)

DEVICES = range(4)


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, namespace="m2flow-test",
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    # The driver creates (and so owns) the lock actors: a killed holder must not take them along.
    ray.get([lock_actor(d).state.remote() for d in DEVICES])
    yield
    ray.shutdown()


@ray.remote(num_cpus=0.01)
class Contender:
    def __init__(self) -> None:
        self.lock: DeviceLock | None = None

    def pid(self) -> int:
        return os.getpid()

    def acquire(self, devices: list[int], holder: str, timeout: float | None = None) -> float:
        self.lock = DeviceLock(devices, holder)
        return self.lock.acquire(timeout)

    def release(self) -> None:
        self.lock.release()

    def take_turns(self, devices: list[int], holder: str, rounds: int, hold_s: float) -> list[tuple[float, float]]:
        """Acquire and release ``rounds`` times; returns the hold intervals."""
        intervals = []
        lock = DeviceLock(devices, holder)
        for _ in range(rounds):
            with lock:
                start = time.time()
                time.sleep(hold_s)
                intervals.append((start, time.time()))
        return intervals


@pytest.fixture(scope="module")
def contenders():
    actors = [Contender.remote() for _ in range(3)]
    ray.get([a.pid.remote() for a in actors])
    return actors


def wait_until_waiting(device: int, holders: list[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while lock_state(device)["waiting"] != holders:
        assert time.monotonic() < deadline, lock_state(device)
        time.sleep(0.02)


def assert_free(device: int) -> None:
    state = lock_state(device)
    assert state["holder"] is None and state["waiting"] == [], state


def test_grants_in_arrival_order(contenders):
    with DeviceLock([0], "driver"):
        refs = []
        for i, c in enumerate(contenders):
            refs.append(c.take_turns.remote([0], f"c{i}", rounds=1, hold_s=0.01))
            wait_until_waiting(0, [f"c{j}" for j in range(i + 1)])
    starts = [intervals[0][0] for intervals in ray.get(refs)]
    assert starts == sorted(starts)
    assert_free(0)


def test_holds_never_overlap(contenders):
    refs = [c.take_turns.remote([1], f"c{i}", rounds=5, hold_s=0.01) for i, c in enumerate(contenders)]
    intervals = sorted(iv for ivs in ray.get(refs) for iv in ivs)
    assert len(intervals) == 15
    for (_, end), (next_start, _) in zip(intervals, intervals[1:]):
        assert end <= next_start
    assert_free(1)


def test_overlapping_device_sets_do_not_deadlock(contenders):
    sets = [[0, 1], [1, 2], [2, 0]]
    refs = [c.take_turns.remote(s, f"c{i}", rounds=10, hold_s=0.001) for i, (c, s) in enumerate(zip(contenders, sets))]
    assert all(len(ivs) == 10 for ivs in ray.get(refs, timeout=30))
    for d in range(3):
        assert_free(d)


def test_timeout_names_lock_waiter_and_holder():
    with DeviceLock([2], "actor:0"):
        with pytest.raises(LockTimeout, match=r"'rollout:1'.*m2flow-lock-2.*held by 'actor:0'"):
            DeviceLock([2], "rollout:1").acquire(timeout=0.2)
        assert lock_state(2)["waiting"] == []
    assert_free(2)


def test_failed_multi_device_acquire_releases_what_it_got():
    with DeviceLock([3], "actor:0"):
        with pytest.raises(LockTimeout):
            DeviceLock([2, 3], "rollout:0").acquire(timeout=0.2)
        assert lock_state(2)["holder"] is None
    assert_free(3)


def test_wait_free_returns_once_nobody_holds_the_devices(contenders):
    watcher = DeviceLock([0, 1], "actor:0")
    assert watcher.wait_free(timeout=1) < 0.5  # free: at once
    ray.get(contenders[0].acquire.remote([1], "rollout:0"))
    with pytest.raises(LockTimeout, match="m2flow-lock-1 was still held"):
        watcher.wait_free(timeout=0.2)
    threading.Timer(0.3, lambda: ray.get(contenders[0].release.remote())).start()
    assert watcher.wait_free(timeout=10) >= 0.25
    assert not watcher.held  # it waited without taking them
    assert_free(0)
    assert_free(1)


def test_release_without_holding_is_an_error():
    with pytest.raises(RuntimeError, match="does not hold"):
        DeviceLock([2], "rollout:0").release()
    with DeviceLock([2], "actor:0"):
        assert "held by 'actor:0'" in ray.get(lock_actor(2).release.remote("rollout:0"))
    assert_free(2)


def test_reentrant_acquire_is_an_error_not_a_hang():
    lock = DeviceLock([2], "actor:0")
    with lock:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            lock.acquire(timeout=1)
        with pytest.raises(RuntimeError, match="not re-entrant"):
            DeviceLock([2], "actor:0").acquire(timeout=1)
        assert lock_state(2)["holder"] == "actor:0"
    assert_free(2)


def test_wait_and_hold_are_traced_and_reported():
    get_tracer().drain()
    before = lock_state(2)["acquisitions"]
    lock = DeviceLock([2], "driver")
    with lock:
        time.sleep(0.2)
    assert lock.last_hold_s >= 0.2 and 0 <= lock.last_wait_s < lock.last_hold_s
    with DeviceLock([2], "actor:0"), pytest.raises(LockTimeout):
        DeviceLock([2], "rollout:0").acquire(timeout=0.1)
    spans = [(e["name"], e["args"]["holder"], e["args"].get("granted"))
             for e in get_tracer().drain() if e.get("cat") == "lock"]
    assert spans == [("wait devices [2]", "driver", True), ("hold devices [2]", "driver", None),
                     ("wait devices [2]", "actor:0", True), ("wait devices [2]", "rollout:0", False),
                     ("hold devices [2]", "actor:0", None)]
    assert lock_state(2)["acquisitions"] == before + 2  # driver, actor:0; rollout:0 timed out


def test_interrupted_acquire_leaves_no_request_behind():
    def interrupt_once_queued():  # not earlier: an interrupt while the lock's actor starts would be another test
        wait_until_waiting(2, ["rollout:0"], timeout=60)
        _thread.interrupt_main()

    # A process started in the background by a non-interactive shell inherits SIGINT ignored,
    # and Python then raises no KeyboardInterrupt for it: the default handler, for this test.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with DeviceLock([2], "actor:0"):
            threading.Thread(target=interrupt_once_queued, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                DeviceLock([2], "rollout:0").acquire()
            wait_until_waiting(2, [])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_free(2)


@pytest.mark.parametrize("death", ["ray.kill", "SIGKILL"])
def test_dead_holder_does_not_block_the_device(contenders, death):
    victim = Contender.remote()
    pid = ray.get(victim.pid.remote())
    ray.get(victim.acquire.remote([3], "victim"))
    waiter = contenders[0]
    ref = waiter.acquire.remote([3], "waiter", timeout=15)
    wait_until_waiting(3, ["waiter"])
    if death == "ray.kill":
        ray.kill(victim)
    else:
        os.kill(pid, signal.SIGKILL)
    ray.get(ref)  # without the dead holder passed over, the waiter's 15 s timeout raises here
    ray.get(waiter.release.remote())
    assert_free(3)


def test_dead_holder_does_not_block_a_wait_for_free_devices():
    victim = Contender.remote()
    pid = ray.get(victim.pid.remote())
    ray.get(victim.acquire.remote([3], "victim"))
    threading.Timer(0.5, lambda: os.kill(pid, signal.SIGKILL)).start()
    # Nobody queues to take the lock: the wait alone has the dead holder passed over.
    assert DeviceLock([3], "actor:1").wait_free(timeout=15) < 5
    assert_free(3)


def test_holder_that_died_may_acquire_again_after_restart():
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    lock, node = lock_actor(2), ray.get_runtime_context().get_node_id()
    # An earlier rollout:0, now dead, first holds the lock and later waits for it.
    assert ray.get(lock.acquire.remote("rollout:0", None, exited.pid, node, None)) == ("granted", None)
    with DeviceLock([2], "rollout:0"):  # not refused as re-entrant
        pass
    with DeviceLock([2], "actor:0"):
        queued = lock.acquire.remote("rollout:0", None, exited.pid, node, None)
        wait_until_waiting(2, ["rollout:0"])
        with pytest.raises(LockTimeout):  # queues in place of its dead self, then times out
            DeviceLock([2], "rollout:0").acquire(timeout=0.2)
        assert ray.get(queued) == ("withdrawn", None)
    assert_free(2)


def test_holder_on_another_node_that_died_may_acquire_again_after_restart():
    """A holder on another node (its pid means nothing here) that died: the next process
    under its name waits for the probe of its actor, finds it dead and is granted the lock,
    instead of being refused as re-entrant."""
    import pickle

    victim = Contender.remote()
    ray.get(victim.pid.remote())
    handle = pickle.dumps(victim)
    ray.kill(victim)
    lock = lock_actor(1)
    assert ray.get(lock.acquire.remote("rollout:0", None, 4242, "node-b", handle)) == ("granted", None)
    # the restarted rollout:0, another process on that node
    assert ray.get(lock.acquire.remote("rollout:0", 10, 5353, "node-b", None)) == ("granted", None)
    assert ray.get(lock.acquire.remote("rollout:0", 10, 5353, "node-b", None)) == ("reentrant", "rollout:0")
    ray.get(lock.release.remote("rollout:0"))
    assert_free(1)
