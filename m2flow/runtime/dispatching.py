"""How a group call reaches its ranks: ``@dispatch`` declares it on a worker method; a
call's arguments are split across the called ranks and their results gathered. ``@routes``
declares where the data a call makes goes: one part to each rank that reads it, over a
channel."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Sequence
from typing import Any, Callable

import numpy as np
import ray

from m2flow.runtime.payload import tensor_type
from m2flow.runtime.worker import CALLS_GROUP, IO_GROUP

# Arguments sent to several ranks above this size go through the object store once.
_SHARE_BYTES = 100 * 1024


def dispatch(split: str = "all", gather: str = "list", immediate: bool = False, concurrent: bool = False) -> Callable:
    """Declares how a group call splits its inputs across ranks and gathers outputs.

    split: ``"all"`` (every rank gets the same arguments), ``"scatter"`` (tensors, arrays,
    lists and dicts of them are cut into one contiguous chunk per rank along the first
    dimension; other arguments go to every rank) or ``"per_rank"`` (each argument is a
    sequence with one entry per rank).
    gather: ``"list"`` (one result per rank), ``"concat"`` (results joined in rank
    order) or ``"first"`` (the first called rank's result).
    immediate: the method runs on the worker's IO threads, at once, even while a long call
    of the worker's is in progress (it must be quick and share state with the main thread
    only through what is thread-safe).
    concurrent: the method runs on the worker's call threads, up to its class's
    ``CALL_THREADS`` calls at once (calls that wait on something of their own: a tool); it
    must be thread-safe.
    """
    if split not in ("all", "scatter", "per_rank"):
        raise ValueError(f"unknown split {split!r}")
    if gather not in ("list", "concat", "first"):
        raise ValueError(f"unknown gather {gather!r}")

    def mark(fn: Callable) -> Callable:
        fn._m2flow_dispatch = (split, gather)
        fn._m2flow_concurrent = concurrent
        if immediate or concurrent:
            return ray.method(concurrency_group=IO_GROUP if immediate else CALLS_GROUP)(fn)
        return fn

    return mark


# -- split and gather ---------------------------------------------------------------
def _split(args: tuple, kwargs: dict, n: int, mode: str) -> list[tuple[tuple, dict]]:
    if mode == "all":
        if n > 1:  # one copy in the object store instead of one per rank
            args = tuple(_share(a) for a in args)
            kwargs = {k: _share(v) for k, v in kwargs.items()}
        return [(args, kwargs)] * n
    if mode == "per_rank":
        for v in (*args, *kwargs.values()):
            if not isinstance(v, Sequence) or len(v) != n:
                raise ValueError(f"per_rank dispatch needs one entry per called rank ({n}), got {type(v).__name__}")
        return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}) for i in range(n)]
    chunks_a = [_chunks(a, n) for a in args]
    chunks_k = {k: _chunks(v, n) for k, v in kwargs.items()}
    return [(tuple(c[i] for c in chunks_a), {k: c[i] for k, c in chunks_k.items()}) for i in range(n)]


def _share(value: Any) -> Any:
    nbytes = value.nbytes if isinstance(value, (tensor_type(), np.ndarray)) else 0
    return ray.put(value) if nbytes > _SHARE_BYTES else value


def _chunks(value: Any, n: int) -> list:
    if isinstance(value, tensor_type()):
        return list(value.tensor_split(n))
    if isinstance(value, np.ndarray):
        return np.array_split(value, n)
    if isinstance(value, (list, tuple)):
        bounds = np.linspace(0, len(value), n + 1).round().astype(int)
        return [value[bounds[i] : bounds[i + 1]] for i in range(n)]
    if isinstance(value, dict):
        per_key = {k: _chunks(v, n) for k, v in value.items()}
        return [{k: c[i] for k, c in per_key.items()} for i in range(n)]
    return [value] * n


def _gather(results: list, mode: str) -> Any:
    if mode == "list":
        return results
    if mode == "first":
        return results[0]
    first = results[0]
    if isinstance(first, tensor_type()):
        return sys.modules["torch"].cat(results)
    if isinstance(first, np.ndarray):
        return np.concatenate(results)
    if isinstance(first, (list, tuple)):
        return type(first)(x for r in results for x in r)
    if isinstance(first, dict):
        return {k: _gather([r[k] for r in results], "concat") for k in first}
    raise TypeError(f"cannot concatenate results of type {type(first).__name__}")


# -- a call's data, routed over a channel to the ranks that read it ---------------------------
def routes(channel: str, key: str, split: Callable[[Any, Any], Sequence[tuple[Any, float]]]) -> Callable:
    """Declares where a worker method's data goes. The method returns ``(report, data)``;
    ``split(worker, data)`` cuts ``data`` into one ``(part, weight)`` per reader rank, and part
    r goes onto the method's ``Channel`` argument named ``channel`` under the key ``(k, r)``,
    ``k`` the value of its argument named ``key`` (its stream's), with that weight. Then the
    channel is flushed and the call returns the report. Reader rank r takes its parts with
    ``routed``."""

    def mark(fn: Callable) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            report, data = fn(self, *args, **kwargs)
            given = signature.bind(self, *args, **kwargs)
            given.apply_defaults()
            out, k = given.arguments[channel], given.arguments[key]
            for rank, (part, weight) in enumerate(split(self, data)):
                out.put(part, key=(k, rank), weight=weight)
            out.flush()
            return report

        return call

    return mark


def routed(channel: Any, key: Any, rank: int, count: int) -> list:
    """The ``count`` parts a ``routes`` method put on ``channel`` for reader rank ``rank`` under
    the key ``key`` (a stream's), in the order they arrive."""
    return [channel.get(key=(key, rank)) for _ in range(count)]
