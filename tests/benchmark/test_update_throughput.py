"""The update-throughput benchmark's pure parts (the timing itself is a benchmark, not a test)."""

from __future__ import annotations

from benchmark.update_throughput import parse_variant, synthetic_batch
from specactor_engine.config import OptimConfig


def test_the_synthetic_batch_has_the_asked_shape():
    batch = synthetic_batch(samples=8, prompt_tokens=5, output_tokens=10, vocab_size=100)
    assert len(batch) == 8 and all(len(p) == 5 for p in batch.prompt_token_ids)
    lengths = [len(o) for o in batch.output_token_ids]
    assert min(lengths) == 5 and max(lengths) == 15  # 0.5x .. 1.5x the mean length
    assert lengths != sorted(lengths) and lengths != sorted(lengths, reverse=True)  # in a rollout's random order
    assert all(0 <= t < 100 for o in batch.output_token_ids for t in o)
    assert min(batch.advantages) < 0 < max(batch.advantages)
    assert len({tuple(p) for p in batch.prompt_token_ids}) == 8  # group_size 1: a prompt per row


def test_the_synthetic_batch_shares_a_prompt_within_each_group_and_keeps_the_lengths():
    grouped = synthetic_batch(samples=8, prompt_tokens=5, output_tokens=10, vocab_size=100, group_size=4)
    prompts = [tuple(p) for p in grouped.prompt_token_ids]
    assert prompts[:4] == [prompts[0]] * 4 and prompts[4:] == [prompts[4]] * 4 and prompts[0] != prompts[4]
    alone = synthetic_batch(samples=8, prompt_tokens=5, output_tokens=10, vocab_size=100)
    assert [len(o) for o in grouped.output_token_ids] == [len(o) for o in alone.output_token_ids]


def test_a_variant_overrides_only_what_it_names():
    base = OptimConfig(dtype="float32", zero_stage=2, micro_batch_size=4, lr=1e-5)
    name, optim = parse_variant("bfloat16:0:8", base)
    assert name == "bfloat16:0:8"
    assert (optim.dtype, optim.zero_stage, optim.micro_batch_size, optim.lr) == ("bfloat16", 0, 8, 1e-5)
    _, same = parse_variant("float32", base)
    assert same == base
    _, capped = parse_variant(":::512", base)  # empty fields keep the config's
    assert capped == base.model_copy(update={"micro_batch_tokens": 512})
    assert parse_variant(":", base)[1] == base
    assert parse_variant("::::1", base)[1] == base.model_copy(update={"shared_prompt": True})


def test_the_autocast_variant_is_float32_weights_with_bf16_autocast_and_a_dtype_variant_turns_it_off():
    base = OptimConfig(dtype="float32", autocast="bfloat16", zero_stage=0)
    name, optim = parse_variant("autocast:2", OptimConfig(dtype="float32", zero_stage=0))
    assert name == "autocast:2" and (optim.dtype, optim.autocast, optim.zero_stage) == ("float32", "bfloat16", 2)
    assert parse_variant("bfloat16", base)[1].autocast == "none"  # bf16 weights cannot run under autocast
    assert parse_variant("float32", base)[1].autocast == "none"
    assert parse_variant(":0", base)[1] == base  # no dtype named: the config's, autocast included


def test_accuracy_compares_each_variant_with_the_first_on_one_on_policy_batch(monkeypatch):
    """The accuracy rows of a variant against itself are exact; bf16 against fp32 is not (the tiny model)."""
    from benchmark import update_throughput
    from specactor_engine.config import ModelConfig, SpecActorConfig, TrainConfig
    from tasks.trainer import PolicyTrainer
    from tests.fixtures.tiny_models import make_tiny_model

    monkeypatch.setattr(update_throughput, "build_trainer", lambda config, path: PolicyTrainer(
        make_tiny_model("llama", seed=2), config.train.optim, temperature=1.0, seed=0))
    config = SpecActorConfig(model=ModelConfig(target="tiny"), train=TrainConfig())
    base = OptimConfig(dtype="float32", zero_stage=0, micro_batch_size=2)
    batch = synthetic_batch(samples=4, prompt_tokens=3, output_tokens=6, vocab_size=200)
    rows = update_throughput.accuracy(config, None, [("float32", base), ("float32", base),
                                                     parse_variant("bfloat16", base)], batch)
    same, low = rows
    assert same["gradient_error"] == 0.0 and same["loss"] == same["reference_loss"] and same["logprob_gap"] == 0.0
    assert low["gradient_error"] > 0 and low["logprob_gap"] > 0 and low["gradient_cosine"] > 0.9
