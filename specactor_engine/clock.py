"""The clock the decode loop reads: every duration the engine records or its policies act on.

`now()` is `time.perf_counter()` unless a simulation replaces the source (`replaced`): the what-if
simulator (benchmark/simulate) runs the engine's own loop, policies and bookkeeping against a cost
model, with a clock that advances by the modelled seconds of each forward and draft instead of the
wall's. Nothing else changes: the code that runs under a replaced clock is the code that runs for real.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator

_source: Callable[[], float] = time.perf_counter


def now() -> float:
    """Seconds on the current clock (monotonic; only differences mean anything)."""
    return _source()


@contextmanager
def replaced(source: Callable[[], float]) -> Iterator[None]:
    """Read `source` instead of the wall clock inside the block (one at a time; not thread-safe)."""
    global _source
    previous, _source = _source, source
    try:
        yield
    finally:
        _source = previous
