"""Facts about the machine and the code a benchmark ran on, and waiting for a quiet machine."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from specactor_engine.policies.cost_profile import cpu_model

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "transformers", "tokenizers", "numpy", "reasoning_gym", "specactor")


def log_engine_progress() -> None:
    """A run's process (worker.py, paired.py) logs the engine's one-off long work into its run log (stderr): the
    verify-cost profile's first measurement on a machine (minutes), a model's conversion, which way the bf16 kernel
    runs; the rest stays quiet."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for name in ("specactor_engine.policies.cost_profile", "specactor_engine.model.registry",
                 "specactor_engine.kernels.bf16_linear"):
        logging.getLogger(name).setLevel(logging.INFO)


class GcTimer:
    """A `gc.callbacks` entry: seconds spent in garbage collections, by the thread that triggered them, and the
    collections of each generation (a full, generation-2 collection walks every tracked object in the process)."""

    def __init__(self) -> None:
        self.by_thread: dict[str, float] = {}
        self.collections: dict[int, int] = {}
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            name = threading.current_thread().name
            self.by_thread[name] = self.by_thread.get(name, 0.0) + time.perf_counter() - self._started
            generation = int(info.get("generation", -1))
            self.collections[generation] = self.collections.get(generation, 0) + 1
            self._started = None

    @property
    def seconds(self) -> float:
        """Every thread's collection seconds."""
        return sum(self.by_thread.values())


def cpu_flags() -> list[str]:
    """The vector-extension flags that decide CPU kernel speed (avx2, avx512*, amx*)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx")))
    except OSError:
        pass
    return []


def physical_cores() -> int | None:
    try:
        import psutil

        return psutil.cpu_count(logical=False)
    except ImportError:
        return None


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def git_info(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit and whether the work tree had uncommitted changes to tracked files (untracked files are left out: a
    benchmark's own output directory, not yet committed, made every results file say "(dirty)")."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


PROBE_BYTES = 256 * 2**20  # far beyond the last-level cache (32 MiB on the AMD EPYC)
PROBE_PASSES = 12


def read_bandwidth_gbps(passes: int = PROBE_PASSES) -> float:
    """The machine's memory read bandwidth right now, GB/s: the median of `passes` sums over a buffer far larger
    than the caches, on this process's torch threads (~0.1 s).

    A decode step at a few rows streams every weight once, so its time follows this figure; on the shared 2-core
    machines it moved between ~34 and ~48 GB/s over tens of seconds with nothing of ours running
    (bench/session36), which is what made whole runs of one system ~25% slower than another's. Read at the start
    and the end of each timed run, it says which state a run met."""
    import torch

    buffer = torch.ones(PROBE_BYTES // 2, dtype=torch.bfloat16)
    seconds = []
    for _ in range(passes):
        started = time.perf_counter()
        buffer.sum()
        seconds.append(time.perf_counter() - started)
    return PROBE_BYTES / sorted(seconds)[len(seconds) // 2] / 1e9


def machine_info(threads: int) -> dict[str, Any]:
    memory = None
    try:
        import psutil

        memory = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return {
        "cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores(), "memory_gib": memory, "threads": threads,
        "platform": platform.platform(), "versions": versions(), "git": git_info(),
    }


def busy_cpu_s() -> float | None:
    """CPU seconds all processes spent busy since boot (all CPUs; /proc/stat), None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def current_load(sample_s: float = 10.0) -> float | None:
    """Busy CPUs right now (0..cpu count), measured over `sample_s` from /proc/stat.

    Unlike the 1-minute load average it does not remember this harness's previous run.
    """
    before = busy_cpu_s()
    time.sleep(sample_s)
    after = busy_cpu_s()
    return None if before is None or after is None else (after - before) / sample_s


def wait_for_quiet(max_load: float, max_wait_s: float = 600, poll_s: float = 60) -> list[dict[str, float | None]]:
    """Wait until the machine is quiet, polling every `poll_s` for at most `max_wait_s`.

    Quiet: the 1-minute load average, or the busy CPUs measured over 10 s (which forget our own
    previous run sooner), is at most `max_load`. Returns every reading, for the results.
    """
    readings: list[dict[str, float | None]] = []
    deadline = time.monotonic() + max_wait_s
    while True:
        load, busy = os.getloadavg()[0], current_load()
        readings.append({"time": time.time(), "loadavg_1m": load, "busy_cpus_10s": busy})
        quiet = load <= max_load or (busy is not None and busy <= max_load)
        if quiet or time.monotonic() >= deadline:
            if not quiet:
                logger.warning("load average %.2f (busy CPUs %s) > %.2f after %.0f s; running anyway", load, busy,
                               max_load, max_wait_s)
            return readings
        logger.info("load average %.2f, busy CPUs %.2f > %.2f: waiting %.0f s", load, busy or 0, max_load, poll_s)
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))
