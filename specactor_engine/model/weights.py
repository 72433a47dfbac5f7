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


def weights_digest(weights: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order.

    Two models with equal digests hold bit-identical weights: the sync check between the
    trainer and the rollout engine.
    """
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in sorted(weights, key=lambda item: item[0]):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def model_digest(model: nn.Module) -> str:
    """`weights_digest` of a model's state dict (tied weights appear under every name)."""
    return weights_digest(model.state_dict().items())
