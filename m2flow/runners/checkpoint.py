"""Checkpoint files: one safetensors file per checkpoint, nothing pickled.

A run's state is a tree of dicts, lists and tuples whose leaves are tensors, numpy arrays and
plain values. ``save`` puts every tensor into the safetensors body (numpy arrays as their bytes)
and the tree, with each tensor replaced by its key, as JSON into the file's header metadata
(``"m2flow"``). So a checkpoint opens with ``safetensors`` and ``json`` alone, and loading one
runs no code from it. Writes are atomic: the file is written beside its final name, flushed to
disk and renamed, so a crash mid-write leaves the previous checkpoint as the latest complete one.

Markers in the JSON tree (a dict holding one of these keys is not a plain dict):
``$t``: a tensor (its key in the body); ``$a``: a numpy array (``dtype``, ``shape``; its bytes
in the body); ``$np``: a numpy scalar (``dtype``, ``v``); ``$tuple``: a tuple; ``$dict``: a
dict with keys other than strings, or keys starting with ``$`` (its ``[key, value]`` pairs);
``$bytes``: bytes (base64).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from m2flow.runners.status import CHECKPOINTS
from m2flow.runtime.files import save_tensors

SUFFIX = ".safetensors"
_KEY = "m2flow"
_MARKERS = ("$t", "$a", "$np", "$tuple", "$dict", "$bytes")


class CheckpointError(ValueError):
    """A file that is not a complete m2flow checkpoint, or a state that cannot be stored."""


def save(path: str | Path, state: dict[str, Any]) -> Path:
    """Writes ``state`` to ``path`` atomically (``m2flow.runtime.files.save_tensors``)."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, set(), "state")
    return save_tensors(path, tensors, metadata={_KEY: json.dumps(tree)})


def check(path: str | Path) -> dict[str, Any]:
    """The JSON tree of a complete checkpoint file, its tensors unread (safetensors checks that
    the file holds every byte its header names); ``CheckpointError`` otherwise (truncated,
    another format, or not a checkpoint of this kind)."""
    path = Path(path)
    if path.suffix != SUFFIX:
        raise CheckpointError(f"{path}: not a checkpoint file (*{SUFFIX}; files of other formats are not opened)")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors reports a short or corrupt file in several ways
        raise CheckpointError(f"{path}: incomplete or corrupt checkpoint ({type(e).__name__}: {e})") from None
    if _KEY not in meta:
        raise CheckpointError(f"{path}: a safetensors file, but not an m2flow checkpoint")
    return json.loads(meta[_KEY])


def load(path: str | Path) -> dict[str, Any]:
    """The state ``save`` wrote; ``CheckpointError`` as ``check``."""
    tree = check(path)
    try:
        tensors = load_file(path)
    except Exception as e:
        raise CheckpointError(f"{path}: incomplete or corrupt checkpoint ({type(e).__name__}: {e})") from None
    return _decode(tree, tensors)


def directory(out_dir: str | Path) -> Path:
    """Where a run (``runner.out_dir``) keeps its checkpoints."""
    return Path(out_dir) / CHECKPOINTS


def latest(folder: str | Path, log=print) -> Path | None:
    """The newest complete checkpoint in ``folder`` (``runner.resume=auto``); those that are
    not are named through ``log`` and passed over."""
    for path in sorted(Path(folder).glob(f"*{SUFFIX}"), reverse=True):  # names sort by the step
        try:
            check(path)
        except CheckpointError as e:
            log(f"skipping {e}")
            continue
        return path
    return None


# -- the tree -------------------------------------------------------------------------------
def _encode(x: Any, tensors: dict[str, torch.Tensor], storages: set, where: str) -> Any:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
        if t.is_sparse or t.layout != torch.strided:
            raise CheckpointError(f"cannot store a {t.layout} tensor at {where}")
        ptr = t.untyped_storage().data_ptr()
        # safetensors refuses tensors sharing memory (tied weights, views): those get a copy.
        t = t.contiguous() if ptr not in storages or t.numel() == 0 else t.clone()
        storages.add(ptr)
        key = str(len(tensors))
        tensors[key] = t
        return {"$t": key}
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise CheckpointError(f"cannot store a numpy array of Python objects at {where}")
        key = str(len(tensors))
        raw = np.ascontiguousarray(x).tobytes()
        tensors[key] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return {"$a": key, "dtype": x.dtype.str, "shape": list(x.shape)}
    if isinstance(x, np.generic):  # before float: np.float64 is a float
        return {"$np": x.dtype.str, "v": x.item() if not isinstance(x, np.void) else None}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, tuple):
        return {"$tuple": [_encode(v, tensors, storages, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, tensors, storages, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and not any(k.startswith("$") for k in x):
            return {k: _encode(v, tensors, storages, f"{where}.{k}") for k, v in x.items()}
        return {"$dict": [[_encode(k, tensors, storages, f"{where} key"), _encode(v, tensors, storages, f"{where}[{k!r}]")]
                          for k, v in x.items()]}
    raise CheckpointError(f"cannot store a {type(x).__module__}.{type(x).__qualname__} at {where}: a checkpoint "
                          "holds tensors, numpy arrays and plain values only")


def _decode(x: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    marker = next((m for m in _MARKERS if m in x), None)
    if marker is None:
        return {k: _decode(v, tensors) for k, v in x.items()}
    if marker == "$t":
        return tensors[x["$t"]]
    if marker == "$a":
        raw = tensors[x["$a"]].numpy().tobytes()
        return np.frombuffer(raw, dtype=np.dtype(x["dtype"])).reshape(x["shape"]).copy()
    if marker == "$np":
        return np.dtype(x["$np"]).type(x["v"])
    if marker == "$tuple":
        return tuple(_decode(v, tensors) for v in x["$tuple"])
    if marker == "$dict":
        return {_decode(k, tensors): _decode(v, tensors) for k, v in x["$dict"]}
    return base64.b64decode(x["$bytes"])


def trainer_weights(ckpt: dict, key: str) -> dict[str, Any]:
    """The actor's weights (rank 0's: every rank holds them, a sharded one in full on rank 0)."""
    state = ckpt["states"]["actor"][0]
    return state["trainer"]["model"] if key == "trainer" else state[key]
