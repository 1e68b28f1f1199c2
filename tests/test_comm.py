from dataclasses import dataclass

import pytest
import torch

from m2flow.runtime import comm, pipes, shm
from m2flow.runtime.errors import WorkerError
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement
from m2flow.runtime.worker import Worker


@dataclass
class Batch:
    obs: torch.Tensor
    meta: dict


class Peer(Worker):
    def send_to(self, obj, group, rank, tag=0):
        return self.send(obj, group, rank, tag)

    def recv_from(self, group, rank, tag=0, timeout=None):
        obj = self.recv(group, rank, tag, timeout=timeout)
        return obj, self.comm.last_transport

    def send_then_change(self, n, group, rank):
        """Sends ``arange(n)``, then changes it in place (as an optimizer step does to weights
        just pushed)."""
        t = torch.arange(n, dtype=torch.float32)
        transport = self.send(t, group, rank)
        t.add_(1.0)
        return transport

    def send_self(self, obj):
        transport = self.send(obj, self.group, self.rank)
        got = self.recv(self.group, self.rank)
        return transport, got is obj

    def async_pair(self, peer_group):
        work = self.irecv(peer_group, 0, tag="reply")
        sent = self.isend(torch.full((300_000,), float(self.rank)), peer_group, 0, tag="ping")
        sent.wait()
        return sent.transport, work.wait(timeout=30).sum().item()

    def answer(self, group, n):
        for r in range(n):
            ping = self.recv(group, r, tag="ping")
            self.send(ping + 1, group, r, tag="reply")

    def burst(self, group, rank, n):
        sizes = (1, 2_500, 50_000)  # a small frame, a frame too big for one pipe write, shm data
        for i in range(n):
            self.isend({"i": i, "pad": torch.zeros(sizes[i % 3])}, group, rank, tag="burst")

    def drain(self, group, rank, n):
        return [self.recv(group, rank, tag="burst")["i"] for _ in range(n)]

    def pair_exchange(self, peer):
        """Builds the pairwise group to ``peer`` (gloo in place of NCCL) and swaps a tensor over it."""
        self.comm.pairs.backend = "gloo"
        pg, peer_rank, _ = self.comm.pairs.group(tuple(peer))
        mine, theirs = torch.full((4,), float(self.rank)), torch.empty(4)
        works = [pg.send([mine], peer_rank, 0), pg.recv([theirs], peer_rank, 0)]
        for w in works:
            w.wait()
        return peer_rank, theirs.tolist()

    def bcast(self, obj, src, group):
        got = self.broadcast(obj, src, group)
        transport = self.comm.last_transport
        if isinstance(got, torch.Tensor) and self.group != src[0]:
            before = got[0].item()
            got[0] = -1.0  # copy-on-write: other receivers keep their values
            return before, transport
        return got, transport


@pytest.fixture(scope="module")
def groups(cluster):
    p = Placement.from_config({"a": "0", "b": "1-2"}, cluster)
    a = WorkerGroup(Peer, p["a"])
    b = WorkerGroup(Peer, p["b"])
    yield a, b
    a.kill()
    b.kill()


def exchange(groups, obj, tag=0):
    a, b = groups
    receiving = b.call("recv_from", "a", 0, tag, ranks=[0])
    transport = a.send_to(obj, "b", 0, tag).wait()[0]
    got, recv_transport = receiving.wait()[0]
    assert transport == recv_transport
    return got, transport


def test_large_tensors_go_through_shared_memory(groups):
    obj = {"x": torch.randn(512, 1024), "y": [torch.arange(100_000), "label"]}
    got, transport = exchange(groups, obj)
    assert transport == "shm"
    assert torch.equal(got["x"], obj["x"]) and torch.equal(got["y"][0], obj["y"][0]) and got["y"][1] == "label"


@pytest.mark.parametrize("n, transport", [(100, "rpc"), (100_000, "shm")])
def test_the_receiver_gets_a_tensor_as_it_was_sent(groups, n, transport):
    """The sender changes its tensor once sent, before the receiver takes it: the receiver
    still gets the values at send time."""
    a, b = groups
    assert a.send_then_change(n, "b", 0).wait() == [transport]
    got, recv_transport = b.call("recv_from", "a", 0, ranks=[0]).wait()[0]
    assert recv_transport == transport and torch.equal(got, torch.arange(n, dtype=torch.float32))


def test_small_and_plain_objects_ride_the_call(groups):
    obj = Batch(torch.ones(3), {"step": 7, "names": {"a", "b"}})
    got, transport = exchange(groups, obj)
    assert transport == "rpc"
    assert isinstance(got, Batch) and torch.equal(got.obs, obj.obs) and got.meta == obj.meta
    got, transport = exchange(groups, ("any", b"picklable", 3.5))
    assert got == ("any", b"picklable", 3.5) and transport == "rpc"


def test_same_process_is_a_handoff(groups):
    a, _ = groups
    transport, same_object = a.send_self({"t": torch.zeros(10)}).wait()[0]
    assert transport == "handoff" and same_object


def test_async_send_and_receive(groups):
    a, b = groups
    answering = a.answer("b", 2)
    results = b.async_pair("a").wait()
    answering.wait()
    assert [r[0] for r in results] == ["shm", "shm"]
    assert [r[1] for r in results] == [300_000.0, 600_000.0]


def test_tags_keep_messages_apart_and_fifo(groups):
    a, b = groups
    for i in range(3):
        a.send_to(i, "b", 1, "first").wait()
    a.send_to("other", "b", 1, "second").wait()
    assert b.call("recv_from", "a", 0, "second", ranks=[1]).wait()[0][0] == "other"
    assert [b.call("recv_from", "a", 0, "first", ranks=[1]).wait()[0][0] for _ in range(3)] == [0, 1, 2]


def test_broadcast_shares_one_copy_on_write(groups):
    a, b = groups
    data = torch.arange(200_000, dtype=torch.float32)
    receiving = b.bcast(None, ("a", 0), "b")
    sender = a.bcast(data, ("a", 0), "b").wait()[0]
    assert torch.equal(sender[0], data)
    assert receiving.wait() == [(0.0, "shm"), (0.0, "shm")]


def test_recv_timeout_is_an_error(groups):
    _, b = groups
    with pytest.raises(WorkerError, match="got nothing from a:0"):
        b.call("recv_from", "a", 0, "never", 0.2, ranks=[0]).wait()


def test_unknown_peer_is_an_error(groups):
    a, _ = groups
    with pytest.raises(WorkerError, match="no worker nobody rank 0"):
        a.send_to(1, "nobody", 0).wait()


def test_transport_choice_per_pair(cluster):
    big = torch.zeros(100_000)
    assert comm.pack(big, same_process=True).transport == "handoff"
    assert comm.pack(torch.zeros(10)).transport == "rpc"
    assert comm.pack(big).transport == "shm"
    remote = comm.pack(big, same_node=False)
    assert remote.transport == "object_store"
    assert torch.equal(comm.unpack(remote), big)


def test_small_tensors_of_any_dtype_and_layout_survive_the_call():
    """The rpc transport pickles small tensors as numpy arrays where numpy has the dtype."""
    import pickle

    base = torch.arange(12.0).reshape(3, 4)
    tensors = {"f32": torch.randn(5), "i64": torch.arange(4), "bool": torch.tensor([True, False]),
               "bf16": torch.randn(3).bfloat16(), "f16": torch.randn(3).half(), "scalar": torch.tensor(2.5),
               "column": base[:, 1], "grad": torch.ones(2, requires_grad=True), "empty": torch.zeros(0, 3)}
    packed = comm.pack(tensors)
    assert packed.transport == "rpc"
    got = comm.unpack(pickle.loads(pickle.dumps(packed)))  # as it crosses a process boundary
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t.detach()), name
        assert not got[name].requires_grad
    got["column"] += 1  # a writable copy of the column alone
    assert torch.equal(got["column"], base[:, 1] + 1)


def test_many_async_sends_arrive_in_order(groups):
    a, b = groups
    receiving = b.call("drain", "a", 0, 300, ranks=[0])
    a.burst("b", 0, 300).wait()
    assert receiving.wait()[0] == list(range(300))


def test_driver_pool_follows_the_cluster_session(monkeypatch):
    """A driver that runs one cluster after another names new segments after the new session,
    so each cluster's shutdown removes its own."""
    try:
        monkeypatch.setenv("M2FLOW_SESSION", "first")
        assert shm.process_pool().prefix == "m2flow-first"
        monkeypatch.setenv("M2FLOW_SESSION", "second")
        ref = shm.process_pool().write([torch.ones(10)])
        assert ref.segment.startswith("m2flow-second-")
        assert torch.equal(comm.unpack(comm.pack(torch.ones(100_000))), torch.ones(100_000))
    finally:
        for session in ("first", "second"):
            shm.cleanup(f"m2flow-{session}")


def test_pairwise_group_when_both_sides_start_it_at_once(cluster):
    # Each rank asks for the pair to the other at the same moment: the lower address hosts it
    # whichever asks first, so both end in one pair instead of two half-built ones.
    g = WorkerGroup(Peer, Placement.from_config({"pairs": "0-1"}, cluster)["pairs"])
    try:
        first = g.call("pair_exchange", ("pairs", 1), ranks=[0])
        second = g.call("pair_exchange", ("pairs", 0), ranks=[1])
        ((r0, got0),), ((r1, got1),) = first.wait(timeout=60), second.wait(timeout=60)
        assert (r0, r1) == (1, 0)  # rank 0 (lower address) is the pair's rank 0
        assert got0 == [1.0] * 4 and got1 == [0.0] * 4
    finally:
        g.shutdown()


def test_a_payload_marked_for_nccl_without_its_tensors_is_a_clear_error():
    """CUDA tensors to another GPU go by the pair's NCCL send; a payload marked so that
    arrives without them (not point to point) fails saying so, not with an IndexError."""
    from m2flow.runtime.comm import Packed, unpack

    packed = Packed(None, "nccl", [((3,), torch.float32)], 12)
    with pytest.raises(RuntimeError, match=r"1 CUDA tensor\(s\) to go by NCCL arrived with 0: NCCL tensors travel "
                                           "only point to point"):
        unpack(packed)


def test_a_pipe_nobody_reads_is_a_clear_error_not_a_hang(tmp_path):
    """A peer killed where it stood leaves its pipe's file behind: opening it to write fails
    at once (a plain open would wait for a reader for good); a pipe a live peer holds open
    gives a blocking write end."""
    import os

    path = str(tmp_path / "pipe")
    os.mkfifo(path, 0o600)
    with pytest.raises(LookupError, match=r"pid 4242 cannot be reached through its pipe .*: its process is gone"):
        pipes.open_pipe(path, 4242)
    reader = os.open(path, os.O_RDWR)  # as a live peer holds its own
    try:
        fd = pipes.open_pipe(path, 4242)
        assert os.get_blocking(fd)
        os.write(fd, b"hi")
        assert os.read(reader, 2) == b"hi"
        os.close(fd)
    finally:
        os.close(reader)
