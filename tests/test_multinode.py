"""Two raylets on this machine (ray.cluster_utils.Cluster) stand in for two nodes."""

import sys

import pytest
import ray
import torch
from ray.cluster_utils import Cluster as RayTestCluster

from m2flow.runtime.cluster import Cluster
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement, PlacementError
from m2flow.runtime.worker import Worker


class NodeProbe(Worker):
    def node(self):
        return ray.get_runtime_context().get_node_id()

    def send_to(self, obj, group, rank):
        return self.send(obj, group, rank)

    def recv_from(self, group, rank):
        obj = self.recv(group, rank)
        return obj, self.comm.last_transport

    def all_reduce(self):
        import torch.distributed as dist

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()


@pytest.fixture(scope="module")
def two_nodes():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if ray.is_initialized():
        ray.shutdown()
    raylets = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    raylets.add_node(num_cpus=2)
    raylets.wait_for_nodes()
    cluster = Cluster(address=raylets.address, node_groups={"head": [0], "second": [1]})
    yield cluster
    ray.shutdown()
    raylets.shutdown()
    cluster.shutdown()  # an attached cluster leaves Ray running; this removes its shared memory


def test_devices_span_nodes(two_nodes):
    assert len(two_nodes.nodes) == 2
    assert [d.index for d in two_nodes.devices] == [0, 1, 2, 3]
    assert [d.node_rank for d in two_nodes.devices] == [0, 0, 1, 1]
    assert [d.index for d in two_nodes.group_devices("second")] == [2, 3]
    with pytest.raises(ValueError, match="names nodes \\[5\\]"):
        Cluster(address="auto", node_groups={"far": [5]})


def test_placement_across_nodes_and_node_groups(two_nodes):
    p = Placement.from_config({"a": "head:0", "b": "second:0-1", "span": {"devices": "1-2"}}, two_nodes)
    assert [d.index for d in p["b"].devices] == [2, 3]
    assert p.sharing == "overlapping"
    with pytest.raises(PlacementError, match="'wide'.*different nodes"):
        Placement.from_config({"wide": {"devices": "1-2", "devices_per_proc": 2}}, two_nodes)
    with pytest.raises(PlacementError, match="'b'.*group 'second' has 2 device"):
        Placement.from_config({"b": "second:0-2"}, two_nodes)


def test_groups_run_on_their_nodes_and_talk(two_nodes):
    p = Placement.from_config({"left": "head:0", "right": "second:0-1"}, two_nodes)
    left = WorkerGroup(NodeProbe, p["left"])
    right = WorkerGroup(NodeProbe, p["right"])
    nodes = {n.rank: n.node_id for n in two_nodes.nodes}
    assert left.node().wait() == [nodes[0]]
    assert right.node().wait() == [nodes[1], nodes[1]]

    data = torch.randn(256, 1024)  # 1 MiB: big enough to skip the inline path
    receiving = right.call("recv_from", "left", 0, ranks=[0])
    assert left.send_to(data, "right", 0).wait() == ["object_store"]
    got, transport = receiving.wait()[0]
    assert transport == "object_store" and torch.equal(got, data)

    # Same node, other rank: shared memory.
    receiving = right.call("recv_from", "right", 0, ranks=[1])
    assert right.call("send_to", data, "right", 1, ranks=[0]).wait() == ["shm"]
    assert receiving.wait()[0][1] == "shm"
    left.kill()
    right.kill()


def test_process_group_across_nodes(two_nodes):
    p = Placement.from_config({"ddp": "1-2"}, two_nodes)
    g = WorkerGroup(NodeProbe, p["ddp"])
    g.init_process_group()
    assert g.all_reduce().wait() == [3.0, 3.0]
    g.kill()


@pytest.mark.slow
def test_a_run_that_loses_a_node_ends_in_a_paragraph_naming_it(tmp_path):
    """A CartPole run across two nodes whose second node's raylet is killed at update 40, told
    not to go on without it (``runner.on_node_loss=fail``): the run ends with one paragraph
    naming the node and its components, after at most one restart
    tried while the cluster still took the node for alive; disaggregated needs three devices,
    so the paragraph names the mode that fits the two left, and ``runner.resume=auto`` under it
    goes on from the last checkpoint on the node left (about 60 s)."""
    import re

    from m2flow.config import load_config
    from m2flow.runners import checkpoint as checkpoints
    from m2flow.runners import status
    from m2flow.runners.embodied import EmbodiedRunner
    from m2flow.runners.status import RunFailed

    raylets, second, cluster = _two_raylets()

    def config(*extra):
        return load_config("embodied/ppo_cartpole", ["placement.mode=disaggregated", "runner.checkpoint_every=20",
                                                     f"runner.out_dir={tmp_path}", "runner.progress=false", *extra])

    runners = [EmbodiedRunner(config("runner.total_env_steps=2000000", "runner.on_node_loss=fail"), cluster)]
    try:
        _kill_at(raylets, second, tmp_path, 40)
        with pytest.raises(RunFailed) as failed:
            runners[0].train()
        runners.pop().close()
        left = Cluster(address=raylets.address)
        assert len(left.devices) == 2
        done = checkpoints.load(status.read(tmp_path)["last_checkpoint"])["done"]
        runners.append(EmbodiedRunner(config(f"runner.total_env_steps={256 * (done + 3)}", "runner.resume=auto",
                                             "placement.mode=collocated"), left))
        rows = runners[0].train()
    finally:
        for runner in runners:
            runner.close()
        cluster.shutdown()
        ray.shutdown()
        raylets.shutdown()
    message = str(failed.value)
    assert re.fullmatch(r"the run failed after \d+ of 7812 updates: the Ray cluster lost node 1 \([^;]+; devices 2-3: "
                        r"rollout, actor\); the last checkpoint: \S+/update_0000[4-9]0.safetensors; continue with "
                        r"runner.resume=auto once the cluster has its 4 devices again, or now on the 2 left with "
                        r"placement.mode=collocated", message), message
    assert [row["update"] for row in rows][-3:] == [done, done + 1, done + 2]
    assert ("was written on another placement (rollout in processes of its own then, fused now; actor 1 rank(s) then, "
            "2 now)") in (tmp_path / "log.txt").read_text()
    assert status.read(tmp_path)["state"] == "finished"


@pytest.mark.slow
def test_a_run_that_loses_a_node_goes_on_on_the_node_left_and_grows_back(tmp_path):
    """The same run and kill, as runs are by default (``runner.on_node_loss=continue``,
    ``runner.on_node_return=grow``): the run goes on from its last checkpoint, collocated on
    the two devices of the node left (disaggregated needs three). A new raylet then joins: at
    the next checkpoint the run grows onto the four devices, disaggregated again, and ends
    with every update once (about 90 s)."""
    import re
    import threading
    import time

    from m2flow.config import load_config
    from m2flow.runners import checkpoint as checkpoints
    from m2flow.runners import status
    from m2flow.runners.embodied import EmbodiedRunner

    raylets, second, cluster = _two_raylets()
    runner = EmbodiedRunner(load_config("embodied/ppo_cartpole", [
        "placement.mode=disaggregated", "runner.total_env_steps=25600", "runner.checkpoint_every=20",
        f"runner.out_dir={tmp_path}", "runner.progress=false"]), cluster)  # 100 updates

    rows, failed = [], []

    def train():  # in a thread: Ray starts a raylet from the main thread only
        try:
            rows.extend(runner.train())
        except BaseException as e:  # noqa: BLE001 - failed below
            failed.append(e)

    try:
        _kill_at(raylets, second, tmp_path, 40)
        training = threading.Thread(target=train, daemon=True)
        training.start()
        # a node once the run has gone on without the lost one
        while training.is_alive() and not (status.read(tmp_path).get("warning") or "").startswith("the Ray cluster lost"):
            time.sleep(0.05)
        raylets.add_node(num_cpus=2)
        training.join()
    finally:
        runner.close()
        cluster.shutdown()
        ray.shutdown()
        raylets.shutdown()
    assert not failed, failed
    assert [row["update"] for row in rows] == list(range(100))
    ended = status.read(tmp_path)
    assert ended["state"] == "finished" and 1 <= ended["restarts"] <= 2 and ended["warning"] is None, ended
    log = (tmp_path / "log.txt").read_text()
    assert re.search(r"the Ray cluster lost node 1 \([^;]+; devices 2-3: rollout, actor\): the run goes on on the 2 "
                     r"devices left under placement.mode=collocated, from \S+/update_000040.safetensors", log), log
    grown = re.search(r"node 1 \([^;]+; 2 device\(s\)\) joined the Ray cluster: the run grows onto the 4 devices there "
                      r"are now under placement.mode=disaggregated, from \S+/update_0000([68]0).safetensors", log)
    assert grown, log
    assert len(cluster.devices) == 4 and len(cluster.nodes) == 2
    last = checkpoints.load(tmp_path / "checkpoints" / "update_000100.safetensors")
    assert last["config"]["placement"]["mode"] == "disaggregated" and len(last["states"]["actor"]) == 1


def _two_raylets():
    """A fresh Ray of two raylets of 2 CPUs each (any Ray this process was attached to is shut
    down first), a cluster attached to it, and its second node."""
    if ray.is_initialized():
        ray.shutdown()
    raylets = RayTestCluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    second = raylets.add_node(num_cpus=2)
    raylets.wait_for_nodes()
    return raylets, second, Cluster(address=raylets.address)


def _kill_at(raylets, node, out, updates):
    """Kills ``node``'s raylet, from a thread, once the run writing to ``out`` has logged ``updates``."""
    import threading
    import time

    from m2flow.runners import status

    def kill():
        while status.read(out).get("done", 0) < updates:
            time.sleep(0.05)
        raylets.remove_node(node, allow_graceful=False)

    threading.Thread(target=kill, daemon=True).start()
