"""The embedded Ray: safe defaults."""

import ipaddress
import os
import re
import socket
import time

import psutil
import pytest
import ray

from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement
from m2flow.runtime.worker import Worker


class Idle(Worker):
    def pid(self):
        return os.getpid()


def _ray_processes() -> list[psutil.Process]:
    """The embedded Ray's processes: this driver and what it started (the GCS, the raylet and,
    under it, the workers)."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def test_an_embedded_ray_listens_on_the_loopback_address_only(cluster):
    group = WorkerGroup(Idle, Placement.from_config({"idle": "0-1"}, cluster)["idle"])
    try:
        workers = set(group.pid().wait())
        procs = _ray_processes()
        assert workers <= {p.pid for p in procs}
        listening = [(p.name(), c.laddr) for p in procs for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        names = {name for name, _ in listening}
        assert {"gcs_server", "raylet"} <= names and len(listening) >= 5, listening  # the test sees them all
        outside = [(name, addr) for name, addr in listening
                   if not ipaddress.ip_address(addr.ip.removeprefix("::ffff:")).is_loopback]
        assert not outside, f"listening beyond the loopback address: {outside}"
        assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())
    finally:
        group.shutdown()


def test_gpu_slots_make_each_gpu_several_devices(monkeypatch):
    """cluster.gpu_slots=k: each GPU is k devices with consecutive indices, numbered node by
    node; a process on any of them sees that GPU, once; an embedded Ray's device count
    counts the slots."""
    from m2flow.config import load_config
    from m2flow.runners.start import local_devices
    from m2flow.runtime.cluster import Cluster
    from m2flow.runtime.worker import visible_gpus

    listed = [{"Alive": True, "NodeID": "b", "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "GPU": 1.0}},
              {"Alive": True, "NodeID": "a", "NodeManagerAddress": "10.0.0.9",
               "Resources": {"CPU": 16.0, "GPU": 2.0, "node:__internal_head__": 1.0}},
              {"Alive": False, "NodeID": "c", "NodeManagerAddress": "10.0.0.3", "Resources": {"GPU": 4.0}}]
    c = Cluster.__new__(Cluster)  # its node listing alone, no Ray
    c._cpu_slots, c._cores_per_slot, c.gpu_slots = None, 1, 2
    nodes = c._discover_nodes(listed)
    devices = [d for n in nodes for d in n.devices]
    assert [(d.index, d.node_id, d.local_index, d.kind) for d in devices] == [
        (0, "a", 0, "cuda"), (1, "a", 0, "cuda"), (2, "a", 1, "cuda"), (3, "a", 1, "cuda"),
        (4, "b", 0, "cuda"), (5, "b", 0, "cuda")]
    assert visible_gpus(tuple(devices[0:2])) == "0" and visible_gpus(tuple(devices[1:3])) == "0,1"
    assert [str(d) for d in devices[1:3]] == ["cuda:1(node 0, GPU 0)", "cuda:2(node 0, GPU 1)"]
    c.gpu_slots = 1
    assert [d.local_index for n in c._discover_nodes(listed) for d in n.devices] == [0, 1, 0]
    cfg = load_config("reasoning/grpo_arith_tiny", ["cluster.gpu_slots=3"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    assert local_devices(cfg.cluster) == (6, "cuda")


def test_an_address_where_no_cluster_answers_fails_at_once():
    from m2flow.runtime.cluster import answers

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        answers(f"127.0.0.1:{port}")
        answers(f"ray://127.0.0.1:{port}")
    answers("auto")  # Ray's to resolve
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"no Ray cluster answers at 127.0.0.1:{port} "):
        answers(f"127.0.0.1:{port}")  # closed now
    assert time.monotonic() - t0 < 5


def _embedded_start(monkeypatch, tmp_path, init):
    """``start_cluster`` of an embedded Ray whose ``ray.init`` is ``init``, as if no Ray ran here."""
    from m2flow.config import ConfigError, load_config
    from m2flow.runners.start import start_cluster

    monkeypatch.setenv("M2FLOW_RAY_TMP", str(tmp_path))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(ConfigError) as e:
        start_cluster(load_config("embodied/ppo_cartpole").cluster)
    return str(e.value)


def test_no_room_for_the_embedded_rays_files_is_one_line_before_it_starts(monkeypatch, tmp_path):
    import m2flow.runtime.cluster as cluster_module

    def init(**kwargs):
        raise AssertionError("ray.init was called")

    monkeypatch.setattr(cluster_module, "MIN_FREE_MB", 1e12)
    message = _embedded_start(monkeypatch, tmp_path, init)
    assert message.startswith("cluster: only ") and message.endswith(
        f" MB free in {tmp_path}, where the embedded Ray writes its sockets and logs (1000000000000 MB needed): free "
        "some, or set M2FLOW_RAY_TMP to a directory with room"), message


def test_an_embedded_ray_that_does_not_start_is_one_line_naming_its_logs(monkeypatch, tmp_path):
    def init(**kwargs):
        raise Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.\nmore")

    message = _embedded_start(monkeypatch, tmp_path, init)
    assert message == ("cluster: the embedded Ray did not start (Exception: The current node timed out during startup. "
                       "This could happen because some of the raylet failed to startup or the GCS has become "
                       f"overloaded.); its logs: {tmp_path}/m2flow-ray-{os.getpid()}/session_latest/logs")


def test_the_demo_says_so_in_one_line_too(monkeypatch, tmp_path, capsys):
    import m2flow.runtime.cluster as cluster_module
    from m2flow import cli

    monkeypatch.setenv("M2FLOW_RAY_TMP", str(tmp_path))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster_module, "MIN_FREE_MB", 1e12)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--out", str(tmp_path / "demo")])
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        rf"m2flow: error: cluster: only [\d.]+ MB free in {re.escape(str(tmp_path))}, where the embedded Ray writes "
        r"its sockets and logs \(1000000000000 MB needed\): free some, or set M2FLOW_RAY_TMP to a directory with room",
        lines[0]), lines
