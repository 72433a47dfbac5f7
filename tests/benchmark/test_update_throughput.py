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
