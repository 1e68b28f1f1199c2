"""The same-node control path: a named pipe per worker process.

A Ray actor call costs ~0.7 ms here; a write to the receiver's named pipe, read by a
thread there, costs tens of microseconds. Frames up to PIPE_BUF are written in one
write(2), which the kernel keeps whole however many senders share the pipe; a larger
frame travels through shared memory and only its reference goes through the pipe.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pickle
import select
import struct
from typing import Callable

from ray import cloudpickle

from m2flow.runtime import shm
from m2flow.runtime.names import shm_prefix

logger = logging.getLogger(__name__)

_FRAME = struct.Struct("<I")


def _pipe_path(session: str, pid: int) -> str:
    return os.path.join(shm.SHM_DIR, f"{shm_prefix(session)}-pipe-{pid}")


def cleanup_pipes(prefix: str) -> None:
    for path in glob.glob(os.path.join(shm.SHM_DIR, f"{glob.escape(prefix)}-pipe-*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _frame(message: tuple) -> bytes:
    body = cloudpickle.dumps(message, protocol=5)  # by value where the receiver cannot import a class
    if _FRAME.size + len(body) > select.PIPE_BUF:
        import torch

        ref = shm.process_pool().write([torch.frombuffer(bytearray(body), dtype=torch.uint8)])
        body = cloudpickle.dumps(("shm", ref), protocol=5)
    return _FRAME.pack(len(body)) + body


def open_pipe(path: str, pid: int) -> int:
    """The write end of a peer's pipe, blocking. A live peer holds its read end open from the
    start (``O_RDWR``); a pipe nobody reads (its process killed, the file left) would block
    a plain open for good, so the open does not wait: ``LookupError`` at once."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:  # ENXIO: no reader; ENOENT: no pipe
        raise LookupError(f"pid {pid} cannot be reached through its pipe {path} ({e.strerror}): its process is "
                          "gone") from None
    os.set_blocking(fd, True)
    return fd


def _read_exactly(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_pipe(fd: int, deliver: Callable[..., None], address: tuple[str, int]) -> None:
    """The loop of the thread that reads a worker's own pipe (``fd``) and hands each message
    to ``deliver``; it ends when the pipe is closed."""
    while True:
        try:
            frame = _read_exactly(fd, _FRAME.unpack(_read_exactly(fd, _FRAME.size))[0])
        except (EOFError, OSError):
            return  # closed
        try:  # a frame is read whole, so one that fails to unpack leaves the next ones intact
            message = pickle.loads(frame)
            if message[0] == "shm":
                message = pickle.loads(shm.open_tensors(message[1])[0].numpy().tobytes())
            deliver(*message)
        except Exception:
            logger.exception("%s:%s dropped a message it could not unpack", *address)
