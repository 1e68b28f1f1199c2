"""Split a payload into a tensor-free skeleton and its tensors, and put it back together.

Transports move the tensors (shared memory, NCCL, object store) and pickle only the
skeleton, which is small and cheap. Containers walked: dict, list, tuple, namedtuple and
dataclass instances; every other leaf stays in the skeleton as is.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from functools import cache
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


class _Slot(int):
    """Where a tensor was: its index in the tensor list (a subclass, so plain int leaves stay ints)."""

    __slots__ = ()


class _Node(NamedTuple):
    """A namedtuple, dataclass or dict/list/tuple subclass; plain containers stay plain."""

    cls: Any  # the class; for a dict subclass an empty copy, which keeps e.g. a defaultdict's factory
    keys: tuple  # dataclass field names or dict keys; () for sequences
    children: tuple


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def flatten(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """Returns (skeleton, tensors). A tensor seen twice is listed once, so aliasing survives."""
    tensors: list[torch.Tensor] = []
    return _strip(obj, tensors, {}, tensor_type()), tensors


class _NoTensor:
    """The tensor type where torch is not imported: nothing is an instance of it."""


def tensor_type() -> type:
    """``torch.Tensor``, or where torch was never imported (a process that handles no tensors
    starts without it) a type nothing is an instance of."""
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else _NoTensor


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Rebuilds what `flatten` took apart, with `tensors` in place of the originals."""
    return _fill(skeleton, tensors)


# Module-level recursion, not nested closures: a closure that calls itself is a reference
# cycle, which would keep the tensors alive until the garbage collector happens to run.
def _strip(x: Any, tensors: list[torch.Tensor], seen: dict[int, _Slot], tensor: type) -> Any:
    t = type(x)
    # Exact-type checks first: they are the common case and much cheaper than isinstance.
    if t is tensor or isinstance(x, tensor):
        slot = seen.get(id(x))
        if slot is None:
            slot = seen[id(x)] = _Slot(len(tensors))
            tensors.append(x)
        return slot
    if t is dict:
        return {k: _strip(v, tensors, seen, tensor) for k, v in x.items()}
    if t is list:
        return [_strip(v, tensors, seen, tensor) for v in x]
    if t is tuple:
        return tuple([_strip(v, tensors, seen, tensor) for v in x])
    if hasattr(t, "__dataclass_fields__"):
        names = _field_names(t)
        return _Node(t, names, tuple([_strip(getattr(x, n), tensors, seen, tensor) for n in names]))
    if isinstance(x, dict):
        empty = copy.copy(x)
        empty.clear()
        return _Node(empty, tuple(x), tuple([_strip(v, tensors, seen, tensor) for v in x.values()]))
    if isinstance(x, (list, tuple)):
        return _Node(t, (), tuple([_strip(v, tensors, seen, tensor) for v in x]))
    return x


def _fill(x: Any, tensors: list[torch.Tensor]) -> Any:
    t = type(x)
    if t is _Slot:
        return tensors[x]
    if t is dict:
        return {k: _fill(v, tensors) for k, v in x.items()}
    if t is list:
        return [_fill(v, tensors) for v in x]
    if t is tuple:
        return tuple([_fill(v, tensors) for v in x])
    if t is _Node:
        return _build(x.cls, x.keys, [_fill(v, tensors) for v in x.children])
    return x


def _build(cls: Any, keys: tuple, values: list) -> Any:
    if isinstance(cls, dict):
        out = copy.copy(cls)
        for k, v in zip(keys, values):
            out[k] = v  # item by item: update() means something else to e.g. Counter
        return out
    if hasattr(cls, "__dataclass_fields__"):
        # Like pickle: no __init__/__post_init__ rerun, and frozen or init=False fields are set too.
        obj = cls.__new__(cls)
        for k, v in zip(keys, values):
            object.__setattr__(obj, k, v)
        return obj
    if hasattr(cls, "_fields"):  # namedtuple
        return cls._make(values)
    return cls(values)


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)
