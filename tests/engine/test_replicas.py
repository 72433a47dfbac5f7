"""Rollout replicas (Ray actors on a local Ray instance): the same records as one in-process engine, whatever
the number of replicas, the mode or a replica killed mid-rollout; weights and drafters synced to every one.

The tiny target is float32 with the CPU kernels on, as a real run; records (ids, samples, token ids, texts,
log-probabilities) are compared exactly.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from specactor_engine.config import SpecActorConfig, load_config
from specactor_engine.engine import Engine
from specactor_engine.model.weights import weights_digest
from specactor_engine.replicas.merge import ChunkStats, merge_stats
from specactor_engine.replicas.plan import group_cost, groups_per_chunk, plan_chunks
from specactor_engine.types import EngineStats
from tests.engine.test_exactness import ragged_requests

ray = pytest.importorskip("ray")

DRAFTERS = "[{kind: suffix, max_depth: 12, min_match: 1}, {kind: ngram, min_n: 1, max_n: 3}]"


@pytest.fixture(scope="module")
def local_ray():
    from specactor_engine.decoupled.ray_transport import ensure_ray

    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # a short path: Ray's unix sockets live under it
    ensure_ray(num_cpus=4, temp_dir=temp)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def replica_config(model_dir: Path, mode: str, replicas: int, drafters: str = DRAFTERS) -> SpecActorConfig:
    return load_config(None, [
        f"model.target={model_dir}", "model.max_model_len=160", f"rollout.mode={mode}", "rollout.verify_length=fixed",
        f"rollout.drafters={drafters}", f"rollout.replicas={replicas}", "rollout.replica_threads=1", "threads=1",
        "sampling.temperature=1.0", "sampling.n=2", "sampling.max_new_tokens=16", "sampling.seed=3"])


def records(result) -> list[dict]:
    return [out.to_json() for out in result.outputs]


def generate(config: SpecActorConfig, requests, progress=None):
    from specactor_engine.replicas.pool import ReplicaPool

    with ReplicaPool.from_config(config) as pool:
        return pool.generate(requests, config.sampling, progress=progress), pool


@pytest.mark.parametrize("mode", ["ar", "coupled", "specactor"])
def test_one_two_and_three_replicas_give_the_same_records(local_ray, tiny_model_dir, mode):
    requests = ragged_requests(6)
    config = replica_config(tiny_model_dir, mode, 1)
    reference = Engine.from_config(config).generate(requests, config.sampling)
    assert len(reference.outputs) == 12
    for replicas in (2, 3):
        result, _ = generate(replica_config(tiny_model_dir, mode, replicas), requests)
        assert records(result) == records(reference), f"{replicas} replicas, mode {mode}"
        split = result.stats.replicas
        assert len(split) == replicas and sum(r["sequences"] for r in split) == 12
        assert all(r["chunks"] >= 1 for r in split)  # the work queue gave every replica work
        assert result.stats.output_tokens == reference.stats.output_tokens
        if mode != "ar":
            assert result.stats.drafted_tokens > 0


def test_a_replica_killed_mid_rollout_loses_and_repeats_nothing(local_ray, tiny_model_dir):
    """The first chunk to return kills the other replica while it decodes a chunk (or is about to take one):
    its groups go back to the queue and the replica is restarted; the records equal the reference."""
    from specactor_engine.replicas.pool import ReplicaPool

    requests = ragged_requests(8)
    config = replica_config(tiny_model_dir, "coupled", 2)
    reference = Engine.from_config(config).generate(requests, config.sampling)
    with ReplicaPool.from_config(config) as pool:
        killed: list[int] = []

        def kill_once(done: int, total: int) -> None:
            if not killed:
                killed.append(1)
                pool.kill_replica(1)

        result = pool.generate(requests, config.sampling, progress=kill_once)
        assert records(result) == records(reference)
        assert sum(r["restarts"] for r in result.stats.replicas) == 1
        assert result.stats.num_sequences == len(reference.outputs)
        again = pool.generate(requests, config.sampling)  # the restarted replica takes work as before
        assert records(again) == records(reference)


def test_weights_and_drafters_reach_every_replica(local_ray, tiny_model_dir, tiny_draft_dir):
    """After an update every replica answers with the driver's digest, also a replica killed before it; the
    outputs then equal an in-process engine's on the same weights; drafters are the driver's, bit for bit."""
    from specactor_engine.replicas.actor import drafter_digests
    from specactor_engine.replicas.pool import ReplicaPool

    drafters = f"[{{kind: suffix, max_depth: 12, min_match: 1}}, {{kind: model, model: {tiny_draft_dir}, name: draft}}]"
    config = replica_config(tiny_model_dir, "coupled", 2, drafters)
    reference = Engine.from_config(config.model_copy(update={"rollout": config.rollout.model_copy(
        update={"replicas": 1})}))
    generator = torch.Generator().manual_seed(0)
    new = {name: p.detach() + 0.01 * torch.randn(p.shape, generator=generator)
           for name, p in reference.runner.model.named_parameters()}
    draft = {name: p.detach() * 0.9 for name, p in reference.drafters[1].trainable_model().named_parameters()}
    requests = ragged_requests(4)
    with ReplicaPool.from_config(config) as pool:
        pool.kill_replica(0)
        pool.update_weights(new.items(), version=1)
        assert pool.digests == [weights_digest(new.items())] * 2 and pool.replicas[0].restarts == 1
        assert pool.replica_digests() == pool.digests and pool.policy_version == 1
        pool.update_weights(draft.items(), version=1, component="draft")
        pool.drafters[0].record_rollout([1, 2, 3], [4, 5])  # driver-side state the replicas must get too
        assert pool.sync_drafters()["sync/replica_drafters_equal"] == 1.0
        held = ray.get([r.actor.digests.remote() for r in pool.replicas])
        assert all(d == drafter_digests(pool.driver) for _, d in held)
        assert drafter_digests(pool.driver)["draft"] == weights_digest(draft.items())
        result = pool.generate(requests, config.sampling)
    reference.update_weights(new.items(), version=1)
    reference.update_weights(draft.items(), version=1, component="draft")
    assert records(result) == records(reference.generate(requests, config.sampling))
    assert {out.policy_version for out in result.outputs} == {1}


def test_history_kept_and_plain_decoding_reach_the_replicas(local_ray, tiny_model_dir):
    from specactor_engine.replicas.pool import ReplicaPool

    requests = ragged_requests(4)
    config = replica_config(tiny_model_dir, "coupled", 2)
    with ReplicaPool.from_config(config) as pool:
        with pool.history_kept():
            speculative = pool.generate(requests, config.sampling)
            assert len(pool.drafters[0].history) == 8  # the driver's suffix drafter saw every output
        assert len(pool.drafters[0].history) == 0
        with pool.plain_decoding():
            assert not pool.speculative
            plain = pool.generate(requests, config.sampling)
        assert pool.speculative
    assert records(plain) == records(speculative)
    assert plain.stats.mode == "ar" and plain.stats.drafted_tokens == 0 < speculative.stats.drafted_tokens


def test_plan_keeps_groups_whole_and_puts_the_longest_first():
    costs = [group_cost(length, 4, 16) for length in (3, 40, 10, 40, 7)]
    chunks = plan_chunks(costs, groups_per_chunk(len(costs), 2, 4, 256))
    assert [c.indices for c in chunks] == [(1, 3), (2, 4), (0,)]
    assert sorted(i for c in chunks for i in c.indices) == list(range(5))
    assert groups_per_chunk(100, 2, 8, 64) == 8  # no more rows than a replica decodes at once
    assert groups_per_chunk(0, 3, 1, 8) == 1


def test_merged_stats_add_up_and_keep_each_replicas_split():
    a = EngineStats(mode="coupled", num_sequences=2, output_tokens=10, drafted_per_position=[4, 2],
                    accepted_per_position=[3, 1], drafted_per_drafter={"ngram": 6}, verify_s=1.0, total_s=2.0,
                    timeline=[{"t": 0.5, "rows": 2}])
    b = EngineStats(mode="coupled", num_sequences=4, output_tokens=20, drafted_per_position=[1, 1],
                    accepted_per_position=[1, 0], drafted_per_drafter={"ngram": 1, "suffix": 1}, verify_s=3.0,
                    total_s=4.0, timeline=[{"t": 0.1, "rows": 4}])
    merged = merge_stats([ChunkStats(0, 0.0, a), ChunkStats(1, 1.0, b)], "coupled", 4.5, [0, 1])
    assert (merged.num_sequences, merged.output_tokens, merged.total_s, merged.verify_s) == (6, 30, 4.5, 4.0)
    assert merged.drafted_per_position == [5, 3] and merged.accepted_per_position == [4, 1]
    assert merged.drafted_per_drafter == {"ngram": 7, "suffix": 1}
    assert [(e["t"], e["replica"]) for e in merged.timeline] == [(0.5, 0), (1.1, 1)]
    assert [(r["busy_s"], r["sequences"], r["restarts"]) for r in merged.replicas] == [(2.0, 2, 0), (4.0, 4, 1)]
