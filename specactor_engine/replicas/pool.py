"""`ReplicaPool`: N rollout engines in Ray actors behind the `Engine`'s generate contract.

`generate` queues the call's GRPO groups (plan.py), hands a chunk to each idle replica, gathers the
outputs back into (request, sample) order and merges the stats (merge.py). The outputs equal one
engine's: a sample's noise is keyed by (seed, request id, sample, position), never by where it runs.

The driver keeps an engine of its own that never decodes (`driver`): the source of truth for what the
replicas must hold. Its target is what the pipeline checks against the trainer and trains the drafters
against; its drafters are the ones refreshed, saved and loaded, and they see every output of the pool
(`Drafter.record_rollout`), so `sync_drafters` hands every replica the same drafters. A replica that
dies (its actor is gone) or cannot load is restarted from the config and loads the driver's target and
drafters before it takes work; a chunk it had not returned goes back to the front of the queue.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import torch

from specactor_engine import clock
from specactor_engine.modes import MODES
from specactor_engine.replicas.actor import (DrafterPayload, ReplicaActor, apply_drafter_payload, drafter_digests,
                                             drafter_payload, target_digest)
from specactor_engine.replicas.merge import ChunkStats, merge_stats
from specactor_engine.replicas.plan import Chunk, group_cost, groups_per_chunk, plan_chunks
from specactor_engine.tokenize import encode_request
from specactor_engine.types import RolloutResult, SequenceOutput

if TYPE_CHECKING:
    from specactor_engine.config import SpecActorConfig
    from specactor_engine.engine import Engine
    from specactor_engine.types import Request

logger = logging.getLogger(__name__)


class ReplicaLoadError(RuntimeError):
    """A replica holds other weights than the driver after a load (and restarts did not fix it)."""


def replica_threads(config: SpecActorConfig) -> int:
    """torch threads per replica: rollout.replica_threads, else the threads (or cores) divided among them."""
    if config.rollout.replica_threads is not None:
        return config.rollout.replica_threads
    return max(1, (config.threads or os.cpu_count() or 1) // config.rollout.replicas)


def driver_config(config: SpecActorConfig) -> SpecActorConfig:
    """The driver engine's config: the same target and in-process drafters, no drafter workers (it never decodes)."""
    rollout = config.rollout
    if rollout.decoupled.drafter is not None:
        mode = rollout.mode if MODES[rollout.mode].in_process and rollout.drafters else "ar"
        rollout = rollout.model_copy(update={"mode": mode, "decoupled": rollout.decoupled.model_copy(
            update={"drafter": None})})
    return config.model_copy(update={"rollout": rollout})


@dataclass
class Replica:
    index: int
    actor: Any  # the Ray actor handle
    restarts: int = 0


class ReplicaPool:
    """Rollout replicas (Ray actors) with the Engine's interface: generate, reserve, update_weights, ...

    Build with `from_config` (joins rollout.ray_address or starts a local Ray); `close` ends the actors.
    """

    def __init__(self, config: SpecActorConfig, driver: Engine, policy_version: int = 0) -> None:
        import ray

        self._ray = ray
        self.config = config
        self.driver = driver
        self.mode = MODES[config.rollout.mode]
        self.threads = replica_threads(config)
        self.max_restarts = config.rollout.replica_restarts
        self._version = driver.policy_version = policy_version
        self._plain = False
        rollout = config.rollout.model_copy(update={"replicas": 1})
        self._replica_config = config.model_copy(update={"threads": self.threads, "rollout": rollout})
        self.replicas = [Replica(i, self._start_actor()) for i in range(config.rollout.replicas)]
        ray.get([r.actor.pid.remote() for r in self.replicas])  # every engine is built before the first call
        self.digests: list[str] = []  # each replica's target digest, as answered at its last load

    @classmethod
    def from_config(cls, config: SpecActorConfig, policy_version: int = 0) -> ReplicaPool:
        from specactor_engine.decoupled.ray_transport import ensure_ray
        from specactor_engine.engine import Engine

        ensure_ray(config.rollout.ray_address,
                   num_cpus=max(os.cpu_count() or 1, config.rollout.replicas * replica_threads(config)))
        return cls(config, Engine.from_config(driver_config(config)), policy_version)

    def _start_actor(self) -> Any:
        remote = self._ray.remote(ReplicaActor).options(num_cpus=self.threads, max_restarts=0)
        return remote.remote(self._replica_config, self._version)

    # ------------------------------------------------------------------ the Engine's attributes
    @property
    def tokenizer(self) -> Any:
        return self.driver.tokenizer

    @property
    def runner(self) -> Any:
        """The driver's target (what the trainer's weights are checked against and drafters train against)."""
        return self.driver.runner

    @property
    def drafters(self) -> list[Any]:
        """The driver's drafters: refreshed, saved and loaded there, then sent to every replica (`sync_drafters`)."""
        return self.driver.drafters

    @property
    def worker_drafter(self) -> None:
        """Each replica's drafter workers keep their own copy; the pool does not refresh it (docs/distributed.md)."""
        return None

    @property
    def speculative(self) -> bool:
        return self.mode.speculative and not self._plain

    @property
    def policy_version(self) -> int:
        return self._version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        """Label the weights every replica holds now (they loaded them from the config's model)."""
        self._ray.get([r.actor.set_policy_version.remote(version) for r in self.replicas])
        self.driver.policy_version = self._version = version

    @contextlib.contextmanager
    def plain_decoding(self) -> Iterator[None]:
        """`Engine.plain_decoding` on every replica for the calls inside the block."""
        self._plain = True
        try:
            with self.driver.plain_decoding():
                yield
        finally:
            self._plain = False

    @contextlib.contextmanager
    def history_kept(self) -> Iterator[None]:
        """`Engine.history_kept` on the driver and every replica."""
        self._ray.get([r.actor.keep_history.remote() for r in self.replicas])
        try:
            with self.driver.history_kept():
                yield
        finally:
            self._ray.get([r.actor.restore_history.remote() for r in self.replicas])

    # ------------------------------------------------------------------ generate
    def generate(self, requests: Sequence[Request], sampling: Any,
                 progress: Callable[[int, int], None] | None = None, *,
                 on_output: Callable[[SequenceOutput], None] | None = None) -> RolloutResult:
        """Roll out `sampling.n` samples of every request on the replicas; outputs in (request, sample) order.

        progress(finished_sequences, total_sequences) is called as each chunk of groups returns, and
        on_output(output) for each of the chunk's samples (whole groups: a pool has no `skip`).
        """
        started = clock.now()
        queue = deque(self._plan(requests, sampling))
        idle = deque(self.replicas)
        in_flight: dict[Any, tuple[Replica, Chunk, float]] = {}
        outputs: dict[int, list[SequenceOutput]] = {}
        parts: list[ChunkStats] = []
        restarts_before = [r.restarts for r in self.replicas]
        while queue or in_flight:
            while queue and idle:
                replica, chunk = idle.popleft(), queue.popleft()
                ref = replica.actor.generate.remote([requests[i] for i in chunk.indices], sampling, self._plain)
                in_flight[ref] = (replica, chunk, clock.now() - started)
            ref = self._ray.wait(list(in_flight), num_returns=1)[0][0]
            replica, chunk, offset = in_flight.pop(ref)
            try:
                result: RolloutResult = pickle.loads(self._ray.get(ref))
            except self._ray.exceptions.RayActorError as exc:
                logger.warning("replica %d died with %d groups unfinished (%s); they go back to the queue",
                               replica.index, len(chunk.indices), str(exc).splitlines()[0])
                queue.appendleft(chunk)
                self._restart(replica)
                idle.append(replica)
                continue
            idle.append(replica)
            self._gather(chunk, result.outputs, sampling.n, outputs)
            if on_output is not None:
                for output in result.outputs:
                    on_output(output)
            parts.append(ChunkStats(replica.index, offset, result.stats))
            if progress is not None:
                progress(sum(map(len, outputs.values())), len(requests) * sampling.n)
        ordered = [out for i in range(len(requests)) for out in outputs.get(i, [])]
        self._record(ordered)
        restarts = [r.restarts - before for r, before in zip(self.replicas, restarts_before)]
        mode = "ar" if self._plain else self.mode.name
        return RolloutResult(ordered, merge_stats(parts, mode, clock.now() - started, restarts))

    def _plan(self, requests: Sequence[Request], sampling: Any) -> list[Chunk]:
        """The call's chunks of groups, longest expected first (prompt lengths from the driver's tokenizer)."""
        lengths = [len(encode_request(r, self.tokenizer, self.driver.chat_template)[0] or ()) for r in requests]
        costs = [group_cost(length, sampling.n, sampling.max_new_tokens) for length in lengths]
        per_chunk = groups_per_chunk(len(requests), len(self.replicas), sampling.n, self.config.rollout.max_batch_size)
        return plan_chunks(costs, per_chunk)

    @staticmethod
    def _gather(chunk: Chunk, chunk_outputs: list[SequenceOutput], n: int,
                outputs: dict[int, list[SequenceOutput]]) -> None:
        """A chunk's outputs (its requests in chunk order, n samples each) under their requests' indices."""
        if len(chunk_outputs) != n * len(chunk.indices):
            raise RuntimeError(f"a replica returned {len(chunk_outputs)} outputs for {len(chunk.indices)} groups "
                               f"of {n}")
        for position, index in enumerate(chunk.indices):
            outputs[index] = chunk_outputs[position * n:(position + 1) * n]

    def _record(self, outputs: list[SequenceOutput]) -> None:
        """The driver's drafters see every finished sample, as one engine's drafters would have."""
        for drafter in self.driver.drafters:  # none inside plain_decoding
            for out in outputs:
                if out.error is None:
                    drafter.record_rollout(out.prompt_token_ids, out.token_ids)

    def reserve(self, requests: Sequence[Request], sampling: Any) -> None:
        """Size every replica's caches for the largest chunk a `generate` of these requests hands it."""
        chunks = self._plan(requests, sampling)
        if chunks:
            largest = max(chunks, key=lambda c: len(c.indices))
            self._ray.get([r.actor.reserve.remote([requests[i] for i in largest.indices], sampling)
                           for r in self.replicas])

    def warm_up(self, requests: Sequence[Request], sampling: Any) -> None:
        """`generate` of `requests` on every replica, outputs dropped: each pays its one-time costs (the sampler's
        compile, first-call dispatch) here rather than in the first chunk it is handed (`generate` of one short
        request would warm only the replica that takes it)."""
        with self.history_kept():
            self._ray.get([r.actor.generate.remote(list(requests), sampling, self._plain) for r in self.replicas])

    def cpu_s(self) -> float:
        """CPU seconds the replicas' processes have used so far (what they computed for this pool)."""
        return float(sum(self._ray.get([r.actor.cpu_s.remote() for r in self.replicas])))

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int,
                       component: str = "target") -> None:
        """Load new weights into the driver, put them once in the object store, and load them on every replica;
        each answers with its digest, which must equal the driver's (`component`: "target" or a drafter's name)."""
        named = {name: tensor.detach().to("cpu").contiguous() for name, tensor in weights}
        self.driver.update_weights(named.items(), version, component)
        if component == "target":
            ref = self._ray.put(named)
            self.digests = self._on_every_replica(lambda r: r.actor.load_target.remote(ref, version))
            self._version = version
            self._check(self.digests, target_digest(self.driver), f"target v{version}")
        else:
            self._sync(drafter_payload(self.driver, [component], with_state=False))

    def sync_drafters(self) -> dict[str, float]:
        """Every replica loads the driver's drafters (weights, state such as the suffix history, versions)."""
        return self._sync(drafter_payload(self.driver))

    def _sync(self, payload: DrafterPayload) -> dict[str, float]:
        ref = self._ray.put(payload)
        answers = self._on_every_replica(lambda r: r.actor.load_drafters.remote(ref))
        self._check(answers, drafter_digests(self.driver), "drafters")
        return {"sync/replica_drafters_equal": 1.0, "sync/replicas": float(len(self.replicas))}

    def replica_digests(self) -> list[str]:
        """Each replica's target digest, asked now."""
        return [target for target, _ in self._ray.get([r.actor.digests.remote() for r in self.replicas])]

    def _on_every_replica(self, call: Callable[[Replica], Any]) -> list[Any]:
        """`call` on every replica; one that died or failed is restarted (it then loads the driver's state)."""
        refs = [call(r) for r in self.replicas]
        answers = []
        for replica, ref in zip(self.replicas, refs):
            try:
                answers.append(self._ray.get(ref))
            except (self._ray.exceptions.RayActorError, self._ray.exceptions.RayTaskError) as exc:
                logger.warning("replica %d could not load (%s); restarting it", replica.index,
                               str(exc).splitlines()[0])
                self._restart(replica)
                answers.append(self._ray.get(call(replica)))
        return answers

    def _check(self, answers: list[Any], expected: Any, what: str) -> None:
        wrong = [i for i, answer in enumerate(answers) if answer != expected]
        if wrong:
            raise ReplicaLoadError(f"replicas {wrong} hold other {what} than the driver after the load")

    def _restart(self, replica: Replica) -> None:
        """A fresh actor for `replica`, holding the driver's target, drafters and version before it takes work."""
        replica.restarts += 1
        if replica.restarts > self.max_restarts:
            raise RuntimeError(f"rollout replica {replica.index} failed {replica.restarts} times "
                               f"(rollout.replica_restarts = {self.max_restarts})")
        with contextlib.suppress(Exception):
            self._ray.kill(replica.actor, no_restart=True)
        replica.actor = self._start_actor()
        weights = {name: p.detach().to("cpu").contiguous() for name, p in self.driver.runner.model.named_parameters()}
        digest = self._ray.get(replica.actor.load_target.remote(self._ray.put(weights), self._version))
        drafters = self._ray.get(replica.actor.load_drafters.remote(self._ray.put(drafter_payload(self.driver))))
        self._check([digest], target_digest(self.driver), f"target v{self._version} (restarted replica)")
        self._check([drafters], drafter_digests(self.driver), "drafters (restarted replica)")
        logger.info("replica %d restarted (restart %d) at v%d", replica.index, replica.restarts, self._version)

    def kill_replica(self, index: int) -> None:
        """Kill a replica's actor abruptly (tests: a replica crash); the pool restarts it when it next fails."""
        self._ray.kill(self.replicas[index].actor, no_restart=True)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """End every replica's actor (its drafter workers with it) and the driver's engine (idempotent)."""
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                self._ray.get(replica.actor.close.remote(), timeout=30)
            with contextlib.suppress(Exception):
                self._ray.kill(replica.actor, no_restart=True)
        self.replicas = []
        self.driver.close()

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ReplicaPool", "ReplicaLoadError", "apply_drafter_payload", "driver_config", "replica_threads"]
