import asyncio
import gc
import itertools
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2flow.runtime.channel import Channel, ChannelClosed, ChannelEmpty, ChannelFull
from m2flow.runtime.channel_actor import OK, ChannelActor
from m2flow.runtime.errors import WorkerError
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement
from m2flow.runtime.pool import WorkerPool
from m2flow.runtime.trace import get_tracer
from m2flow.runtime.worker import Worker

_names = itertools.count()


def drain(channel: Channel, key=None) -> list:
    """Everything a consumer gets until the channel is closed and empty."""
    got = []
    while True:
        try:
            got.append(channel.get(key, timeout=30))
        except ChannelClosed:
            return got


class Peer(Worker):
    def produce(self, channel, n, keys=(None,)):
        for i in range(n):
            channel.put((f"{self.group}:{self.rank}", i), key=keys[i % len(keys)])
        channel.flush()

    def put_one(self, channel, item, timeout=None):
        channel.put(item, timeout=timeout)

    def put_tensor(self, channel, n):
        import torch  # here: the other methods' processes start without it

        channel.put({"x": torch.arange(n, dtype=torch.float32), "step": 3})
        channel.flush()

    def consume(self, channel, keys=(None,)):
        return drain(channel, keys[self.rank % len(keys)])

    def get_with_transport(self, channel):
        return channel.get(timeout=30), channel.last_transport


@pytest.fixture(scope="module")
def workers(cluster):
    p = Placement.from_config({"producers": "0-2", "consumers": "1-3"}, cluster)
    producers, consumers = WorkerGroup(Peer, p["producers"]), WorkerGroup(Peer, p["consumers"])
    yield producers, consumers
    producers.kill()
    consumers.kill()


@pytest.fixture
def channel(cluster):
    created = []

    def make(maxsize=0, **kwargs):
        created.append(Channel.create(f"test-{next(_names)}", maxsize, **kwargs))
        return created[-1]

    yield make
    for ch in created:
        ch.destroy()


def test_fifo_per_key_and_keys_are_independent(channel):
    ch = channel()
    for i in range(3):
        ch.put(("a", i), key="a")
        ch.put(("b", i), key="b")
        ch.put(("none", i))
    ch.flush()
    assert [ch.qsize("a"), ch.qsize("b"), ch.qsize()] == [3, 3, 3]
    assert [ch.get(key="b") for _ in range(3)] == [("b", i) for i in range(3)]
    assert [ch.get() for _ in range(3)] == [("none", i) for i in range(3)]
    assert ch.get_nowait(key="a") == ("a", 0)
    assert [ch.get(key="a", timeout=1) for _ in range(2)] == [("a", 1), ("a", 2)]
    with pytest.raises(ChannelEmpty, match="no item with key 'a'"):
        ch.get_nowait(key="a")


def test_a_stream_read_to_its_end_leaves_the_next_stream_alone(channel):
    """Two streams queued back to back, each ending in a marker. Unkeyed, a prefetching
    reader of the first, still alive, has taken the second too; keyed apart (as the reasoning
    runner keys each step's stream), it has taken nothing of it."""
    for keyed in (False, True):
        ch = channel()
        for stream in (1, 2):
            for item in ("x", "y", "end"):
                ch.put((stream, item), key=stream if keyed else None)
        ch.flush()
        first, second = Channel.connect(ch.name), Channel.connect(ch.name)
        assert [first.get(1 if keyed else None) for _ in range(3)] == [(1, "x"), (1, "y"), (1, "end")]
        if keyed:
            assert [second.get(2, timeout=10) for _ in range(3)] == [(2, "x"), (2, "y"), (2, "end")]
        else:
            with pytest.raises(ChannelEmpty):
                second.get_nowait()


def test_get_batch_by_weight(channel, workers):
    ch = channel(maxsize=2)
    for w in (1, 2, 3, 4):
        ch.put(f"w{w}", weight=w)
        if w == 2:  # the channel holds two items: make room
            assert ch.get_batch(3) == ["w1", "w2"]
    assert ch.get_batch(4) == ["w3", "w4"]  # 3 < 4: takes the next one too
    # A batch heavier than the channel can hold still arrives: taken items make room.
    producing = workers[0].produce(ch, 7, ranks=[0])
    got = ch.get_batch(7, timeout=30)
    producing.wait(timeout=30)
    assert got == [("producers:0", i) for i in range(7)]
    ch.put("last", weight=5)
    ch.close()
    assert ch.get_batch(100) == ["last"]  # closed: the rest
    with pytest.raises(ChannelClosed):
        ch.get_batch(1)


def test_get_batch_timeout_keeps_the_items(channel):
    ch = channel()
    ch.put("a", weight=1)
    ch.put("b", weight=1)
    with pytest.raises(TimeoutError, match="channel 'test-.*', key 'k'"):
        ch.get_batch(3, key="k", timeout=0.1)
    with pytest.raises(TimeoutError, match="not enough weight"):
        ch.get_batch(3, timeout=0.2)
    assert ch.get_batch(2) == ["a", "b"]


def test_backpressure(channel, workers):
    producers, _ = workers
    ch = channel(maxsize=2, prefetch=1)  # no prefetch: a get frees exactly one slot
    ch.put(0)
    ch.put(1)
    ch.flush()
    putting = producers.put_one(ch, 2, timeout=30, ranks=[0])  # waits until the item is in the channel
    time.sleep(0.5)
    assert not putting.done() and ch.qsize() == 2
    assert ch.get() == 0
    putting.wait(timeout=30)
    assert ch.qsize() == 2
    with pytest.raises(TimeoutError, match=r"channel 'test-.*', key 'k': still full after 0.2 s"):
        ch.put("late", key="k", timeout=0.2)
    with pytest.raises(ChannelFull):
        ch.put_nowait("late")
    assert [ch.get(), ch.get()] == [1, 2]


def test_pipelined_puts_stall_when_full_and_keep_order(channel, workers):
    producers, _ = workers
    ch = channel(maxsize=2)  # window: at most 2 puts on the way
    producing = producers.produce(ch, 20, ranks=[0])
    deadline = time.monotonic() + 30
    while ch.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert not producing.done() and ch.qsize() == 2
    assert [ch.get(timeout=30) for _ in range(20)] == [("producers:0", i) for i in range(20)]
    producing.wait(timeout=30)


def test_weight_bound(channel):
    ch = channel(max_weight=3)
    ch.put("heavy", weight=10, timeout=1)  # alone in an empty channel, an oversized item passes
    with pytest.raises(TimeoutError):
        ch.put("more", timeout=0.1)
    assert ch.get() == "heavy"
    ch.put("two", weight=2)
    with pytest.raises(ChannelFull):
        ch.put_nowait("two more", weight=2)
    ch.put_nowait("one more", weight=1)
    assert ch.get_batch(3) == ["two", "one more"]


def test_close_drains_then_raises(channel, workers):
    _, consumers = workers
    ch = channel()
    waiting = consumers.consume(ch, ranks=[0])  # blocked on an empty channel
    time.sleep(0.3)
    for i in range(3):
        ch.put(i)
    ch.close()
    assert waiting.wait(timeout=30) == [[0, 1, 2]]  # woken by close, ends cleanly
    with pytest.raises(ChannelClosed, match="cannot put"):
        ch.put(3)
    with pytest.raises(WorkerError, match="ChannelClosed.*cannot put"):
        workers[0].put_one(ch, 3, timeout=1, ranks=[0]).wait(timeout=30)
    with pytest.raises(WorkerError, match="ChannelClosed.*closed before all puts"):  # pipelined
        workers[0].produce(ch, 1, ranks=[1]).wait(timeout=30)
    with pytest.raises(ChannelClosed, match="no item left"):
        ch.get(timeout=1)

    ch = channel()
    for i in range(2):
        ch.put(i)
    ch.close()
    assert [ch.get(), ch.get_nowait()] == [0, 1]
    with pytest.raises(ChannelClosed):
        ch.get_nowait()


def test_get_timeout_names_channel_and_key(channel):
    ch = channel()
    with pytest.raises(TimeoutError, match=r"channel 'test-\d+', key 'rollouts': no item after 0.2 s"):
        ch.get(key="rollouts", timeout=0.2)


def test_large_tensor_goes_through_shared_memory(channel, workers):
    producers, consumers = workers
    n = 10 * 2**20 // 4  # 10 MB
    expected = torch.arange(n, dtype=torch.float32)
    ch = channel()
    producers.put_tensor(ch, n, ranks=[0]).wait(timeout=30)
    got = ch.get()  # the driver as consumer
    assert ch.last_transport == "shm" and got["step"] == 3 and torch.equal(got["x"], expected)
    receiving = consumers.get_with_transport(ch, ranks=[0])
    ch.put({"x": expected, "step": 3})  # the driver as producer
    got, transport = receiving.wait(timeout=30)[0]
    assert transport == "shm" and torch.equal(got["x"], expected)
    ch.put(torch.ones(3))
    assert torch.equal(ch.get(), torch.ones(3)) and ch.last_transport == "rpc"


def test_object_store_between_nodes(channel):
    ch = channel()
    ch.multi_node = True  # as Channel.create decides on a multi-node cluster
    big = torch.randn(100_000)
    ch.put(big)
    assert torch.equal(ch.get(), big) and ch.last_transport == "object_store"


def test_put_snapshots_the_item(channel):
    ch = channel()
    item = {"xs": [1, 2], "t": torch.zeros(3)}
    ch.put(item)
    item["xs"].append(3)
    item["t"] += 1
    got = ch.get()
    assert got["xs"] == [1, 2] and torch.equal(got["t"], torch.zeros(3))


def test_dropped_handle_gives_prefetched_items_back(channel):
    ch = channel()
    for i in range(5):
        ch.put(i)
    ch.flush()
    other = Channel.connect(ch.name)
    assert other.get() == 0  # prefetched the other four
    assert other.qsize() == 4 and ch.qsize() == 0
    del other
    gc.collect()
    assert [ch.get(timeout=10) for _ in range(4)] == [1, 2, 3, 4]


def test_names_are_unique(channel):
    ch = channel()
    with pytest.raises(ValueError, match="already exists.*Channel.connect"):
        Channel.create(ch.name)
    with pytest.raises(LookupError, match="no channel named 'missing'"):
        Channel.connect("missing")
    Channel.connect(ch.name).put("via connect")
    assert ch.get(timeout=10) == "via connect"


def test_calls_that_overtake_each_other_keep_the_producers_order():
    async def main():
        actor = ChannelActor("local", "uid", 0, None, False)  # the actor's logic, without Ray
        late = asyncio.ensure_future(actor.put_batch("uid", "p", 1, [(None, b"b", 1.0), (None, b"c", 1.0)]))
        await asyncio.sleep(0.01)
        assert not late.done() and await actor.qsize(None) == 0  # waits for call 0 of "p"
        assert await actor.put("uid", "q", 0, None, b"other", 1.0, None, False) == OK
        assert await actor.put("uid", "p", 0, None, b"a", 1.0, None, False) == OK
        assert await late == OK
        status, entries = await actor.get("uid", None, 0, 10)
        assert [blob for blob, _ in entries] == [b"other", b"a", b"b", b"c"]

    asyncio.run(main())


def test_waits_are_traced(channel):
    ch = channel()
    get_tracer().drain()
    ch.put(1)
    ch.flush()
    ch.get()
    names = {e["name"] for e in get_tracer().drain() if e.get("cat") == "channel"}
    assert {f"flush {ch.name}", f"get {ch.name}"} <= names


@settings(max_examples=8, deadline=None, database=None)
@given(n_producers=st.integers(1, 3), n_consumers=st.integers(1, 3), per_producer=st.integers(0, 40),
       maxsize=st.integers(0, 5), n_keys=st.integers(1, 3))
def test_many_producers_and_consumers_lose_nothing(workers, n_producers, n_consumers, per_producer, maxsize, n_keys):
    producers, consumers = workers
    ch = Channel.create(f"test-many-{next(_names)}", maxsize)
    keys = [None, "k1", "k2"][: min(n_keys, n_consumers + 1)]  # every key has a consumer
    consuming = consumers.consume(ch, keys, ranks=range(n_consumers))
    with ThreadPoolExecutor(1) as pool:
        driver_consuming = pool.submit(drain, Channel.connect(ch.name), keys[n_consumers % len(keys)])
        producing = producers.produce(ch, per_producer, keys, ranks=range(n_producers))
        for i in range(per_producer):
            ch.put(("driver", i), key=keys[i % len(keys)])
        producing.wait(timeout=60)
        ch.close()
        got = consuming.wait(timeout=60) + [driver_consuming.result(timeout=60)]
    ch.destroy()

    sources = ["driver"] + [f"producers:{r}" for r in range(n_producers)]
    assert Counter(item for items in got for item in items) == Counter(
        (src, i) for src in sources for i in range(per_producer))
    for items in got:  # each consumer sees each producer's items in order
        for src in sources:
            seq = [i for s, i in items if s == src]
            assert seq == sorted(seq)


def test_items_given_back_go_ahead_of_those_a_waiting_batch_took():
    """A reader's prefetched items given back (its handle dropped) are older than an item a
    batch getter already waiting took meanwhile: the getter's batch holds them in put order."""
    async def main():
        actor = ChannelActor("local", "uid", 0, None, False)
        for seq, blob in enumerate((b"1", b"2", b"3")):
            assert await actor.put("uid", "p", seq, "k", blob, 1.0, None, False) == OK
        status, prefetched = await actor.get("uid", "k", 0, 3)  # a reader takes all three, uses the first
        assert [b for b, _ in prefetched] == [b"1", b"2", b"3"]
        batch = asyncio.ensure_future(actor.get("uid", "k", 10, 1, 2.0))  # another waits for a weight of 2
        await asyncio.sleep(0.01)
        assert await actor.put("uid", "p", 3, "k", b"4", 1.0, None, False) == OK
        await asyncio.sleep(0.01)
        assert not batch.done()  # it holds item 4, a weight of 1
        await actor.requeue("uid", "k", prefetched[1:])  # the first reader's leftovers come back
        status, entries = await batch
        assert status == OK and [b for b, _ in entries] == [b"2", b"3"]
        _, rest = await actor.get("uid", "k", 0, 10)
        assert [b for b, _ in rest] == [b"4"] and (await actor.stats())["gets"] == 6

    asyncio.run(main())


def test_a_released_channel_lends_its_actor_to_the_next_of_its_name_and_refuses_old_handles(workers):
    """A channel given to a pool (``release``) is the next channel of its name without a
    process start; the handles on the one before, here and in a worker, are refused, and
    their items (put or given back) do not reach the new one."""
    producers, _ = workers
    pool, name = WorkerPool(), f"test-kept-{next(_names)}"
    old = Channel.create(name, maxsize=4, pool=pool)
    old.put("old", key="k")
    old.flush()
    prefetched = Channel.connect(name, prefetch=4)
    old.put("old 2", key="k")
    old.flush()
    assert prefetched.get("k", timeout=10) == "old"  # and holds "old 2": given back when dropped
    old.release(pool)
    new = Channel.create(name, maxsize=2, pool=pool)
    assert new._actor._actor_id == old._actor._actor_id  # the same process
    assert new.maxsize == 2 and new.stats()["puts"] == 0 and new.qsize("k") == 0
    with pytest.raises(ChannelClosed):
        old.put("stale", key="k", timeout=5)
    with pytest.raises(WorkerError, match="ChannelClosed"):
        producers.put_one(old, "stale from a worker", timeout=5, ranks=[0]).wait(timeout=30)
    del prefetched
    gc.collect()
    new.put("new", key="k")
    new.flush()
    assert new.get("k", timeout=10) == "new"
    with pytest.raises(ChannelEmpty):
        new.get_nowait("k")  # nothing of the old channel's came back into it
    old.close()  # an old handle's close leaves the new channel open
    new.put("still open", key="k", timeout=5)
    assert new.get("k", timeout=10) == "still open"

    # a kept actor that died meanwhile: the next channel of its name starts a new one
    new.release(pool)
    ray.kill(new._actor, no_restart=True)
    again = Channel.create(name, pool=pool)
    assert again._actor._actor_id != new._actor._actor_id
    again.put(1, timeout=30)
    assert again.get(timeout=10) == 1
    again.release(pool)
    pool.close()
    with pytest.raises(LookupError):
        Channel.connect(name)
