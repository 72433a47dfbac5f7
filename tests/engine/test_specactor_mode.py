"""Mode `specactor`: Fastest-of-N per request over in-process drafters and the drafter workers'
streamed drafts, dynamic verify length, dynamic decoupling. Exact against plain decoding (fp64)."""

from __future__ import annotations

import pytest
import torch

from specactor_engine import clock
from specactor_engine.decoupled.launch import DrafterWorkers
from specactor_engine.engine import Engine
from tests.engine.test_decoupled import K, coordinator_for, models, slow_verifier, target  # noqa: F401 - fixtures
from tests.engine.test_exactness import MAX_LEN, make_drafter, ragged_requests, rollout, run, sampling, token_ids
from tests.fixtures.tiny_models import make_tokenizer


def specactor_engine(target, drafters, coordinator=None, cost_table=None, verifier_threads=None,
                     **fields) -> Engine:  # noqa: F811
    """fields: RolloutConfig fields (and `dynamic_decoupling`) over the tests' defaults."""
    fields.setdefault("max_batch_size", 16)
    config = rollout("specactor", workers=coordinator is not None, num_draft_tokens=K, **fields)
    workers = DrafterWorkers(coordinator, verifier_threads) if coordinator is not None else None
    return Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN, drafters=drafters, workers=workers,
                  cost_table=cost_table, check_invariants=True)


@pytest.fixture(scope="module")
def noisy_workers(models, target):  # noqa: F811
    coordinator = coordinator_for(models["other"], target.config.vocab_size, workers=1, max_delay_s=0.005)
    yield coordinator
    coordinator.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_in_process_drafters_only_is_exact_and_uses_several(target, temperature):  # noqa: F811
    params = sampling(temperature, n=3, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(6), params))
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("suffix", "ngram", "model")]
    result = specactor_engine(target, drafters).generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    assert len(result.stats.drafted_per_drafter) >= 2  # the selector tried more than one method
    # the per-round timeline splits acceptance by method (the drafter-mix plots read it)
    per_method: dict[str, int] = {}
    for entry in result.stats.timeline:
        for name, accepted in entry["accepted_by_drafter"].items():
            per_method[name] = per_method.get(name, 0) + accepted
    assert per_method == {k: v for k, v in result.stats.accepted_per_drafter.items() if k in per_method}
    assert sum(per_method.values()) == result.stats.accepted_tokens
    # ... and drafting time by method: every method that drafted was timed, the rounds add up to the totals
    spent: dict[str, float] = {}
    for entry in result.stats.timeline:
        for name, seconds in entry["draft_s_by_drafter"].items():
            spent[name] = spent.get(name, 0.0) + seconds
    timed = result.stats.draft_s_per_drafter
    assert set(result.stats.drafted_per_drafter) <= set(timed) and all(s > 0 for s in timed.values())
    assert spent.keys() == timed.keys()
    assert all(abs(spent[name] - timed[name]) < 1e-3 for name in timed)
    assert sum(timed.values()) <= result.stats.draft_s + 1e-6


def test_while_decoding_plainly_shadow_drafts_try_every_model_free_method(target):  # noqa: F811
    """Verify cost proportional to tokens: the verify length stays at 0, so nothing is verified, yet the
    selector still tries every model-free method per request (on shadow drafts) and outputs stay exact."""
    from tests.engine.test_dynamic_verify_length import table

    params = sampling(1.0, n=2, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(4), params))
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("suffix", "ngram")]
    engine = specactor_engine(target, drafters, cost_table=table(0.0, 0.01), verify_length="dynamic")
    from specactor_engine.policies.verify_length import AcceptanceStats, VerifyLengthPolicy

    engine.length_policy = VerifyLengthPolicy(table(0.0, 0.01), AcceptanceStats(max_k=K, prior=0.05), probe_every=0)
    # a clock that stands still: every width calibrates alike, so the length (and how far speculation is from paying,
    # which spaces the shadow drafts) follows the table and the acceptance, not what the rounds took on the wall clock
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(4), params)
    assert token_ids(result) == reference
    assert set(engine.length_policy.history) == {0} and result.stats.drafted_tokens == 0
    assert set(result.stats.shadow_drafts_per_drafter) == {"suffix", "ngram"}
    assert sum(result.stats.shadow_drafts_per_drafter.values()) == result.stats.shadow_drafts >= 8


def test_while_plain_decoding_is_far_ahead_the_choice_is_remade_every_few_rounds(target, monkeypatch):  # noqa: F811
    """Speculation expected far below plain decoding's rate: the verify length and methods are weighed in the first
    round and then every SPARSE_EVERY-th (with that round's shadow drafts), every FAR_EVERY-th farther below once
    FAR_EVERY rounds were far; the rounds between decode plainly and are recorded as k = 0. Outputs stay exact; with
    speculation within reach every round is chosen."""
    from specactor_engine.policies.shadow import FAR_EVERY, FAR_MARGIN, SPARSE_EVERY, SPARSE_MARGIN
    from specactor_engine.policies.verify_length import AcceptanceStats, VerifyLengthPolicy
    from tests.engine.test_dynamic_verify_length import table

    params = sampling(1.0, n=2, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(4), params))
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("suffix", "ngram")]
    engine = specactor_engine(target, drafters, cost_table=table(0.0, 0.01), verify_length="dynamic")
    for margin, every in ((FAR_MARGIN / 2, FAR_EVERY), (FAR_MARGIN, SPARSE_EVERY), (SPARSE_MARGIN, 1)):
        policy = engine.length_policy = VerifyLengthPolicy(table(0.0, 0.01), AcceptanceStats(max_k=K, prior=0.05),
                                                           probe_every=0)
        choices = []

        def choose(*args, _choose=policy.choose, _policy=policy, _margin=margin, **kwargs) -> int:
            choices.append(1)
            k = _choose(*args, **kwargs)
            _policy.speculation_margin = _margin  # speculation reported this far (the choice itself still k = 0)
            return k

        monkeypatch.setattr(policy, "choose", choose)
        # a clock that stands still: every width calibrates alike, so each choice is k = 0 by the table and the
        # prior, not by what the rounds took on the wall clock
        with clock.replaced(lambda: 0.0):
            result = engine.generate(ragged_requests(4), params)
        assert token_ids(result) == reference
        rounds = result.stats.verify_rounds
        assert set(policy.history) == {0} and len(policy.history) == rounds
        if every == FAR_EVERY:  # its first FAR_EVERY far rounds choose every SPARSE_EVERY-th (the prior's margin)
            assert rounds > FAR_EVERY and len(choices) == FAR_EVERY // SPARSE_EVERY + -(-(rounds - FAR_EVERY) // every)
        else:
            assert len(choices) == -(-rounds // every)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_workers_and_in_process_drafters_are_exact(target, noisy_workers, temperature):  # noqa: F811
    params = sampling(temperature, n=2, max_new_tokens=30, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(6), params))
    # a small-LM drafter always has a proposal, so the selector's first tries show in the counts
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("suffix", "model")]
    engine = specactor_engine(target, drafters, noisy_workers)
    result = engine.generate(ragged_requests(6), params, progress=slow_verifier)
    assert token_ids(result) == reference
    used = result.stats.drafted_per_drafter
    assert used.get("decoupled", 0) > 0 and used.get("model", 0) > 0, used
    assert result.stats.accepted_per_drafter.get("decoupled", 0) > 0


def test_paused_workers_phase_still_drafts_in_process_and_is_exact(target, noisy_workers):  # noqa: F811
    params = sampling(1.0, n=2, max_new_tokens=40, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(5), params))
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("suffix", "model")]
    engine = specactor_engine(target, drafters, noisy_workers, dynamic_decoupling=True,
                              verifier_threads=1)
    result = engine.generate(ragged_requests(5), params, progress=slow_verifier)
    assert token_ids(result) == reference
    assert set(result.stats.arm_rounds) == {"decoupled", "solo"}
    solo = [r for r in result.stats.timeline if r["arm"] == "solo"]
    assert solo and not any("decoupled" in r["by_drafter"] for r in solo)  # paused workers supply nothing
    assert any(r["drafted"] for r in solo)  # while the in-process drafters go on drafting

    dynamic = specactor_engine(target, drafters, noisy_workers, verify_length="dynamic")
    assert token_ids(dynamic.generate(ragged_requests(5), params, progress=slow_verifier)) == reference


def test_specactor_needs_a_draft_source(target):  # noqa: F811
    with pytest.raises(ValueError, match="needs drafters"):
        specactor_engine(target, [])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_combined_candidates_are_exact_and_the_longer_path_wins(target, temperature):  # noqa: F811
    """Every round verifies a second method's candidate per row beside the row's own drafts.

    With a random small LM and the target itself as drafters, a row whose own method is the
    random LM is beaten by the target's candidate (accepted in full), so wins must happen, and
    the KV copied back from the scratch slot must leave every later round exact.
    """
    params = sampling(temperature, n=2, max_new_tokens=30, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(6), params))
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("model", "self")]
    result = specactor_engine(target, drafters, combine_below=16).generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    stats = result.stats
    assert stats.candidate_rows > 0 and 0 < stats.candidate_wins <= stats.candidate_rows, stats
    # the timeline counts each round's candidate rows and its verifier seconds
    assert sum(entry.get("candidates", 0) for entry in stats.timeline) == stats.candidate_rows
    assert sum(entry["verify_s"] for entry in stats.timeline) == pytest.approx(stats.verify_s, abs=1e-3)
    # without combination the same run is exact too, and accepts less per round
    plain = specactor_engine(target, drafters).generate(ragged_requests(6), params)
    assert token_ids(plain) == reference and plain.stats.candidate_rows == 0
    assert stats.mean_acceptance_length > plain.stats.mean_acceptance_length


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_combination_on_large_batches_uses_free_slots_and_stays_exact(target, temperature):  # noqa: F811
    """With at least twice `combine_below` slots the candidates go to slots whose rows finished (`scratch_slots`):
    the cache has no slots past the real ones, the rounds of the last 4 rows (admitted when the first 8 finished)
    still take candidates, and the copies back leave every later round exact."""
    from specactor_engine.run import scratch_slots

    assert [scratch_slots(n, 4) for n in (1, 4, 7, 8, 128)] == [1, 4, 4, 0, 0]
    assert scratch_slots(12, 0) == 0
    params = sampling(temperature, n=2, max_new_tokens=30, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(6), params))
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("model", "self")]
    engine = specactor_engine(target, drafters, combine_below=4, max_batch_size=8)
    result = engine.generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    assert engine.runner.cache.num_slots == 8  # 8 rows at a time of 6 requests x 2 samples, nothing after them
    assert result.stats.candidate_rows > 0 and result.stats.candidate_wins > 0, result.stats
    rows_when_combined = [entry["rows"] for entry in result.stats.timeline if entry.get("candidates")]
    assert rows_when_combined and max(rows_when_combined) <= 4


def test_combination_needs_position_keyed_acceptance_and_several_drafters(target):  # noqa: F811
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("model", "ngram")]
    assert specactor_engine(target, drafters, combine_below=8).combine_below == 8
    assert specactor_engine(target, drafters, combine_below=8, acceptance="rejection").combine_below == 0
    assert specactor_engine(target, drafters[:1], combine_below=8).combine_below == 0
    with pytest.raises(ValueError, match="combine_below"):
        specactor_engine(target, drafters, combine_below=-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_dynamic_length_with_the_draft_model_beside_model_free_methods_is_exact(target, temperature):  # noqa: F811
    """The verify length and each row's method chosen together (the draft model in process, beside suffix
    and n-gram, with shadow drafts): exact against plain decoding, and the draft model's drafts are verified."""
    from tests.engine.test_dynamic_verify_length import table

    params = sampling(temperature, n=3, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(6), params))
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("model", "suffix", "ngram")]
    # the table prices a plain round at 10 ms, where the tiny models take well under 1: the draft model's prior
    # (its share of the target's bytes, 0.6 here) would price it at 6 ms a position, and it would never be tried
    drafters[0].cost_share = 0.01
    drafters[0].catch_up_estimate_s = lambda state, slots, steady=0: 0.0  # likewise its catch-ups, timed in real seconds
    engine = specactor_engine(target, drafters, cost_table=table(0.01, 0.0001), verify_length="dynamic")
    # a clock that stands still: drafting costs nothing and every width calibrates alike, so the draft model is weighed
    # by the table and its acceptance; on the wall clock its steps, timed on a machine busy with other work, could
    # price it out before a second round drafted with it (its catch-ups are still timed by the drafter, on the wall)
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    assert result.stats.drafted_per_drafter.get("model", 0) > 0
    policy = engine.length_policy
    assert policy is not None and "model" in policy.draft_s_by_method and "model" in policy.by_method
    # its feed rate before one is measured: its share of a target token of the widest profiled verify
    rows, width = policy.cost.batch_sizes[-1], engine.num_draft_tokens + 1
    assert drafters[0].feed_s_prior == pytest.approx(0.01 * policy.cost.cost(rows, width) / (rows * width))


@pytest.mark.parametrize("per_token, combined", [(0.0, True), (0.01, False)])
def test_under_a_dynamic_length_combination_runs_only_where_extra_rows_are_nearly_free(target, per_token, combined,
                                                                                         monkeypatch):  # noqa: F811
    """A verify whose cost does not grow with rows (memory-bound) drafts candidates beside the rows' drafts;
    one whose cost grows with every token (compute-bound) does not, since doubling the rows would cost far
    more than the candidates could win. Exact either way."""
    from specactor_engine.proposer import Proposer
    from tests.engine.test_dynamic_verify_length import table

    calls = []
    add_candidates = Proposer.add_candidates

    def counted(self, *args, **kwargs):
        calls.append(1)
        return add_candidates(self, *args, **kwargs)

    monkeypatch.setattr(Proposer, "add_candidates", counted)
    params = sampling(1.0, n=2, max_new_tokens=30, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(3), params))
    # the target drafting for itself (always accepted, so the rounds draft), candidates from the free methods
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("self", "suffix", "ngram")]
    # without draft trimming: under the compute-bound cost it would cut every draft (the rounds must verify drafts)
    engine = specactor_engine(target, drafters, cost_table=table(0.05, per_token), verify_length="dynamic",
                              combine_below=16, draft_trimming=False)
    engine.prepare_length_policy(ragged_requests(3), params)
    engine.length_policy.probe_budget = 1.0  # a deep probe on its regular schedule (not held by the 5% time budget)
    # nor by the gate on what it could reveal (under the compute-bound cost drafting with the target itself cannot
    # pay; the rounds must draft for candidates to be weighed at all; the gate has its own test)
    engine.length_policy._probe_may_pay = lambda *args: True
    # and the self drafter's catch-ups priced at nothing: timed in real seconds against the table's, they made the
    # probe's rows go to the free methods in some runs, which find nothing on these prompts (the same lengths chosen,
    # nothing drafted: 2 of 5 runs in session 33; 6 of 6 drafted with this)
    drafters[0].catch_up_estimate_s = lambda state, slots, steady=0: 0.0
    # and a clock that stands still: drafting costs nothing and every width calibrates alike, so the lengths and the
    # combination's cost follow the table; on the wall clock the target's own draft steps are timed against it
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(3), params)
    assert token_ids(result) == reference
    assert result.stats.drafted_tokens > 0 and (len(calls) > 0) == combined, len(calls)


def test_the_draft_model_is_offered_for_the_whole_batch_even_where_the_selector_prefers_free_drafts(target):  # noqa: F811
    """Per row, the selector charges a draft model its whole step for one row and prefers suffix drafts that are
    half right (trace D: it gave the rows to them, 0.5 accepted where the model got 3.4). The verify length weighs
    the round's cost, where the model's step is paid once for all rows, so it is offered every row on the model
    first (the option it keeps probed), then the selector's choice and its free-only choice, without duplicates;
    rows with no room draft nothing."""
    from types import SimpleNamespace

    from specactor_engine.policies.selector import FastestOfNSelector
    from specactor_engine.proposer import Proposer
    from specactor_engine.types import EngineStats

    drafters = [make_drafter(kind, target, torch.float64) for kind in ("model", "suffix", "ngram")]
    selector = FastestOfNSelector([d.name for d in drafters])
    keys = [11, 12, 13]
    for key in keys:  # every method tried; the model's drafts accepted 3 of 4, at a step cost 3x a row's verify
        selector.observe([key] * 3, ["model", "suffix", "ngram"], [3, 1, 0])
    selector.cost.update({"model": 0.3, "suffix": 0.0, "ngram": 0.0})
    stats = EngineStats()
    stats.verify_s, stats.row_rounds = 0.1, 1
    state = SimpleNamespace(seq_keys=torch.tensor(keys))
    proposer = Proposer(state, sampling(1.0), stats, drafters, None, selector, None, 0, True, 64,
                        lambda slot: ([], 0, False))
    assert selector.choose(keys, 0.1) == ["suffix"] * 3  # the premise
    options = proposer.method_options(torch.arange(3), torch.tensor([4, 0, 4]), workers_on=False)
    assert options == [["model", None, "model"], ["suffix", None, "suffix"]]


def _two_row_proposer(drafters):
    """A Proposer over `drafters` for two rows (sequence keys 11, 12) with a Fastest-of-N selector, a row's verify
    share 0.1 s: (proposer, selector)."""
    from types import SimpleNamespace

    from specactor_engine.policies.selector import FastestOfNSelector
    from specactor_engine.proposer import Proposer
    from specactor_engine.types import EngineStats

    selector = FastestOfNSelector([d.name for d in drafters])
    stats = EngineStats()
    stats.verify_s, stats.row_rounds = 0.1, 1
    state = SimpleNamespace(seq_keys=torch.tensor([11, 12]))
    proposer = Proposer(state, sampling(1.0), stats, drafters, None, selector, None, 0, True, 64,
                        lambda slot: ([], 0, False))
    return proposer, selector


def test_with_two_draft_models_the_one_measured_cheaper_is_offered_first_and_kept_probed(target):  # noqa: F811
    """The first option is the one the verify length probes while another wins; probing the costlier of two
    draft models (each probe also pays its catch-up forward) cost trace D more than it found. A model not
    measured yet and without a size prior (no engine set one) counts as free and goes first (config order among
    those), so that it gets measured."""
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("model", "self", "suffix")]
    names = [d.name for d in drafters]
    assert [d.model_free for d in drafters] == [False, False, True]
    proposer, selector = _two_row_proposer(drafters)
    caps = torch.tensor([4, 4])
    assert proposer.method_options(torch.arange(2), caps, workers_on=False)[:2] == [[names[0]] * 2, [names[1]] * 2]
    selector.cost.update({names[0]: 0.05})  # only the first measured: the second goes first, to be measured
    assert proposer.method_options(torch.arange(2), caps, workers_on=False)[:2] == [[names[1]] * 2, [names[0]] * 2]
    selector.cost.update({names[1]: 0.08})  # both measured, the first cheaper: it goes first
    assert proposer.method_options(torch.arange(2), caps, workers_on=False)[:2] == [[names[0]] * 2, [names[1]] * 2]
    selector.cost.update({names[1]: 0.01})  # the second measured cheaper: it goes first
    assert proposer.method_options(torch.arange(2), caps, workers_on=False)[:2] == [[names[1]] * 2, [names[0]] * 2]


def test_a_draft_model_not_measured_yet_is_ranked_by_its_size(target):  # noqa: F811
    """The engine gives each draft model a prior cost, its step's weight bytes over the target's; until a model is
    measured it is ranked by that prior (share x a row's verify seconds), so of two models the smaller one is the
    first option (measured and kept probed) and the larger is tried only where the verify length expects it to
    win: counted free, trace D's 0.5B was probed beside a feature-level drafter that dominated it."""
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("self", "model", "suffix")]
    engine = specactor_engine(target, drafters)
    big, small = drafters[0], drafters[1]
    assert big.cost_share == pytest.approx(1.0)  # the target itself
    assert small.cost_share == pytest.approx(small.step_bytes() / engine.runner.step_bytes())
    assert 0.0 < small.cost_share < 0.6 and drafters[2].cost_share is None
    layers = sum(p.numel() * p.element_size() for p in target.model.layers.parameters())
    head = target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    norm = sum(p.numel() * p.element_size() for p in target.model.norm.parameters())
    assert engine.runner.step_bytes() == layers + head + norm

    proposer, selector = _two_row_proposer(drafters)
    caps = torch.tensor([4, 4])
    # config order puts the big one first; its size puts the small one first
    assert proposer.method_options(torch.arange(2), caps, workers_on=False)[:2] == [["model"] * 2, ["self"] * 2]
    selector.cost.update({"self": 0.2 * small.cost_share * 0.1})  # the big one measured cheaper than the prior
    assert proposer.method_options(torch.arange(2), caps, workers_on=False)[:2] == [["self"] * 2, ["model"] * 2]


def test_plain_decoding_inside_the_block_is_the_ar_baseline_and_speculation_resumes_after(target):  # noqa: F811
    """What the post-training flow's evaluation measures a speculative rollout against: the same engine with
    its drafters switched off for the block (same weights, kernels and noise), then speculating again."""
    params = sampling(1.0, n=2, max_new_tokens=20)
    drafters = [make_drafter(kind, target, torch.float64) for kind in ("suffix", "ngram", "model")]
    engine = specactor_engine(target, drafters)
    speculative = engine.generate(ragged_requests(4), params)
    with engine.plain_decoding():
        assert not engine.speculative
        plain = engine.generate(ragged_requests(4), params)
    assert engine.speculative and engine.drafters == drafters
    again = engine.generate(ragged_requests(4), params)
    assert token_ids(plain) == token_ids(speculative) == token_ids(again)
    assert plain.stats.mode == "ar" and plain.stats.drafted_tokens == 0
    assert speculative.stats.drafted_tokens > 0 and again.stats.drafted_tokens > 0


def test_rollouts_inside_history_kept_leave_the_suffix_history_as_it_was(target):  # noqa: F811
    """An evaluation's outputs must not draft the next evaluation of the same prompts."""
    params = sampling(1.0, n=2, max_new_tokens=12)
    suffix = make_drafter("suffix", target, torch.float64)
    engine = specactor_engine(target, [suffix, make_drafter("ngram", target, torch.float64)])
    engine.generate(ragged_requests(2), params)  # a training rollout: joins the history
    before = {key: [list(o) for o in outputs] for key, outputs in suffix.history.outputs.items()}
    assert before
    with engine.history_kept():
        engine.generate(ragged_requests(4), params)
        assert len(suffix.history) > len(before)  # recorded meanwhile ...
    assert {key: [list(o) for o in outputs] for key, outputs in suffix.history.outputs.items()} == before  # ... and undone


def test_reserve_measures_the_verify_length_s_cost_profile_before_the_timed_generate(target):  # noqa: F811
    """A timed `generate` after `reserve` holds decoding only: the post-training evaluation times the speculative
    rollout against plain decoding, and the first profile measurement must not land in one of them."""
    engine = specactor_engine(target, [make_drafter("ngram", target, torch.float64)], verify_length="dynamic")
    assert engine.length_policy is None
    engine.reserve(ragged_requests(3), sampling(1.0, n=2, max_new_tokens=8))
    assert engine.length_policy is not None and engine.cost_table is not None
    table = engine.cost_table
    engine.generate(ragged_requests(3), sampling(1.0, n=2, max_new_tokens=8))
    assert engine.cost_table is table  # not measured again
