"""Drafter workers as Ray actors: the `Transport` for drafters on other machines of a Ray cluster.

The actor holds a `DraftWorker` and runs the same `serve` loop as a local worker process, on a
thread of its own, between an inbox queue and an outbox list. The verifier side talks to it
through one `exchange(messages) -> replies` call at a time: `send` queues locally, `drain` checks
(without waiting) whether the call in flight has returned, takes its replies, and starts the next
call with everything queued since. One call in flight keeps the messages in order (Ray does not
order calls of a threaded actor) and the verifier never blocks on the network.

Both directions travel as one pickled bytes blob, unpickled into memory this process owns. Ray
deserialises numpy arrays zero-copy out of its own buffers, and those of a small (inlined) reply
are freed once the ObjectRef is dropped: draft arrays kept past that read freed memory (measured:
every draft turned to zeros, 0 accepted, once the engine returned freed heap pages to the OS).

The draft model is loaded from `WorkerSpec.model_path` on the actor's node, so that path must
exist there (a shared file system, or the same cache directory on every node).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import threading
from typing import Any

from specactor_engine.decoupled.protocol import Ready, Shutdown
from specactor_engine.decoupled.transport import Transport, WorkerLost, WorkerSpec

logger = logging.getLogger(__name__)


def ensure_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None) -> None:
    """Join the Ray cluster at `address`, or start a local instance (no dashboard, no usage stats,
    no auth token in the home directory; session files under temp_dir, default /tmp/ray), unless
    Ray is already up in this process."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
                 **({"_temp_dir": temp_dir} if temp_dir else {}))


class DraftActor:
    """The Ray actor's body (wrapped with `ray.remote` by `RayWorker`): a worker on its own thread."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.outbox: list[Any] = []
        self.lock = threading.Lock()
        self.failure = ""
        self.thread = threading.Thread(target=self._run, args=(spec,), daemon=True, name="specactor-drafter")
        self.thread.start()

    def _emit(self, message: Any) -> None:
        with self.lock:
            self.outbox.append(message)

    def _run(self, spec: WorkerSpec) -> None:
        from specactor_engine.decoupled.drafter_worker import load_worker, serve

        try:
            worker, ready = load_worker(spec.model_path, spec.dtype, spec.threads, spec.target_vocab_size)
            self._emit(ready)
            serve(worker, self.inbox.get, lambda: not self.inbox.empty(), self._emit)
        except Exception as exc:  # noqa: BLE001 - surfaced to the verifier by the next exchange
            self.failure = f"{type(exc).__name__}: {exc}"
            logger.exception("drafter actor failed")

    def exchange(self, blob: bytes) -> bytes:
        """Deliver the pickled messages (in order); return everything the worker emitted since the last
        call, pickled (see the module docstring for why not Ray's own serialisation)."""
        if self.failure:
            raise RuntimeError(f"drafter actor {os.getpid()} failed: {self.failure}")
        for message in pickle.loads(blob):
            self.inbox.put(message)
        with self.lock:
            out, self.outbox = self.outbox, []
        return pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)

    def pid(self) -> int:
        return os.getpid()


class RayWorker(Transport):
    """A drafter worker in a Ray actor (`ray.init` must have run: a local instance or a cluster).

    actor_options go to `.options()` (e.g. a node's resources or a scheduling strategy); the
    actor asks for `spec.threads` CPUs.
    """

    def __init__(self, spec: WorkerSpec, actor_options: dict[str, Any] | None = None) -> None:
        import ray

        if not ray.is_initialized():
            raise RuntimeError("Ray drafter workers need a running Ray: call ray.init() (a local instance or "
                               "address=... of a cluster) before starting them")
        self._ray = ray
        options = {"num_cpus": spec.threads} | (actor_options or {})
        self.actor = ray.remote(DraftActor).options(**options).remote(spec)
        self.outgoing: list[Any] = []
        self.in_flight: Any | None = None  # the ObjectRef of the exchange call in flight
        self.lost = ""
        self.process_id: int | None = None
        self.closed = False

    def _start_exchange(self) -> None:
        self.in_flight = self.actor.exchange.remote(pickle.dumps(self.outgoing, protocol=pickle.HIGHEST_PROTOCOL))
        self.outgoing = []

    def _collect(self, timeout_s: float) -> list[Any]:
        """The replies of the call in flight if it has returned within timeout_s ([] otherwise)."""
        if self.in_flight is None:
            return []
        ready, _ = self._ray.wait([self.in_flight], timeout=timeout_s)
        if not ready:
            return []
        ref, self.in_flight = self.in_flight, None
        try:
            replies = pickle.loads(self._ray.get(ref))  # copies out of Ray's buffers before `ref` goes
        except Exception as exc:  # noqa: BLE001 - RayActorError, a task error from a failed load, ...
            self.lost = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise WorkerLost(f"drafter actor: {self.lost}") from exc
        for message in replies:
            if isinstance(message, Ready):
                self.process_id = message.pid
        return replies

    def send(self, message: Any) -> None:
        if self.lost:
            raise WorkerLost(f"drafter actor: {self.lost}")
        self.outgoing.append(message)
        if self.in_flight is None:
            self._start_exchange()

    def drain(self) -> list[Any]:
        if self.lost:
            raise WorkerLost(f"drafter actor: {self.lost}")
        replies = self._collect(0)
        if self.in_flight is None:  # keep one call in flight: it is how drafts come back
            self._start_exchange()
        return replies

    def alive(self) -> bool:
        return not self.lost and not self.closed

    def kill(self) -> None:
        """Kill the actor abruptly (tests: a drafter crash)."""
        self._ray.kill(self.actor, no_restart=True)

    def cpu_s(self) -> float:
        if self.process_id is None:
            return 0.0
        try:
            import psutil

            times = psutil.Process(self.process_id).cpu_times()  # only when the actor runs on this node
            return times.user + times.system
        except Exception:  # noqa: BLE001 - another node, or the process is gone: unknown
            return 0.0

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.lost:
            try:
                self._collect(10)
                self.outgoing.append(Shutdown())
                self._start_exchange()
                self._collect(10)
            except WorkerLost:
                pass
        self._ray.kill(self.actor, no_restart=True)  # its process goes with it
