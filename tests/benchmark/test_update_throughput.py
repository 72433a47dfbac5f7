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
