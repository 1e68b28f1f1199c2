"""Point-to-point communication between workers, with the transport chosen per pair.

A payload (a tensor, a nested dict/list/tuple/dataclass of tensors, or any picklable
object) is split into a skeleton and its tensors. The skeleton rides on a Ray actor call
to the receiver's mailbox; the tensors take the cheapest path for that pair:

  handoff       same process: the objects themselves, no copy
  rpc           small CPU payloads (< INLINE_BYTES): pickled into the actor call
  shm           same node, CPU tensors: one copy into a pooled shared-memory segment,
                mapped copy-on-write by the receiver
  object_store  different nodes, CPU tensors: Ray's object store, one hop
  cuda_ipc      same GPU: one copy on the GPU, handed over by a CUDA IPC handle
  nccl          different GPUs: NCCL send/recv over a pairwise communicator

Between processes, every transport delivers the payload as it was when it was sent: the
sender may change its tensors at once (an optimizer step on weights just pushed).
``cuda_ipc`` copies them for that (a handle to the sender's live memory would let the
receiver read whatever the sender wrote since); the copy lives until the receiver drops its
tensors (torch keeps a shared block alive while a receiver holds it, even once the sender
has let it go). NCCL needs no copy: the sender's later kernels queue behind the send.

The transport used is recorded on the returned work handle, in the worker's
``comm_log`` and in trace spans. Between workers on one node the envelope goes through the
receiver's named pipe (``pipes.py``); the NCCL pairs are ``Pairs`` (``pairs.py``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from m2flow.runtime import payload, shm
from m2flow.runtime.names import NAMESPACE, shm_prefix
from m2flow.runtime.pairs import Pairs
from m2flow.runtime.pipes import _frame, _pipe_path, open_pipe, read_pipe
from m2flow.runtime.trace import get_tracer

if TYPE_CHECKING:  # imported where tensors are handled: a worker that sends none starts without it
    import torch

INLINE_BYTES = 64 * 1024


@dataclass(frozen=True)
class PeerInfo:
    node_id: str
    pid: int
    gpus: tuple[str, ...]  # physical GPU UUIDs visible to the peer, in device order
    pipe: str | None = None  # its named pipe, for same-node messages


@dataclass
class Packed:
    """A payload ready to cross a process boundary."""

    skeleton: Any
    transport: str
    data: Any  # list of numpy arrays or tensors (rpc), ShmRef, list of ObjectRefs, IPC handles, or NCCL metadata
    nbytes: int
    cpu_index: list[int] = field(default_factory=list)  # tensor positions of a mixed CPU/GPU payload
    cpu_part: Packed | None = None


@dataclass
class Envelope:
    src: tuple[str, int]
    tag: Hashable
    packed: Packed
    sent_at: float
    seq: int  # per (sender, receiver, tag): deliveries run on several threads and may overtake


class _Mailbox:
    """Messages of one (sender, tag), released in the order they were sent."""

    def __init__(self):
        self.ready: deque[tuple[Envelope, int]] = deque()
        self.early: dict[int, tuple[Envelope, int]] = {}
        self.next = 0

    def add(self, env: Envelope, reader: int) -> None:
        self.early[env.seq] = (env, reader)
        while self.next in self.early:
            self.ready.append(self.early.pop(self.next))
            self.next += 1


def node_id() -> str:
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


def local_peer_info(pipe: str | None = None) -> PeerInfo:
    gpus: tuple[str, ...] = ()
    torch = sys.modules.get("torch")  # a process that never imported it holds no CUDA tensor
    if torch is not None and torch.cuda.is_available():
        gpus = tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))
    return PeerInfo(node_id(), os.getpid(), gpus, pipe)


# -- packing -----------------------------------------------------------------------
def pack(obj: Any, *, same_process: bool = False, same_node: bool = True, readers: int = 1,
         same_gpu: bool = False) -> Packed:
    if same_process:  # the object itself, not even flattened
        return Packed(obj, "handoff", None, 0)
    return pack_flat(*payload.flatten(obj), same_node=same_node, readers=readers, same_gpu=same_gpu)


def pack_flat(skeleton: Any, tensors: list[torch.Tensor], *, same_node: bool = True, readers: int = 1,
              same_gpu: bool = False) -> Packed:
    """Chooses the transport for CPU and CUDA tensors; NCCL needs a live pair and is
    handled by ``Communicator``, so here a CUDA payload to another GPU is marked "nccl"."""
    nbytes = payload.nbytes(tensors)
    if any(t.is_cuda for t in tensors):
        cpu_index = [i for i, t in enumerate(tensors) if not t.is_cuda]
        cuda = [t for t in tensors if t.is_cuda]
        cpu_part = _pack_cpu(None, [tensors[i] for i in cpu_index], same_node, readers) if cpu_index else None
        if same_gpu:
            import torch.multiprocessing.reductions

            # a snapshot (a leaf, as the tensor was): the receiver maps it, not the sender's live memory
            handles = [torch.multiprocessing.reductions.reduce_tensor(
                t.detach().clone(memory_format=torch.contiguous_format).requires_grad_(t.requires_grad)) for t in cuda]
            return Packed(skeleton, "cuda_ipc", handles, nbytes, cpu_index, cpu_part)
        meta = [(tuple(t.shape), t.dtype) for t in cuda]
        return Packed(skeleton, "nccl", meta, nbytes, cpu_index, cpu_part)
    return _pack_cpu(skeleton, tensors, same_node, readers)


def _pack_cpu(skeleton: Any, tensors: list[torch.Tensor], same_node: bool, readers: int) -> Packed:
    nbytes = payload.nbytes(tensors)
    if nbytes < INLINE_BYTES:
        return Packed(skeleton, "rpc", [_as_array(t) for t in tensors], nbytes)
    if same_node:
        return Packed(skeleton, "shm", shm.process_pool().write(tensors, readers=readers), nbytes)
    return Packed(skeleton, "object_store", [ray.put(t.contiguous()) for t in tensors], nbytes)


def _as_array(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A small tensor as the numpy array on its memory: numpy arrays pickle and unpickle
    ~10-30x faster than tensors (~0.1 ms against ~1 ms for a small policy's 13 weights).
    Dtypes numpy lacks (bfloat16...) stay tensors."""
    try:
        return t.detach().contiguous().numpy()
    except (TypeError, RuntimeError):
        return t.contiguous()


def unpack(p: Packed, reader: int = 0, nccl_tensors: list[torch.Tensor] | None = None) -> Any:
    if p.transport == "handoff":
        return p.skeleton
    if p.transport == "cuda_ipc":
        cuda = [fn(*args) for fn, args in p.data]
    elif p.transport == "nccl":
        cuda = nccl_tensors or []
        if len(cuda) != len(p.data):  # they come by the pair's own NCCL send (Communicator)
            raise RuntimeError(f"a payload of {len(p.data)} CUDA tensor(s) to go by NCCL arrived with {len(cuda)}: "
                               "NCCL tensors travel only point to point between two workers")
    else:
        return payload.unflatten(p.skeleton, _cpu_tensors(p, reader))
    tensors: list[torch.Tensor] = [None] * (len(cuda) + len(p.cpu_index))  # type: ignore[list-item]
    cpu = _cpu_tensors(p.cpu_part, reader) if p.cpu_part else []
    for i, t in zip(p.cpu_index, cpu):
        tensors[i] = t
    it = iter(cuda)
    tensors = [t if t is not None else next(it) for t in tensors]
    return payload.unflatten(p.skeleton, tensors)


def _cpu_tensors(p: Packed, reader: int) -> list[torch.Tensor]:
    if p.transport == "rpc":
        if not p.data:  # no tensor: torch stays unimported where it is (a tool worker)
            return []
        import torch  # tensors arrive: the receiver makes them too

        return [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in p.data]
    if p.transport == "shm":
        return shm.open_tensors(p.data, reader)
    if p.transport == "object_store":
        return ray.get(p.data)
    raise ValueError(f"unknown transport {p.transport!r}")


# -- work handles --------------------------------------------------------------------
class CommWork:
    """An asynchronous send or receive; ``wait()`` returns the received object (or None)."""

    def __init__(self, transport: str, future: Future | None = None, refs: list | None = None, value: Any = None):
        self.transport = transport
        self._future, self._refs, self._value = future, refs, value

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        if self._refs:
            return len(ray.wait(self._refs, num_returns=len(self._refs), timeout=0)[0]) == len(self._refs)
        return True

    def wait(self, timeout: float | None = None) -> Any:
        if self._future is not None:
            return self._future.result(timeout)
        if self._refs:
            ray.get(self._refs, timeout=timeout)
        return self._value


@dataclass
class CommRecord:
    op: str
    peer: tuple[str, int]
    transport: str
    nbytes: int
    seconds: float


class Communicator:
    """One per worker process: sends, a mailbox for receives, pairwise NCCL groups."""

    def __init__(self, address: tuple[str, int]):
        self.received = 0  # messages taken (the watchdog counts them as progress)
        self.address = address
        self.log: deque[CommRecord] = deque(maxlen=1024)
        self._peers: dict[tuple[str, int], tuple[Any, PeerInfo]] = {}
        self._mail: dict[tuple, _Mailbox] = defaultdict(_Mailbox)
        self._sent: dict[tuple, int] = defaultdict(int)  # next sequence number per (receiver, tag)
        self._mail_cv = threading.Condition()
        self.pairs = Pairs(address, self.peer)
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="m2flow-comm")
        self._pipes: dict[str, int] = {}  # write ends of peers' pipes
        self._pipe_lock = threading.Lock()
        # Our own pipe, opened read-write so that it never reports EOF while we live.
        session = os.environ.get("M2FLOW_SESSION", "default")
        shm.hold(shm_prefix(session))  # the session's files here stay while this process lives
        shm.sweep()  # those of sessions whose processes all ended (killed) go
        pipe = _pipe_path(session, os.getpid())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pipe)
        os.mkfifo(pipe, 0o600)
        self._pipe_fd = os.open(pipe, os.O_RDWR)
        self.info = local_peer_info(pipe)
        threading.Thread(target=read_pipe, args=(self._pipe_fd, self.deliver, self.address), name="m2flow-pipe",
                         daemon=True).start()

    # -- peers -----------------------------------------------------------------
    def peer(self, address: tuple[str, int]) -> tuple[Any, PeerInfo]:
        if address not in self._peers:
            try:
                actor = ray.get_actor(f"{address[0]}:{address[1]}", namespace=NAMESPACE)
            except ValueError:
                raise LookupError(f"no worker {address[0]} rank {address[1]} is running") from None
            self._peers[address] = (actor, ray.get(actor._m2flow_peer_info.remote()))
        return self._peers[address]

    def _pack_for(self, flat: tuple[Any, list[torch.Tensor]], dst: PeerInfo, readers: int = 1) -> Packed:
        skeleton, tensors = flat
        same_node = dst.node_id == self.info.node_id
        same_gpu = False
        cuda = [t for t in tensors if t.is_cuda]
        if cuda and same_node and self.info.gpus and dst.gpus:
            same_gpu = self.info.gpus[cuda[0].device.index] == dst.gpus[0]
        return pack_flat(skeleton, tensors, same_node=same_node, readers=readers, same_gpu=same_gpu)

    # -- send ------------------------------------------------------------------
    def isend(self, obj: Any, dst: tuple[str, int], tag: Hashable = 0) -> CommWork:
        start = time.time()
        if dst == self.address:  # the object itself, not even flattened
            packed = Packed(obj, "handoff", None, 0)
            self.deliver(Envelope(self.address, tag, packed, start, self._next_seq(dst, tag)))
            self._record("send", dst, packed, start)
            return CommWork(packed.transport)
        actor, info = self.peer(dst)
        flat = payload.flatten(obj)
        packed = self._pack_for(flat, info)
        refs = self._post(actor, info, Envelope(self.address, tag, packed, start, self._next_seq(dst, tag)))
        if packed.transport == "nccl":
            self.pairs.send(dst, flat[1])
        self._record("send", dst, packed, start)
        return CommWork(packed.transport, refs=refs)

    def send(self, obj: Any, dst: tuple[str, int], tag: Hashable = 0, timeout: float | None = None) -> str:
        """Returns once the payload is handed over (in the receiver's mailbox, or written to
        its pipe on this node); gives the transport."""
        work = self.isend(obj, dst, tag)
        work.wait(timeout)
        return work.transport

    def broadcast(self, obj: Any, src: tuple[str, int], dst: list[tuple[str, int]], tag: Hashable = 0,
                  timeout: float | None = None) -> Any:
        """Collective: ``src`` sends ``obj`` to every address in ``dst``; receivers get it.
        Same-node receivers share one shared-memory copy (copy-on-write each)."""
        btag = ("broadcast", tag)
        if self.address != src:
            return self.recv(src, btag, timeout)
        start = time.time()
        flat = payload.flatten(obj)
        others = [d for d in dst if d != src]
        peers = [self.peer(d) for d in others]
        # Same-node receivers of a CPU payload share one packed copy, one reader slot each.
        local = [i for i, (_, info) in enumerate(peers) if info.node_id == self.info.node_id and info.pid != self.info.pid]
        shared = None
        if local and not any(t.is_cuda for t in flat[1]):
            shared = self._pack_for(flat, peers[local[0]][1], readers=len(local))
        refs = []
        for i, (d, (actor, info)) in enumerate(zip(others, peers)):
            if shared is not None and i in local:
                packed, reader = shared, local.index(i)
            else:
                packed, reader = self._pack_for(flat, info), 0
            refs += self._post(actor, info, Envelope(src, btag, packed, start, self._next_seq(d, btag)), reader)
            if packed.transport == "nccl":
                self.pairs.send(d, flat[1])
            self._record("broadcast", d, packed, start)
        ray.get(refs, timeout=timeout)
        return obj

    def _post(self, actor: Any, info: PeerInfo, env: Envelope, reader: int = 0) -> list:
        """Hands an envelope to the receiver: through its pipe on this node, else a Ray call
        (whose reference is returned, to wait on)."""
        if info.pipe is None or info.node_id != self.info.node_id:
            return [actor._m2flow_deliver.remote(env, reader)]
        frame = _frame((env, reader))
        with self._pipe_lock:
            fd = self._pipes.get(info.pipe)
            if fd is None:
                fd = self._pipes[info.pipe] = open_pipe(info.pipe, info.pid)
        try:
            os.write(fd, frame)
        except BrokenPipeError:
            raise LookupError(f"worker {env.src} cannot reach pid {info.pid}: its process is gone") from None
        return []

    def _next_seq(self, dst: tuple[str, int], tag: Hashable) -> int:
        seq = self._sent[(dst, tag)]
        self._sent[(dst, tag)] = seq + 1
        return seq

    # -- receive ---------------------------------------------------------------
    def deliver(self, env: Envelope, reader: int = 0) -> None:
        with self._mail_cv:
            self._mail[(env.src, env.tag)].add(env, reader)
            self._mail_cv.notify_all()

    def recv(self, src: tuple[str, int], tag: Hashable = 0, timeout: float | None = None) -> Any:
        start = time.time()
        key = (tuple(src), tag)
        with self._mail_cv:
            box = self._mail[key]
            if not self._mail_cv.wait_for(lambda: box.ready, timeout):
                raise TimeoutError(f"{self.address[0]}:{self.address[1]} got nothing from {src[0]}:{src[1]} (tag {tag!r}) in {timeout}s")
            env, reader = box.ready.popleft()
            self.received += 1
        packed = env.packed
        nccl = self.pairs.recv(tuple(src), packed.data) if packed.transport == "nccl" else None
        obj = unpack(packed, reader, nccl)
        self._record("recv", tuple(src), packed, start)
        return obj

    def ready(self, src: tuple[str, int], tag: Hashable = 0) -> int:
        """Messages from ``src`` under ``tag`` that a ``recv`` would take now, without waiting."""
        with self._mail_cv:
            box = self._mail.get((tuple(src), tag))
            return len(box.ready) if box is not None else 0

    def irecv(self, src: tuple[str, int], tag: Hashable = 0, timeout: float | None = None) -> CommWork:
        return CommWork("pending", future=self._executor.submit(self.recv, src, tag, timeout))

    @property
    def last_transport(self) -> str | None:
        return self.log[-1].transport if self.log else None

    def _record(self, op: str, peer: tuple[str, int], packed: Packed, start: float) -> None:
        end = time.time()
        self.log.append(CommRecord(op, peer, packed.transport, packed.nbytes, end - start))
        get_tracer().record(f"{op} {peer[0]}:{peer[1]}", start, end, cat="recv" if op == "recv" else "send",
                            transport=packed.transport, bytes=packed.nbytes)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for fd in self._pipes.values():
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.info.pipe)
        shm.close_process_pool()
