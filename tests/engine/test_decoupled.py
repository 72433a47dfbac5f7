"""Decoupled speculation: drafter workers in their own processes, the verifier never waits.

Exactness against plain decoding (fp64 tiny models, greedy and seeded sampling) with random
transport delays and two workers; a worker killed mid-rollout; a stress run; the buffers' and
the worker's protocol logic in process.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from specactor_engine.decoupled.buffers import DraftBuffers
from specactor_engine.decoupled.coordinator import DecoupledCoordinator
from specactor_engine.decoupled.drafter_worker import DraftWorker
from specactor_engine.decoupled.launch import DrafterWorkers
from specactor_engine.decoupled.protocol import (AddRows, Commits, Drafts, Pause, Ready, Reserve, Reserved, Reset,
                                                 SamplingSpec, chain_hash)
from specactor_engine.decoupled.transport import DelayedTransport, LocalWorker, Transport, WorkerSpec
from specactor_engine.engine import Engine
from specactor_engine.model.runner import load_hf_model
from specactor_engine.types import Request
from tests.engine.test_exactness import MAX_LEN, ragged_requests, rollout, run, sampling, token_ids
from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer, save_tiny_model

K = 4
NOISE = 0.3  # relative std of the noise on the noisy drafter's lm_head
ROUND_S = 0.03  # tiny models verify in ~1 ms: a slower verifier (as with real models) lets drafts arrive


def slow_verifier(done: int, total: int) -> None:
    """Progress callback (after every round) that stands in for a real model's verify time."""
    time.sleep(ROUND_S)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decoupled")
    # a noisy copy of the target: its drafts are often right and often wrong, so both keeping
    # streamed drafts and realigning after rejections are exercised
    noisy = make_tiny_model("qwen2", seed=11, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        noisy.lm_head.weight.add_(torch.randn(noisy.lm_head.weight.shape, generator=generator,
                                              dtype=torch.float64) * NOISE * noisy.lm_head.weight.std())
    noisy.save_pretrained(root / "noisy")
    make_tokenizer().save_pretrained(root / "noisy")
    return {"target": save_tiny_model(root / "target", "qwen2", seed=11, dtype=torch.float64),
            "other": root / "noisy"}


@pytest.fixture(scope="module")
def target(models):
    return load_hf_model(models["target"], "float64")


def coordinator_for(path: Path, vocab: int, workers: int = 1, max_delay_s: float = 0.0) -> DecoupledCoordinator:
    def start(index: int):
        worker = LocalWorker(WorkerSpec(str(path), "float64", 1, vocab))
        return DelayedTransport(worker, max_delay_s, seed=index) if max_delay_s else worker

    coordinator = DecoupledCoordinator(start, workers)
    assert coordinator.wait_ready(120), "drafter workers did not start"
    return coordinator


def decoupled_engine(target, coordinator, verifier_threads: int | None = None, **fields) -> Engine:
    """fields: RolloutConfig fields (and `dynamic_decoupling`) over the tests' defaults."""
    config = rollout("decoupled", workers=True, num_draft_tokens=K, max_batch_size=16, **fields)
    return Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN,
                  workers=DrafterWorkers(coordinator, verifier_threads), check_invariants=True)


@pytest.fixture(scope="module")
def delayed_pair(models, target):
    """Two workers running the target's own weights (accepted drafts), delays up to 20 ms each way."""
    coordinator = coordinator_for(models["target"], target.config.vocab_size, workers=2, max_delay_s=0.02)
    yield coordinator
    coordinator.close()


@pytest.fixture(scope="module")
def other_drafter(models, target):
    coordinator = coordinator_for(models["other"], target.config.vocab_size, workers=1, max_delay_s=0.005)
    yield coordinator
    coordinator.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_exact_with_delays_and_two_workers(target, delayed_pair, temperature):
    params = sampling(temperature, n=2, max_new_tokens=24)
    reference = token_ids(run(target, ragged_requests(6), params))
    result = decoupled_engine(target, delayed_pair).generate(ragged_requests(6), params, progress=slow_verifier)
    assert token_ids(result) == reference
    assert result.stats.accepted_tokens > 0  # drafts were really used
    assert result.stats.decoupled["drafts_arrived"] > 0
    workers_used = {int(w) for w in delayed_pair.worker_of if w >= 0}
    assert workers_used <= {0, 1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_exact_with_a_drafter_that_is_often_wrong(target, other_drafter, temperature):
    params = sampling(temperature, n=2, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(6), params))
    result = decoupled_engine(target, other_drafter).generate(ragged_requests(6), params, progress=slow_verifier)
    assert token_ids(result) == reference
    assert result.stats.drafted_tokens > result.stats.accepted_tokens  # rejections happened


def test_dynamic_verify_length_is_exact_in_decoupled_mode(target, delayed_pair):
    params = sampling(1.0, n=2, max_new_tokens=24)
    reference = token_ids(run(target, ragged_requests(5), params))
    engine = decoupled_engine(target, delayed_pair, verify_length="dynamic")
    assert token_ids(engine.generate(ragged_requests(5), params, progress=slow_verifier)) == reference


def test_dynamic_decoupling_switches_phases_and_stays_exact(target, delayed_pair):
    params = sampling(1.0, n=2, max_new_tokens=40, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(5), params))
    engine = decoupled_engine(target, delayed_pair, verify_length="dynamic", dynamic_decoupling=True,
                              verifier_threads=1)
    result = engine.generate(ragged_requests(5), params, progress=slow_verifier)
    assert token_ids(result) == reference
    assert set(result.stats.arm_rounds) == {"decoupled", "solo"}  # both arms were measured
    threads = torch.get_num_threads()
    engine.generate(ragged_requests(2), sampling(0.0, max_new_tokens=4))
    assert torch.get_num_threads() == threads  # the caller's thread count comes back after each call


@pytest.mark.parametrize("dynamic", [True, False])
def test_each_cost_profile_is_measured_on_the_threads_its_rounds_run_on(target, delayed_pair, monkeypatch, dynamic):
    """With dynamic decoupling plain rounds (workers paused) run on every thread and the workers' arm on the
    verifier's: a profile each. Without it every round runs on the verifier's threads: one profile, on them."""
    from specactor_engine.policies import cost_profile
    from tests.engine.test_dynamic_verify_length import table

    measured: list[int] = []
    tables = []

    def measure(*args, **kwargs):
        measured.append(torch.get_num_threads())
        tables.append(table(0.01 * len(measured), 0.001))
        return tables[-1]

    monkeypatch.setattr(cost_profile, "_load_or_measure", measure)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = decoupled_engine(target, delayed_pair, verify_length="dynamic", dynamic_decoupling=dynamic,
                                  verifier_threads=1)
        engine.generate(ragged_requests(2), sampling(0.0, max_new_tokens=4))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)
    policy = engine.length_policy
    assert policy is not None
    if dynamic:
        assert measured == [2, 1]
        assert policy.cost is engine.cost_table is tables[0] and policy.cost_for("solo") is tables[0]
        assert policy.cost_for("decoupled") is tables[1]  # measured on the verifier's one thread
    else:
        assert measured == [1] and policy.regime_costs == {}


def test_killed_worker_still_completes_identically_and_restarts(models, target):
    params = sampling(1.0, n=2, max_new_tokens=60, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(6), params))
    coordinator = coordinator_for(models["target"], target.config.vocab_size, workers=1)
    first = coordinator.workers[0].transport
    engine = decoupled_engine(target, coordinator)
    killed, rounds = [], []

    def kill_midway(done: int, total: int) -> None:  # called after every round
        rounds.append(done)
        slow_verifier(done, total)
        if len(rounds) == 5:
            first.kill()
            killed.append(True)

    try:
        result = engine.generate(ragged_requests(6), params, progress=kill_midway)
        assert killed and token_ids(result) == reference
        assert not first.process.is_alive()
        assert coordinator.workers[0].restarts == 1
        assert coordinator.wait_ready(120)  # the replacement comes up and takes the rows of the next call
        again = engine.generate(ragged_requests(6), params, progress=slow_verifier)
        assert token_ids(again) == reference and again.stats.accepted_tokens > 0
    finally:
        coordinator.close()
    assert not any(w.transport.process.is_alive() for w in coordinator.workers)


def test_stress_random_delays_and_lengths_leaves_no_process(models, target):
    before = {p.pid for p in multiprocessing.active_children()}
    coordinator = coordinator_for(models["other"], target.config.vocab_size, workers=2, max_delay_s=0.05)
    engine = decoupled_engine(target, coordinator, verify_length="dynamic")
    rng = np.random.default_rng(0)
    try:
        for trial in range(3):
            requests = [Request(f"s{trial}-{i}", prompt_token_ids=rng.integers(3, 200, int(rng.integers(1, 30))).tolist())
                        for i in range(int(rng.integers(3, 9)))]
            params = sampling(1.0, n=int(rng.integers(1, 4)), max_new_tokens=int(rng.integers(5, 50)), seed=trial)
            reference = token_ids(run(target, requests, params))
            pause = float(rng.uniform(0, 0.02))
            assert token_ids(engine.generate(requests, params, progress=lambda d, t: time.sleep(pause))) == reference
    finally:
        coordinator.close()
    deadline = time.monotonic() + 10
    while {p.pid for p in multiprocessing.active_children()} - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not {p.pid for p in multiprocessing.active_children()} - before


# ------------------------------------------------------------------------------ protocol units
def test_buffers_keep_only_drafts_that_continue_the_chain():
    buffers = DraftBuffers(num_slots=2, width=4)
    buffers.add_rows(np.array([0, 1]))
    owned = np.array([True, True])

    def drafts(slots, positions, tokens, parents):
        return Drafts(np.array(slots), np.array(positions), np.array(tokens), np.array(parents, dtype=np.int64), 0.0, 1)

    buffers.ingest(drafts([0, 1], [0, 0], [7, 9], [chain_hash([]), 12345]), owned)  # row 1: wrong parent
    buffers.ingest(drafts([0], [1], [8], [chain_hash([7])]), owned)
    buffers.ingest(drafts([0], [3], [5], [chain_hash([7, 8, 1])]), owned)  # a gap: dropped
    assert buffers.count.tolist() == [2, 0]
    tokens, num = buffers.take(np.array([0, 1]), np.array([4, 4]))
    assert tokens.tolist() == [[7, 8], [0, 0]] and num.tolist() == [2, 0]
    # row 0 verifies 1 draft, accepts it, and the target's next token equals its 2nd draft: it stays
    commits = buffers.reconcile(np.array([0]), np.array([[7, 8]]), np.array([2]))
    assert buffers.count[0] == 0 and buffers.committed_len[0] == 2
    assert commits.tokens.tolist() == [7, 8] and commits.starts.tolist() == [0]
    buffers.ingest(drafts([0], [2], [4], [chain_hash([7, 8])]), owned)
    buffers.ingest(drafts([0], [3], [6], [chain_hash([7, 8, 4])]), owned)
    # verify 1 of 2, rejected (target says 3): the rest is dropped
    buffers.reconcile(np.array([0]), np.array([[3, 0]]), np.array([1]))
    assert buffers.count[0] == 0 and buffers.pending_hash[0] == chain_hash([7, 8, 3])
    # a late draft built on the rejected token dies on arrival
    buffers.ingest(drafts([0], [3], [1], [chain_hash([7, 8, 4])]), owned)
    assert buffers.count[0] == 0


def test_worker_realigns_on_a_diverging_commit(target):
    worker = DraftWorker(target, target.config.vocab_size)
    worker.handle(Reset(2, 64, SamplingSpec(1.0, 0, 1.0, 20), window=3, generation=1))
    worker.handle(AddRows(np.array([1]), np.array([99]), [np.array([5, 6, 7])], [np.array([], dtype=np.int64)]))
    steps = [worker.step() for _ in range(4)]
    assert steps[3] is None  # the window (3 past the last known commit) is full
    drafted = [int(s.tokens[0]) for s in steps[:3]]
    assert [int(s.positions[0]) for s in steps[:3]] == [0, 1, 2]
    wrong = (drafted[1] + 1) % target.config.vocab_size
    worker.handle(Commits(np.array([1]), np.array([0]), np.array([0, 2]), np.array([drafted[0], wrong])))
    row = worker.rows[1]
    assert row.chain == [drafted[0], wrong] and row.known == 2
    assert row.kv <= 3 + 1  # KV cut back to the divergence
    nxt = worker.step()
    assert int(nxt.positions[0]) == 2 and int(nxt.parent_hashes[0]) == chain_hash([drafted[0], wrong])


def test_worker_reserve_sizes_the_cache_a_later_reset_reuses(target):
    """`Reserve` at start-up allocates the worker's KV cache; a generate call's `Reset` of at most that
    size keeps the same buffers (no allocation on the rollout's clock)."""
    worker = DraftWorker(target, target.config.vocab_size)
    assert worker.handle(Reserve(4, 64)) == Reserved(4, 64)  # the answer the coordinator waits for
    cache = worker.runner.cache
    assert cache.num_slots >= 4 and cache.max_len >= 64
    worker.handle(Reset(3, 60, SamplingSpec(1.0, 0, 1.0, 20), window=3, generation=1))
    assert worker.runner.cache is cache
    worker.handle(Reset(4, 128, SamplingSpec(1.0, 0, 1.0, 20), window=3, generation=2))
    assert worker.runner.cache is not cache and worker.runner.cache.max_len >= 128  # bigger: re-sized


def test_coordinator_reserve_waits_for_every_worker(delayed_pair):
    assert delayed_pair.reserve(4, 64, timeout_s=60)
    assert all(w.reserved is not None and w.reserved.num_slots >= 4 and w.reserved.max_len >= 64
               for w in delayed_pair.workers)


class RecordingTransport(Transport):
    """An in-process stand-in for a worker: ready at once, keeps every message sent to it."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.announced = False

    def send(self, message: object) -> None:
        self.sent.append(message)

    def drain(self) -> list[object]:
        if self.announced:
            return []
        self.announced = True
        return [Ready(pid=0, load_s=0.0)]

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


def test_paused_workers_get_no_commits_and_catch_up_on_resume(target):
    """Dynamic decoupling's plain phases: a paused worker is sent no per-round commits (applying them
    took CPU from the verifier); on resume one message brings each row's chain up to date."""
    transport = RecordingTransport()
    coordinator = DecoupledCoordinator(lambda index: transport, 1)
    assert coordinator.wait_ready(5)
    outputs: dict[int, list[int]] = {0: [], 1: []}
    coordinator.reset(2, 64, SamplingSpec(1.0, 0, 1.0, 20), window=3, output_of=lambda slot: outputs[slot])
    coordinator.add_rows(np.array([0, 1]), np.array([7, 8]), [np.array([5, 6]), np.array([5, 7])])

    def commit(rows: dict[int, list[int]]) -> None:
        slots = np.array(sorted(rows))
        width = max(max(len(t) for t in rows.values()), 1)
        output = np.zeros((len(slots), width), dtype=np.int64)
        for r, slot in enumerate(slots.tolist()):
            output[r, : len(rows[slot])] = rows[slot]
            outputs[slot] += rows[slot]
        coordinator.after_round(slots, output, np.array([len(rows[s]) for s in slots.tolist()]))

    commit({0: [1, 2], 1: [3]})
    coordinator.pause(True)
    paused_from = len(transport.sent)
    commit({0: [4], 1: [5, 6]})
    commit({0: [7, 8, 9], 1: []})
    assert not any(isinstance(m, Commits) for m in transport.sent[paused_from:])
    # nor are the buffers reconciled while paused (nothing is taken from them): marked, brought up to date on resume
    assert coordinator.unreconciled[[0, 1]].all() and coordinator.buffers.committed_len.tolist() == [2, 1]
    coordinator.pause(False)
    resumed = transport.sent[paused_from:]
    assert [type(m) for m in resumed] == [Commits, Pause]  # the missed commits, then the resume
    assert not coordinator.unreconciled.any()
    commit({0: [10], 1: [11]})
    buffers = coordinator.buffers
    for slot in (0, 1):
        assert buffers.committed_len[slot] == len(outputs[slot])
        assert buffers.committed_hash[slot] == buffers.pending_hash[slot] == chain_hash(outputs[slot])
    # a draft the worker builds on the resumed chain joins the buffer
    buffers.ingest(Drafts(np.array([0]), np.array([len(outputs[0])]), np.array([3]),
                          np.array([chain_hash(outputs[0])], dtype=np.int64), 0.0, coordinator.generation),
                   np.array([True, True]))
    assert buffers.count[0] == 1
    worker = DraftWorker(target, target.config.vocab_size)
    for message in transport.sent:
        worker.handle(message)
    for slot in (0, 1):
        assert worker.rows[slot].chain == outputs[slot] and worker.rows[slot].known == len(outputs[slot])


# ------------------------------------------------------------------------------ drafter weight sync
def test_pushed_weights_reach_every_worker_and_a_restarted_one(models, target, tmp_path):
    """The pipeline's drafter sync for workers: a file pushed with `load_weights` is loaded in place
    (digest checked), drafting uses it (the noisy drafter becomes the target: every draft accepted),
    and a worker that restarts afterwards loads it before it drafts again."""
    from safetensors.torch import save_file

    from specactor_engine.model.weights import weights_digest

    path = tmp_path / "drafter.safetensors"
    save_file({k: v.contiguous() for k, v in target.named_parameters()}, str(path))
    params = sampling(0.0, n=2, max_new_tokens=24, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(4), params))
    coordinator = coordinator_for(models["other"], target.config.vocab_size, workers=2)
    engine = decoupled_engine(target, coordinator)
    try:
        before = engine.generate(ragged_requests(4), params, progress=slow_verifier).stats
        answers = coordinator.load_weights(str(path), version=1)
        assert [a.digest for a in answers] == [weights_digest(target.named_parameters())] * 2
        after = engine.generate(ragged_requests(4), params, progress=slow_verifier)
        assert token_ids(after) == reference
        assert after.stats.accepted_tokens == after.stats.drafted_tokens > 0
        assert before.accepted_tokens < before.drafted_tokens  # the old weights were wrong at times

        coordinator.workers[0].transport.kill()
        coordinator.poll()  # notices the loss and restarts it
        assert coordinator.workers[0].restarts == 1
        assert coordinator.wait_ready(120)  # up, and the pushed weights loaded again
        assert coordinator.workers[0].weights.digest == answers[0].digest

        bad = coordinator.load_weights(str(tmp_path / "missing.safetensors"), version=2)
        assert len(bad) == 2 and all(a.error and not a.digest for a in bad)
        again = engine.generate(ragged_requests(4), params, progress=slow_verifier)
        assert token_ids(again) == reference and again.stats.accepted_tokens > 0  # old weights still draft
    finally:
        coordinator.close()


def test_buffers_keep_the_worker_chain_when_another_drafters_block_matches_it():
    """Fastest-of-N verifies some rows with another drafter's block: the worker's pending drafts stay
    exactly when the committed tokens are their prefix."""
    buffers = DraftBuffers(num_slots=2, width=4)
    buffers.add_rows(np.array([0, 1]))
    for slot in (0, 1):
        for position, token in enumerate([5, 6, 7]):
            buffers.ingest(Drafts(np.array([slot]), np.array([position]), np.array([token]),
                                  np.array([chain_hash([5, 6, 7][:position])], dtype=np.int64), 0.0, 1),
                           np.array([True, True]))
    # row 0 committed 5, 6 (agrees with its chain); row 1 committed 5, 9 (disagrees at the 2nd)
    buffers.reconcile(np.array([0, 1]), np.array([[5, 6, 0], [5, 9, 0]]), np.array([2, 2]))
    assert buffers.count.tolist() == [1, 0]
    assert buffers.pending[0, 0] == 7 and buffers.pending_hash[0] == chain_hash([5, 6, 7])
    assert buffers.pending_hash[1] == buffers.committed_hash[1] == chain_hash([5, 9])


def test_worker_prefills_a_shared_prompt_once_and_drafts_as_if_alone(target):
    """A GRPO group (rows with the same prompt) is prefilled once; every row drafts what it would alone."""
    spec = SamplingSpec(1.0, 0, 1.0, 20)
    prompts = [np.array([5, 6, 7, 8]), np.array([5, 6, 7, 8]), np.array([9, 6, 7]), np.array([5, 6, 7, 8])]
    outputs = [np.array([], dtype=np.int64), np.array([3, 4], dtype=np.int64), np.array([], dtype=np.int64),
               np.array([], dtype=np.int64)]

    def drafts_of(rows: list[int]) -> tuple[dict[int, list[int]], int]:
        worker = DraftWorker(target, target.config.vocab_size)
        worker.handle(Reset(4, 64, spec, window=3, generation=1))
        worker.handle(AddRows(np.array(rows), np.array([100 + r for r in rows]), [prompts[r] for r in rows],
                              [outputs[r] for r in rows]))
        forwarded = []
        forward = worker.runner.forward
        worker.runner.forward = lambda tokens, *a, **kw: forwarded.append(int(tokens.numel())) or forward(tokens, *a, **kw)
        got: dict[int, list[int]] = {r: [] for r in rows}
        while (step := worker.step()) is not None:
            for slot, token in zip(step.slots.tolist(), step.tokens.tolist()):
                got[slot].append(token)
        return got, sum(forwarded)

    together, fed_together = drafts_of([0, 1, 2, 3])
    alone = {r: drafts_of([r])[0][r] for r in range(4)}
    assert together == alone
    fed_alone = sum(drafts_of([r])[1] for r in range(4))
    assert fed_together < fed_alone  # rows 1 and 3 reused row 0's prompt


def test_paused_workers_give_their_threads_back(models, target, monkeypatch):
    """Dynamic decoupling's plain phases: the verifier decodes on every thread and the paused worker
    process takes no CPU (it blocks on its pipe), so a paused phase is plain decoding with nothing beside it;
    in the workers' phases the verifier keeps to its own threads."""
    from specactor_engine.decoupled.phase import SOLO
    from specactor_engine.run import Run

    params = sampling(1.0, n=2, max_new_tokens=60, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(5), params))
    coordinator = coordinator_for(models["other"], target.config.vocab_size)
    worker = coordinator.workers[0].transport
    total = torch.get_num_threads()
    seen: list[tuple[str, int, float]] = []  # per round: arm, verifier threads, worker CPU seconds so far
    choose_arm = Run._choose_arm

    def recording(run, slots, caps, context):
        arm = choose_arm(run, slots, caps, context)
        seen.append((arm, torch.get_num_threads(), worker.cpu_s()))
        return arm

    monkeypatch.setattr(Run, "_choose_arm", recording)
    try:
        engine = decoupled_engine(target, coordinator, verify_length="dynamic", dynamic_decoupling=True,
                                  verifier_threads=1)
        result = engine.generate(ragged_requests(5), params, progress=slow_verifier)
    finally:
        coordinator.close()
    assert token_ids(result) == reference
    arms = [arm for arm, _, _ in seen]
    assert SOLO in arms and "decoupled" in arms
    assert all(threads == (total if arm == SOLO else 1) for arm, threads, _ in seen)
    # CPU the worker took during settled paused rounds (a round whose predecessor was paused too)
    paused_cpu = sum(b[2] - a[2] for a, b in zip(seen, seen[1:]) if a[0] == SOLO and b[0] == SOLO)
    paused_rounds = sum(1 for a, b in zip(seen, seen[1:]) if a[0] == SOLO and b[0] == SOLO)
    running_cpu = sum(b[2] - a[2] for a, b in zip(seen, seen[1:]) if a[0] != SOLO)
    # the premise: the worker's CPU time is measured (0.34 s seen in its phases, in 10 ms ticks)
    assert paused_rounds >= 10 and running_cpu > 0.05, (paused_rounds, running_cpu)
    assert paused_cpu <= 0.05, (paused_cpu, paused_rounds, running_cpu)  # blocked (0.01 s seen over 40 rounds)
