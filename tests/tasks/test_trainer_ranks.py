"""RankedTrainer: the update on 2 DeepSpeed ranks, Ray actors on a local Ray instance (gloo, 1 thread each),
against the one-rank PolicyTrainer in this process on the same global batch."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from transformers import AutoModelForCausalLM

from specactor_engine.config import OptimConfig
from tasks.trainer import PolicyTrainer, RolloutBatch
from tasks.trainer_ranks import RankedTrainer, TrainerRank, TrainerRankError, deal_rows
from tests.fixtures.tiny_models import save_tiny_model

pytestmark = pytest.mark.slow

# float32: the ranks sum the gradient in another order than one rank does. The metrics (loss, grad_norm: the
# gradient's scale) agree to float32 precision; Adam's first steps move a weight by lr * g / (|g| + eps), which
# amplifies the relative error of near-zero gradient entries: seen 1.8e-6 apart (0.2% of the lr of 1e-3) on an
# Intel Xeon, and on an AMD EPYC (session 27) 2.8e-4 apart on 3-11 of 107,456 entries, every other within 1e-5.
# So almost every entry agrees within WEIGHT_ATOL, at most WEIGHT_OUTLIERS of them by less than one lr; a reduction
# that lost or doubled a rank's gradient moves most entries (and the metrics)
# The second update's metrics and the log-probs after it follow from those few weights: the loss seen 1.2e-5 apart
# (relative) on the EPYC, the log-probs 2.9e-4 (absolute)
LR = 1e-3
WEIGHT_ATOL = 1e-5
WEIGHT_OUTLIERS = 1e-3
METRIC_RTOL = 1e-4


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    import ray

    from specactor_engine.decoupled.ray_transport import ensure_ray

    ensure_ray(num_cpus=2, temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("policy"), "llama", seed=0)


def _settings(zero_stage: int, world_size: int) -> OptimConfig:
    return OptimConfig(lr=LR, zero_stage=zero_stage, micro_batch_size=2, world_size=world_size, threads_per_rank=1)


def _one_rank(policy, zero_stage: int) -> PolicyTrainer:
    model = AutoModelForCausalLM.from_pretrained(policy, dtype="float32")
    return PolicyTrainer(model, _settings(zero_stage, 1), temperature=1.0, seed=0)


def _assert_close(ranked: dict, single: dict, keys=("loss", "pg_loss", "kl", "grad_norm", "entropy")) -> None:
    for key in keys:
        assert ranked[key] == pytest.approx(single[key], rel=METRIC_RTOL, abs=1e-9), key
    assert ranked["tokens"] == single["tokens"] and ranked["sequences"] == single["sequences"]


def _assert_weights_close(ranked, single) -> None:
    want = dict(single.state_dict_for_sync())
    got = dict(ranked.state_dict_for_sync())
    assert got.keys() == want.keys()
    diffs = torch.cat([(got[name] - want[name]).abs().flatten() for name in want])
    beyond = float((diffs > WEIGHT_ATOL).float().mean())
    assert beyond <= WEIGHT_OUTLIERS and diffs.max().item() < LR, (beyond, diffs.max().item())
    assert diffs.mean().item() < 1e-7


def test_rows_are_dealt_longest_first_round_robin():
    batch = RolloutBatch([[1]] * 5, [[1] * n for n in (3, 9, 1, 7, 5)], [[0.0] * n for n in (3, 9, 1, 7, 5)],
                         [1.0] * 5)
    assert deal_rows(batch, 2) == [[1, 2, 4], [0, 3]]  # outputs of 9, 5, 1 tokens and of 7, 3


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_two_ranks_make_the_one_rank_update_of_the_global_batch(local_ray, policy, zero_stage):
    """Two updates on 7 rows (3 and 4 per rank, micro-batches of 2: the ranks run different numbers of
    micro-batches): the metrics and the weights equal one rank's within float32 summation-order error."""
    single = _one_rank(policy, zero_stage)
    ranked = RankedTrainer(policy, _settings(zero_stage, 2), temperature=1.0, seed=0)
    try:
        for seed in (1, 2):
            batch = RolloutBatch.make_dummy(num_samples=7, seed=seed)
            batch = RolloutBatch(batch.prompt_token_ids, batch.output_token_ids, single.logprobs(batch),
                                 batch.advantages)
            _assert_close(ranked.step(batch), single.step(batch))
            _assert_weights_close(ranked, single)
        assert ranked.version == single.version == 2
        got, want = ranked.logprobs(batch), single.logprobs(batch)
        assert [len(row) for row in got] == [len(row) for row in want]
        assert sum(got, []) == pytest.approx(sum(want, []), abs=1e-3)  # EPYC: 2.9e-4 apart, from those weights
    finally:
        ranked.close()


def _die_at_the_update(rank: TrainerRank) -> None:
    """In rank 1's process: SIGKILL itself when the optimizer step begins (its backward done, rank 0 waiting
    for it in the gradient reduction)."""
    rank.trainer.engine.step = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_killed_mid_step_leaves_the_checkpoint_to_resume_from(local_ray, policy, tmp_path):
    """Rank 1 is SIGKILLed within the second update: the step fails (no hang), every rank is stopped, nothing
    of the step is saved; new ranks resume from v1 and redo it, as one rank would."""
    import ray

    single = _one_rank(policy, 2)
    first, second = (RolloutBatch.make_dummy(num_samples=8, seed=seed) for seed in (1, 2))
    single.step(first)
    expected = single.step(second)

    ranked = RankedTrainer(policy, _settings(2, 2), temperature=1.0, seed=0)
    try:
        ranked.step(first)
        checkpoint = ranked.save_checkpoint(tmp_path / "v000001")
        saved = (checkpoint / "model.safetensors").read_bytes()
        ray.get(ranked._ranks[1].__ray_call__.remote(_die_at_the_update))
        with pytest.raises(TrainerRankError, match="in step"):
            ranked.step(second)
        assert not ranked._ranks  # every rank stopped
        with pytest.raises(TrainerRankError, match="stopped"):
            ranked.step(second)
    finally:
        ranked.close()
    assert [p.name for p in tmp_path.iterdir()] == ["v000001"]
    assert (checkpoint / "model.safetensors").read_bytes() == saved

    resumed = RankedTrainer(checkpoint, _settings(2, 2), temperature=1.0, seed=0)
    try:
        resumed.load_checkpoint(checkpoint)
        assert resumed.version == 1
        _assert_close(resumed.step(second), expected)
        _assert_weights_close(resumed, single)
    finally:
        resumed.close()
