"""The watchdog: a group call that never returns is stopped, with a report of every rank."""

import re
import time

import pytest

from m2flow.runtime.channel import Channel
from m2flow.runtime.errors import WorkerDiedError
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement
from m2flow.runtime.watchdog import Watchdog
from m2flow.runtime.worker import Worker


class Stuck(Worker):
    def sleep_forever(self):
        while True:
            time.sleep(3600)

    def wait_for_an_item(self, channel):
        return channel.get()


def test_a_stuck_call_is_stopped_with_a_report_of_every_rank(cluster, tmp_path):
    placement = Placement.from_config({"stuck": "0", "waiting": "1"}, cluster)
    stuck, waiting = WorkerGroup(Stuck, placement["stuck"]), WorkerGroup(Stuck, placement["waiting"])
    channel = Channel.create("watched")
    try:
        start = time.monotonic()
        with Watchdog(3.0, tmp_path, [stuck, waiting], {"watched": channel}, poll_s=0.5) as dog:
            handles = [stuck.sleep_forever(), waiting.wait_for_an_item(channel)]
            with pytest.raises(WorkerDiedError):  # killed by the watchdog: the driver's wait ends
                handles[0].wait(timeout=60)
        assert time.monotonic() - start < 3.0 + 30
        assert dog.report is not None and dog.report.parent == tmp_path
        report = dog.report.read_text()
        assert "stuck rank 0 (pid " in report and "busy at " in report
        assert "waiting rank 0" in report and "waiting on a channel" in report
        assert "in sleep_forever" in report and "time.sleep(3600)" in report  # the stuck rank's stack
        assert '"waiting_getters": {"None": 1}' in report  # what the channel saw
        assert str(dog.error()).startswith("no component made progress for 3 s (runner.hang_timeout_s): "
                                           "stuck rank 0 busy at ")
        assert "test_watchdog.py" in str(dog.error()) and "waiting rank" not in str(dog.error())
    finally:
        channel.destroy()
        stuck.shutdown(), waiting.shutdown()


def test_progress_keeps_it_quiet(cluster, tmp_path):
    placement = Placement.from_config({"moving": "0"}, cluster)
    group = WorkerGroup(Stuck, placement["moving"])
    channel = Channel.create("moving")
    try:
        with Watchdog(2.0, tmp_path, [group], {"moving": channel}, poll_s=0.25) as dog:
            for i in range(10):  # 5 s in all, an item every 0.5 s: never 2 s without one
                channel.put(i)
                assert group.wait_for_an_item(channel).wait() == [i]
                time.sleep(0.5)
        assert dog.report is None and not list(tmp_path.iterdir())
    finally:
        channel.destroy()
        group.shutdown()


class Napper(Worker):
    def nap(self, seconds):
        time.sleep(seconds)


def test_a_stall_is_told_once_then_counts_among_the_spells_seen(cluster, tmp_path, monkeypatch):
    """After a step ends, a call 1.5 s long with nothing moving, where the floor of a stall is
    0.5 s: told once (a report of every rank, then None once it returns); the same nap again
    is no longer far longer than the longest spell seen (3x it would be 4.5 s): not told."""
    from m2flow.runtime import watchdog

    monkeypatch.setattr(watchdog, "STALL_FLOOR_S", 0.5)
    group = WorkerGroup(Napper, Placement.from_config({"napper": "0"}, cluster)["napper"])
    told = []
    try:
        with Watchdog(60.0, tmp_path, [group], poll_s=0.1, stall_factor=3, on_stall=told.append) as dog:
            group.nap(0.0).wait()
            dog.beat()
            group.nap(1.5).wait()
            dog.beat()
            time.sleep(0.3)  # a poll sees it move
            assert len(told) == 2 and told[1] is None, told
            group.nap(1.5).wait()
            dog.beat()
            time.sleep(0.3)
        (report,) = tmp_path.glob("stall-*.txt")
        assert re.fullmatch(r"nothing has moved for [01] s, where the longest quiet spell since the first step ended "
                            rf"was 0 s \(napper rank 0 busy at .*in nap: time.sleep\(seconds\); stacks: {report}\); "
                            r"runner.hang_timeout_s=60 stops the run if nothing moves", told[0]), told[0]
        assert len(told) == 2 and dog.report is None and "in nap\n" in report.read_text()
    finally:
        group.shutdown()
