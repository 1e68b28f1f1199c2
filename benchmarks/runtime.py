"""Runtime benchmark: m2flow against its raw baselines, side by side in one run.

  p2p       100 MB CPU tensor, worker -> worker on one node, vs torch.distributed gloo
            send/recv between two plain processes (both pinned to one core each)
  channel   producer worker -> consumer worker, 10 MB tensors and 1 KB items,
            vs ray.util.queue.Queue
  call      a group call on one rank vs a raw Ray actor call

Every receiver touches each page of what it receives, so zero-copy paths pay for their
page faults. Prints one JSON object; ratios > 1 mean m2flow is faster.

    python benchmarks/runtime.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from m2flow.runtime.channel import Channel
from m2flow.runtime.cluster import Cluster
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.placement import Placement
from m2flow.runtime.worker import Worker

MB = 1 << 20
TARGETS = {"p2p_100MB": 1.5, "channel_10MB": 3.0, "channel_1KB": 1.5, "group_call": 1 / 1.2}


def touch(x) -> float:
    """Reads one element per 4 KiB page: cheap, but faults every page in."""
    if isinstance(x, torch.Tensor):
        flat = x.reshape(-1)
        step = max(1, 4096 // flat.element_size())
        return float(flat[::step].sum())
    return float(len(x))


class Bench(Worker):
    """Both ends of every m2flow measurement."""

    def send_tensors(self, dst_group: str, n: int, nbytes: int) -> None:
        t = torch.randn(nbytes // 4)
        self.send("go", dst_group, 0)
        for _ in range(n):
            self.send(t, dst_group, 0)

    def recv_tensors(self, src_group: str, n: int) -> float:
        self.recv(src_group, 0)
        start = time.perf_counter()
        for _ in range(n):
            touch(self.recv(src_group, 0))
        return time.perf_counter() - start

    def produce(self, channel, n: int, item_bytes: int, ray_queue: bool = False) -> None:
        item = torch.randn(item_bytes // 4) if item_bytes >= MB else os.urandom(item_bytes)
        put = channel.put
        for _ in range(n + 1):  # the first item starts the consumer's clock
            put(item)
        if not ray_queue:
            channel.flush()

    def consume(self, channel, n: int) -> float:
        touch(channel.get())
        start = time.perf_counter()
        for _ in range(n):
            touch(channel.get())
        return time.perf_counter() - start

    def noop(self) -> None:
        return None


@ray.remote(num_cpus=0.01)
class RawActor:
    def noop(self) -> None:
        return None


# -- p2p -------------------------------------------------------------------------------
def _gloo_rank(rank: int, port: int, n: int, nbytes: int, out) -> None:
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.randn(nbytes // 4) if rank == 0 else torch.empty(nbytes // 4)
    go = torch.zeros(1)
    if rank == 0:
        dist.send(go, 1)
        for _ in range(n):
            dist.send(t, 1)
    else:
        dist.recv(go, 0)
        start = time.perf_counter()
        for _ in range(n):
            dist.recv(t, 0)
            touch(t)
        out.put(time.perf_counter() - start)
    dist.destroy_process_group()


def gloo_seconds(n: int, nbytes: int) -> float:
    from m2flow.runtime.worker import free_port

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, n, nbytes, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"gloo baseline processes failed: exit codes {[p.exitcode for p in procs]}")
    return out.get()


def bench_p2p(sender: WorkerGroup, receiver: WorkerGroup, n: int, nbytes: int) -> dict:
    def m2flow_seconds() -> float:
        receiving = receiver.recv_tensors(sender.name, n)
        sender.send_tensors(receiver.name, n, nbytes).wait()
        return receiving.wait()[0]

    m2flow_seconds()  # warm-up: creates and faults in the shared-memory segments
    gloo_seconds(2, nbytes)
    m2, gl = min(m2flow_seconds() for _ in range(3)), min(gloo_seconds(n, nbytes) for _ in range(3))
    gbps = lambda s: round(n * nbytes / s / 1e9, 2)  # noqa: E731
    return {"m2flow_GBps": gbps(m2), "gloo_GBps": gbps(gl), "ratio": round(gl / m2, 2)}


# -- channel ---------------------------------------------------------------------------
def bench_channel(producer: WorkerGroup, consumer: WorkerGroup, n: int, item_bytes: int, name: str) -> dict:
    from ray.util.queue import Queue

    def run(channel, ray_queue: bool) -> float:
        consuming = consumer.consume(channel, n)
        producer.produce(channel, n, item_bytes, ray_queue).wait()
        return consuming.wait()[0]

    channel = Channel.create(f"bench-{name}", maxsize=64)
    queue = Queue(maxsize=64, actor_options={"num_cpus": 0.01})
    run(channel, False), run(queue, True)  # warm-up
    m2 = min(run(channel, False) for _ in range(3))
    rq = min(run(queue, True) for _ in range(3))
    channel.close()
    queue.shutdown()
    return {"m2flow_items_per_s": round(n / m2, 1), "ray_queue_items_per_s": round(n / rq, 1), "ratio": round(rq / m2, 2)}


# -- group call ------------------------------------------------------------------------
def bench_call(group: WorkerGroup, n: int) -> dict:
    raw = RawActor.remote()
    ray.get(raw.noop.remote())

    def per_call(fn) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - start) / n

    m2flow_call = lambda: group.call("noop", ranks=[0]).wait()  # noqa: E731
    raw_call = lambda: ray.get(raw.noop.remote())  # noqa: E731
    per_call(m2flow_call), per_call(raw_call)  # warm-up
    m2, rw = [], []
    for _ in range(5):  # interleaved blocks: drift hits both alike
        m2.append(per_call(m2flow_call))
        rw.append(per_call(raw_call))
    m2s, rws = sorted(m2)[2], sorted(rw)[2]
    ray.kill(raw)
    return {"m2flow_ms": round(m2s * 1e3, 3), "ray_ms": round(rws * 1e3, 3), "ratio": round(rws / m2s, 2),
            "overhead": round(m2s / rws, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    scale = 0.25 if args.quick else 1.0
    reps = lambda n: max(2, int(n * scale))  # noqa: E731

    cluster = Cluster(num_cpus=os.cpu_count())
    placement = Placement.from_config({"sender": "0", "receiver": "1"}, cluster)
    sender = WorkerGroup(Bench, placement["sender"])
    receiver = WorkerGroup(Bench, placement["receiver"])
    results = {
        "p2p_100MB": bench_p2p(sender, receiver, reps(8), 100 * MB),
        "channel_10MB": bench_channel(sender, receiver, reps(40), 10 * MB, "10MB"),
        "channel_1KB": bench_channel(sender, receiver, reps(2000), 1024, "1KB"),
        "group_call": bench_call(sender, reps(1000)),
    }
    for key, target in TARGETS.items():
        results[key]["target"] = round(target, 2)
        results[key]["meets_target"] = results[key]["ratio"] >= target
    results["machine"] = {"cpus": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
                          "ray": ray.__version__, "platform": platform.platform()}
    sender.kill()
    receiver.kill()
    cluster.shutdown()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
