"""Files written whole: a reader finds a file complete or absent, also after a crash."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Writes ``tensors`` (safetensors) to ``path`` atomically (``write_whole``)."""
    return write_whole(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def write_text(path: str | Path, text: str) -> Path:
    """Writes ``text`` to ``path`` atomically (``write_whole``)."""
    return write_whole(path, lambda tmp: tmp.write_text(text))


def write_whole(path: str | Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` writes a temporary file beside ``path``; it is flushed to disk, renamed
    over ``path``, then the directory flushed (the rename itself durable)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
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
