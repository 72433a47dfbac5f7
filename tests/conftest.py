"""Test-session set-up: project-local tool caches, no hub access, shared fixtures.

The environment is set at import, before any test module imports transformers,
huggingface_hub, prefect or wandb (they read it at import time). `setdefault`
keeps the values the Makefile exports; a bare `pytest` gets the same ones.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR = Path(__file__).resolve().parents[1] / ".cache"

_ENV_DEFAULTS = {
    "SPECACTOR_CACHE_DIR": str(CACHE_DIR / "specactor"),
    "XDG_CACHE_HOME": str(CACHE_DIR),
    "HF_HOME": str(CACHE_DIR / "huggingface"),
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TORCH_EXTENSIONS_DIR": str(CACHE_DIR / "torch_extensions"),
    "TRITON_CACHE_DIR": str(CACHE_DIR / "triton"),
    "TORCHINDUCTOR_CACHE_DIR": str(CACHE_DIR / "torchinductor"),
    "WANDB_DIR": str(CACHE_DIR / "wandb"),
    "WANDB_CACHE_DIR": str(CACHE_DIR / "wandb" / "cache"),
    "WANDB_DATA_DIR": str(CACHE_DIR / "wandb" / "data"),
    "WANDB_MODE": "offline",
    "PREFECT_HOME": str(CACHE_DIR / "prefect"),
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "MPLCONFIGDIR": str(CACHE_DIR / "matplotlib"),
}
for _name, _value in _ENV_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

pytest_plugins = ["tests.fixtures.tiny_models"]
