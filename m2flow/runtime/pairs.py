"""Pairwise process groups between two workers of any groups: NCCL between two GPUs.

A pair is a two-rank process group outside torch.distributed's world, over a TCPStore that
the lower address of the pair hosts (``runtime/listen.py``). ``Communicator`` owns one
``Pairs`` per worker process; a worker's ``_m2flow_nccl_open`` and ``_m2flow_nccl_join`` are
the other side's calls into it.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # NCCL pairs carry CUDA tensors: torch is there when one is used
    import torch

from m2flow.runtime import listen


class Pairs:
    """This worker's pairwise groups, one per peer it sent CUDA tensors to or received them from."""

    backend = "nccl"  # the pairwise groups' backend; tests build the same pairs with gloo

    def __init__(self, address: tuple[str, int], peer: Callable[[tuple[str, int]], tuple[Any, Any]]):
        """``peer``: the communicator's look-up of a worker, (actor, PeerInfo)."""
        self.address = address
        self.peer = peer
        self._groups: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()

    def group(self, peer: tuple[str, int]):
        """A two-rank process group for this pair, outside torch.distributed's world so that
        any two workers of any groups can pair up: (group, peer's rank in it, store).

        The lower address of the pair always hosts the store and is rank 0, whichever side
        needs the pair first: two peers that first send to each other at the same moment
        still build one pair, not two half-built ones waiting for each other.
        """
        if peer in self._groups:
            return self._groups[peer]
        actor, _ = self.peer(peer)
        if self.address < peer:
            self._host(peer, actor)
        else:  # ask the lower side to host; it calls back our join
            actor._m2flow_nccl_open.remote(self.address)
        return self._wait(peer)

    def _host(self, peer: tuple[str, int], actor: Any) -> None:
        with self._lock:  # the main and an IO thread may both get here
            if peer in self._groups:
                return
            # the store listens on this node's Ray address only (``runtime/listen.py``)
            listener = listen.bound_socket(listen.node_address())
            host, port = listener.getsockname()[:2]
            store = listen.host_store(listener, 2, wait_for_workers=False)
            actor._m2flow_nccl_join.remote(self.address, (host, port))  # before the group: gloo's waits for it
            self._groups[peer] = (self._pair(store, 0), 1, store)

    def open(self, peer: tuple[str, int]) -> None:
        """The higher side of a pair asks this worker to host it."""
        self._host(peer, self.peer(peer)[0])

    def join(self, peer: tuple[str, int], store_addr: tuple[str, int]) -> None:
        with self._lock:
            if peer not in self._groups:
                store = listen.join_store(store_addr[0], store_addr[1], 2)
                self._groups[peer] = (self._pair(store, 1), 0, store)

    def _pair(self, store: Any, rank: int) -> Any:
        import torch.distributed as dist

        prefixed = dist.PrefixStore("m2flow-p2p", store)
        if self.backend == "gloo":
            return dist.ProcessGroupGloo(prefixed, rank, 2)
        return dist.ProcessGroupNCCL(prefixed, rank, 2)

    def _wait(self, peer: tuple[str, int], timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while peer not in self._groups:  # the other side's request may still be in flight
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {self.backend} pair with {peer} after {timeout:.0f} s")
            time.sleep(0.001)
        return self._groups[peer]

    def send(self, dst: tuple[str, int], tensors: list[torch.Tensor]) -> None:
        pg, peer_rank, _ = self.group(dst)
        for t in tensors:
            if t.is_cuda:
                pg.send([t.contiguous()], peer_rank, 0).wait()

    def recv(self, src: tuple[str, int], meta: list) -> list[torch.Tensor]:
        import torch

        pg, peer_rank, _ = self.group(src)
        out = []
        for shape, dtype in meta:
            t = torch.empty(shape, dtype=dtype, device="cuda")
            pg.recv([t], peer_rank, 0).wait()
            out.append(t)
        return out
