"""Whether the Ray cluster's head still answers, and what its loss leaves behind.

When the head's control store (the GCS) goes away and does not come back, Ray's core lets a
driver and its workers go on for ``gcs_rpc_server_reconnect_timeout_s`` (60 s unless set), then
ends each process at once, with no Python code run. Until then, calls between the running
processes and the object store need no GCS: a run can still finish the update in progress and
write a checkpoint. ``HeadMonitor`` is the driver's thread that notices the loss early enough:
it connects to the GCS's port every ``poll_s`` seconds and takes the head for lost once no
connection has succeeded for ``lost_after_s``; a connection that succeeds again takes it back.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil


def ray_grace_s() -> float:
    """How long Ray's core keeps a process going without its GCS (Ray's own setting, which
    ``RAY_gcs_rpc_server_reconnect_timeout_s`` changes)."""
    try:
        return float(os.environ.get("RAY_gcs_rpc_server_reconnect_timeout_s", 60))
    except ValueError:
        return 60.0


class HeadMonitor:
    def __init__(self, address: str | None, poll_s: float = 1.0, lost_after_s: float = 5.0,
                 on_change: Callable[[HeadMonitor], None] | None = None):
        """``address``: the GCS's ``host:port`` (None: nothing is watched, the head is never
        lost); ``on_change(monitor)`` is called from the thread when the head is taken for lost
        and when it answers again."""
        self.address, self.poll_s, self.lost_after_s = address, poll_s, lost_after_s
        self.on_change = on_change
        self.lost = False
        self.last_answer = time.time()  # wall time of the last connection that succeeded
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if address is not None:
            host, _, port = address.rpartition(":")
            self._target = (host.strip("[]"), int(port))
            self._thread = threading.Thread(target=self._run, name="m2flow-head", daemon=True)
            self._thread.start()

    def _answers(self) -> bool:
        try:
            with socket.create_connection(self._target, timeout=max(0.1, min(self.poll_s, 2.0))):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            answers = self._answers()
            if answers:
                self.last_answer = time.time()
            lost = not answers and time.time() - self.last_answer >= self.lost_after_s
            if lost != self.lost:
                self.lost = lost
                if self.on_change is not None:
                    self.on_change(self)

    def describe(self) -> str:
        """Since when the head has not answered, in a few words."""
        since = time.strftime("%H:%M:%S", time.localtime(self.last_answer))
        return f"the Ray cluster's head (its GCS at {self.address}) has not answered since {since}"

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


def end_leftovers(ray_dir: str | Path) -> list[int]:
    """Ends the processes of a local Ray whose head was lost that its shutdown left running
    (its agents outlive their raylet): those, other than this one, with a file open under
    ``ray_dir``, the Ray's own temporary directory. Their pids."""
    ray_dir, ended = str(Path(ray_dir).resolve()), []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and any(f.path.startswith(ray_dir) for f in p.open_files()):
                p.kill()
                ended.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return ended
