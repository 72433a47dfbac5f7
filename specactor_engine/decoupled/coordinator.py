"""The verifier's side of decoupled speculation: workers, row pinning, buffers, failure handling.

The engine calls, per generate: `reset`; per admission: `add_rows`; per verify round: `poll`
(drain every worker, never wait), `take` (drafts to verify), `after_round` (reconcile and send
commits), `remove_rows`. Rows are pinned to the least-loaded live worker. A worker that dies
loses its rows' drafts (they decode plainly, outputs unchanged), is restarted, and gets its rows
back, committed output included, once the new process reports `Ready`. Between generate calls,
`load_weights` pushes new draft-model weights (the pipeline's drafter sync) to every worker; a
worker that restarts later gets them again before any row.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from specactor_engine.decoupled.buffers import DraftBuffers
from specactor_engine.decoupled.protocol import (
    AddRows,
    Commits,
    Drafts,
    LoadWeights,
    Pause,
    Ready,
    RemoveRows,
    Reserve,
    Reserved,
    Reset,
    SamplingSpec,
    WeightsLoaded,
)
from specactor_engine.decoupled.transport import Transport, WorkerLost

logger = logging.getLogger(__name__)

NO_WORKER = -1


@dataclass
class WorkerSlot:
    """One drafter worker as the verifier sees it."""

    transport: Transport
    ready: bool = False
    busy_s: float = 0.0  # compute time its draft steps reported
    steps: int = 0
    restarts: int = 0
    started: float = field(default_factory=time.perf_counter)
    weights: WeightsLoaded | None = None  # its answer to the latest LoadWeights
    reserved: Reserved | None = None  # its answer to the latest Reserve


class DecoupledCoordinator:
    """Owns the drafter workers for an engine; `make_transport(i)` starts worker i."""

    def __init__(self, make_transport: Callable[[int], Transport], num_workers: int, max_restarts: int = 3) -> None:
        self.make_transport = make_transport
        self.max_restarts = max_restarts
        self.workers = [WorkerSlot(make_transport(i)) for i in range(num_workers)]
        self.reset_message: Reset | None = None
        self.buffers: DraftBuffers | None = None
        self.worker_of = np.zeros(0, dtype=np.int64)
        self.sent = np.zeros(0, dtype=np.int64)
        self.rows: dict[int, tuple[int, np.ndarray]] = {}  # slot -> (key, prompt ids)
        self.output_of: Callable[[int], list[int]] = lambda slot: []
        self.generation = 0
        self.paused = False
        self.unreconciled = np.zeros(0, dtype=bool)  # [S] rows that committed while paused (`after_round`)
        self.weights_message: LoadWeights | None = None  # the latest weights pushed (re-sent on restart)

    # ------------------------------------------------------------------ lifecycle
    def reset(self, num_slots: int, max_len: int, sampling: SamplingSpec, window: int,
              output_of: Callable[[int], list[int]]) -> None:
        """A new generate call; output_of(slot) returns a row's committed output (for re-adds)."""
        self.generation += 1
        self.reset_message = Reset(num_slots, max_len, sampling, window, self.generation)
        self.buffers = DraftBuffers(num_slots, window)
        self.worker_of = np.full(num_slots, NO_WORKER, dtype=np.int64)
        self.sent = np.zeros(num_slots, dtype=np.int64)  # output tokens of each row its worker has been sent
        self.unreconciled = np.zeros(num_slots, dtype=bool)
        self.rows.clear()
        self.output_of = output_of
        self.paused = False
        for index, worker in enumerate(self.workers):
            if worker.ready:
                self._send(index, self.reset_message)
                self._send(index, Pause(False))

    def reserve(self, num_slots: int, max_len: int, timeout_s: float = 300.0) -> bool:
        """Have every ready worker size its KV cache now (start-up), and wait until they have: the
        `Reset` of a generate call of at most this size then reuses it instead of allocating on the
        rollout's clock (a worker still zeroing gigabytes would also take a core from the verifier's
        prefill). Between generate calls only. True when every ready worker answered in time."""
        asked = [index for index, worker in enumerate(self.workers) if worker.ready]
        for index in asked:
            self.workers[index].reserved = None
            self._send(index, Reserve(num_slots, max_len))
        self._await(lambda w: w.ready and w.reserved is None and w.transport.alive(), timeout_s)
        return all(self.workers[i].reserved is not None for i in asked)

    def _await(self, waiting: Callable[[WorkerSlot], bool], timeout_s: float) -> None:
        """Take in control messages until no worker is `waiting` or the timeout passes (between calls)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._drain_control()
            if not any(waiting(worker) for worker in self.workers):
                return
            time.sleep(0.01)

    def close(self) -> None:
        for worker in self.workers:
            worker.transport.close()

    def load_weights(self, path: str, version: int, timeout_s: float = 300.0) -> list[WeightsLoaded]:
        """Push draft-model weights (a safetensors file) to every worker and wait for their answers.

        Between generate calls only. Waits for workers still loading their model too. Returns one
        `WeightsLoaded` per worker that answered; a worker that restarts later loads the file before
        it gets any row.
        """
        self.weights_message = LoadWeights(path, version)
        for index, worker in enumerate(self.workers):
            worker.weights = None
            if worker.ready:
                self._send(index, self.weights_message)
        # a worker still loading its model gets the file once it is Ready
        self._await(lambda w: w.weights is None and (w.ready or w.transport.alive()), timeout_s)
        return [w.weights for w in self.workers if w.weights is not None and w.weights.version == version]

    def _drain_control(self) -> None:
        """Between generate calls: take in `Ready` and `WeightsLoaded`; drafts of the last call are dropped."""
        self._drain(take_drafts=False)

    def wait_ready(self, timeout_s: float = 120.0) -> bool:
        """Block until every worker has loaded its model, and the latest pushed weights if any
        (start-up and between calls only; rounds never wait)."""
        deadline = time.monotonic() + timeout_s
        while not self._all_ready() and time.monotonic() < deadline:
            self._drain_control()
            time.sleep(0.01)
        return self._all_ready()

    def _all_ready(self) -> bool:
        version = self.weights_message.version if self.weights_message is not None else None
        return all(w.ready and (version is None or (w.weights is not None and w.weights.version == version))
                   for w in self.workers)

    # ------------------------------------------------------------------ rows
    def add_rows(self, slots: np.ndarray, keys: np.ndarray, prompts: list[np.ndarray]) -> None:
        assert self.buffers is not None
        self.buffers.add_rows(slots)
        self.sent[slots] = 0
        for slot, key, prompt in zip(slots.tolist(), keys.tolist(), prompts):
            self.rows[slot] = (key, prompt)
        live = [i for i, w in enumerate(self.workers) if w.transport.alive()]
        load = {i: 0 for i in live}
        for owner in self.worker_of[self.worker_of != NO_WORKER].tolist():
            if owner in load:
                load[owner] += 1
        chosen = []
        for _ in range(len(slots)):  # least-loaded first, one row at a time
            best = min(load, key=lambda i: (load[i], i)) if load else NO_WORKER
            chosen.append(best)
            if best != NO_WORKER:
                load[best] += 1
        self.worker_of[slots] = chosen
        for index in set(chosen) - {NO_WORKER}:
            mine = slots[np.asarray(chosen) == index]
            if self.workers[index].ready:
                self._send_rows(index, mine, with_output=False)

    def pause(self, paused: bool) -> None:
        """Pause or resume drafting on every worker (dynamic decoupling's plain-decoding phases).

        Paused workers get no commits (applying them every round took CPU from the verifier that
        the pause is meant to give back); on resume each first gets what its rows committed meanwhile.
        """
        resuming = self.paused and not paused
        self.paused = paused
        if resuming:
            self._resync()
        for index, worker in enumerate(self.workers):
            if not worker.ready:
                continue
            if resuming:
                self._send_missed_commits(index)
            self._send(index, Pause(paused))

    def _resync(self) -> None:
        """The buffers of the rows that committed while paused, brought up to their committed output."""
        if self.buffers is None or not self.unreconciled.any():
            return
        slots = np.flatnonzero(self.unreconciled & (self.worker_of != NO_WORKER))
        self.buffers.resync(slots, [np.asarray(self.output_of(s), dtype=np.int64) for s in slots.tolist()])
        self.unreconciled[:] = False

    def _send_missed_commits(self, index: int) -> None:
        """One `Commits` with every output token the worker's rows committed since it was last sent any."""
        slots = np.flatnonzero(self.worker_of == index)
        if not len(slots):
            return
        outputs = [np.asarray(self.output_of(slot), dtype=np.int64)[self.sent[slot]:] for slot in slots.tolist()]
        lengths = np.array([len(o) for o in outputs], dtype=np.int64)
        keep = lengths > 0
        if not keep.any():
            return
        slots, lengths = slots[keep], lengths[keep]
        tokens = np.concatenate([o for o, k in zip(outputs, keep.tolist()) if k])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        self._send(index, Commits(slots, self.sent[slots].copy(), offsets, tokens))
        self.sent[slots] += lengths

    def remove_rows(self, slots: np.ndarray) -> None:
        owners = self.worker_of[slots]
        for index in set(owners.tolist()) - {NO_WORKER}:
            if self.workers[index].ready:
                self._send(index, RemoveRows(slots[owners == index]))
        self.worker_of[slots] = NO_WORKER
        self.unreconciled[slots] = False
        for slot in slots.tolist():
            self.rows.pop(slot, None)

    # ------------------------------------------------------------------ per round
    def poll(self) -> None:
        """Take in whatever every worker has sent; restart dead workers. Never waits."""
        assert self.buffers is not None
        self._drain(take_drafts=True)

    def _drain(self, take_drafts: bool) -> None:
        """Every worker's messages: drafts into the buffers (when take_drafts), `Ready`, `WeightsLoaded`."""
        owned = self.worker_of != NO_WORKER
        for index, worker in enumerate(self.workers):
            try:
                messages = worker.transport.drain()
            except WorkerLost as exc:
                self._lost(index, str(exc))
                continue
            for message in messages:
                if isinstance(message, Drafts):
                    if not take_drafts or message.generation != self.generation:
                        continue  # between calls, or from an earlier generate call
                    assert self.buffers is not None
                    worker.busy_s += message.busy_s
                    worker.steps += 1
                    self.buffers.ingest(message, owned & (self.worker_of == index))
                elif isinstance(message, Ready):
                    self._on_ready(index)
                elif isinstance(message, WeightsLoaded):
                    self._on_weights(index, message)
                elif isinstance(message, Reserved):
                    worker.reserved = message
            if take_drafts and not worker.transport.alive():
                self._lost(index, "process exited")

    def take(self, slots: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        assert self.buffers is not None
        return self.buffers.take(slots, caps)

    def after_round(self, slots: np.ndarray, output: np.ndarray, emitted: np.ndarray) -> None:
        """Reconcile the buffers with a verify (or prefill) round and send each worker its commits. Paused, neither:
        nothing is taken from the buffers then, so the rows are marked and brought up to date on resume (`_resync`),
        and `pause(False)` sends what they committed meanwhile (trace D on 2 cores, where the workers stay paused:
        reconciling every round was ~0.3 ms of host work a round)."""
        assert self.buffers is not None
        if self.paused:
            self.unreconciled[slots] = True
            return
        commits = self.buffers.reconcile(slots, output, emitted)
        owners = self.worker_of[slots]
        for index in set(owners.tolist()) - {NO_WORKER}:
            if not self.workers[index].ready:
                continue
            mask = owners == index
            lengths = emitted[mask]
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            # the rows' tokens, in the same row order as the full message
            row_starts = commits.offsets[:-1][mask]
            tokens = np.concatenate([commits.tokens[s : s + n] for s, n in zip(row_starts, lengths)]) \
                if len(lengths) else np.zeros(0, dtype=np.int64)
            self._send(index, type(commits)(slots[mask], commits.starts[mask], offsets, tokens))
            self.sent[slots[mask]] = commits.starts[mask] + lengths

    # ------------------------------------------------------------------ failures
    def _send(self, index: int, message: object) -> None:
        try:
            self.workers[index].transport.send(message)
        except WorkerLost as exc:
            self._lost(index, str(exc))

    def _send_rows(self, index: int, slots: np.ndarray, with_output: bool) -> None:
        keys = np.asarray([self.rows[s][0] for s in slots.tolist()], dtype=np.int64)
        prompts = [self.rows[s][1] for s in slots.tolist()]
        outputs = [np.asarray(self.output_of(s) if with_output else [], dtype=np.int64) for s in slots.tolist()]
        self._send(index, AddRows(slots, keys, prompts, outputs))
        self.sent[slots] = [len(o) for o in outputs]

    def _on_weights(self, index: int, message: WeightsLoaded) -> None:
        self.workers[index].weights = message
        if message.error:
            logger.warning("drafter worker %d could not load weights v%d (%s); it drafts with its old weights",
                           index, message.version, message.error)

    def _on_ready(self, index: int) -> None:
        worker = self.workers[index]
        worker.ready = True
        if self.weights_message is not None:  # a restarted worker starts from the model files: bring it up to date
            self._send(index, self.weights_message)
        if self.reset_message is None:
            return
        self._send(index, self.reset_message)
        self._send(index, Pause(self.paused))
        mine = np.flatnonzero(self.worker_of == index)
        if len(mine):
            assert self.buffers is not None
            self.buffers.drop_pending(mine)
            self._send_rows(index, mine, with_output=True)

    def _lost(self, index: int, why: str) -> None:
        worker = self.workers[index]
        if not worker.ready and worker.transport.alive():
            return
        logger.warning("drafter worker %d lost (%s); its rows decode without drafts until it is back", index, why)
        if self.buffers is not None:
            self.buffers.drop_pending(np.flatnonzero(self.worker_of == index))
        worker.transport.close()
        if worker.restarts >= self.max_restarts:
            logger.warning("drafter worker %d failed %d times; not restarting it", index, worker.restarts)
            self.worker_of[self.worker_of == index] = NO_WORKER
            worker.ready = False
            return
        self.workers[index] = WorkerSlot(self.make_transport(index), restarts=worker.restarts + 1,
                                         busy_s=worker.busy_s, steps=worker.steps)

    def stats(self) -> dict[str, float]:
        assert self.buffers is not None
        return {"drafts_arrived": self.buffers.arrived, "drafts_kept": self.buffers.kept,
                "worker_busy_s": sum(w.busy_s for w in self.workers),
                "worker_restarts": sum(w.restarts for w in self.workers)}
