"""Spans in the Chrome trace-event format, to open in Perfetto (ui.perfetto.dev) or chrome://tracing.

Every process keeps its spans in memory; whoever collects them (a worker group, the driver)
calls ``drain()`` and writes all processes' events into one file with ``write_chrome_trace``.
Timestamps are wall-clock microseconds since the epoch, so spans from different processes on
one machine line up on the same timeline.

Categories used by the runtime: "call" (worker method calls), "send", "recv", "lock" (device
lock waits and holds), "channel".
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable

# (name, cat, ts_us, dur_us, tid, args): tuples are cheaper to build than dicts on the hot path;
# drain() turns them into trace events.
_Record = tuple[str, str, float, float, int, dict[str, Any]]


class _Span:
    __slots__ = ("tracer", "name", "cat", "args", "start_ns")

    def __init__(self, tracer: Tracer, name: str, cat: str, args: dict[str, Any]) -> None:
        self.tracer, self.name, self.cat, self.args = tracer, name, cat, args

    def __enter__(self) -> dict[str, Any]:
        self.start_ns = time.time_ns()
        return self.args

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        end_ns = time.time_ns()
        if exc_type is not None:
            # A span that ended in an exception is otherwise indistinguishable from a normal one.
            self.args["error"] = exc_type.__name__
        self.tracer._add(self.name, self.cat, self.start_ns / 1000, (end_ns - self.start_ns) / 1000, self.args)


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> dict[str, Any]:
        return {}  # callers may still write args into it

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_SPAN = _NullSpan()


class Tracer:
    """Thread-safe in-memory buffer of complete ("X") trace events for one process."""

    def __init__(self, process_name: str, enabled: bool = True, max_events: int = 100_000) -> None:
        self.process_name = process_name
        self.enabled = enabled
        self._lock = threading.Lock()
        # Bounded so that a long run nobody drains keeps only its latest events instead of growing.
        self._records: deque[_Record] = deque(maxlen=max_events)
        self._thread_names: dict[int, str] = {}

    def span(self, name: str, cat: str = "call", **args: Any) -> _Span | _NullSpan:
        """``with tracer.span("generate", batch=8) as a: ...; a["tokens"] = n`` records one span."""
        if not self.enabled:
            return _NULL_SPAN
        return _Span(self, name, cat, args)

    def record(self, name: str, start_s: float, end_s: float, cat: str = "call", **args: Any) -> None:
        """Record a span measured elsewhere; ``start_s``/``end_s`` come from ``time.time()``."""
        if self.enabled:
            self._add(name, cat, start_s * 1e6, (end_s - start_s) * 1e6, args)

    def _add(self, name: str, cat: str, ts_us: float, dur_us: float, args: dict[str, Any]) -> None:
        tid = threading.get_native_id()
        with self._lock:
            if tid not in self._thread_names:
                self._thread_names[tid] = threading.current_thread().name
            self._records.append((name, cat, ts_us, dur_us, tid, args))

    def drain(self) -> list[dict[str, Any]]:
        """Return and forget the recorded events, preceded by process and thread name metadata."""
        with self._lock:
            records, self._records = self._records, deque(maxlen=self._records.maxlen)
            thread_names = dict(self._thread_names)
        if not records:
            return []
        # getpid() here rather than at construction: a forked child reports its own pid.
        pid = os.getpid()
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": self.process_name}}
        ]
        # Metadata is repeated in every non-empty drain so that each drained batch is a
        # self-contained trace; duplicate metadata events are harmless to the viewers.
        events += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread_names[tid]}}
            for tid in sorted({r[4] for r in records})
        ]
        events += [
            {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}
            for name, cat, ts, dur, tid, args in records
        ]
        return events


# On by default, keeping the latest 100k spans per process (tens of MB at most);
# M2FLOW_TRACE=0 turns it off.
_tracer = Tracer(Path(sys.argv[0]).stem or "python", enabled=os.environ.get("M2FLOW_TRACE", "1") != "0")


def get_tracer() -> Tracer:
    """The tracer of this process, shared by all runtime code in it."""
    return _tracer


def set_process_name(name: str) -> None:
    """Name this process in traces (e.g. "rollout:0"); applies to events not yet drained."""
    _tracer.process_name = name


def write_chrome_trace(path: str | os.PathLike[str], events: Iterable[dict[str, Any]]) -> Path:
    """Write events (from any number of processes' ``drain()``) as one Chrome trace JSON file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        # default=str: span args come from callers and may hold numpy scalars, paths, dtypes.
        json.dump({"traceEvents": list(events), "displayTimeUnit": "ms"}, f, default=str)
    return path
