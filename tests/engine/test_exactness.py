"""Speculative output == plain output, token for token.

Greedy: `ar` and `coupled` (every drafter, k = 1..5) equal transformers' generate.
Seeded sampling (fp64): `ar` and `coupled` (every drafter, several k, other batch
compositions) emit identical sequences. KV length invariants are asserted after every
round (Engine(check_invariants=True)).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from specactor_engine.config import DecoupledConfig, RolloutConfig
from specactor_engine.drafters import DrafterContext
from specactor_engine.drafters.model import ModelDrafter
from specactor_engine.drafters.ngram import NgramDrafter
from specactor_engine.drafters.suffix import SuffixDrafter
from specactor_engine.engine import Engine
from specactor_engine.run import Run
from specactor_engine.types import Request
from tests.fixtures.tiny_models import EOS_ID, make_tiny_model, make_tokenizer

MAX_LEN = 160


def sampling(temperature: float = 0.0, max_new_tokens: int = 24, n: int = 1, seed: int = 0, **extra):
    base = dict(temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, n=n, seed=seed,
                stop=[], stop_token_ids=[], ignore_eos=False)
    return SimpleNamespace(**{**base, **extra})


def ragged_requests(count: int = 8, seed: int = 0) -> list[Request]:
    """Prompts of lengths 3..3+2*(count-1) with a repeated phrase so n-grams can match."""
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(count):
        phrase = torch.randint(0, 256, (2 + i % 3,), generator=gen).tolist()
        tail = torch.randint(0, 256, (1 + i,), generator=gen).tolist()
        requests.append(Request(request_id=f"req-{i}", prompt_token_ids=phrase * 2 + tail))
    return requests


def make_drafter(kind: str, target, dtype: torch.dtype, max_batch_size: int = 16):
    tokenizer = make_tokenizer()
    context = DrafterContext("cpu", str(dtype).removeprefix("torch."), tokenizer,
                             target.config.vocab_size)
    if kind == "ngram":
        return NgramDrafter(SimpleNamespace(name="ngram", min_n=1, max_n=3), context)
    if kind == "model":
        draft = make_tiny_model("llama", seed=1, num_layers=1, dtype=dtype)
        return ModelDrafter(SimpleNamespace(name="model"), context, model=draft, tokenizer=tokenizer)
    if kind == "suffix":
        return SuffixDrafter(SimpleNamespace(name="suffix", max_depth=12, min_match=1, max_history=4), context)
    if kind == "self":  # draft == target: every draft must be accepted
        return ModelDrafter(SimpleNamespace(name="self"), context, model=target, tokenizer=tokenizer)
    raise ValueError(kind)


def rollout(mode: str = "ar", *, workers: bool = False, dynamic_decoupling: bool = False, **fields) -> RolloutConfig:
    """A RolloutConfig with the engine tests' defaults (fixed verify length, no combination, static
    decoupling) unless `fields` say otherwise; `workers`: drafter workers are handed to the engine."""
    decoupled = DecoupledConfig(drafter="in-memory workers" if workers else None, dynamic=dynamic_decoupling)
    return RolloutConfig(mode=mode, **{"verify_length": "fixed", "combine_below": 0, **fields}, decoupled=decoupled)


def run(target, requests, params, mode: str = "ar", drafters=(), k: int = 4, max_batch_size: int = 16,
        acceptance_rule: str = "position_keyed"):
    config = rollout(mode, num_draft_tokens=k, max_batch_size=max_batch_size, acceptance=acceptance_rule)
    engine = Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN, drafters=list(drafters),
                    check_invariants=True)
    return engine.generate(requests, params)


def token_ids(result) -> dict[tuple[str, int], list[int]]:
    return {(o.request_id, o.sample_index): o.token_ids for o in result.outputs}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral"])
def family_target(request):
    return make_tiny_model(request.param, seed=0)


def hf_greedy(model, request: Request, max_new_tokens: int) -> list[int]:
    prompt = torch.tensor([request.prompt_token_ids])
    out = model.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS_ID,
                         pad_token_id=258, attention_mask=torch.ones_like(prompt))
    return out[0, prompt.shape[1]:].tolist()


def test_greedy_matches_transformers_generate(family_target):
    requests = ragged_requests(8)
    params = sampling(0.0)
    reference = {(r.request_id, 0): hf_greedy(family_target, r, params.max_new_tokens) for r in requests}
    assert token_ids(run(family_target, requests, params)) == reference
    for kind in ("ngram", "suffix", "model"):
        for k in range(1, 6):
            drafter = make_drafter(kind, family_target, torch.float32)
            got = token_ids(run(family_target, requests, params, "coupled", [drafter], k=k))
            assert got == reference, f"coupled/{kind}/k={k} differs from generate"


@pytest.fixture(scope="module")
def fp64_target():
    return make_tiny_model("qwen2", seed=3, dtype=torch.float64)


@pytest.mark.parametrize("kind", ["ngram", "suffix", "model", "self"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_seeded_sampling_is_speculation_invariant(fp64_target, kind, k):
    requests = ragged_requests(8, seed=1)
    params = sampling(1.0, n=3, seed=7)
    plain = token_ids(run(fp64_target, requests, params))
    drafter = make_drafter(kind, fp64_target, torch.float64)
    assert token_ids(run(fp64_target, requests, params, "coupled", [drafter], k=k)) == plain


def test_seeded_sampling_ignores_batch_composition(fp64_target):
    requests = ragged_requests(8, seed=2)
    params = sampling(0.8, n=2, seed=11, top_k=50, top_p=0.9)
    full = token_ids(run(fp64_target, requests, params))
    # other order, a subset, and a tiny batch that forces continuous admission
    shuffled = token_ids(run(fp64_target, requests[::-1], params, "coupled", [make_drafter("ngram", fp64_target, torch.float64)]))
    subset = token_ids(run(fp64_target, requests[2:5], params, max_batch_size=3))
    small = token_ids(run(fp64_target, requests, params, "coupled", [make_drafter("model", fp64_target, torch.float64, 3)],
                          k=2, max_batch_size=3))
    assert shuffled == full
    assert subset == {key: full[key] for key in subset}
    assert small == full


@pytest.mark.parametrize("mode, kind", [("ar", None), ("coupled", "ngram"), ("coupled", "model")])
def test_a_sample_admitted_beside_a_decoding_sibling_reuses_its_prompt(fp64_target, monkeypatch, mode, kind):
    """Rows that stop early free slots one at a time, so a request's samples are admitted piecemeal; a sample
    whose sibling is still decoding copies its prompt KV and takes the prompt's kept logits: no second prefill,
    and the same tokens as when every sample is admitted at once."""
    requests = ragged_requests(3, seed=4)
    params = sampling(1.0, n=4, seed=5, max_new_tokens=30, stop_token_ids=list(range(40)))  # ~15% stop a token
    drafters = [make_drafter(kind, fp64_target, torch.float64, 16)] if kind else []
    at_once = token_ids(run(fp64_target, requests, params, mode, drafters, k=2))
    prefilled, needed, without_reuse = [], [], []
    admit, prefill = Run._admit, Run._prefill

    def counting_admit(self, batch):
        live = {id(seq.request) for seq in self.slot_seq.values()}
        distinct = {id(seq.request) for seq in batch}
        needed.append(len(distinct - live))
        without_reuse.append(len(distinct))
        return admit(self, batch)

    def counting_prefill(self, slots):
        prefilled.append(len(slots))
        return prefill(self, slots)

    monkeypatch.setattr(Run, "_admit", counting_admit)
    monkeypatch.setattr(Run, "_prefill", counting_prefill)
    drafters = [make_drafter(kind, fp64_target, torch.float64, 2)] if kind else []
    piecemeal = token_ids(run(fp64_target, requests, params, mode, drafters, k=2, max_batch_size=2))
    assert piecemeal == at_once
    assert sum(needed) < sum(without_reuse)  # some samples did join a decoding sibling
    assert sum(prefilled) == sum(needed)


def test_seed_changes_samples_and_samples_differ(fp64_target):
    requests = ragged_requests(4, seed=3)
    a = token_ids(run(fp64_target, requests, sampling(1.0, n=2, seed=1)))
    b = token_ids(run(fp64_target, requests, sampling(1.0, n=2, seed=2)))
    assert a != b
    assert a[("req-0", 0)] != a[("req-0", 1)]
    assert a == token_ids(run(fp64_target, requests, sampling(1.0, n=2, seed=1)))


def test_cascade_of_drafters_is_exact(fp64_target):
    requests = ragged_requests(8, seed=4)
    params = sampling(1.0, n=2, seed=5)
    plain = token_ids(run(fp64_target, requests, params))
    drafters = [make_drafter("ngram", fp64_target, torch.float64), make_drafter("model", fp64_target, torch.float64)]
    result = run(fp64_target, requests, params, "coupled", drafters, k=3)
    assert token_ids(result) == plain
    assert set(result.stats.drafted_per_drafter) <= {"ngram", "model"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fastest_of_n_selection_is_exact(fp64_target, temperature):
    """Per-request choice among n-gram, suffix, a weak model and the target itself: same outputs."""
    requests = ragged_requests(8, seed=6)
    params = sampling(temperature, n=3, seed=8, max_new_tokens=30)
    plain = token_ids(run(fp64_target, requests, params))
    drafters = [make_drafter(kind, fp64_target, torch.float64) for kind in ("ngram", "suffix", "model", "self")]
    engine = Engine(fp64_target, make_tokenizer(),
                    rollout("coupled", num_draft_tokens=3, max_batch_size=16, selection="fastest_of_n"),
                    max_model_len=MAX_LEN, drafters=drafters, check_invariants=True)
    result = engine.generate(requests, params)
    assert token_ids(result) == plain
    used = {name for name, drafted in result.stats.drafted_per_drafter.items() if drafted}
    assert len(used) >= 2  # rows really went to different drafters
    stats = result.stats
    assert stats.accepted_per_drafter.get("self", 0) == stats.drafted_per_drafter.get("self", 0)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_draft_equal_to_target_accepts_everything(fp64_target, k):
    rounds = 5
    params = sampling(1.0, max_new_tokens=1 + rounds * (k + 1), ignore_eos=True, n=2)
    result = run(fp64_target, ragged_requests(4), params, "coupled", [make_drafter("self", fp64_target, torch.float64)], k=k)
    stats = result.stats
    assert stats.acceptance_rate == 1.0
    assert stats.mean_acceptance_length == k + 1
    assert stats.accepted_per_position == [stats.drafted_per_position[0]] * k
    assert all(len(o.token_ids) == params.max_new_tokens for o in result.outputs)


def test_rejection_rule_greedy_is_exact_and_sampling_runs(fp64_target):
    requests = ragged_requests(6, seed=5)
    greedy = sampling(0.0)
    plain = token_ids(run(fp64_target, requests, greedy))
    drafters = [make_drafter("ngram", fp64_target, torch.float64), make_drafter("model", fp64_target, torch.float64)]
    assert token_ids(run(fp64_target, requests, greedy, "coupled", drafters, acceptance_rule="rejection")) == plain
    sampled = run(fp64_target, requests, sampling(1.0, n=2), "coupled", [make_drafter("self", fp64_target, torch.float64)],
                  k=3, acceptance_rule="rejection")
    assert sampled.stats.acceptance_rate == 1.0  # q == p: min(1, p/q) = 1
    assert all(o.finish_reason in ("stop", "length") for o in sampled.outputs)


def test_model_drafter_prefills_each_distinct_prompt_once(fp64_target):
    """Samples of one prompt share the drafter's prefill (KV copied); drafts stay those of the target."""
    drafter = make_drafter("self", fp64_target, torch.float64)
    prefill_rows: list[int] = []
    forward = drafter.runner.forward

    def recording(tokens, slots, counts=None, logits_at="all"):
        if logits_at == "none":  # the prompts' prefill
            prefill_rows.append(len(slots))
        return forward(tokens, slots, counts, logits_at=logits_at)

    drafter.runner.forward = recording
    params = sampling(1.0, max_new_tokens=11, ignore_eos=True, n=3)
    result = run(fp64_target, ragged_requests(2), params, "coupled", [drafter], k=2)
    assert prefill_rows == [2]  # 6 rows, 2 distinct prompts
    assert result.stats.acceptance_rate == 1.0  # the copied KV is the prompt's own


@pytest.mark.parametrize("mode, kinds", [("ar", ()), ("coupled", ("ngram", "model"))])
def test_a_resumed_rollout_decodes_the_skipped_samples_away_and_the_rest_exactly(fp64_target, mode, kinds):
    """`generate(skip=...)`, what `specactor rollout` does with a journal's finished samples: the other samples come
    out as in one whole run (tokens and log-probs), each handed to on_output once as it finishes."""
    requests = ragged_requests(6, seed=9)
    params = sampling(1.0, n=3, seed=13)
    whole = {(o.request_id, o.sample_index): o for o in run(fp64_target, requests, params).outputs}
    skip = {key for i, key in enumerate(sorted(whole)) if i % 3 != 1}  # whole groups and parts of groups
    drafters = [make_drafter(kind, fp64_target, torch.float64, 3) for kind in kinds]
    engine = Engine(fp64_target, make_tokenizer(), rollout(mode, num_draft_tokens=3, max_batch_size=3),
                    max_model_len=MAX_LEN, drafters=drafters, check_invariants=True)
    handed = []
    result = engine.generate(requests, params, skip=skip, on_output=handed.append)
    rest = sorted(set(whole) - skip)
    assert [(o.request_id, o.sample_index) for o in result.outputs] == rest  # (request, sample) order
    assert result.stats.num_sequences == len(rest)
    assert sorted((o.request_id, o.sample_index) for o in handed) == rest
    for output in handed:
        expected = whole[(output.request_id, output.sample_index)]
        assert output.token_ids == expected.token_ids and output.logprobs == expected.logprobs


def near_drafter(target, noise: float = 0.01) -> ModelDrafter:
    """A draft model that is the target with its weights perturbed: it accepts about half of its drafts, so rows
    run apart (a row can be near its budget while another drafts deep)."""
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn(weight.shape, generator=gen, dtype=weight.dtype) * noise)
    tokenizer = make_tokenizer()
    context = DrafterContext("cpu", str(target.dtype).removeprefix("torch."), tokenizer, target.config.vocab_size)
    return ModelDrafter(SimpleNamespace(name="near"), context, model=draft, tokenizer=tokenizer)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padded_verify_rows_near_their_budget_fit_the_plain_decoding_cache(fp64_target, temperature):
    """The target's cache is `ar`'s size (no draft headroom): in padded verify rounds (packing off) rows near their
    budget pad past it, and those pads go to its last position, which no real token reaches. Output equals plain
    decoding token for token."""
    # prompts of one length: every row's budget ends at the cache's end, and rows reach it in different rounds
    requests = [Request(request_id=r.request_id, prompt_token_ids=(r.prompt_token_ids * 3)[:12])
                for r in ragged_requests(8, seed=5)]
    params = sampling(temperature, n=2, seed=3, max_new_tokens=21, ignore_eos=True)
    plain_engine = Engine(fp64_target, make_tokenizer(), rollout("ar", max_batch_size=16), max_model_len=MAX_LEN,
                          check_invariants=True)
    reference = token_ids(plain_engine.generate(requests, params))
    config = rollout("coupled", num_draft_tokens=4, max_batch_size=16, packed_verify=False)
    engine = Engine(fp64_target, make_tokenizer(), config, max_model_len=MAX_LEN,
                    drafters=[near_drafter(fp64_target)], check_invariants=True)
    moved = []
    clamp = engine.runner._clamp_pads

    def counting(positions, num_tokens):
        out = clamp(positions, num_tokens)
        moved.append(int((out != positions).sum()))
        return out

    engine.runner._clamp_pads = counting
    result = engine.generate(requests, params)
    assert token_ids(result) == reference
    assert engine.runner.cache.max_len == plain_engine.runner.cache.max_len
    assert sum(moved) > 0  # some rounds padded past the cache
    assert result.stats.drafted_tokens > result.stats.accepted_tokens > 0
