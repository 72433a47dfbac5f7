"""Attention of new queries against their rows' slots of the static KV cache, without a gather.

`paged_decode_attention` is a C++ kernel (`csrc/paged_decode_attention.cpp`, built once per machine
by torch's extension loader into TORCH_EXTENSIONS_DIR, ~30 s) that reads every cached key and value
of a row once per KV head, for all 1..k+1 queries of that head group, straight from the cache slot.
`paged_decode_attention_reference` is the same contract in torch (gather, masked SDPA with fp32
accumulation): the source of truth, and the fallback, with one warning, where no compiler is at hand.

Contract: q [R, T, H, D]; key_cache, value_cache [N, L, H_kv, D] (contiguous); slots [R] int64;
positions [R, T] int64. Query t of row r sees keys [lo, positions[r, t]] of slot slots[r], lo = 0 or,
with a sliding window w > 0, positions[r, t] - w + 1. Returns [R, T, H, D] in q's dtype.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from specactor_engine.files import file_lock

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_attention.cpp"


def paged_decode_attention_reference(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                                     slots: torch.Tensor, positions: torch.Tensor, scale: float,
                                     window: int = 0) -> torch.Tensor:
    """The kernel's contract in torch (see the module docstring): [R, T, H, D]."""
    upto = int(positions.max()) + 1 if positions.numel() else 1
    keys = key_cache[slots, :upto].transpose(1, 2).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    values = value_cache[slots, :upto].transpose(1, 2).to(keys.dtype)  # [R, H_kv, S, D]
    index = torch.arange(upto)
    mask = index[None, None, :] <= positions[:, :, None]  # [R, T, S]
    if window > 0:
        mask &= index[None, None, :] > positions[:, :, None] - window
    out = F.scaled_dot_product_attention(q.transpose(1, 2).to(keys.dtype), keys, values, attn_mask=mask[:, None],
                                         scale=scale, enable_gqa=key_cache.shape[2] != q.shape[2])
    return out.transpose(1, 2).to(q.dtype)


def _machine_tag() -> str:
    """The build is tuned for this CPU (-march=native): a cache shared across machines must not mix them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{flags}|{torch.__version__}".encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def kernel_available() -> bool:
    """Build (first use on this machine) or load the compiled kernel, registered as
    `torch.ops.specactor.paged_decode_attention`; False, with one warning, where that fails."""
    from torch.utils.cpp_extension import get_default_build_root, load

    name = f"specactor_paged_attention_{_machine_tag()}"
    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name
    try:
        with file_lock(build_dir.parent / f"{name}.build-lock"):  # one builder at a time across processes
            # torch's own lock file outlives a builder that was killed (Ctrl-C, a test timeout), and every
            # later load then waits on it forever; under our lock nobody else is building, so it is stale
            (build_dir / "lock").unlink(missing_ok=True)
            build_dir.mkdir(parents=True, exist_ok=True)
            load(name=name, sources=[str(SOURCE)], build_directory=str(build_dir), is_python_module=False,
                 extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"],
                 extra_ldflags=["-fopenmp", "-lmvec"], verbose=False)
        return True
    except Exception as exc:  # noqa: BLE001 - no compiler, or a failed build: the reference serves
        logger.warning("paged decode attention kernel unavailable (%s: %s); using the torch reference",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """The compiled kernel on CPU tensors, else the reference: [R, T, H, D] (module docstring)."""
    if q.device.type != "cpu" or not kernel_available():
        return paged_decode_attention_reference(q, key_cache, value_cache, slots, positions, scale, window)
    return torch.ops.specactor.paged_decode_attention(q, key_cache, value_cache, slots, positions, scale, window)
