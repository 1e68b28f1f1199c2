"""Files written whole: a reader finds a file complete or absent, also after a crash; and a
directory only one process writes into at a time."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Writes ``tensors`` (safetensors) to ``path`` atomically (``write_whole``). An I/O error
    (a full disk) is an ``OSError`` with its errno, as Python's own writes raise it."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file  # here: the rest of this module needs no torch

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, tmp, metadata=metadata)
        except SafetensorError as e:  # "... I/O error: No space left on device (os error 28)"
            code = re.search(r"\(os error (\d+)\)", str(e))
            if code is None:
                raise
            raise OSError(int(code[1]), os.strerror(int(code[1]))) from e

    return write_whole(path, write)


def write_text(path: str | Path, text: str) -> Path:
    """Writes ``text`` to ``path`` atomically (``write_whole``)."""
    return write_whole(path, lambda tmp: tmp.write_text(text))


def write_whole(path: str | Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` writes a temporary file beside ``path``; it is flushed to disk, renamed
    over ``path``, then the directory flushed (the rename itself durable). An ``OSError`` that
    names no file (a full disk, as a write reports it) is raised naming ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


class DirectoryBusy(RuntimeError):
    """Another process holds the directory (``DirectoryLock``); the message names it."""


class DirectoryLock:
    """One process at a time writes into ``folder``: an exclusive ``flock`` on its
    ``.m2flow.lock`` file, taken without waiting (``DirectoryBusy`` names the holder by the pid,
    host and time the file records). The kernel lets go of it when the process ends, however it
    ends, so a crashed run leaves no stale lock. Holds nested in one process share the first's
    lock (a run that profiles, then trains in one directory). Where the file system answers
    ``flock`` with an error (some network and FUSE ones), nothing is locked."""

    NAME = ".m2flow.lock"
    _held: ClassVar[dict[str, list]] = {}  # real path -> [its open lock file, holds]

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.key = os.path.realpath(self.folder)
        self.holding = False

    def acquire(self) -> DirectoryLock:
        if self.holding:
            return self
        held = self._held.get(self.key)
        if held is None:
            f = open(Path(self.key) / self.NAME, "a+")
            try:
                self._lock(f)
            except BaseException:
                f.close()
                raise
            held = self._held[self.key] = [f, 0]
        held[1] += 1
        self.holding = True
        return self

    @staticmethod
    def _lock(f: IO[str]) -> None:
        """The flock on ``f``, and this process named in it; ``DirectoryBusy`` if another holds it."""
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise DirectoryBusy(f.read().strip() or "a process") from None
        except OSError:  # no flock on this file system
            pass
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()

    @classmethod
    def holder(cls, folder: str | Path) -> str | None:
        """Who holds ``folder`` (the lock file's words), or None where no process does; the lock
        file is left as it is."""
        key = os.path.realpath(folder)
        path = Path(key) / cls.NAME
        if key in cls._held:
            return f"pid {os.getpid()} (this process)"
        if not path.exists():
            return None
        with open(path) as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return f.read().strip() or "a process"
            except OSError:  # no flock on this file system: nothing to tell by
                return None
        return None  # taken and let go at once (closing the file)

    def release(self) -> None:
        """Lets go of this hold (again: nothing); the last in the process closes the file."""
        if not self.holding:
            return
        self.holding = False
        held = self._held[self.key]
        held[1] -= 1
        if held[1] == 0:
            del self._held[self.key]
            held[0].close()  # which lets go of the flock

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()
