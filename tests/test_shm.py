import gc
import multiprocessing as mp
import os
import pickle
import threading
import uuid

import pytest
import torch

from m2flow.runtime import shm


@pytest.fixture
def prefix():
    p = f"m2flow-test-{uuid.uuid4().hex[:8]}"
    yield p
    shm.cleanup(p)


@pytest.fixture
def segments(prefix):
    with shm.ShmPool(prefix) as p:
        yield p


def files(prefix: str) -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix + "-")}


def flags(ref: shm.ShmRef) -> bytes:
    with open(os.path.join(shm.SHM_DIR, ref.segment), "rb") as f:
        return f.read(ref.readers)


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    return torch.randint(0, 100, shape, dtype=dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 5)]


def test_round_trip_of_dtypes_and_shapes(segments):
    tensors = [sample(d, s) for d in DTYPES for s in SHAPES]
    ref = segments.write(tensors)
    assert all(off % shm.ALIGN == 0 and off >= shm.HEADER for off, _, _ in ref.tensors)
    out = shm.open_tensors(pickle.loads(pickle.dumps(ref)))
    for a, b in zip(tensors, out, strict=True):
        assert (b.dtype, b.shape) == (a.dtype, a.shape) and torch.equal(a, b)


def test_non_contiguous_and_grad_inputs(segments):
    base = torch.randn(6, 8)
    tensors = [base.t(), base[:, ::3], torch.randn(1, 4).expand(5, 4), base[2],
               torch.randn(3, requires_grad=True), torch.randn(4, 4).to(torch.bfloat16).t()]
    out = shm.open_tensors(segments.write(tensors))
    for a, b in zip(tensors, out, strict=True):
        assert b.is_contiguous() and not b.requires_grad and torch.equal(a.detach(), b)


def test_outputs_are_views_of_one_mapping_each_with_its_own_storage(segments):
    out = shm.open_tensors(segments.write([torch.ones(1000), torch.zeros(10)]))
    # Its own storage: pickling or torch.save of one tensor must not drag the whole segment.
    assert out[0].untyped_storage().nbytes() == 4000


def test_receiver_writes_stay_private(segments):
    ref = segments.write([torch.arange(1000.0)], readers=2)
    (mine,) = shm.open_tensors(ref, reader=0)
    mine += 1
    (theirs,) = shm.open_tensors(ref, reader=1)
    assert torch.equal(theirs, torch.arange(1000.0))
    del mine, theirs
    # The next message on the same segment shows the sender's data, not the receiver's writes.
    ref2 = segments.write([torch.full((1000,), 7.0)])
    assert ref2.segment == ref.segment
    (again,) = shm.open_tensors(ref2)
    assert torch.equal(again, torch.full((1000,), 7.0))


@pytest.fixture
def no_gc():
    gc.disable()
    yield
    gc.enable()


def test_segment_reused_once_released(segments, no_gc):
    ref = segments.write([torch.randn(100, 100)])
    out = shm.open_tensors(ref)
    assert flags(ref) == b"\x01"
    del out
    assert flags(ref) == b"\x00"  # at once, by reference counting
    for _ in range(5):
        ref2 = segments.write([torch.randn(100, 100)])
        assert ref2.segment == ref.segment
        shm.open_tensors(ref2)  # dropped at once
    assert len(segments) == 1


def test_no_reuse_while_a_view_is_alive(segments):
    ref = segments.write([torch.randn(64, 64), torch.randn(5)])
    out = shm.open_tensors(ref)
    view = out[0][3:].reshape(-1)[::2]  # a view of a view
    del out
    gc.collect()
    busy = segments.write([torch.randn(10)])
    assert busy.segment != ref.segment and len(segments) == 2
    shm.open_tensors(busy)
    del view
    assert flags(ref) == b"\x00"
    assert segments.write([torch.randn(10)]).segment in {ref.segment, busy.segment}
    assert len(segments) == 2


def test_broadcast_segment_waits_for_every_reader(segments):
    ref = segments.write([torch.ones(10)], readers=3)
    for reader in (0, 2):
        shm.open_tensors(ref, reader)
    assert flags(ref) == b"\x00\x01\x00"
    assert segments.write([torch.ones(10)]).segment != ref.segment
    shm.open_tensors(ref, 1)
    assert flags(ref) == b"\x00\x00\x00"


def test_empty_message(segments):
    ref = segments.write([])
    assert shm.open_tensors(ref) == []
    assert segments.write([]).segment == ref.segment


def test_small_message_does_not_pin_a_big_segment(segments):
    big = segments.write([torch.zeros(3 << 20)])  # 12 MiB -> a 16 MiB segment
    shm.open_tensors(big)
    small = segments.write([torch.zeros(10)])
    assert small.segment != big.segment
    shm.open_tensors(small)
    assert segments.write([torch.zeros(2 << 20)]).segment == big.segment  # 8 MiB fits the 16 MiB one


def test_max_bytes_unlinks_free_segments_first(prefix):
    with shm.ShmPool(prefix, max_bytes=3 << 20) as segments:
        held = shm.open_tensors(segments.write([torch.zeros(10)]))  # 1 MiB, busy
        free = segments.write([torch.zeros(10)])  # another 1 MiB
        shm.open_tensors(free)
        big = segments.write([torch.zeros(1 << 19)])  # 2 MiB + header -> 4 MiB: over budget
        assert free.segment not in files(prefix)
        assert len(segments) == 2 and segments.nbytes == 5 << 20  # a busy segment is never reclaimed
        del held, big


def test_readers_validated(segments):
    with pytest.raises(ValueError):
        segments.write([torch.ones(1)], readers=0)
    ref = segments.write([torch.ones(1)], readers=2)
    with pytest.raises(ValueError):
        shm.open_tensors(ref, reader=2)


def test_concurrent_writers(segments):
    errors = []

    def work(seed: int):
        for i in range(20):
            t = torch.full((1000,), float(seed * 100 + i))
            (back,) = shm.open_tensors(segments.write([t]))
            if not torch.equal(back, t):
                errors.append((seed, i))

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(segments) <= 8  # each thread holds at most two messages at once


def _expected() -> torch.Tensor:
    # Rebuilt in the child rather than sent: a tensor argument would travel through
    # torch's own shared-memory pickling, a second mechanism this test does not need.
    return torch.arange(90_000.0).view(300, 300).sin()


def _child_reads(ref: shm.ShmRef) -> None:
    (t,) = shm.open_tensors(ref, reader=1)
    assert torch.equal(t, _expected())
    t.mul_(-1)  # private to this process
    del t  # a process ends without running finalizers: release explicitly by dropping


def test_cross_process(segments):
    data = _expected()
    ref = segments.write([data], readers=2)
    (mine,) = shm.open_tensors(ref, reader=0)
    child = mp.get_context("spawn").Process(target=_child_reads, args=(ref,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0, "the child failed: see its traceback in the captured stderr"
    assert torch.equal(mine, data)
    assert flags(ref) == b"\x01\x00"  # the child released its slot
    del mine
    assert segments.write([data]).segment == ref.segment


def test_close_and_cleanup_remove_files(prefix):
    segments = shm.ShmPool(prefix)
    free = segments.write([torch.ones(10)])
    shm.open_tensors(free)
    busy = segments.write([torch.ones(10)])
    segments.close()
    assert files(prefix) == {busy.segment}  # a receiver may still open it
    (t,) = shm.open_tensors(busy)
    assert torch.equal(t, torch.ones(10))
    with pytest.raises(RuntimeError, match="ShmPool is closed"):
        segments.write([torch.ones(1)])
    assert shm.cleanup(prefix) == [busy.segment]
    assert files(prefix) == set()
    assert torch.equal(t, torch.ones(10))  # an open mapping outlives the unlink


def test_cleanup_leaves_other_prefixes(prefix):
    with shm.ShmPool(prefix + "x") as other, shm.ShmPool(prefix) as segments:
        kept = other.write([torch.ones(1)])
        segments.write([torch.ones(1)])
        shm.cleanup(prefix)
        assert files(prefix + "x") == {kept.segment}
        shm.cleanup(prefix + "x")


def test_missing_segment_is_a_clear_error(segments, prefix):
    ref = segments.write([torch.ones(10)], readers=2)
    shm.open_tensors(ref, reader=0)  # leaves an fd on it in this process's cache
    never_opened = segments.write([torch.ones(10)])
    shm.cleanup(prefix)
    for r in (ref, never_opened):
        with pytest.raises(FileNotFoundError, match=r.segment):
            shm.open_tensors(r, reader=r.readers - 1)


_MEMBER = """
import os, sys, time, torch
from m2flow.runtime import shm
prefix = sys.argv[1]
shm.hold(prefix)
if sys.argv[2] == "write":
    ref = shm.ShmPool(prefix).write([torch.ones(10)])
    os.mkfifo(os.path.join(shm.SHM_DIR, f"{prefix}-pipe-{os.getpid()}"), 0o600)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_session_whose_processes_were_killed_leaves_nothing_once_another_starts(prefix):
    """Two processes of a session (one wrote a segment and made its pipe) killed with
    SIGKILL, as when the driver is: their files stay while either lives, and the next sweep
    (each process's start) removes them and the session's marker."""
    import signal
    import subprocess
    import sys

    members = [subprocess.Popen([sys.executable, "-c", _MEMBER, prefix, role], stdout=subprocess.PIPE, text=True)
               for role in ("write", "join")]
    try:
        for m in members:
            assert m.stdout.readline().strip() == "ready"
        left = files(prefix) | ({prefix + shm.MARKER} & set(os.listdir(shm.SHM_DIR)))
        assert left == {f"{prefix}-{members[0].pid}-0", f"{prefix}-pipe-{members[0].pid}", prefix + shm.MARKER}, left
        assert not [n for n in shm.sweep() if n.startswith(prefix)]  # both live
        members[0].send_signal(signal.SIGKILL)
        members[0].wait()
        assert not [n for n in shm.sweep() if n.startswith(prefix)] and files(prefix)  # one lives: its session too
        members[1].send_signal(signal.SIGKILL)
        members[1].wait()
        assert sorted(n for n in shm.sweep() if n.startswith(prefix)) == sorted(left - {prefix + shm.MARKER})
        assert not files(prefix) and not os.path.exists(os.path.join(shm.SHM_DIR, prefix + shm.MARKER))
    finally:
        for m in members:
            m.kill()
            m.wait()
    shm.hold(prefix)  # this process's own session: never swept while it holds it, gone with its last
    assert prefix + shm.MARKER in os.listdir(shm.SHM_DIR) and not [n for n in shm.sweep() if n.startswith(prefix)]
    shm.release(prefix)
    assert prefix + shm.MARKER not in os.listdir(shm.SHM_DIR)
