"""A model's weights for weight sync and its checks: ``named_weights`` (each storage once),
``weights_hash`` (equal exactly when two models hold identical weights), and for a model
sharded over ranks, ``fully_shard_model`` (FSDP2) and ``gathered_weights``."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn


def named_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, tensor)`` for every persistent weight of ``model`` (its state dict), each
    storage once: a tied weight (e.g. ``lm_head.weight`` = embeddings) comes under its first
    name only. The tensors are the live ones, detached; copy them to keep a snapshot."""
    seen = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tensor.dtype)
        if key in seen:
            continue
        seen.add(key)
        yield name, tensor


def fully_shard_model(model: nn.Module, group: dist.ProcessGroup | None, device: torch.device) -> None:
    """FSDP2 over ``group``'s ranks: a unit per decoder layer (a transformers model names its
    layer classes in ``_no_split_modules``), then the root, which holds the rest (embeddings,
    final norm, head: tied weights stay in one unit)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def gathered_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``named_weights`` of a sharded model: each weight gathered in full (a collective, in
    state-dict order on every rank); a tied weight under its first name only."""
    from torch.distributed.tensor import DTensor

    seen = set()
    for name, tensor in model.state_dict(keep_vars=True).items():  # the parameters themselves: tied ones are one
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensor = tensor.detach()
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def weights_hash(weights: nn.Module | Iterable[tuple[str, Tensor]]) -> str:
    """sha256 over names, dtypes, shapes and bytes of the weights, in name order: equal for
    two models exactly when they hold identical weights (same names, tying and values)."""
    named = named_weights(weights) if isinstance(weights, nn.Module) else weights
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
