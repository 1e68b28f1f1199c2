"""What a run's own processes listen on: torch.distributed's rendezvous stores and the
transports of gloo and NCCL bind the node's address in the Ray cluster, never every interface.

On an embedded Ray that address is the loopback one (``cluster._loopback_only``), so nothing
of a run on one node listens beyond the loopback address; on a cluster of several nodes, each
binds the interface holding its node's Ray address. ``TCPStore`` takes no bind address: its
listening socket is made here, bound to that address, and handed to it (``master_listen_fd``).
gloo and NCCL bind the interface ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` name, set
in each worker process before any group forms (unless its environment sets them already).

Imports nothing of m2flow.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Any

# The variables that name the interface gloo's and NCCL's transports bind (NCCL's bootstrap
# reads its own once per process, before its first communicator).
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def node_address() -> str:
    """This process's node's address in the Ray cluster (``127.0.0.1`` on an embedded Ray)."""
    import ray

    return ray.util.get_node_ip_address()


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (``lo`` for ``127.0.0.1``), or
    None where none here does (an address translated on its way, say)."""
    import psutil

    try:
        wanted = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.split("%")[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None


def set_interfaces(address: str) -> str | None:
    """Names the interface holding ``address`` (the node's Ray address) for gloo's and NCCL's
    transports in this process's environment, where it names none already; returns it (None:
    no interface holds the address, and the libraries choose as they do by default)."""
    name = interface_of(address)
    if name is not None:
        for variable in IFNAME_VARIABLES:
            os.environ.setdefault(variable, name)
    return name


def bound_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host`` (``port`` 0: a free one), not yet listening: it holds the
    port, so that no other process takes it before the store that listens on it is made."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        if port:  # a port a store closed: its connections' TIME_WAIT must not keep it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except BaseException:
        s.close()
        raise
    return s


STORE_TIMEOUT = datetime.timedelta(seconds=300)  # TCPStore's own default


def host_store(listener: socket.socket, world_size: int, timeout: datetime.timedelta = STORE_TIMEOUT,
               wait_for_workers: bool = True) -> Any:
    """A ``TCPStore`` server listening on ``listener`` (bound: ``bound_socket``), which it takes
    over (the store closes it)."""
    import torch.distributed as dist

    host, port = listener.getsockname()[:2]
    listener.listen(128)
    # (libuv's store serves the socket it is given; the socket is the store's from here on,
    # closed with it)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=wait_for_workers,
                         master_listen_fd=listener.detach())


def join_store(host: str, port: int, world_size: int, timeout: datetime.timedelta = STORE_TIMEOUT) -> Any:
    """A client of the ``TCPStore`` at ``host:port``."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
