"""What a run listens on: on one node, nothing beyond the loopback address. Every listening
socket of every process of a running run is read: the embedded Ray's (GCS, raylet, workers,
agents) and the workers' own (the actor ranks' rendezvous store and gloo's pair listeners)."""

import ipaddress
import threading

import psutil
import torch

from m2flow.config import load_config
from m2flow.runners.embodied import EmbodiedRunner
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement
from m2flow.runtime.worker import Worker


def _listening() -> list[tuple[int, str, str, int]]:
    """(pid, process name, address, port) of every listening TCP socket of this process (the
    driver) and of every process under it: the embedded Ray's and, under its raylet, the
    workers."""
    me = psutil.Process()
    found = []
    for p in [me, *me.children(recursive=True)]:
        try:
            name = p.name()
            found += [(p.pid, name, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.ZombieProcess):  # ended meanwhile
            continue
    return found


def _outside(listening) -> list:
    return [s for s in listening if not ipaddress.ip_address(s[2].removeprefix("::ffff:")).is_loopback]


def test_a_run_on_one_node_listens_on_the_loopback_address_only(cluster, pool, tmp_path):
    """Two actor ranks (a gloo group: its rendezvous store on rank 0, gloo's listeners on
    both) and two env ranks, read while the run starts, trains and ends its updates."""
    overrides = ["placement.mode=custom", "placement.components.env=0-1", "placement.components.rollout=0-1",
                 "placement.components.actor=0-1", "runner.total_env_steps=1024", "env.kwargs.max_episode_steps=20",
                 "runner.progress=false", f"runner.out_dir={tmp_path}"]  # 4 updates
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", overrides), cluster, pool)  # its processes may be older
    seen, done = set(_listening()), threading.Event()

    def watch():
        while not done.wait(0.2):
            seen.update(_listening())

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        actors = set(runner.groups["actor"].pids())
        watcher.start()
        history = runner.train()
    finally:
        done.set()
        watcher.join(timeout=10)
        runner.close()
    assert len(history) == 4
    names = {name for _, name, _, _ in seen}
    assert {"gcs_server", "raylet"} <= names, seen  # Ray's own are seen
    # both actor ranks listen (gloo; rank 0 the store too): the test sees the group's sockets
    assert actors <= {pid for pid, *_ in seen}, (actors, seen)
    assert not _outside(seen), f"listening beyond the loopback address: {_outside(seen)}"


class Pair(Worker):
    def exchange(self, peer, backend):
        """A pairwise group to ``peer`` (gloo in place of NCCL here), a tensor swapped over it;
        then this process's listening sockets, the pair's among them."""
        self.comm.pairs.backend = backend
        pg, peer_rank, _ = self.comm.pairs.group(tuple(peer))
        mine, theirs = torch.full((2,), float(self.rank)), torch.empty(2)
        for w in [pg.send([mine], peer_rank, 0), pg.recv([theirs], peer_rank, 0)]:
            w.wait()
        me = psutil.Process()
        return theirs.tolist(), [(c.laddr.ip, c.laddr.port) for c in me.net_connections(kind="inet")
                                 if c.status == psutil.CONN_LISTEN]


def test_a_pair_of_workers_on_one_node_listens_on_the_loopback_address_only(cluster):
    """The pairwise groups between any two workers (NCCL on GPUs): the store its lower side
    hosts and gloo's listeners bind the loopback address."""
    group = WorkerGroup(Pair, Placement.from_config({"pair": "0-1"}, cluster)["pair"])
    try:
        calls = [group.call("exchange", ("pair", 1 - r), "gloo", ranks=[r]) for r in (0, 1)]
        (zero, first), (one, second) = [call.wait()[0] for call in calls]
    finally:
        group.shutdown()
    assert zero == [1.0, 1.0] and one == [0.0, 0.0]
    assert first and second  # rank 0 hosts the store; both have gloo's listener
    outside = [a for a in first + second if not ipaddress.ip_address(a[0].removeprefix("::ffff:")).is_loopback]
    assert not outside, f"listening beyond the loopback address: {outside}"


def test_the_interface_is_the_one_holding_the_nodes_address():
    """On several nodes a worker binds the interface that holds its node's Ray address, not
    every interface; the loopback address is the loopback interface's."""
    from m2flow.runtime import listen

    assert listen.interface_of("127.0.0.1") == next(
        name for name, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs))
    assert listen.interface_of("192.0.2.1") is None  # an address no interface here holds (TEST-NET-1)
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family.name == "AF_INET":
                assert listen.interface_of(a.address) == name
