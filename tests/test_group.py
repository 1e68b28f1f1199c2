import inspect
import json
import os
import pydoc
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from m2flow.runtime.dispatching import dispatch
from m2flow.runtime.errors import WorkerDiedError, WorkerError
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement
from m2flow.runtime.worker import Worker


class Echo(Worker):
    def __init__(self, scale=1):
        self.scale = scale
        self.noted, self.notes = threading.Event(), []

    @dispatch(split="scatter", immediate=True)
    def note(self, values):
        """Answered at once, beside a call in progress: what ``wait_for_note`` waits for."""
        self.notes.extend(values)
        self.noted.set()

    def wait_for_note(self, timeout):
        """Waits (a long call) for a ``note``; what it noted, None if none came in time."""
        return list(self.notes) if self.noted.wait(timeout) else None

    def whoami(self):
        return {
            "rank": self.rank,
            "world": self.world_size,
            "env_rank": os.environ["RANK"],
            "affinity": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads(),
            "devices": [d.index for d in self.devices],
        }

    def times(self, x):
        """``x`` times the scale."""
        return x * self.scale

    def keywords(self, x: int, *, by: int = 1, **extra) -> dict:
        """Its arguments."""
        return {"x": x, "by": by, **extra}

    def times_twice(self, x):
        return self.times(self.times(x))

    @dispatch(split="scatter", gather="concat")
    def double(self, batch, offset=0):
        return batch * 2 + offset

    @dispatch(split="per_rank", gather="list")
    def pick(self, item):
        return (self.rank, item)

    @dispatch(gather="first")
    def same(self):
        return "same"

    def fail(self):
        raise ValueError(f"bad input on rank {self.rank}")

    def sleep(self, seconds):
        time.sleep(seconds)
        return os.getpid()

    def fail_then(self, seconds, die):
        """Rank 0 fails at once; the others, ``seconds`` later, die (``die``) or return."""
        if self.rank == 0:
            raise ConnectionResetError("its peer is gone")
        time.sleep(seconds)
        if die:
            os._exit(1)
        return self.rank

    def all_reduce(self):
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()


@pytest.fixture(scope="module")
def group(cluster):
    placement = Placement.from_config({"echo": {"devices": "0-1", "procs_per_device": 1}}, cluster)
    g = WorkerGroup(Echo, placement["echo"], kwargs={"scale": 3})
    yield g
    g.kill()


def test_ranks_devices_and_pinning(group):
    info = group.whoami().wait()
    assert [i["rank"] for i in info] == [0, 1]
    assert [i["env_rank"] for i in info] == ["0", "1"]
    assert all(i["world"] == 2 for i in info)
    assert [i["devices"] for i in info] == [[0], [1]]
    usable = sorted(os.sched_getaffinity(0))
    assert [i["affinity"] for i in info] == [[usable[0]], [usable[1 % len(usable)]]]
    assert all(i["threads"] == 1 for i in info)


def test_call_all_subset_and_trace(group):
    group.trace_events()  # drop what earlier tests recorded
    handle = group.times(2)
    assert handle.wait() == [6, 6]
    sub = group.call("times", 5, ranks=[1])
    assert sub.wait() == [15] and sub.ranks == [1]
    assert group.call("times_twice", 1, ranks=[1]).wait() == [9]
    slow = group.call("sleep", 0.3, ranks=[0])
    assert not slow.done()
    slow.wait()
    assert slow.done()
    # Each call is a "call" span on the rank that ran it; methods a worker calls itself are not.
    spans = [(e["name"], e["args"]["rank"], e["dur"]) for e in group.trace_events() if e.get("cat") == "call"]
    assert sorted((name, rank) for name, rank, _ in spans) == [
        (f"{group.name}.sleep", 0), (f"{group.name}.times", 0), (f"{group.name}.times", 1), (f"{group.name}.times", 1),
        (f"{group.name}.times_twice", 1)]
    assert [dur for name, _, dur in spans if name.endswith(".sleep")][0] >= 0.3e6


def test_an_immediate_method_runs_beside_a_call_in_progress(group):
    waiting = group.wait_for_note(20)
    time.sleep(0.5)  # the long call has started
    assert not waiting.done()
    group.note([1, 2, 3, 4]).wait(timeout=10)  # split like any call: ranks 0 and 1 get [1, 2] and [3, 4]
    assert waiting.wait(timeout=10) == [[1, 2], [3, 4]]


def test_split_and_gather(group):
    batch = torch.arange(10.0)
    assert torch.equal(group.double(batch, offset=1).wait(), batch * 2 + 1)
    assert group.pick(["a", "b"]).wait() == [(0, "a"), (1, "b")]
    assert group.same().wait() == "same"
    with pytest.raises(ValueError, match="one entry per called rank"):
        group.pick(["only one"])
    big = torch.ones(100_000)  # shared through the object store once
    assert [t.sum().item() for t in group.times(big).wait()] == [300_000.0, 300_000.0]


def test_error_names_group_rank_and_traceback(group):
    with pytest.raises(WorkerError) as err:
        group.call("fail", ranks=[1]).wait()
    e = err.value
    assert e.group == "echo" and e.rank == 1 and e.method == "fail"
    # one paragraph: what failed, where in the worker's own code; Ray's traceback kept aside
    assert str(e).startswith("echo rank 1 failed in fail(): ValueError: bad input on rank 1\n  at ")
    # (the file's path relative to the working directory, whole where it lies outside it)
    assert re.search(r"\n  at (\S+/)?tests/test_group.py:\d+ in fail: raise ValueError", str(e)), str(e)
    assert "ray/" not in str(e) and len(str(e).splitlines()) <= 4
    assert 'test_group.py", line' in e.traceback and "ray" in e.traceback
    assert isinstance(e.cause, ValueError)
    for missing in ("missing", "_m2flow_init"):  # unknown, or not public
        with pytest.raises(AttributeError, match=f"no public method '{missing}'"):
            group.call(missing)
    with pytest.raises(IndexError):
        group.call("times", 1, ranks=[2])


def test_group_methods_are_bound_with_the_worker_methods_signature_and_docstring(group):
    ranks = inspect.Parameter("ranks", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Sequence[int] | None")
    for name in ("times", "keywords", "double"):
        method, worker_method = getattr(group, name), getattr(Echo, name)
        assert inspect.ismethod(method) and method.__self__ is group and method.__name__ == name
        assert method.__doc__ == worker_method.__doc__
        # Without self, and without the parameter Ray adds to an actor class's methods for its tracing.
        params = [p for p in list(inspect.signature(worker_method).parameters.values())[1:] if p.name != "_ray_trace_ctx"]
        at = len(params) - (name == "keywords")  # ranks goes before **extra
        assert list(inspect.signature(method).parameters.values()) == [*params[:at], ranks, *params[at:]]
        assert inspect.signature(method).return_annotation == "GroupHandle"
    doc = pydoc.render_doc(group.times, renderer=pydoc.plaintext)  # help(group.times)
    assert "times(x, *, ranks: 'Sequence[int] | None' = None) -> 'GroupHandle'" in doc and "``x`` times the scale." in doc
    assert group.keywords(2, by=3, ranks=[1], z=4).wait() == [{"x": 2, "by": 3, "z": 4}]
    with pytest.raises(AttributeError, match="Echo has no public method 'missing'"):
        group.missing(1)
    with pytest.raises(AttributeError, match="has no attribute '_m2flow_init'"):
        group._m2flow_init()
    assert inspect.signature(group.init_process_group) == inspect.signature(WorkerGroup.init_process_group).replace(
        parameters=list(inspect.signature(WorkerGroup.init_process_group).parameters.values())[1:])  # the group's own


def test_wait_timeout(group):
    with pytest.raises(TimeoutError, match=r"echo.sleep\(\) not finished"):
        group.call("sleep", 2, ranks=[0]).wait(timeout=0.2)
    group.call("sleep", 0, ranks=[0]).wait()


def test_process_group_gloo(group):
    group.init_process_group()
    assert group.all_reduce().wait() == [3.0, 3.0]


def test_constructor_error_surfaces(cluster):
    placement = Placement.from_config({"bad": "2"}, cluster)
    with pytest.raises(WorkerError, match=r"bad rank 0 failed in __init__"):
        WorkerGroup(Echo, placement["bad"], kwargs={"nope": 1})


def test_start_together_readies_channels_and_destroys_them_when_a_group_fails(cluster):
    import ray

    from m2flow.runtime.channel import Channel
    from m2flow.runtime.group import start_together

    placement = Placement.from_config({"good": "2", "bad": "3"}, cluster)
    good = WorkerGroup(Echo, placement["good"], wait=False)
    ready = Channel.create("start-together-ready")
    start_together(good, channels=[ready])
    ready.put(1)
    assert ready.get(timeout=10) == 1
    ready.destroy()
    good.shutdown()

    bad = WorkerGroup(Echo, placement["bad"], kwargs={"nope": 1}, wait=False)
    doomed = Channel.create("start-together-doomed")
    with pytest.raises(WorkerError, match=r"bad rank 0 failed in __init__"):
        start_together(bad, channels=[doomed])
    with pytest.raises(ray.exceptions.RayActorError):  # its actor was killed
        doomed.wait_ready(timeout=10)


def test_killed_worker_surfaces_fast(cluster):
    placement = Placement.from_config({"victim": "2-3"}, cluster)
    g = WorkerGroup(Echo, placement["victim"])
    pid = g.pids()[1]
    handle = g.sleep(600)  # past the test's timeout: only a detected death ends the wait in time
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError) as err:
        handle.wait()
    assert err.value.rank == 1 and "died" in str(err.value)
    g.kill()


@pytest.mark.slow  # 16 s: a Ray of its own in a subprocess, made to run low on memory
def test_a_worker_killed_by_rays_memory_monitor_is_a_death_told_in_a_line(tmp_path):
    # Ray tells it as OutOfMemoryError, with a page of object-store statistics: a death, so
    # the runner restarts from its last checkpoint, and a line in the message (the page goes
    # to the traceback, which a run writes to its log).
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("oom_worker.py")), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    ended = json.loads(out.stdout.strip().splitlines()[-1])
    assert ended["died"] and ended["rank"] == 0 and ended["method"] == "eat", ended
    assert ended["seconds"] < 50, ended  # killed while it ate, not after its minute of holding it
    message = ended["message"]
    assert message.startswith("eater rank 0 failed in eat(): the worker process died: Ray's memory monitor killed it, "
                              "the node running low on memory ("), message
    assert "\n" not in message and "exceeded threshold" in message and len(message) < 600, message
    assert "the largest process then: ray::Eater._m2flow_call_eat (pid " in message, message
    assert "Object store memory usage" in ended["traceback"]


def test_a_death_behind_another_ranks_error_is_raised_as_the_cause(cluster, group):
    # A collective whose peer was killed fails on the living rank a moment before Ray notices
    # the death: the run must see the death (and restart), not the living rank's error.
    from m2flow.runtime.group import wait

    two = Placement.from_config({"pair": "2-3"}, cluster)["pair"]
    g = WorkerGroup(Echo, two)
    with pytest.raises(WorkerDiedError) as err:
        g.fail_then(1.0, die=True).wait()
    assert err.value.rank == 1 and err.value.method == "fail_then"
    g.kill()
    # the same across calls waited on together: the error in one, the death in another group's
    # (the module's two ranks raise and return, none dies: they serve as the group that fails)
    g, other = group, WorkerGroup(Echo, Placement.from_config({"other": "0"}, cluster)["other"])
    pid = other.pids()[0]
    failing, sleeping = g.call("fail_then", 0.0, False, ranks=[0]), other.sleep(600)
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    with pytest.raises(WorkerDiedError) as err:
        wait(failing, sleeping)
    assert err.value.group == other.name and err.value.rank == 0
    other.kill()
    # with no death, the error itself, once the others have finished
    with pytest.raises(WorkerError, match="ConnectionResetError: its peer is gone") as err:
        g.fail_then(1.0, die=False).wait()
    assert not isinstance(err.value, WorkerDiedError) and err.value.rank == 0


def test_a_pool_reuses_processes_re_pins_them_and_drops_their_state(cluster):
    import ray

    from m2flow.runtime.pool import WorkerPool

    usable = sorted(os.sched_getaffinity(0))
    pool = WorkerPool()
    two = Placement.from_config({"pooled": "0-1"}, cluster)["pooled"]
    first = WorkerGroup(Echo, two, kwargs={"scale": 3}, name="pooled", pool=pool)
    first.init_process_group()
    assert first.all_reduce().wait() == [3.0, 3.0]
    pids = first.pids()
    first.shutdown()  # back to the pool: the processes live on
    assert ray.get_actor("pooled:1", namespace="m2flow") is not None

    one = Placement.from_config({"pooled": "1"}, cluster)["pooled"]
    second = WorkerGroup(Echo, one, kwargs={"scale": 5}, name="pooled", pool=pool)
    assert second.pids() == [pids[0]]  # rank 0's process, re-initialised
    info = second.whoami().wait()[0]
    assert info["world"] == 1 and info["devices"] == [1] and info["affinity"] == [usable[1 % len(usable)]]
    assert second.times(2).wait() == [10]  # its new state
    with pytest.raises(ValueError):  # rank 1 was ended: a group's size is read off its ranks' names
        ray.get_actor("pooled:1", namespace="m2flow")
    second.init_process_group()  # the old process group was destroyed: a world of one now
    assert second.all_reduce().wait() == [1.0]

    other = WorkerGroup(Echo, one, name="pooled-other", pool=pool)  # another name: a new process
    assert other.pids()[0] not in pids
    other.shutdown()
    second.shutdown()
    pool.close()  # returns once the names are free: a later run may name its processes alike
    for name in ("pooled:0", "pooled-other:0"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace="m2flow")


def test_a_pooled_group_whose_rank_died_starts_anew_only_that_rank(cluster):
    """What a run's restart does: the living rank goes back to the pool, the dead one is ended,
    and the group made again at once (the dead rank's name maybe not yet free) takes the living
    process and starts a new one in the dead one's place. A pool handed to one run ends, once
    that run's groups started, the processes they left idle."""
    import signal

    import ray

    from m2flow.runtime.pool import WorkerPool

    pool = WorkerPool(for_one_run=True)
    two = Placement.from_config({"again": "0-1"}, cluster)["again"]
    first = WorkerGroup(Echo, two, name="again", pool=pool)
    pids = first.pids()
    os.kill(pids[1], signal.SIGKILL)
    first.shutdown()
    second = WorkerGroup(Echo, two, kwargs={"scale": 2}, name="again", pool=pool)
    again = second.pids()
    assert again[0] == pids[0] and again[1] not in pids
    assert second.times(3).wait() == [6, 6]
    spare = WorkerGroup(Echo, Placement.from_config({"spare": "0"}, cluster)["spare"], name="spare", pool=pool)
    spare.shutdown()  # idle in the pool
    pool.started()
    with pytest.raises(ValueError):
        ray.get_actor("spare:0", namespace="m2flow")
    second.shutdown()
    pool.close()


def test_where_slots_share_cores_a_process_computes_with_its_share_of_them(cluster):
    """The fixture's 4 slots over 2 cores are half a core each: a process on two of them is
    pinned to both cores (slot s pins core s mod 2) but computes with one thread, as a process
    on one slot of a machine with a core per slot would; on all four, with two. Two threads
    each beside another slot's process on the same cores would wait spinning on each other."""
    from m2flow.runtime.pool import WorkerPool

    usable = sorted(os.sched_getaffinity(0))
    assert [d.core_share for d in cluster.devices] == [0.5] * 4
    pool = WorkerPool()
    try:
        for devices, n, threads in (("0-1", 2, 1), ("0-3", 4, 2), ("2", 1, 1)):
            placement = Placement.from_config({"shared": {"devices": devices, "devices_per_proc": n}}, cluster)["shared"]
            g = WorkerGroup(Echo, placement, name="shared", pool=pool)
            info = g.whoami().wait()[0]
            g.shutdown()
            cores = sorted({usable[s % len(usable)] for s in info["devices"]})
            assert info["affinity"] == cores and info["threads"] == min(threads, len(cores)), (devices, info)
    finally:
        pool.close()


def test_a_pool_holds_a_group_only_where_it_would_start_no_process():
    """``WorkerPool.holds``: every rank of the group finds its process idle in the pool, of its
    class and node; a CPU worker fits any devices (it re-pins itself), a GPU worker only its
    own (a profile's probe that moves a GPU component starts processes anew, and leaves its
    first update out as the first probe does)."""
    from m2flow.runtime.cluster import Device
    from m2flow.runtime.pool import WorkerPool
    from m2flow.runtime.placement import ComponentPlacement

    def devices(kind, *indices):
        return tuple(Device(i, kind, "n0", 0, i // 2 if kind == "cuda" else i) for i in indices)

    class Actor:
        pass

    class Other:
        pass

    pool = WorkerPool()
    over_both = ComponentPlacement("actor", devices("cuda", 0, 1), devices_per_proc=2)  # one rank on both slots
    pool.give("actor:0", Actor, "n0", over_both.ranks()[0].devices, object())
    assert pool.holds(Actor, over_both, "actor")
    assert not pool.holds(Actor, ComponentPlacement("actor", devices("cuda", 1)), "actor")  # moved: a new process
    assert not pool.holds(Other, over_both, "actor")
    assert not pool.holds(Actor, ComponentPlacement("actor", devices("cuda", 0, 1)), "actor")  # rank 1 has none
    cpu = devices("cpu", 0, 1)
    pool.give("rollout:0", Actor, "n0", cpu[:1], object())
    assert pool.holds(Actor, ComponentPlacement("rollout", cpu[1:]), "rollout")  # re-pinned, not started
    assert not pool.holds(Actor, ComponentPlacement("rollout", cpu[1:]), "reward")


def test_own_frames_skip_rays_package_and_the_executors_not_a_directory_named_ray():
    """A worker's traceback names the frames of the code it ran: Ray's package and the
    standard library's executors are passed over, but a user's code under a directory
    named ray (the home of Ray's own images, /home/ray) is not."""
    import asyncio
    import concurrent.futures
    import threading

    import ray

    from m2flow.runtime.errors import own_frames

    machinery = [ray.__file__.replace("__init__.py", "_private/worker.py"), threading.__file__,
                 concurrent.futures.__file__.replace("__init__.py", "thread.py"),
                 asyncio.__file__.replace("__init__.py", "events.py"), "<string>"]
    text = "Traceback (most recent call last):\n" + "".join(
        f'  File "{f}", line {i + 1}, in f{i}\n    call()\n' for i, f in enumerate(machinery))
    text += '  File "/home/ray/project/my_env.py", line 12, in step\n    raise RuntimeError("boom")\nRuntimeError: boom'
    assert own_frames(text) == ['/home/ray/project/my_env.py:12 in step: raise RuntimeError("boom")']
