"""The embedded Ray: safe defaults."""

import ipaddress
import os

import psutil
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
