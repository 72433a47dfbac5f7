"""Versioned in-place weight updates (the trainer -> engine sync primitive)."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


@torch.no_grad()
def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy (name, tensor) pairs into `model`'s parameters/buffers in place; returns how many.

    Names are Hugging Face state-dict names; tied weights may arrive under either name.
    Unknown names and shape mismatches raise before any parameter is modified.
    """
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers()))
    pairs = list(weights)
    for name, tensor in pairs:  # validate everything before touching any parameter
        if name not in targets:
            raise KeyError(f"weight {name!r} does not exist in {type(model).__name__}")
        if targets[name].shape != tensor.shape:
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != {tuple(targets[name].shape)}")
    for name, tensor in pairs:
        targets[name].copy_(tensor.to(device=targets[name].device, dtype=targets[name].dtype))
    return len(pairs)
