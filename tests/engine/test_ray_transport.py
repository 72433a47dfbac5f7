"""Drafter workers as Ray actors (a local Ray instance): exact, survive a killed actor, leave nothing behind."""

from __future__ import annotations

import shutil
import tempfile
import time

import psutil
import pytest

from specactor_engine.decoupled.coordinator import DecoupledCoordinator
from specactor_engine.decoupled.transport import DelayedTransport, WorkerSpec
from tests.engine.test_decoupled import decoupled_engine, models, slow_verifier, target  # noqa: F401 - fixtures
from tests.engine.test_exactness import ragged_requests, run, sampling, token_ids

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    from specactor_engine.decoupled.ray_transport import ensure_ray

    # a short path: Ray's unix sockets live under it (108-byte limit); nothing goes to the home directory
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ensure_ray(num_cpus=2, temp_dir=temp)
    yield
    ray.shutdown()
    shutil.rmtree(temp, ignore_errors=True)


def ray_coordinator(path, vocab: int, workers: int, max_delay_s: float = 0.0) -> DecoupledCoordinator:
    from specactor_engine.decoupled.ray_transport import RayWorker

    def start(index: int):
        worker = RayWorker(WorkerSpec(str(path), "float64", 1, vocab))
        return DelayedTransport(worker, max_delay_s, seed=index) if max_delay_s else worker

    coordinator = DecoupledCoordinator(start, workers)
    assert coordinator.wait_ready(180), "Ray drafter actors did not start"
    return coordinator


def slower_verifier(done: int, total: int) -> None:
    """A Ray message takes longer than a pipe's, and on a loaded 2-core machine the actors fall behind a
    verifier of `slow_verifier`'s pace for a whole 24-token rollout (no draft arrives in time, or every
    one arrives stale): this one stands in for a verify round three times as long."""
    for _ in range(3):
        slow_verifier(done, total)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ray_actors_are_exact_with_delays(local_ray, models, target, temperature):  # noqa: F811
    params = sampling(temperature, n=2, max_new_tokens=24)
    reference = token_ids(run(target, ragged_requests(5), params))
    coordinator = ray_coordinator(models["other"], target.config.vocab_size, workers=2, max_delay_s=0.01)
    try:
        result = decoupled_engine(target, coordinator).generate(ragged_requests(5), params, progress=slower_verifier)
        assert token_ids(result) == reference
        assert result.stats.decoupled["drafts_arrived"] > 0 and result.stats.accepted_tokens > 0
        assert coordinator.stats()["worker_busy_s"] > 0
    finally:
        coordinator.close()


def test_killed_ray_actor_still_completes_identically_and_is_replaced(local_ray, models, target):  # noqa: F811
    params = sampling(1.0, n=2, max_new_tokens=50, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(4), params))
    coordinator = ray_coordinator(models["target"], target.config.vocab_size, workers=1)
    first = coordinator.workers[0].transport
    engine = decoupled_engine(target, coordinator)
    rounds: list[int] = []

    def kill_midway(done: int, total: int) -> None:
        rounds.append(done)
        slow_verifier(done, total)
        if len(rounds) == 5:
            first.kill()

    try:
        result = engine.generate(ragged_requests(4), params, progress=kill_midway)
        assert token_ids(result) == reference
        assert not first.alive() and coordinator.workers[0].restarts == 1
        assert coordinator.wait_ready(180)
        again = engine.generate(ragged_requests(4), params, progress=slow_verifier)
        assert token_ids(again) == reference and again.stats.accepted_tokens > 0
        pid = coordinator.workers[0].transport.process_id
    finally:
        coordinator.close()
    assert pid is not None
    deadline = time.monotonic() + 60  # closed: the actor's process goes (ray.kill is asynchronous)
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _running(pid)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ray_worker_needs_a_running_ray(models, target, monkeypatch):  # noqa: F811
    from specactor_engine.decoupled.ray_transport import RayWorker

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="ray.init"):
        RayWorker(WorkerSpec(str(models["other"]), "float64", 1, target.config.vocab_size))
