"""The engine with a dynamic verify length: still exact, and it follows the cost model."""

from __future__ import annotations

import logging

import pytest
import torch

from specactor_engine import clock
from specactor_engine.policies.cost_profile import load_or_measure, profile_batches
from specactor_engine.engine import Engine
from specactor_engine.model.runner import ModelRunner
from specactor_engine.policies.verify_length import CostTable
from tests.engine.test_exactness import MAX_LEN, make_drafter, ragged_requests, rollout, run, sampling, token_ids
from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer

K = 4


@pytest.fixture(scope="module")
def fp64_target():
    return make_tiny_model("qwen2", seed=11, dtype=torch.float64)


def table(fixed: float, per_token: float, batches=(1, 4, 16)) -> CostTable:
    widths = tuple(range(1, K + 2))
    return CostTable(batches, widths, tuple(tuple(fixed + per_token * b * w for w in widths) for b in batches))


def dynamic_engine(target, drafters, cost_table=None, shadow_rows=4) -> Engine:
    config = rollout("coupled", num_draft_tokens=K, max_batch_size=16, verify_length="dynamic",
                     shadow_rows=shadow_rows)
    return Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN, drafters=drafters,
                  cost_table=cost_table, check_invariants=True)


@pytest.mark.parametrize("kind", ["ngram", "model", "self"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dynamic_length_is_exact(fp64_target, kind, temperature):
    """Whatever lengths the policy picks (0 included), outputs equal plain decoding (fp64)."""
    params = sampling(temperature, n=2, max_new_tokens=24)
    reference = token_ids(run(fp64_target, ragged_requests(6), params))
    # a flat-ish cost makes the policy move between lengths as acceptance changes
    engine = dynamic_engine(fp64_target, [make_drafter(kind, fp64_target, torch.float64)], table(0.01, 0.0005))
    result = engine.generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    assert result.stats.timeline and len(engine.length_policy.history) == result.stats.verify_rounds


def test_the_timeline_records_the_rates_each_choice_weighed(fp64_target):
    """Each round the policy chose (not held) records its expected tokens/s at k = 0..K; drafting with the target
    itself (every draft accepted) under a flat cost, the chosen length is the one rated best."""
    engine = dynamic_engine(fp64_target, [make_drafter("self", fp64_target, torch.float64)], table(0.01, 0.0))
    # a clock that stands still: drafting costs nothing and every width calibrates alike, so the rates follow the flat
    # table and the acceptance; on the wall clock each draft is a forward of the target, timed against the verify
    # rounds it saves, and which length rates best hangs on timing noise (the next test's docstring)
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(4), sampling(1.0, n=2, max_new_tokens=40))
    rated = [entry for entry in result.stats.timeline if "scores" in entry]
    assert len(rated) == result.stats.verify_rounds > 2
    assert all(len(entry["scores"]) == K + 1 for entry in rated)
    best = [max(range(K + 1), key=lambda k: (entry["scores"][k], -k)) for entry in rated]
    # the last round's cap is bounded by the tokens the rows have left
    assert [entry["cap"] for entry in rated[:-1]] == best[:-1] == [K] * (len(rated) - 1)
    # and the calibration each rate used: none observed before the first round, then what the rounds took
    assert all(len(entry["factors"]) == K + 1 for entry in rated)
    assert rated[0]["factors"] == [1.0] * (K + 1)
    assert all(factor > 0 for entry in rated for factor in entry["factors"]) and rated[-1]["factors"][K] != 1.0
    # the seconds it priced each k's verify at (before any round: the profile's), and the tokens each round verified
    assert rated[0]["priced_s"] == pytest.approx([0.01] * (K + 1), abs=1e-4)
    assert all(len(entry["priced_s"]) == K + 1 for entry in rated)
    assert all(entry["rows"] <= entry["tokens"] <= entry["rows"] * (entry["k"] + 1) for entry in result.stats.timeline)
    assert rated[0]["tokens"] == rated[0]["rows"] * (K + 1)  # every draft accepted: none cut


@pytest.mark.parametrize("shadow_rows", [0, 4])
def test_useless_drafts_under_a_compute_bound_cost_fall_back_to_plain_decoding(fp64_target, shadow_rows):
    """An n-gram drafter on random tiny-model text accepts ~nothing: with verify cost proportional
    to tokens, the policy settles on k=0. Without shadow drafts it probes the deepest length now and
    then; with them the statistics come from drafts scored against the committed tokens and no round
    verifies at the deepest length."""
    engine = dynamic_engine(fp64_target, [make_drafter("ngram", fp64_target, torch.float64)], table(0.0, 0.01),
                            shadow_rows=shadow_rows)
    params = sampling(1.0, n=2, max_new_tokens=40)
    engine.prepare_length_policy(ragged_requests(8), params)
    # deep probes on their regular schedule: under this compute-bound cost the 5% time budget
    # (`_length_probe_rounds`) would hold them past this short run
    engine.length_policy.probe_budget = 1.0
    # ... and not held by the gate on what they could reveal (at a cost proportional to tokens even drafts all
    # accepted would only tie with plain decoding; the gate has its own test in test_verify_length.py)
    engine.length_policy._probe_may_pay = lambda *args: True
    # a clock that stands still: every width calibrates alike, so the lengths, and when the probes fall due, follow the
    # table and the acceptance; on the wall clock the widths' factors are what the rounds took on the machine then
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(8), params)
    history = engine.length_policy.history
    probe = engine.length_policy.probe_every
    settled = history[probe:]
    assert settled.count(0) >= 0.8 * len(settled)
    if shadow_rows:
        assert K not in history[probe:]  # no deep probes
        # ... the shadows were scored instead (every few rounds: plain decoding is far ahead)
        assert result.stats.shadow_drafts >= 2 * shadow_rows
        assert engine.length_policy.stats.accept_through[0] < 0.5  # and taught the policy the drafts are poor
    else:
        assert max(history) == K  # probes still check the deepest length
        assert result.stats.shadow_drafts == 0


def test_perfect_drafts_under_a_memory_bound_cost_go_deep(fp64_target):
    """Drafts that are always right and cost nothing (the plain run's own outputs, looked up):
    with verify cost flat in tokens the policy picks the longest length.

    (The target drafting for itself would be break-even, each draft costing a forward, so the
    choice would hang on timing noise.)"""
    from benchmark.systems import OracleDrafter
    from specactor_engine.sampling import sequence_key

    params = sampling(1.0, max_new_tokens=30, ignore_eos=True)
    plain = run(fp64_target, ragged_requests(4), params)
    oracle = OracleDrafter({sequence_key(0, o.request_id, o.sample_index): o.token_ids for o in plain.outputs})
    engine = dynamic_engine(fp64_target, [oracle], table(0.05, 0.0))
    # a clock that stands still: every width calibrates alike, so the length follows the flat table; on the wall
    # clock wide rounds slowed by other load would be priced above it
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(4), params)
    assert engine.length_policy.history[-5:] == [K] * 5
    assert result.stats.acceptance_rate == 1.0


@pytest.mark.parametrize("shadow_rows", [0, 2])
def test_shadow_drafts_find_good_drafts_while_decoding_plainly(fp64_target, shadow_rows):
    """Statistics that say drafts are worthless and no probes: plain decoding never learns otherwise.
    Shadow drafts (perfect ones here) are scored while k = 0 and lead the policy to the longest length."""
    from benchmark.systems import OracleDrafter
    from specactor_engine.sampling import sequence_key
    from specactor_engine.policies.verify_length import AcceptanceStats, VerifyLengthPolicy

    params = sampling(1.0, max_new_tokens=30, ignore_eos=True)
    plain = run(fp64_target, ragged_requests(4), params)
    oracle = OracleDrafter({sequence_key(0, o.request_id, o.sample_index): o.token_ids for o in plain.outputs})
    flat = table(0.05, 0.0)
    engine = dynamic_engine(fp64_target, [oracle], flat, shadow_rows=shadow_rows)
    engine.length_policy = VerifyLengthPolicy(flat, AcceptanceStats(max_k=K, accept_through=[0.0] * K), probe_every=0)
    # a clock that stands still: every round calibrates alike (the MIN_SCALE clamp), so the verify length follows the
    # acceptance alone; with the wall clock, rounds slowed by other load made some widths look dearer (k = 2 and 3 at
    # the end of a run on a loaded machine)
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(4), params)
    assert token_ids(result) == token_ids(plain)
    history = engine.length_policy.history
    if shadow_rows:
        assert history[0] == 0 and history[-5:] == [K] * 5
        assert result.stats.shadow_accepted == K * result.stats.shadow_drafts  # every shadow draft was right
    else:
        assert set(history) == {0}


def test_cost_profile_is_measured_once_and_cached(tmp_path, caplog):
    """Measured once (minutes on a real model: it says so, and logs each sweep), then read from the cache."""
    target = make_tiny_model("llama", seed=2)
    runner = ModelRunner(target)
    with caplog.at_level(logging.INFO, logger="specactor_engine.policies.cost_profile"):
        first = load_or_measure(runner, max_rows=5, max_k=2, cache_dir=tmp_path)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("measuring the verify cost once") and str(tmp_path) in messages[0]
    sweeps = [m for m in messages if ": sweep " in m]
    assert len(sweeps) == 2 * 4 and sweeps[-1].startswith("verify-cost profile at context 256: sweep 4 of 4")
    caplog.clear()
    assert first.batch_sizes == profile_batches(5) == (1, 4, 5)
    assert first.widths == (1, 2, 3)
    assert [t.context for t in first.tables] == [128, 256]  # the short context and the default longest
    assert all(s > 0 for t in first.tables for row in t.seconds for s in row)
    files = list((tmp_path / "cost_profiles").glob("*.json"))
    assert len(files) == 1
    with caplog.at_level(logging.INFO, logger="specactor_engine.policies.cost_profile"):
        assert load_or_measure(runner, max_rows=5, max_k=2, cache_dir=tmp_path) == first  # read back, not re-measured
    assert not caplog.records
    assert load_or_measure(runner, max_rows=5, max_k=3, cache_dir=tmp_path).widths == (1, 2, 3, 4)
    assert len(list((tmp_path / "cost_profiles").glob("*.json"))) == 2


def test_a_kernel_edit_makes_the_cached_profile_stale(tmp_path, monkeypatch):
    """The profile key covers the CPU kernels' sources: after an edit the rounds are measured again rather than
    priced as the old kernel ran them (session 35 found a profile that had outlived its kernel)."""
    from specactor_engine.kernels.build import sources_digest
    from specactor_engine.policies import cost_profile

    runner = ModelRunner(make_tiny_model("llama", seed=2))
    assert runner.paged_attention  # a CPU runner on the engine's kernels
    load_or_measure(runner, max_rows=1, max_k=1, cache_dir=tmp_path)
    assert len(list((tmp_path / "cost_profiles").glob("*.json"))) == 1
    assert len(sources_digest()) == 12
    monkeypatch.setattr(cost_profile, "sources_digest", lambda: "edited-kernel")
    load_or_measure(runner, max_rows=1, max_k=1, cache_dir=tmp_path)
    assert len(list((tmp_path / "cost_profiles").glob("*.json"))) == 2  # measured again under a new key
    plain = ModelRunner(make_tiny_model("llama", seed=2), packed_linear=False, paged_attention=False)
    key_then = cost_profile.profile_key(plain, (1,), (1, 2), 256)
    monkeypatch.setattr(cost_profile, "sources_digest", lambda: "edited-again")
    assert cost_profile.profile_key(plain, (1,), (1, 2), 256) == key_then  # torch's own ops: no kernel in the key


def test_the_bf16_kernels_variant_is_in_the_profile_key(monkeypatch):
    """The bf16 kernel's two variants give the same bits at different speeds: a profile measured with one must
    not price the other's rounds. fp32 models do not use it, and their keys do not change with it."""
    from specactor_engine.kernels import bf16_linear
    from specactor_engine.policies import cost_profile

    bf16 = ModelRunner(make_tiny_model("llama", seed=2).to(torch.bfloat16))
    fp32 = ModelRunner(make_tiny_model("llama", seed=2))
    if bf16.projections is None:
        pytest.skip("this CPU has no oneDNN bf16 packing (AVX-512 BF16 or AVX-NE-CONVERT): bf16 linears stay torch's")
    monkeypatch.setattr(bf16_linear, "available", lambda: True)  # the key's rule, on CPUs the kernel does not serve too
    assert bf16.dtype == torch.bfloat16
    keys = {}
    for variant in bf16_linear.VARIANTS:
        monkeypatch.setattr(bf16_linear, "variant", lambda v=variant: v)
        keys[variant] = (cost_profile.profile_key(bf16, (1,), (1, 2), 256),
                         cost_profile.profile_key(fp32, (1,), (1, 2), 256))
    assert keys["dpbf16"][0] != keys["fma"][0]
    assert keys["dpbf16"][1] == keys["fma"][1]


def test_engine_profiles_on_first_dynamic_generate(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECACTOR_CACHE_DIR", str(tmp_path))
    target = make_tiny_model("llama", seed=2)
    engine = Engine(target, make_tokenizer(),
                    rollout("coupled", num_draft_tokens=2, max_batch_size=16, verify_length="dynamic"),
                    max_model_len=MAX_LEN, drafters=[make_drafter("ngram", target, torch.float32)])
    reference = token_ids(run(target, ragged_requests(3), sampling(1.0, n=2)))
    assert token_ids(engine.generate(ragged_requests(3), sampling(1.0, n=2))) == reference
    assert engine.cost_table is not None and engine.cost_table.batch_sizes[-1] == 6
    assert list((tmp_path / "cost_profiles").glob("*.json"))
