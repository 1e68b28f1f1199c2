import types
from contextlib import nullcontext

import pytest

from m2flow.runtime import clock as clock_module
from m2flow.runtime.clock import Clock


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class Turn:
    """A device turn that takes ``wait`` seconds to get, like a DeviceLock or a GroupTurn."""

    def __init__(self, time: FakeTime, wait: float) -> None:
        self.time, self.wait, self.last_wait_s, self.exited = time, wait, 0.0, None

    def __enter__(self) -> "Turn":
        self.time.now += self.wait
        self.last_wait_s = self.wait
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.exited = exc_type


@pytest.fixture
def time(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(clock_module, "time", types.SimpleNamespace(perf_counter=fake.perf_counter))
    return fake


def test_blocks_turns_and_report(time):
    clock = Clock()
    with clock.idle():
        time.now += 2.0
    with clock.turn(Turn(time, 0.5)) as turn, clock.busy():
        assert isinstance(turn, Turn)  # the turn's own context value
        time.now += 3.0
    with clock.busy():
        time.now += 1.0
        with clock.idle():  # idle inside busy is idle only
            time.now += 4.0
        with clock.turn(Turn(time, 0.25)):
            time.now += 1.0
    time.now += 7.0  # in no block: neither busy nor idle
    assert clock.report() == {"busy_s": 5.0, "idle_s": 6.75}
    assert list(clock.report(lock_wait=True).items()) == [("busy_s", 5.0), ("idle_s", 6.75), ("lock_wait_s", 0.75)]
    assert clock.elapsed() == 18.75


def test_busy_unless_idle(time):
    clock = Clock(busy_unless_idle=True)
    with clock.idle():
        time.now += 2.0
    time.now += 1.0
    with clock.turn(Turn(time, 0.5)):
        time.now += 3.0
    assert clock.report(lock_wait=True) == {"busy_s": 4.0, "idle_s": 2.5, "lock_wait_s": 0.5}


def test_turn_without_wait_time_and_errors_pass_through(time):
    clock = Clock()
    with clock.turn(nullcontext()):  # no turns to take: no last_wait_s
        pass
    assert clock.report(lock_wait=True) == {"busy_s": 0.0, "idle_s": 0.0, "lock_wait_s": 0.0}
    turn = Turn(time, 1.0)
    with pytest.raises(ValueError), clock.turn(turn), clock.busy():
        raise ValueError("in the turn")
    assert turn.exited is ValueError  # a GroupTurn skips its closing barrier on an error
    clock.waited(2.0)
    assert clock.report(lock_wait=True) == {"busy_s": 0.0, "idle_s": 3.0, "lock_wait_s": 3.0}
