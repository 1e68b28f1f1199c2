"""Run as a script by tests/test_group.py: a worker that Ray's memory monitor kills in the
middle of a call, on a Ray of its own whose kill threshold is 1.5 GB over the memory the
machine uses now (Ray reads the threshold when it starts). Prints how the call ended, as JSON.

    python tests/oom_worker.py RUN_DIR
"""
import json
import os
import sys
import time


def used_and_total() -> tuple[int, int]:
    """Bytes in use and in all, as Ray's memory monitor counts them (no cgroup limit here)."""
    info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in open("/proc/meminfo"))}
    return info["MemTotal"] - info["MemAvailable"], info["MemTotal"]


used, total = used_and_total()
os.environ["RAY_memory_usage_threshold"] = f"{(used + 1500 * 2**20) / total:.4f}"
os.environ["RAY_memory_monitor_refresh_ms"] = "100"

import numpy as np  # noqa: E402 -- after the settings Ray reads at start

from m2flow.runtime.cluster import Cluster  # noqa: E402
from m2flow.runtime.errors import WorkerDiedError  # noqa: E402
from m2flow.runtime.group import WorkerGroup  # noqa: E402
from m2flow.runtime.placement import Placement  # noqa: E402
from m2flow.runtime.worker import Worker  # noqa: E402


class Eater(Worker):
    def eat(self, mb: int) -> int:
        chunks = []
        for _ in range(mb // 50):
            chunks.append(np.ones(50 * 2**17))  # 50 MB, every page written
            time.sleep(0.05)
        time.sleep(60)  # holds it all: the monitor has time to act
        return len(chunks)


cluster = Cluster(num_cpus=2, cpu_slots=2, run_dir=sys.argv[1])
group = WorkerGroup(Eater, Placement.from_config({"eater": "0"}, cluster)["eater"])
start = time.monotonic()
try:
    group.eat(4000).wait()
    outcome = {"died": False}
except WorkerDiedError as e:
    outcome = {"died": True, "rank": e.rank, "method": e.method, "message": str(e), "traceback": e.traceback}
outcome["seconds"] = time.monotonic() - start
print(json.dumps(outcome))
cluster.shutdown()
