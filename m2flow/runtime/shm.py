"""Same-node tensor transport through shared-memory files in /dev/shm.

Page faults, not copies, dominate here: first touch of fresh memory costs 1-13 us per 4 KiB
page, so a fresh 100 MB buffer costs far more than a 100 MB memcpy. Hence:

- the sender (`ShmPool`) keeps its segments mapped and reuses them, so a write into a
  reused segment is one memcpy per tensor into pages that are already there;
- a receiver (`open_tensors`) maps the segment copy-on-write (MAP_PRIVATE) and returns
  zero-copy views; reading an existing file is cheap thanks to kernel fault-around, and a
  receiver that writes into its tensors gets private pages, invisible to anyone else.

Segment layout: a HEADER-byte header whose byte i is reader i's "still in use" flag, then
the tensors, each at a 64-byte aligned offset. The sender sets the flags; each receiver
clears its own with `os.pwrite` once all its tensors are garbage-collected (writes through
a private mapping never reach the file). A segment with no flag set may be rewritten.
"""

from __future__ import annotations

import fcntl
import itertools
import mmap
import os
import re
import threading
import weakref
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

import numpy as np

from m2flow.runtime.names import shm_prefix

if TYPE_CHECKING:  # imported where tensors are handled: a process that only names segments (the
    import torch  # cluster's sweep, a worker that sends none) starts without it

SHM_DIR = "/dev/shm"
HEADER = 4096  # one page: the data starts page-aligned
ALIGN = 64
MIN_SEGMENT = 1 << 20
MAX_READERS = HEADER
# Names stay unique per process even with several pools, so a receiver's cached fd
# can never silently point at a different segment of the same name.
_counter = itertools.count()


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where a message lies: small and picklable, it travels in place of the tensors."""

    segment: str
    tensors: tuple[tuple[int, str, tuple[int, ...]], ...]  # (offset, dtype name, shape)
    readers: int
    size: int  # bytes to map: header + data


@dataclass(slots=True)
class _Segment:
    name: str
    size: int
    mm: mmap.mmap  # MAP_SHARED: flags written by receivers show up here
    readers: int = 0  # flags set by the last write

    def free(self) -> bool:
        return self.mm.find(b"\x01", 0, self.readers) < 0

    def unlink(self) -> None:
        _unlink(self.name)
        self.mm.close()


class ShmPool:
    """A process's shared-memory segments, reused across messages. Thread-safe.

    `max_bytes` bounds the pool softly: above it, free segments are unlinked before a new one
    is created, but segments still held by receivers cannot be reclaimed.
    """

    def __init__(self, prefix: str, max_bytes: int | None = None):
        if "/" in prefix:
            raise ValueError(f"prefix must not contain '/': {prefix!r}")
        self.prefix = prefix
        self.max_bytes = max_bytes
        self._segments: dict[str, _Segment] = {}  # least recently used first
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self._segments)

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in list(self._segments.values()))  # list(): atomic vs. writers

    def write(self, tensors: list[torch.Tensor], readers: int = 1) -> ShmRef:
        """Packs `tensors` into one segment that `readers` receivers may each open once."""
        if not 1 <= readers <= MAX_READERS:
            raise ValueError(f"readers must be in 1..{MAX_READERS}, got {readers}")
        layout, end = [], HEADER
        for t in tensors:
            end = -(-end // ALIGN) * ALIGN
            layout.append((end, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
            end += t.nbytes
        with self._lock:
            if self._closed:
                raise RuntimeError("ShmPool is closed")
            seg = self._acquire(end)
            seg.mm[:readers] = b"\x01" * readers
            seg.readers = readers
        # Outside the lock: the flags make this segment ours, so writers run in parallel.
        for t, where in zip(tensors, layout):
            # copy_ also packs a non-contiguous tensor, in the same single pass.
            _view(seg.mm, *where).copy_(t.detach())
        return ShmRef(seg.name, tuple(layout), readers, end)

    def _acquire(self, needed: int) -> _Segment:
        # A big segment may carry a small message, but not one far too small for it:
        # it would stay pinned while a receiver holds that message.
        limit = 4 * max(needed, MIN_SEGMENT)
        fits = [s for s in self._segments.values() if needed <= s.size <= limit and s.free()]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self._segments[seg.name] = self._segments.pop(seg.name)  # most recently used
            return seg
        size = max(MIN_SEGMENT, 1 << (needed - 1).bit_length())
        if self.max_bytes is not None:
            total = self.nbytes
            for seg in [s for s in self._segments.values() if s.free()]:
                if total + size <= self.max_bytes:
                    break
                del self._segments[seg.name]
                seg.unlink()
                total -= seg.size
        seg = self._create(size)
        self._segments[seg.name] = seg
        return seg

    def _create(self, size: int) -> _Segment:
        while True:
            name = f"{self.prefix}-{os.getpid()}-{next(_counter)}"
            try:
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:  # left over by a dead process that had our pid
                continue
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return _Segment(name, size, mm)

    def close(self) -> None:
        """Unlinks the free segments; busy ones stay for their receivers (see `cleanup`)."""
        with self._lock:
            self._closed = True
            for seg in self._segments.values():
                if seg.free():
                    seg.unlink()
                else:
                    seg.mm.close()
            self._segments.clear()

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- this process's pool ------------------------------------------------------------
_POOL: ShmPool | None = None
_POOL_LOCK = threading.Lock()


def process_pool() -> ShmPool:
    """This process's shared-memory pool; its segments are named after the session so
    that the cluster can remove leftovers of crashed processes."""
    global _POOL
    prefix = shm_prefix(os.environ.get("M2FLOW_SESSION", "default"))
    with _POOL_LOCK:
        if _POOL is None or _POOL.prefix != prefix:  # a driver may run one cluster after another
            if _POOL is not None:
                _POOL.close()
            _POOL = ShmPool(prefix)
        return _POOL


def close_process_pool() -> None:
    """Closes this process's pool (its communicator's close)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None:
            _POOL.close()
            _POOL = None  # a process re-initialised for another rank (``WorkerPool``) makes a new one


# A session's files on a node (segments, pipes: ``<prefix>-...``) outlive a process killed
# with SIGKILL (the driver too: then nobody removes them, and tmpfs holds them in memory until
# a reboot). Every process of a session on a node holds a shared lock on its marker file
# ``<prefix>.alive``; a lock goes with its process however that ends. Where nobody holds a
# marker any more, ``sweep`` (at each process's start) removes that session's files.
MARKER = ".alive"
_held: dict[str, int] = {}  # prefix -> the marker fd this process holds its lock with
_held_lock = threading.Lock()


def hold(prefix: str) -> None:
    """This process takes part in session ``prefix`` on its node until it exits (or
    ``release``): ``sweep`` leaves the session's files alone meanwhile."""
    with _held_lock:
        if prefix in _held:
            return
        marker = os.path.join(SHM_DIR, prefix + MARKER)
        while True:
            try:
                fd = os.open(marker, os.O_RDONLY)
            except FileNotFoundError:  # the first of the session here: a marker locked before it is seen
                fresh = f"{marker}.{os.getpid()}"
                fd = os.open(fresh, os.O_RDONLY | os.O_CREAT, 0o600)
                fcntl.flock(fd, fcntl.LOCK_SH)
                try:
                    os.link(fresh, marker)
                except FileExistsError:  # another was first: take its
                    os.close(fd)
                    continue
                finally:
                    os.unlink(fresh)
                break
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.stat(marker).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # swept between the open and the lock: a new one
        _held[prefix] = fd


def release(prefix: str) -> None:
    """This process leaves session ``prefix`` (its files removed, say); the marker goes with
    the last to leave."""
    with _held_lock:
        fd = _held.pop(prefix, None)
    if fd is not None:
        os.close(fd)
        _sweep(prefix)


def sweep() -> list[str]:
    """Removes the files of every session on this node whose processes have all ended
    (none holds its marker); returns their names."""
    with _held_lock:
        mine = set(_held)
    removed = []
    for name in os.listdir(SHM_DIR):
        if name.startswith("m2flow-") and name.endswith(MARKER) and name[:-len(MARKER)] not in mine:
            removed += _sweep(name[:-len(MARKER)])
    return removed


def _sweep(prefix: str) -> list[str]:
    marker = os.path.join(SHM_DIR, prefix + MARKER)
    try:
        fd = os.open(marker, os.O_RDONLY)
    except FileNotFoundError:
        return []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a process of the session lives
            return []
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-")]
        for name in names:
            _unlink(name)
        _unlink(prefix + MARKER)
        return names
    finally:
        os.close(fd)


def cleanup(prefix: str) -> list[str]:
    """Unlinks every segment any pool with this prefix made; returns their names."""
    pattern = re.compile(rf"{re.escape(prefix)}-\d+-\d+")
    names = [n for n in os.listdir(SHM_DIR) if pattern.fullmatch(n)]
    for name in names:
        _unlink(name)
    return names


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


class _SegmentFile:
    """An fd on a segment, closed when neither the cache nor a live message needs it."""

    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def __del__(self, _close=os.close) -> None:  # bound early: may run at interpreter exit
        _close(self.fd)

    def unlinked(self) -> bool:
        return os.fstat(self.fd).st_nlink == 0


_files: dict[str, _SegmentFile] = {}
_files_lock = threading.Lock()


def _open_file(name: str) -> _SegmentFile:
    with _files_lock:
        f = _files.get(name)
        if f is not None and not f.unlinked():
            return f
        # A miss usually means the sender made a new segment, perhaps after unlinking old
        # ones: drop those, since an open fd would keep their memory alive.
        for stale in [n for n, g in _files.items() if g.unlinked()]:
            del _files[stale]
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory segment {name!r} no longer exists in {SHM_DIR} "
                "(its sender closed or cleaned it up before this receiver opened it)") from None
        f = _files[name] = _SegmentFile(fd)
        return f


def _release(f: _SegmentFile, reader: int) -> None:
    os.pwrite(f.fd, b"\x00", reader)


@cache
def _dtypes(name: str) -> tuple[torch.dtype, np.dtype]:
    """A torch dtype, and the numpy dtype its bytes are mapped as."""
    import torch

    dtype = getattr(torch, name)
    try:
        return dtype, torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # numpy lacks it (bfloat16, float8...): same-size integers, viewed back in torch
        return dtype, np.dtype(f"u{dtype.itemsize}")


def _view(buffer: mmap.mmap | np.ndarray, offset: int, dtype_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor on `buffer`'s memory; it keeps `buffer` alive."""
    import torch

    dtype, np_dtype = _dtypes(dtype_name)
    t = torch.from_numpy(np.ndarray(shape, np_dtype, buffer=buffer, offset=offset))
    return t if t.dtype == dtype else t.view(dtype)


def open_tensors(ref: ShmRef, reader: int = 0) -> list[torch.Tensor]:
    """Zero-copy, copy-on-write views of a message; each reader index opens it once.

    The segment returns to the sender when every returned tensor, and every view of
    them, has been garbage-collected.
    """
    if not 0 <= reader < ref.readers:
        raise ValueError(f"reader must be in 0..{ref.readers - 1}, got {reader}")
    f = _open_file(ref.segment)
    # Mapped afresh for every message (never cached): the sender may have rewritten it since.
    buf = np.frombuffer(mmap.mmap(f.fd, ref.size, access=mmap.ACCESS_COPY), dtype=np.uint8)
    # Every tensor keeps its own numpy array alive, and each array keeps `buf`.
    weakref.finalize(buf, _release, f, reader)
    return [_view(buf, *where) for where in ref.tensors]
