"""One flat tensor for all of a module's parameters, and one for their gradients."""

from __future__ import annotations

import torch
from torch import nn


def flatten_parameters(module: nn.Module) -> nn.Parameter:
    """Moves the parameters of ``module`` into one flat parameter, their gradients into its
    ``grad``; the module's parameters and gradients become views of the two.

    An optimizer, gradient clipping or an all-reduce over the flat parameter then costs one
    operation instead of one per tensor. Autograd accumulates into the existing gradient
    views in place, so zero them with ``flat.grad.zero_()``, never by setting them to None.
    """
    params = list(module.parameters())
    flat = nn.Parameter(torch.cat([p.detach().reshape(-1) for p in params]))
    flat.grad = torch.zeros_like(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.data = flat.data[offset:offset + n].view_as(p)
        p.grad = flat.grad[offset:offset + n].view_as(p)
        offset += n
    return flat
