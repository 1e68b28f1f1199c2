"""Runtime benchmark: m2flow against the strongest simple baselines, side by side in one run.

  p2p       100 MB CPU tensor, worker -> worker on one node, vs torch.distributed gloo
            send/recv between two plain processes, each pinned to one core like the
            workers. The gloo processes are started once and warmed up with the same
            sends; their buffers are allocated and written before any timing.
  channel   producer worker -> consumer worker, 10 MB tensors and 1 KB items, one put and
            one get per item, vs three plain Ray ways between the same two workers:
            ``ray.util.queue.Queue`` with one blocking put/get per item
            (``ray_queue``); the same queue carrying lists of ``BATCH`` items per put/get
            (``ray_queue_batch``); and a pull pipeline (``ray_pull``), the consumer calling a
            producer method that returns ``BATCH`` items (Ray stores them in its object
            store) and ``ray.get``ting the ObjectRefs, ``PULL_WINDOW`` calls in flight. The
            Ray baselines carry numpy arrays (the tensor's data), which Ray hands over
            without a copy on get. ``ratio`` is m2flow's per-item throughput over the
            fastest baseline's; ``m2flow_batch`` is the channel carrying the same lists as
            the batched baselines, for a like-for-like comparison with them.
  memcpy    the ceiling for the bytes: a one-thread ``torch`` copy of the same payload into
            a buffer written before, reported next to m2flow's p2p and 10 MB channel
            throughput (m2flow / memcpy as a fraction).
  call      a group call on one rank vs a raw Ray actor call.

Every receiver touches each page of what it receives, so zero-copy paths pay for their page
faults. Each measurement warms every side up once, then times ``--reps`` repetitions of
every side, in ABAB order (the order flips from one repetition to the next), recording the
1-minute load average around each side; it reports each side's spread (min, median, max)
and the ratio per repetition against the fastest baseline of that repetition (> 1: m2flow
is faster). The machine's fp32 matmul speed is measured at the start and the end.

    python benchmarks/runtime.py [--reps 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections import deque

import numpy as np
import ray
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import Run, json_safe, loaded, log, side_order, spread
from m2flow.runtime.channel import Channel
from m2flow.runtime.cluster import Cluster
from m2flow.runtime.group import WorkerGroup
from m2flow.runtime.names import free_port
from m2flow.runtime.placement import Placement
from m2flow.runtime.worker import Worker

MB = 1 << 20
TARGETS = {"p2p_100MB": 1.5, "channel_10MB": 3.0, "channel_1KB": 1.5, "group_call": 1 / 1.2}
BATCH = {10 * MB: 4, 1024: 64}  # items per put/get of the batched queue and per pull call
PULL_WINDOW = 4  # pull calls in flight
QUEUE_SIZE = 64


def touch(x) -> float:
    """Reads one element per 4 KiB page: cheap, but faults every page in."""
    if isinstance(x, torch.Tensor):
        flat = x.reshape(-1)
        return float(flat[::max(1, 4096 // flat.element_size())].sum())
    if isinstance(x, np.ndarray):
        flat = x.reshape(-1)
        return float(flat[::max(1, 4096 // flat.itemsize)].sum())
    return float(len(x))


def make_item(nbytes: int, numpy: bool = False):
    """A payload: a float32 tensor (its numpy array for the Ray baselines) from 1 MB, else bytes."""
    if nbytes < MB:
        return os.urandom(nbytes)
    t = torch.randn(nbytes // 4)
    return t.numpy() if numpy else t


class Bench(Worker):
    """Both ends of every m2flow and Ray measurement."""

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

    def produce(self, channel, n: int, item_bytes: int, batch: int = 0) -> None:
        """n items after those that start the consumer's clock; ``batch``: lists of that many
        distinct items per put (a list of one object repeated would be pickled once)."""
        numpy = not isinstance(channel, Channel)
        if batch:
            items = [make_item(item_bytes, numpy) for _ in range(batch)]
            for _ in range(n // batch + 1):
                channel.put(items)
        else:
            item = make_item(item_bytes, numpy)
            for _ in range(n + 1):
                channel.put(item)
        if not numpy:
            channel.flush()

    def consume(self, channel, n: int, batch: int = 0) -> float:
        first = channel.get()
        for item in first if batch else [first]:
            touch(item)
        start = time.perf_counter()
        got = 0
        while got < n:
            items = channel.get() if batch else [channel.get()]
            for item in items:
                touch(item)
            got += len(items)
        return time.perf_counter() - start

    def items(self, k: int, item_bytes: int) -> list:
        """The producer of the pull pipeline: k distinct items, made once per size."""
        cache = self.__dict__.setdefault("_items", {})
        if (k, item_bytes) not in cache:
            cache[(k, item_bytes)] = [make_item(item_bytes, numpy=True) for _ in range(k)]
        return cache[(k, item_bytes)]

    def pull(self, producer, n: int, item_bytes: int, batch: int, window: int) -> float:
        """Calls ``producer.items`` for ``batch`` items at a time and ``ray.get``s the results,
        keeping ``window`` calls in flight; the first call's items start the clock."""
        for item in ray.get(producer.items.remote(batch, item_bytes)):
            touch(item)
        start = time.perf_counter()
        calls, pending = n // batch, deque()
        for _ in range(min(window, calls)):
            pending.append(producer.items.remote(batch, item_bytes))
        issued = len(pending)
        while pending:
            items = ray.get(pending.popleft())
            if issued < calls:
                pending.append(producer.items.remote(batch, item_bytes))
                issued += 1
            for item in items:
                touch(item)
        return time.perf_counter() - start

    def noop(self) -> None:
        return None


@ray.remote(num_cpus=0.01)
class RawActor:
    def noop(self) -> None:
        return None


# -- memcpy ceiling ----------------------------------------------------------------------
def memcpy_seconds(n: int, nbytes: int) -> float:
    """n one-thread copies of nbytes into a buffer written before."""
    src, dst = torch.randn(nbytes // 4), torch.zeros(nbytes // 4)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dst.copy_(src)
        start = time.perf_counter()
        for _ in range(n):
            dst.copy_(src)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(before)


# -- p2p -------------------------------------------------------------------------------
def _gloo_rank(rank: int, port: int, nbytes: int, conn) -> None:
    """One persistent gloo process: for each ``n`` it gets, sends (rank 0) or receives
    (rank 1) n tensors into the same buffer; rank 1 answers with the seconds it took."""
    os.sched_setaffinity(0, [sorted(os.sched_getaffinity(0))[rank % os.cpu_count()]])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.randn(nbytes // 4) if rank == 0 else torch.zeros(nbytes // 4)  # both written: no faults later
    go = torch.zeros(1)
    while (n := conn.recv()) is not None:
        if rank == 0:
            dist.send(go, 1)
            for _ in range(n):
                dist.send(t, 1)
            conn.send(0.0)
        else:
            dist.recv(go, 0)
            start = time.perf_counter()
            for _ in range(n):
                dist.recv(t, 0)
                touch(t)
            conn.send(time.perf_counter() - start)
    dist.destroy_process_group()


class GlooPair:
    """Two warm gloo processes, started once, timed as often as asked."""

    def __init__(self, nbytes: int) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(2):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_gloo_rank, args=(rank, port, nbytes, theirs), daemon=True)
            proc.start()
            self.conns.append(ours)
            self.procs.append(proc)

    def seconds(self, n: int) -> float:
        for conn in self.conns:
            conn.send(n)
        for conn, proc in zip(self.conns, self.procs):
            while not conn.poll(1.0):
                if not proc.is_alive():
                    raise RuntimeError(f"gloo baseline process {proc.pid} died (exit code {proc.exitcode})")
        return [conn.recv() for conn in self.conns][1]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def timed_reps(sides: dict, reps: int) -> list[dict]:
    """``reps`` repetitions of every side (name -> function returning seconds), ABAB; each
    row holds the order, the seconds per side and the load around each side."""
    rows = []
    for rep in range(reps):
        row = {"order": side_order(list(sides), rep), "seconds": {}, "load": {}}
        for name in row["order"]:
            row["seconds"][name], row["load"][name] = loaded(sides[name])
        rows.append(row)
    return rows


def bench_p2p(sender: WorkerGroup, receiver: WorkerGroup, n: int, nbytes: int, reps: int) -> dict:
    def m2flow_seconds() -> float:
        receiving = receiver.recv_tensors(sender.name, n)
        sender.send_tensors(receiver.name, n, nbytes).wait()
        return receiving.wait()[0]

    gloo = GlooPair(nbytes)
    try:
        m2flow_seconds(), gloo.seconds(n), memcpy_seconds(n, nbytes)  # warm-up with the timed sizes
        rows = timed_reps({"m2flow": m2flow_seconds, "gloo": lambda: gloo.seconds(n),
                           "memcpy": lambda: memcpy_seconds(n, nbytes)}, reps)
    finally:
        gloo.close()
    gbps = {side: [n * nbytes / r["seconds"][side] / 1e9 for r in rows] for side in ("m2flow", "gloo", "memcpy")}
    ratios = [r["seconds"]["gloo"] / r["seconds"]["m2flow"] for r in rows]
    fractions = [r["seconds"]["memcpy"] / r["seconds"]["m2flow"] for r in rows]
    return {"bytes": nbytes, "sends_per_rep": n, "GBps": {side: spread(v, 2) for side, v in gbps.items()},
            "ratio": round(statistics.median(ratios), 2), "ratio_spread": spread(ratios, 2),
            "m2flow_over_memcpy": spread(fractions, 3), "reps": rows}


# -- channel ---------------------------------------------------------------------------
def bench_channel(producer: WorkerGroup, consumer: WorkerGroup, n: int, item_bytes: int, name: str,
                  reps: int) -> dict:
    from ray.util.queue import Queue

    batch = BATCH[item_bytes]
    n = math.ceil(n / batch) * batch  # whole batches for the batched baselines

    def through(channel, b: int = 0) -> float:
        consuming = consumer.consume(channel, n, b)
        producer.produce(channel, n, item_bytes, b).wait()
        return consuming.wait()[0]

    source = producer.actors[0]
    channel = Channel.create(f"bench-{name}", maxsize=QUEUE_SIZE)
    queue = Queue(maxsize=QUEUE_SIZE, actor_options={"num_cpus": 0.01})
    sides = {
        "m2flow": lambda: through(channel),
        "m2flow_batch": lambda: through(channel, batch),
        "ray_queue": lambda: through(queue),
        "ray_queue_batch": lambda: through(queue, batch),
        "ray_pull": lambda: consumer.pull(source, n, item_bytes, batch, PULL_WINDOW).wait()[0],
    }
    if item_bytes >= MB:
        sides["memcpy"] = lambda: memcpy_seconds(n, item_bytes)
    try:
        for side in sides.values():  # warm-up
            side()
        rows = timed_reps(sides, reps)
    finally:
        channel.close()
        queue.shutdown()
    baselines = ["ray_queue", "ray_queue_batch", "ray_pull"]
    per_s = {side: [n / r["seconds"][side] for r in rows] for side in sides}
    ratios = [per_s["m2flow"][i] / max(per_s[b][i] for b in baselines) for i in range(reps)]
    out = {"item_bytes": item_bytes, "items_per_rep": n, "batch": batch, "pull_window": PULL_WINDOW,
           "items_per_s": {side: spread(v, 1) for side, v in per_s.items()},
           "fastest_baseline": [max(baselines, key=lambda b: per_s[b][i]) for i in range(reps)],
           "ratio": round(statistics.median(ratios), 2), "ratio_spread": spread(ratios, 2),
           "ratio_per_baseline": {b: spread([per_s["m2flow"][i] / per_s[b][i] for i in range(reps)], 2)
                                  for b in baselines},
           # The channel carrying the same lists as the batched baselines, against the fastest baseline.
           "m2flow_batch_ratio_spread": spread([per_s["m2flow_batch"][i] / max(per_s[b][i] for b in baselines)
                                                for i in range(reps)], 2)}
    if "memcpy" in sides:
        out["m2flow_over_memcpy"] = spread([per_s["m2flow"][i] / per_s["memcpy"][i] for i in range(reps)], 3)
    return out | {"reps": rows}


# -- group call ------------------------------------------------------------------------
def bench_call(group: WorkerGroup, n: int, blocks: int) -> dict:
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
    rows = timed_reps({"m2flow": lambda: per_call(m2flow_call), "ray": lambda: per_call(raw_call)}, blocks)
    ray.kill(raw)
    m2 = [r["seconds"]["m2flow"] for r in rows]
    rw = [r["seconds"]["ray"] for r in rows]
    overheads = [a / b for a, b in zip(m2, rw)]
    return {"calls_per_block": n, "m2flow_ms": spread([s * 1e3 for s in m2], 3), "ray_ms": spread([s * 1e3 for s in rw], 3),
            "ratio": round(1 / statistics.median(overheads), 2), "overhead": round(statistics.median(overheads), 2),
            "overhead_spread": spread(overheads, 2), "reps": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of every side, in ABAB order")
    parser.add_argument("--quick", action="store_true", help="a quarter of the items per repetition (a smoke run)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps must be at least 1, got {args.reps}")
    scale = 0.25 if args.quick else 1.0
    count = lambda n: max(2, int(n * scale))  # noqa: E731

    bench = Run()
    cluster = Cluster(num_cpus=os.cpu_count())
    placement = Placement.from_config({"sender": "0", "receiver": "1"}, cluster)
    sender = WorkerGroup(Bench, placement["sender"])
    receiver = WorkerGroup(Bench, placement["receiver"])
    results = {}
    try:
        log("p2p, 100 MB")
        results["p2p_100MB"] = bench_p2p(sender, receiver, count(8), 100 * MB, args.reps)
        log("channel, 10 MB items")
        results["channel_10MB"] = bench_channel(sender, receiver, count(40), 10 * MB, "10MB", args.reps)
        log("channel, 1 KB items")
        results["channel_1KB"] = bench_channel(sender, receiver, count(2000), 1024, "1KB", args.reps)
        log("group call")
        results["group_call"] = bench_call(sender, count(1000), max(5, args.reps))
    finally:
        sender.kill()
        receiver.kill()
        cluster.shutdown()
    for key, target in TARGETS.items():
        results[key]["target"] = round(target, 2)
        results[key]["meets_target"] = results[key]["ratio"] >= target
    report = {"benchmark": "runtime", "reps": args.reps, "quick": args.quick, **results,
              **bench.finish(torch=torch.__version__, ray=ray.__version__)}
    print(json.dumps(json_safe(report), indent=1))


if __name__ == "__main__":
    main()
