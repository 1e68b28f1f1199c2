import dataclasses
import gc
import pickle
import weakref
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from m2flow.runtime.payload import flatten, nbytes, unflatten

Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Batch:
    obs: torch.Tensor
    info: dict
    step: int = 0


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: Any
    derived: int = dataclasses.field(init=False, default=0)

    def __post_init__(self):
        # Rerunning this on rebuild would overwrite the restored field.
        object.__setattr__(self, "derived", self.derived + 1)


@dataclasses.dataclass(slots=True)
class Slotted:
    t: torch.Tensor
    name: str


class Opaque:
    """A leaf that is none of the walked containers."""

    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return type(other) is Opaque and other.v == self.v


def assert_same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


class _NoTensors(pickle.Pickler):
    def reducer_override(self, obj):
        assert not isinstance(obj, torch.Tensor), "skeleton holds a tensor"
        return NotImplemented


def round_trip(obj):
    """flatten -> pickle the skeleton -> unflatten, as a transport does."""
    skeleton, tensors = flatten(obj)
    with open("/dev/null", "wb") as sink:
        _NoTensors(sink).dump(skeleton)
    out = unflatten(pickle.loads(pickle.dumps(skeleton)), tensors)
    assert_same(obj, out)
    return out, tensors


def test_nested_round_trip_keeps_types_order_and_leaves():
    obj = {
        "z": [torch.arange(3), (torch.ones(2, 2), "text", None)],
        "a": Point(torch.zeros(1), 7),
        "m": {"nested": [[torch.tensor(1.5)], {"deep": torch.eye(2)}], "np": np.arange(4)},
        "o": Opaque(3),
        "f": 2.5,
        "size": torch.Size([2, 3]),
        "max": torch.max(torch.arange(6.0).view(2, 3), dim=1),
        1: b"bytes",
    }
    out, tensors = round_trip(obj)
    assert len(tensors) == 7
    assert list(out) == ["z", "a", "m", "o", "f", "size", "max", 1]
    assert out["z"][0] is obj["z"][0]  # tensors are handed back as given, not copied


def test_dataclasses_rebuilt_with_their_class_without_rerunning_init():
    frozen = Frozen(torch.ones(3), {"k": [torch.zeros(2)]})
    assert frozen.derived == 1
    out, tensors = round_trip([Batch(torch.rand(2, 3), {"r": torch.ones(1)}, step=4), frozen])
    assert len(tensors) == 4
    assert out[1].derived == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        out[1].b = None
    round_trip(Slotted(torch.arange(4), "s"))


def test_namedtuple_and_dict_subclasses():
    round_trip(Point(torch.ones(1), Point(2, torch.zeros(2))))
    round_trip(OrderedDict(b=torch.ones(1), a=2))
    dd = defaultdict(list, {"x": [torch.ones(2)]})
    out, _ = round_trip(dd)
    assert out.default_factory is list


def test_bare_tensor_and_tensor_free_payloads():
    t = torch.randn(4, 5)
    skeleton, tensors = flatten(t)
    assert len(tensors) == 1 and tensors[0] is t
    assert unflatten(skeleton, tensors) is t
    for obj in [3, "s", None, [1, (2, {"a": 3})], Point(1, 2)]:
        out, tensors = round_trip(obj)
        assert tensors == []


def test_same_tensor_twice_is_listed_once_and_stays_aliased():
    t = torch.ones(3)
    out, tensors = round_trip({"a": t, "b": [t], "c": torch.ones(3)})
    assert len(tensors) == 2
    assert out["a"] is out["b"][0]


def test_no_reference_cycle_keeps_tensors_alive():
    # Shared-memory segments are reused when their tensors die: that must not wait for gc.
    gc.disable()
    try:
        t = torch.ones(3)
        alive = weakref.ref(t)
        out = unflatten(*flatten({"a": [t], "b": Point(t, 1)}))
        del t, out
        assert alive() is None
    finally:
        gc.enable()


def test_nbytes():
    assert nbytes([torch.zeros(10), torch.zeros(3, dtype=torch.bfloat16), torch.zeros(0)]) == 46
    assert nbytes([]) == 0


_leaves = st.one_of(
    st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False), st.booleans(),
    st.builds(lambda n, dt: torch.randn(n).to(dt), st.integers(0, 5),
              st.sampled_from([torch.float32, torch.int64, torch.bfloat16, torch.bool])),
)
_payloads = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=4),
        st.builds(Point, inner, inner),
        st.builds(Batch, inner, st.dictionaries(st.text(max_size=3), inner, max_size=3)),
        st.builds(Frozen, inner, inner),
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(_payloads)
def test_round_trip_property(obj):
    _, tensors = round_trip(obj)
    assert all(isinstance(t, torch.Tensor) for t in tensors)
