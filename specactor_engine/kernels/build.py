"""Building and loading the engine's C++ CPU kernels: one torch extension, built once per machine.

The sources in `csrc/` register their operators under `torch.ops.specactor` (paged decode attention,
the decoder layer's elementwise ops). torch's extension loader compiles them on first use into
TORCH_EXTENSIONS_DIR (~30-40 s on 2 cores) and rebuilds when a source changes; `extension_available`
says whether they are loaded, False (one warning) where no compiler is at hand, so callers keep their
torch references.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path

import torch

from specactor_engine.files import file_lock

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_decode_attention.cpp", CSRC / "decode_layer_ops.cpp", CSRC / "gumbel_argmax.cpp",
           CSRC / "bf16_linear.cpp", CSRC / "int8_linear.cpp")
HEADERS = (CSRC / "huge_pages.h",)


def machine_tag() -> str:
    """The build is tuned for this CPU (-march=native): a cache shared across machines must not mix them."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(f"{flags}|{torch.__version__}".encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def sources_digest() -> str:
    """A digest of the CPU kernels' sources (the C++, the Python that calls it, the packed linears): what a build,
    and any cost measured with it, depends on besides the CPU and torch."""
    packed_linear = Path(__file__).parents[1] / "model" / "packed_linear.py"
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS, *sorted(Path(__file__).parent.glob("*.py")), packed_linear):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def headers_digest() -> str:
    """A digest of the headers the sources include: torch rebuilds when a source or a flag changes, not a header,
    so the build passes it as a flag."""
    return hashlib.sha256(b"".join(h.name.encode() + b"\0" + h.read_bytes() for h in HEADERS)).hexdigest()[:12]


def build_directory() -> Path:
    """Where this machine's build lives (and its lock file)."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / extension_name()


def extension_name() -> str:
    return f"specactor_paged_attention_{machine_tag()}"


@functools.lru_cache(maxsize=1)
def extension_available() -> bool:
    """Build (first use on this machine, or after a source changed) or load the kernels; False, with one
    warning, where that fails."""
    from torch.utils.cpp_extension import load

    build_dir = build_directory()
    try:
        with file_lock(build_dir.parent / f"{extension_name()}.build-lock"):  # one builder at a time
            # torch's own lock file outlives a builder that was killed (Ctrl-C, a test timeout), and every
            # later load then waits on it forever; under our lock nobody else is building, so it is stale
            (build_dir / "lock").unlink(missing_ok=True)
            build_dir.mkdir(parents=True, exist_ok=True)
            load(name=extension_name(), sources=[str(source) for source in SOURCES], build_directory=str(build_dir),
                 is_python_module=False, verbose=False,
                 extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
                               f"-DSPECACTOR_HEADERS={headers_digest()}"],
                 extra_ldflags=["-fopenmp", "-lmvec"])
        return True
    except Exception as exc:  # noqa: BLE001 - no compiler, or a failed build: the references serve
        logger.warning("the engine's C++ CPU kernels are unavailable (%s: %s); using their torch references",
                       type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return False
