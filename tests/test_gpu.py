"""GPU paths of the runtime: devices, CUDA_VISIBLE_DEVICES, CUDA IPC, NCCL.

Skipped on machines without CUDA (CI has none); docs/architecture.md records where and when
they last ran on a GPU. Pairwise NCCL needs two GPUs: NCCL refuses two ranks on one GPU.
"""

import os

import pytest
import torch

from m2flow.runtime.cluster import Cluster
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement
from m2flow.runtime.worker import Worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class GpuPeer(Worker):
    def describe(self):
        return {"device": self.device, "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "count": torch.cuda.device_count(), "uuid": str(torch.cuda.get_device_properties(0).uuid)}

    def send_cuda(self, group, rank, n, change_after=False):
        """Sends ``arange(n)`` and lets it go (the transport keeps what it sent); with
        ``change_after``, adds 1 to it in place once sent, as an optimizer step does to
        weights just pushed."""
        t = torch.arange(n, dtype=torch.float32, device="cuda")
        transport = self.send({"x": t, "step": 3}, group, rank)
        if change_after:
            t.add_(1.0)
            torch.cuda.synchronize()
        return transport

    def recv_cuda(self, group, rank):
        got = self.recv(group, rank, timeout=60)
        x = got["x"]
        return {"transport": self.comm.last_transport, "is_cuda": x.is_cuda, "sum": x.sum().item(),
                "step": got["step"]}

    def put_cuda(self, channel):
        channel.put({"x": torch.arange(10, dtype=torch.float32, device="cuda"), "step": 3})
        channel.flush()

    def all_reduce(self):
        import torch.distributed as dist

        self.init_process_group()
        t = torch.full((4,), float(self.rank + 1), device="cuda")
        dist.all_reduce(t)
        return dist.get_backend(), t.tolist()


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    import sys

    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(num_cpus=4, run_dir=tmp_path_factory.mktemp("gpu-run"))
    yield c
    c.shutdown()


def test_cluster_lists_each_gpu_as_a_device(gpu_cluster):
    cuda = [d for d in gpu_cluster.devices if d.kind == "cuda"]
    assert len(cuda) == torch.cuda.device_count() and gpu_cluster.device_kind == "cuda"


def test_worker_sees_only_its_gpu(gpu_cluster):
    last = torch.cuda.device_count() - 1
    group = WorkerGroup(GpuPeer, Placement.from_config({"w": str(last)}, gpu_cluster)["w"])
    try:
        (info,) = group.describe().wait(timeout=120)
    finally:
        group.kill()
    assert info["device"] == "cuda" and info["visible"] == str(last) and info["count"] == 1
    assert info["uuid"] == str(torch.cuda.get_device_properties(last).uuid)


def exchange(cluster, a_devices: str, b_devices: str, change_after: bool = False) -> tuple[str, dict]:
    """Worker a sends a CUDA tensor to worker b: (the sender's transport, what b saw).
    ``change_after``: the sender changes the tensor once sent, before b receives it."""
    p = Placement.from_config({"a": a_devices, "b": b_devices}, cluster)
    a, b = WorkerGroup(GpuPeer, p["a"]), WorkerGroup(GpuPeer, p["b"])
    try:
        if change_after:  # sent (a message in b's mailbox) and changed before b takes it
            (transport,) = a.call("send_cuda", b.name, 0, 1000, True).wait(timeout=120)
            (got,) = b.call("recv_cuda", a.name, 0).wait(timeout=120)
        else:
            received = b.call("recv_cuda", a.name, 0)
            (transport,) = a.call("send_cuda", b.name, 0, 1000).wait(timeout=120)
            (got,) = received.wait(timeout=120)
    finally:
        a.kill()
        b.kill()
    return transport, got


def test_same_gpu_tensors_go_by_cuda_ipc(gpu_cluster):
    transport, got = exchange(gpu_cluster, "0", "0")
    assert transport == "cuda_ipc"
    assert got == {"transport": "cuda_ipc", "is_cuda": True, "sum": float(sum(range(1000))), "step": 3}


def test_cuda_ipc_delivers_the_tensor_as_sent(gpu_cluster):
    """The receiver gets the values at send time though the sender changed its tensor since
    (a handle to the sender's live memory would show the change: sum + 1000)."""
    transport, got = exchange(gpu_cluster, "0", "0", change_after=True)
    assert transport == "cuda_ipc" and got["sum"] == float(sum(range(1000)))


def test_nccl_process_group_in_a_gpu_worker(gpu_cluster):
    group = WorkerGroup(GpuPeer, Placement.from_config({"w": "0"}, gpu_cluster)["w"])
    try:
        (result,) = group.all_reduce().wait(timeout=180)
    finally:
        group.kill()
    assert result == ("cpu:gloo,cuda:nccl", [1.0] * 4)  # CUDA tensors go by NCCL, CPU ones by gloo


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="pairwise NCCL needs two GPUs")
def test_different_gpus_go_by_nccl(gpu_cluster):
    transport, got = exchange(gpu_cluster, "0", "1")
    assert transport == "nccl" and got["transport"] == "nccl" and got["sum"] == float(sum(range(1000)))


def test_two_devices_of_one_gpu_share_it_and_talk_by_cuda_ipc(gpu_cluster):
    """cluster.gpu_slots=2: devices 0 and 1 are both GPU 0; a worker on each sees that GPU
    alone, and tensors between them go by CUDA IPC (NCCL refuses two ranks on one GPU)."""
    slots = Cluster(gpu_slots=2, run_dir=gpu_cluster.run_dir)  # attaches to the running Ray
    os.environ["M2FLOW_SESSION"] = gpu_cluster.session  # the workers go on naming this run's files
    assert len(slots.devices) == 2 * torch.cuda.device_count()
    p = Placement.from_config({"a": "0", "b": "1"}, slots)
    a, b = WorkerGroup(GpuPeer, p["a"]), WorkerGroup(GpuPeer, p["b"])
    try:
        (seen_a,), (seen_b,) = a.describe().wait(timeout=120), b.describe().wait(timeout=120)
    finally:
        a.kill()
        b.kill()
    assert seen_a["visible"] == seen_b["visible"] == "0" and seen_a["count"] == seen_b["count"] == 1
    assert seen_a["uuid"] == seen_b["uuid"] == str(torch.cuda.get_device_properties(0).uuid)
    transport, got = exchange(slots, "0", "1")
    assert transport == "cuda_ipc" and got["transport"] == "cuda_ipc" and got["sum"] == float(sum(range(1000)))


def test_cuda_tensors_cross_a_channel_as_cpu_copies(gpu_cluster):
    """A channel has no NCCL pair between its writers and readers: a GPU worker's CUDA
    tensors reach the reader as CPU tensors with their values."""
    from m2flow.runtime import Channel

    group = WorkerGroup(GpuPeer, Placement.from_config({"w": "0"}, gpu_cluster)["w"])
    channel = Channel.create("cuda-items", maxsize=4)
    try:
        group.put_cuda(channel).wait(timeout=180)
        got = channel.get(timeout=60)
    finally:
        group.kill()
    assert not got["x"].is_cuda and got["x"].sum().item() == 45.0 and got["step"] == 3
