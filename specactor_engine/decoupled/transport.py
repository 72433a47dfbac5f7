"""How the verifier reaches a drafter worker: one interface, a local-process implementation.

`Transport` is what the coordinator uses: `send` a message, `drain` whatever has arrived without
waiting, `alive`, `close`. `LocalWorker` runs `worker_main` in a spawned process (its own torch
threads) over a duplex pipe. `DelayedTransport` wraps any transport and holds every message in
both directions for a random time (order kept), which the tests use to stress the protocol.
A Ray-actor transport for drafters on other machines fits behind the same four methods.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any

from specactor_engine.decoupled.protocol import Shutdown

logger = logging.getLogger(__name__)


class WorkerLost(RuntimeError):
    """The worker's process or connection is gone."""


class Transport(ABC):
    @abstractmethod
    def send(self, message: Any) -> None:
        """Queue a message for the worker (raises WorkerLost if it is gone)."""

    @abstractmethod
    def drain(self) -> list[Any]:
        """Every message that has arrived, oldest first, without waiting (WorkerLost if gone)."""

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def close(self) -> None:
        """Stop the worker and release its resources (idempotent)."""

    def cpu_s(self) -> float:
        """CPU seconds the worker used so far (0 when unknown)."""
        return 0.0


@dataclass(frozen=True)
class WorkerSpec:
    """How to start a drafter worker process."""

    model_path: str
    dtype: str
    threads: int
    target_vocab_size: int


class LocalWorker(Transport):
    """A drafter worker in a spawned process on this machine, over a duplex pipe."""

    def __init__(self, spec: WorkerSpec) -> None:
        from specactor_engine.decoupled.drafter_worker import worker_main

        context = multiprocessing.get_context("spawn")  # no forked torch thread pools
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=worker_main, daemon=True, name="specactor-drafter",
                                       args=(child, spec.model_path, spec.dtype, spec.threads,
                                             spec.target_vocab_size))
        self.process.start()
        child.close()

    def send(self, message: Any) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise WorkerLost(f"drafter worker {self.process.pid}: {exc}") from exc

    def drain(self) -> list[Any]:
        out = []
        try:
            while self.conn.poll(0):
                out.append(self.conn.recv())
        except (EOFError, ConnectionResetError, OSError) as exc:
            raise WorkerLost(f"drafter worker {self.process.pid}: {exc}") from exc
        return out

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        """Kill the process abruptly (tests: a drafter crash)."""
        self.process.kill()
        self.process.join(timeout=10)

    def cpu_s(self) -> float:
        try:
            import psutil

            times = psutil.Process(self.process.pid).cpu_times()
            return times.user + times.system
        except Exception:  # noqa: BLE001 - psutil missing or the process gone: unknown
            return 0.0

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(Shutdown())
            except (BrokenPipeError, ConnectionResetError, OSError):
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            logger.warning("drafter worker %s did not stop; terminating it", self.process.pid)
            self.process.terminate()
            self.process.join(timeout=10)
        self.conn.close()


class DelayedTransport(Transport):
    """Hold each message, both ways, for a random 0..max_delay_s (FIFO per direction)."""

    def __init__(self, inner: Transport, max_delay_s: float, seed: int = 0) -> None:
        self.inner = inner
        self.max_delay_s = max_delay_s
        self.rng = random.Random(seed)
        self.outgoing: deque[tuple[float, Any]] = deque()
        self.incoming: deque[tuple[float, Any]] = deque()

    def _release_time(self, queue: deque[tuple[float, Any]]) -> float:
        after = queue[-1][0] if queue else 0.0
        return max(after, time.monotonic() + self.rng.uniform(0, self.max_delay_s))

    def _flush_outgoing(self) -> None:
        now = time.monotonic()
        while self.outgoing and self.outgoing[0][0] <= now:
            self.inner.send(self.outgoing.popleft()[1])

    def send(self, message: Any) -> None:
        self.outgoing.append((self._release_time(self.outgoing), message))
        self._flush_outgoing()

    def drain(self) -> list[Any]:
        self._flush_outgoing()
        for message in self.inner.drain():
            self.incoming.append((self._release_time(self.incoming), message))
        now, out = time.monotonic(), []
        while self.incoming and self.incoming[0][0] <= now:
            out.append(self.incoming.popleft()[1])
        return out

    def alive(self) -> bool:
        return self.inner.alive()

    def close(self) -> None:
        self.inner.close()

    def cpu_s(self) -> float:
        return self.inner.cpu_s()

    def __getattr__(self, name: str) -> Any:  # kill() and friends of the wrapped transport
        return getattr(self.inner, name)
