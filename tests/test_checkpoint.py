"""Checkpoint files: safetensors plus JSON, nothing pickled; atomic writes; the latest complete one."""

import errno
import json
import math
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from m2flow.runners import checkpoint as checkpoints
from m2flow.runners.checkpoint import CheckpointError
from m2flow.runtime.files import write_whole


def _state():
    weight = torch.randn(4, 3)
    return {
        "model": {"embed.weight": weight, "head.weight": weight, "half": torch.ones(2, dtype=torch.bfloat16),
                  "scalar": torch.tensor(3.5), "empty": torch.zeros(0), "view": weight[1:, :2]},
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(3)}},
                      "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.999), "params": [0]}]},
        "rng": torch.get_rng_state(),
        "np_rng": np.random.default_rng(5).bit_generator.state,  # 128-bit integers
        "legacy_rng": np.random.RandomState(1).get_state(),  # a tuple with a uint32 array
        "arrays": [np.arange(6, dtype=np.float64).reshape(2, 3), np.array([True, False]), np.zeros((0, 2), np.float32)],
        "np_scalars": (np.float32(1.25), np.int64(-3), np.bool_(True)),
        "floats": [math.inf, -math.inf, 0.1 + 0.2],
        "odd_keys": {"$t": 1, (1, 2): "pair"},
        "raw": b"\x00\x01",
        "none": None,
    }


def _equal(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _equal(x, y)
    else:
        assert a == b


def test_a_state_round_trips_exactly_with_types_kept(tmp_path):
    state = _state()
    path = checkpoints.save(tmp_path / "update_000001.safetensors", state)
    loaded = checkpoints.load(path)
    _equal(state, loaded)
    assert loaded["model"]["embed.weight"] is not loaded["model"]["head.weight"]  # tied weights stored twice
    # a restored RNG goes on with the same numbers
    torch.set_rng_state(loaded["rng"])
    x = torch.rand(3)
    torch.set_rng_state(state["rng"])
    assert torch.equal(x, torch.rand(3))


def test_the_file_opens_with_safetensors_and_json_alone(tmp_path):
    path = checkpoints.save(tmp_path / "c.safetensors", _state())
    with safe_open(str(path), "pt") as f:
        tree = json.loads(f.metadata()["m2flow"])
        keys = set(f.keys())
        weight = f.get_tensor(tree["model"]["embed.weight"]["$t"])
    assert weight.shape == (4, 3)
    assert tree["model"]["head.weight"]["$t"] in keys and tree["arrays"][0]["dtype"] == "<f8"
    assert tree["optimizer"]["param_groups"][0]["lr"] == 3e-4


def test_what_a_checkpoint_cannot_hold_is_named_by_where_it_is(tmp_path):
    with pytest.raises(CheckpointError, match=r"cannot store a builtins.object at state.envs\[1\].sim"):
        checkpoints.save(tmp_path / "c.safetensors", {"envs": [{}, {"sim": object()}]})
    assert not list(tmp_path.iterdir())  # nothing written, no temporary file left
    (tmp_path / "old.pt").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(CheckpointError, match="not a checkpoint file"):
        checkpoints.load(tmp_path / "old.pt")


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    good = checkpoints.save(tmp_path / "step_000001.safetensors", {"done": 1})

    def crash(tensors, filename, metadata):
        with open(filename, "wb") as f:
            f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # half a header
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.torch.save_file", crash)  # the writer of checkpoints and saved weights
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(tmp_path / "step_000002.safetensors", {"done": 2})
    assert not (tmp_path / "step_000002.safetensors").exists()
    (tmp_path / ".step_000003.safetensors.4242.tmp").write_bytes(b"half")  # what a killed process leaves
    assert checkpoints.latest(tmp_path) == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_000003.safetensors.4242.tmp", "step_000001.safetensors"]


def test_a_full_disk_is_an_oserror_naming_the_file(tmp_path, monkeypatch):
    """safetensors reports a failed write in its own error type; a text write names no file:
    either way the caller gets an OSError with the errno and the file it was writing, and no
    temporary file is left."""
    from safetensors import SafetensorError

    def full(tensors, filename, metadata):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    path = tmp_path / "step_000001.safetensors"
    with pytest.raises(OSError) as e:
        checkpoints.save(path, {"done": 1})
    assert (e.value.errno, e.value.strerror, e.value.filename) == (errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def text_full(tmp):
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a file's flush raises it

    with pytest.raises(OSError) as e:
        write_whole(tmp_path / "plan.yaml", text_full)
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(tmp_path / "plan.yaml"))
    assert list(tmp_path.iterdir()) == []


def test_latest_passes_over_a_truncated_checkpoint(tmp_path):
    for done in (1, 2, 3):
        checkpoints.save(tmp_path / f"step_{done:06d}.safetensors", {"done": done, "w": torch.randn(64)})
    newest = tmp_path / "step_000003.safetensors"
    newest.write_bytes(newest.read_bytes()[:-100])  # a crash while copying it, a full disk
    (tmp_path / "step_000004.safetensors").write_bytes(b"")
    skipped = []
    assert checkpoints.latest(tmp_path, log=skipped.append) == tmp_path / "step_000002.safetensors"
    assert len(skipped) == 2 and all("incomplete or corrupt" in s for s in skipped)
    with pytest.raises(CheckpointError, match="step_000003.safetensors: incomplete or corrupt"):
        checkpoints.load(newest)
    assert checkpoints.latest(tmp_path / "none") is None
