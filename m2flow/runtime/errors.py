"""What a failed group call raises, and what tells a worker's death from its error.

``WorkerError`` is a rank's call that failed: the group, the rank, the method, and the last
frames of the code it ran (``own_frames``); ``WorkerDiedError`` is a rank whose process died,
in a line (``death_reason``) where Ray's report runs to a page.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, OutOfMemoryError, RayActorError, RayTaskError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray's memory monitor kills a worker when the node runs low on memory: a death, told as OutOfMemoryError.
_DIED = (ActorDiedError, ActorUnavailableError, RayActorError, OutOfMemoryError)


class WorkerError(RuntimeError):
    """A rank's call failed. Its message is one paragraph: the group, the rank, the method,
    the exception and the last frames of the code it ran (not Ray's); ``traceback`` holds
    the whole remote traceback (a run writes it to its ``log.txt``)."""

    def __init__(self, group: str, rank: int, method: str, detail: str, cause: BaseException | None = None,
                 traceback: str = ""):
        super().__init__(f"{group} rank {rank} failed in {method}(): {detail}")
        self.group, self.rank, self.method, self.cause = group, rank, method, cause
        self.traceback = traceback or detail


class WorkerDiedError(WorkerError):
    pass


class PeerDiedError(RuntimeError):
    """A worker's direct call to another group's rank (``runtime.peers``) found that rank's
    process dead: a group call that fails with it is that rank's death (``WorkerDiedError``
    naming it), which a run answers with a restart, as any death."""

    def __init__(self, group: str, rank: int, method: str, reason: str):
        super().__init__(f"{group} rank {rank} died under a call of {method}(): {reason}")
        self.group, self.rank, self.method, self.reason = group, rank, method, reason

    def __reduce__(self):  # raised in a worker, read in the driver
        return PeerDiedError, (self.group, self.rank, self.method, self.reason)


def death_reason(e: BaseException) -> str:
    """Ray's error for a worker's death, in a line where it runs to a page (the memory
    monitor's report: object store statistics, the processes it considered)."""
    text = _ANSI.sub("", str(e)).strip()
    if isinstance(e, OutOfMemoryError):
        used = re.search(r"was (\S+ used / \S+ limit)", text)
        reason = re.search(r"OOM kill reason: (.+)", text)
        # The monitor kills the newest calls first, not the largest process: name that one too.
        top = re.search(r"Top \d+ memory users:.*\n(\d+)\s+([\d.]+)\s+(\S+)", text)
        largest = f"; the largest process then: {top[3]} (pid {top[1]}, {top[2]} GB)" if top else ""
        return ("Ray's memory monitor killed it, the node running low on memory ("
                + "; ".join(m.group(1).strip() for m in (used, reason) if m) + f"{largest}): give the run more "
                "memory, or its components less (fewer envs or rows per process)")
    return text


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
# Frames of these files are the machinery a call passes through, not the code it ran: Ray's
# package and the standard library's executors (any directory named ray, e.g. the home of
# Ray's own images, /home/ray, holds code of the user's).
_MACHINERY = re.compile(r"[/\\](site|dist)-packages[/\\]ray[/\\]|[/\\]python3(\.\d+)?[/\\](concurrent|asyncio)[/\\]"
                        r"|[/\\]python3(\.\d+)?[/\\]threading\.py$|^<")


def own_frames(traceback: str, last: int = 3) -> list[str]:
    """The ``last`` frames of a traceback's text outside Ray and the standard library's
    executors, as ``file:line in function: code``."""
    lines = traceback.splitlines()
    frames = []
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m is None or _MACHINERY.search(m["file"]):
            continue
        code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
        rel = os.path.relpath(m["file"])
        path = m["file"] if rel.startswith("..") else rel
        frames.append(f"{path}:{m['line']} in {m['func']}" + (f": {code}" if code else ""))
    return frames[-last:]


def _death_among(refs: list, grace_s: float) -> tuple[Any, BaseException] | None:
    """The first of the calls ``refs`` whose worker process died, with Ray's error, given
    ``grace_s`` seconds to show it; None when none did by then (those that finish otherwise
    are passed over)."""
    deadline = time.monotonic() + grace_s
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        try:
            ray.get(ready[0])
        except RayTaskError:  # the call's own error (checked first: it may also be an instance of _DIED)
            continue
        except _DIED as e:
            return ready[0], e
        except Exception:  # noqa: BLE001 -- any other outcome is not a death
            continue
    return None
