"""A run's directory: one process writes into it at a time (``runtime.files.DirectoryLock``)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from m2flow.runtime.files import DirectoryBusy, DirectoryLock

HOLD = textwrap.dedent("""
    import sys, time
    from m2flow.runtime.files import DirectoryLock
    DirectoryLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(600)
""")


def _try(folder) -> str:
    """Another process's try: 'taken' or the DirectoryBusy message."""
    code = ("import sys\nfrom m2flow.runtime.files import DirectoryBusy, DirectoryLock\n"
            "try:\n    DirectoryLock(sys.argv[1]).acquire(); print('taken')\n"
            "except DirectoryBusy as e:\n    print(f'busy: {e}')")
    return subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def test_one_process_holds_a_directory_and_its_end_lets_go(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        seen = _try(tmp_path)
        assert seen.startswith(f"busy: pid {holder.pid} on ") and " since " in seen, seen
        assert f"busy: {DirectoryLock.holder(tmp_path)}" == seen  # asked without taking it
        with pytest.raises(DirectoryBusy, match=f"^pid {holder.pid} on "):  # this process, too
            DirectoryLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # no clean exit: the kernel lets go all the same
        holder.wait()
    assert _try(tmp_path) == "taken"


def test_holds_nested_in_one_process_share_the_lock_until_the_last_lets_go(tmp_path):
    outer = DirectoryLock(tmp_path).acquire()
    with DirectoryLock(tmp_path / ".." / tmp_path.name) as inner:  # the same directory by another path
        assert inner.holding
    assert _try(tmp_path).startswith(f"busy: pid {os.getpid()} on ")  # the outer hold remains
    assert DirectoryLock.holder(tmp_path) == f"pid {os.getpid()} (this process)"
    outer.release()
    outer.release()  # again: nothing
    assert DirectoryLock.holder(tmp_path) is None
    assert not outer.holding and _try(tmp_path) == "taken"
