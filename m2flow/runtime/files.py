"""Files written whole: a reader finds a file complete or absent, also after a crash."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Writes ``tensors`` (safetensors) to ``path`` atomically: to a temporary file beside it,
    flushed to disk, renamed over ``path``, then the directory flushed (the rename itself
    durable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path
