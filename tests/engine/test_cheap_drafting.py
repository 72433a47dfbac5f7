"""Cheaper model drafting: int8 or bf16 drafting weights and a compact head over part of the vocabulary.

Neither may change the output (a draft is only a proposal): exact against plain decoding in fp64, under
both acceptance rules; the compact head's sampling equals full-vocabulary sampling with the other tokens
masked; the int8 copy follows the float weights through updates.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specactor_engine import clock
from specactor_engine.drafters import DraftRequest, DrafterContext
from specactor_engine.counter_hash import token_hash_of
from specactor_engine.drafters.draft_head import DraftHead, VocabGrowth, float_linear
from specactor_engine.drafters.model import ModelDrafter
from specactor_engine.engine import Engine
from specactor_engine.model.draft_vocab import GrowingVocab, lowest_ids_vocab
from specactor_engine.model.packed_linear import PackedModule, packing_supported
from specactor_engine.model.quantize import Int8PackedLinear, int8_supported, quantize_int8
from specactor_engine.model.runner import ModelRunner
from specactor_engine.sampling import SamplingParams, sample_tokens
from specactor_engine.state import SequenceState
from tests.engine.test_exactness import MAX_LEN, ragged_requests, rollout, run, sampling, token_ids
from tests.fixtures.tiny_models import VOCAB_SIZE, make_tiny_model, make_tokenizer

needs_int8 = pytest.mark.skipif(not int8_supported(), reason="no x86/fbgemm quantized engine in this torch build")


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("qwen2", seed=11, dtype=torch.float64)


def drafter(target, quantize: str = "none", draft_vocab: int | None = None, model=None) -> ModelDrafter:
    tokenizer = make_tokenizer()
    context = DrafterContext("cpu", "float32", tokenizer, target.config.vocab_size)
    model = model if model is not None else make_tiny_model("llama", seed=1, num_layers=1, dtype=torch.float32)
    config = SimpleNamespace(name="model", quantize=quantize, draft_vocab=draft_vocab)
    return ModelDrafter(config, context, model=model, tokenizer=tokenizer)


@pytest.mark.parametrize("quantize", ["none", pytest.param("int8", marks=needs_int8)])
@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("acceptance, temperature", [("position_keyed", 0.0), ("position_keyed", 1.0),
                                                     ("rejection", 0.0)])
def test_cheap_model_drafters_are_exact(target, quantize, draft_vocab, acceptance, temperature):
    """Token for token (rejection sampling is exact in distribution when sampling: the next test)."""
    params = sampling(temperature, n=3, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(6), params))
    draft = drafter(target, quantize, draft_vocab)
    config = rollout("coupled", num_draft_tokens=4, max_batch_size=16, acceptance=acceptance)
    engine = Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN, drafters=[draft], check_invariants=True)
    result = engine.generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    assert result.stats.drafted_tokens > 0
    if draft_vocab is not None:  # the vocabulary took in every token the target emitted
        emitted = torch.tensor([t for output in result.outputs for t in output.token_ids])
        assert bool(draft.vocab.member[emitted].all()) and len(draft.vocab) > draft_vocab


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bf16_drafter_over_a_packed_compact_head_is_exact(target, temperature):
    """A bf16 draft model whose compact head is packed like its linears (PackedModule where packing applies: the
    engine's bf16 kernel on AVX-512 BF16 CPUs). Its drafts differ from an fp32 drafter's; the output does not (fp64
    target)."""
    params = sampling(temperature, n=3, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(6), params))
    draft = drafter(target, "none", 40, model=make_tiny_model("llama", seed=1, num_layers=1, dtype=torch.bfloat16))
    engine = Engine(target, make_tokenizer(), rollout("coupled", num_draft_tokens=4, max_batch_size=16),
                    max_model_len=MAX_LEN, drafters=[draft], check_invariants=True)
    result = engine.generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    assert result.stats.drafted_tokens > 0 and result.stats.accepted_tokens > 0
    base = draft.head._base
    assert isinstance(base, PackedModule) == packing_supported(torch.bfloat16, torch.device("cpu"))


def test_a_float_compact_head_is_packed_where_packing_applies():
    """float_linear: the rows' logits, through PackedLinear where it packs this dtype (same values up to the
    summation order), torch's linear elsewhere; `.weight` is the rows either way."""
    torch.manual_seed(0)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        rows, x = torch.randn(100, 64, dtype=dtype), torch.randn(3, 2, 64, dtype=dtype)
        head = float_linear(rows)
        assert isinstance(head, PackedModule) == packing_supported(dtype, torch.device("cpu"))
        assert torch.equal(head.weight, rows)
        expected = (x.double() @ rows.double().T)
        assert torch.allclose(head(x).double(), expected, rtol=tolerance, atol=tolerance * 8)


@needs_int8
def test_the_int8_copy_drafts_and_the_float_model_is_what_is_trained_and_synced(target):
    """Drafting runs on int8 linears quantized from the float master (no copy of the model); trainable_model is the
    master; after a weight update the int8 weights follow (its drafts equal those of a drafter built on them)."""
    first, second = (make_tiny_model("llama", seed=s, num_layers=1, dtype=torch.float32) for s in (1, 2))
    updated = drafter(target, "int8", model=first)
    assert all(isinstance(linear, Int8PackedLinear) for linear in updated.runner.projections[0].linears())
    assert updated.runner.model is first and updated.trainable_model() is first
    assert isinstance(first.model.layers[0].mlp.down_proj, torch.nn.Linear)
    updated.update_weights(second.state_dict().items(), version=1)
    fresh = drafter(target, "int8", model=make_tiny_model("llama", seed=2, num_layers=1, dtype=torch.float32))
    assert torch.equal(_drafts(updated), _drafts(fresh))
    assert not torch.equal(_drafts(drafter(target, "int8", model=make_tiny_model("llama", seed=1, num_layers=1,
                                                                                  dtype=torch.float32))),
                           _drafts(fresh))  # the premise: the two weights draft differently


@pytest.mark.parametrize("quantize", ["none", pytest.param("int8", marks=needs_int8)])
def test_compact_head_draft_probabilities_are_a_distribution_over_its_vocabulary(target, quantize):
    """Rejection sampling needs q: with a compact head, q is zero outside the drafter's vocabulary, sums to
    one, and gives the drafted token positive mass (then the rejection rule is exact for any q)."""
    draft = drafter(target, quantize, draft_vocab=40)
    proposal = _proposal(draft, coupled_noise=False)
    assert proposal.probs is not None and proposal.probs.shape[-1] == target.config.vocab_size
    outside = ~draft.vocab.member
    assert float(proposal.probs[..., outside].abs().max()) == 0.0
    assert torch.allclose(proposal.probs.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    assert bool((proposal.probs.gather(-1, proposal.token_ids[..., None]) > 0).all())


def _drafts(model_drafter: ModelDrafter) -> torch.Tensor:
    """Drafts [2, 5] at T=1 for two fixed prompts."""
    return _proposal(model_drafter).token_ids


def _proposal(model_drafter: ModelDrafter, coupled_noise: bool = True):
    """The drafter's proposal of 5 tokens per row at T=1 for two fixed prompts."""
    state = SequenceState.allocate(2, 32)
    prompts = torch.tensor([[5, 9, 17, 33, 2, 8], [40, 41, 42, 43, 44, 45]])
    state.tokens[:, :6] = prompts
    state.lengths[:] = state.prompt_lengths[:] = 6
    state.seq_keys[:] = torch.tensor([3, 4])
    model_drafter.allocate(2, 32)
    slots = torch.arange(2)
    model_drafter.add_rows(state, slots)
    request = DraftRequest(slots, torch.tensor([5, 5]), SamplingParams(temperature=1.0), coupled_noise=coupled_noise)
    return model_drafter.propose(state, request)


def test_compact_sampling_equals_full_sampling_with_the_other_tokens_masked():
    torch.manual_seed(0)
    for vocab_size in (300, 6000):  # the reference path and the fused kernel's
        logits = torch.randn(3, 2, vocab_size)
        ids = torch.sort(torch.randperm(vocab_size)[: vocab_size // 4]).values
        masked = torch.full_like(logits, float("-inf"))
        masked[..., ids] = logits[..., ids]
        keys, positions = torch.tensor([11, 22, 33]), torch.tensor([[0, 1], [5, 6], [9, 10]])
        for temperature in (0.0, 0.7, 1.0):
            params = SamplingParams(temperature)
            full = sample_tokens(masked, params, keys, positions)
            compact = sample_tokens(logits[..., ids], params, keys, positions, vocab_ids=ids)
            assert torch.equal(full, compact)
            assert bool(torch.isin(compact, ids).all())
            kept = sample_tokens(logits[..., ids], params, keys, positions, vocab_ids=ids,
                                 vocab_hashes=token_hash_of(ids))  # a head's hashes kept between its rebuilds
            assert torch.equal(kept, compact)


def test_draft_head_keeps_its_columns_hashes_in_step_with_a_growing_vocabulary():
    vocab = GrowingVocab(lowest_ids_vocab(8, VOCAB_SIZE, always=[]), VOCAB_SIZE)
    weight = torch.randn(VOCAB_SIZE, 16)
    head = DraftHead(lambda: weight, vocab, "none", VOCAB_SIZE)
    head.module()
    assert head.id_hashes is not None and torch.equal(head.id_hashes, token_hash_of(head.ids))
    vocab.add(torch.tensor([VOCAB_SIZE - 1, VOCAB_SIZE - 2]))
    head.module()  # rebuilt over the grown vocabulary: the new columns get their tokens' hashes
    assert len(head.ids) == 10 and torch.equal(head.id_hashes, token_hash_of(head.ids))


def test_growing_vocab_keeps_insertion_order_and_counts_changes():
    vocab = GrowingVocab(lowest_ids_vocab(4, 100, always=[99, 500]), 100)
    assert vocab.ids.tolist() == [0, 1, 2, 3, 99] and vocab.version == 0
    vocab.add(torch.tensor([[3, 7], [7, 150]]))  # 150 lies outside the vocabulary: ignored
    assert vocab.ids.tolist() == [0, 1, 2, 3, 99, 7] and vocab.version == 1
    vocab.add(torch.tensor([1, 2]))
    assert vocab.version == 1  # nothing new: a head built over it stays valid


def test_committed_tokens_join_the_vocabulary_before_drafting_and_when_a_row_finishes():
    """VocabGrowth defers a round's committed tokens to the next draft (or the row's end): the vocabulary a draft
    sees holds every token committed so far, and a finished row's last tokens are taken in before its slot holds
    another row's prompt."""
    vocab = GrowingVocab(lowest_ids_vocab(4, 100, always=[]), 100)
    state = SequenceState.allocate(3, 16)
    growth = VocabGrowth(vocab, 3)

    def admit(slot: int, prompt: list[int]) -> None:
        state.lengths[slot] = 0
        state.append(torch.tensor([slot]), torch.tensor([prompt]), torch.tensor([len(prompt)]))
        state.prompt_lengths[slot] = len(prompt)
        growth.admit(state, torch.tensor([slot]))

    admit(0, [10, 11])
    admit(1, [12])
    assert vocab.ids.tolist() == [0, 1, 2, 3, 10, 11, 12]
    rows = torch.tensor([0, 1])
    state.append(rows, torch.tensor([[20, 21], [22, 0]]), torch.tensor([2, 1]))
    growth.committed(rows)
    assert not bool(vocab.member[[20, 21, 22]].any())  # deferred: nothing gathered after the round
    state.append(rows, torch.tensor([[23, 0], [24, 0]]), torch.tensor([1, 1]))
    growth.committed(rows)
    growth.before_drafting(state)  # both rounds' tokens of both rows, once
    assert vocab.ids.tolist()[7:] == [20, 21, 22, 23, 24]
    state.append(rows, torch.tensor([[30, 0], [31, 0]]), torch.tensor([1, 1]))
    growth.committed(rows)
    growth.finish(state, torch.tensor([1]))  # row 1 ends: its last token joins; row 0's waits for the next draft
    assert bool(vocab.member[31]) and not bool(vocab.member[30])
    admit(1, [40])  # the slot's next row: its prompt, and nothing of the old row twice
    growth.before_drafting(state)
    assert vocab.ids.tolist()[7:] == [20, 21, 22, 23, 24, 31, 40, 30]


def test_int8_needs_a_float32_drafter():
    with pytest.raises(ValueError, match="float32"):
        quantize_int8(make_tiny_model("llama", seed=1, num_layers=1, dtype=torch.float64))
    with pytest.raises(ValueError, match="set the drafter's dtype to float32"):
        ModelRunner(make_tiny_model("llama", seed=1, num_layers=1, dtype=torch.bfloat16), int8=True)


@needs_int8
def test_fused_int8_linears_equal_the_separate_int8_copies():
    """q/k/v in one int8 GEMM give what three int8 linears give: per-channel weight scales are per output row, and
    the activations' quantization depends on the input alone."""
    torch.manual_seed(0)
    parts = [torch.nn.Linear(64, n, bias=bias) for n, bias in ((64, True), (32, False), (32, True))]
    x = torch.randn(5, 3, 64)
    fused = Int8PackedLinear(parts)(x)
    separate = torch.cat([quantize_int8(torch.nn.Sequential(p))[0](x) for p in parts], dim=-1)
    assert torch.allclose(fused, separate, rtol=0, atol=1e-6)
    assert Int8PackedLinear(parts).nbytes() == 128 * 64 + 4 * 128 * 2


@needs_int8
def test_an_int8_runner_computes_the_float_models_logits_from_a_quarter_of_the_bytes():
    """ModelRunner(int8=True): the float32 model's own modules with fused int8 projections and head: the logits of
    an int8 copy of the model (the fused GEMMs change nothing; the fused layer ops may move a rounding), near the
    float runner's, and a step reads about a quarter of the linears' float32 bytes."""
    model = make_tiny_model("llama", seed=3, num_layers=2, hidden=128, dtype=torch.float32, init_range=0.05)
    runners = [ModelRunner(model, packed_linear=False), ModelRunner(model, int8=True),
               ModelRunner(quantize_int8(model), packed_linear=False)]
    tokens, slots = torch.tensor([[5, 9, 17, 33, 2, 8], [40, 41, 42, 43, 44, 45]]), torch.arange(2)
    logits = []
    for runner in runners:
        runner.allocate(2, 16)
        logits.append(runner.forward(tokens, slots))
    reference, quantized, copy = logits
    assert float((quantized - copy).norm() / copy.norm()) < 0.01
    assert float((quantized - reference).norm() / reference.norm()) < 0.1
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert runners[1].step_bytes() < runners[0].step_bytes() - 2.5 * linears


@needs_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_runner_with_some_projections_in_int8_keeps_the_others_and_the_model_s_dtype(dtype):
    """ModelRunner(int8_projections=("o", "gate_up", "down")): those run on int8 weights and hand back the model's
    dtype, q/k/v stay packed in it; the logits lie near the plain runner's and a step reads fewer bytes. A name that
    is no projection, or a dtype the others cannot be packed in, is refused."""
    from specactor_engine.model.packed_linear import PackedLinear, packing_supported

    if not packing_supported(dtype, torch.device("cpu")):
        pytest.skip(f"this CPU does not pack {dtype}")
    model = make_tiny_model("llama", seed=3, num_layers=2, hidden=128, dtype=dtype, init_range=0.05)
    plain, mixed = ModelRunner(model), ModelRunner(model, int8_projections=("o", "gate_up", "down"))
    layer = mixed.projections[0]
    assert isinstance(layer.o, Int8PackedLinear) and isinstance(layer.down, Int8PackedLinear)
    assert type(layer.qkv) is PackedLinear and type(plain.projections[0].o) is PackedLinear
    tokens, slots = torch.tensor([[5, 9, 17, 33, 2, 8], [40, 41, 42, 43, 44, 45]]), torch.arange(2)
    logits = []
    for runner in (plain, mixed):
        runner.allocate(2, 16)
        logits.append(runner.forward(tokens, slots))
    assert logits[1].dtype == dtype
    reference, quantized = (x.float() for x in logits)
    assert float((quantized - reference).norm() / reference.norm()) < 0.1
    int8_weights = sum(p.numel() for layer in model.model.layers for name in ("o_proj", "gate_proj", "up_proj",
                                                                              "down_proj")
                       for p in (getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)).parameters())
    saved = plain.step_bytes() - mixed.step_bytes()
    assert (torch.finfo(dtype).bits // 8 - 1.1) * int8_weights < saved < (torch.finfo(dtype).bits // 8) * int8_weights
    with pytest.raises(ValueError, match="not projections"):
        ModelRunner(model, int8_projections=("mlp",))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ModelRunner(make_tiny_model("llama", seed=1, num_layers=1, dtype=torch.float64), int8_projections=("down",))


@needs_int8
@pytest.mark.parametrize("kernel", [True, False])
def test_int8_projections_take_a_bfloat16_input_on_either_int8_path(kernel, monkeypatch):
    """A bf16 layer's int8 projection (`int8_projections`) hands its input to the engine's kernel or, on CPUs without
    AVX-512 VNNI, to torch's dynamic int8 linear, which takes float32 only: both return the input's dtype, near the
    float result."""
    from specactor_engine.kernels import int8_linear as int8_kernel

    if kernel and not int8_kernel.available():
        pytest.skip("no AVX-512 VNNI kernel here")
    if not kernel:
        monkeypatch.setattr(int8_kernel, "available", lambda: False)
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    x = torch.randn(3, 64).to(torch.bfloat16)
    y = Int8PackedLinear([linear])(x)
    assert y.dtype == torch.bfloat16
    reference = linear(x.float())
    assert float((y.float() - reference).norm() / reference.norm()) < 0.05


def test_a_model_drafter_that_fell_behind_catches_up_apart_and_drafts_the_same():
    """Rounds drafted by other methods leave the model's KV behind; its next propose feeds those tokens in a
    forward of its own, timed as `catch_up_s` (a switching cost the verify length does not weigh as the
    steady per-draft cost), and drafts exactly what a drafter that never fell behind drafts (fp64)."""
    target = make_tiny_model("qwen2", seed=11, dtype=torch.float64)
    tokenizer = make_tokenizer()
    context = DrafterContext("cpu", "float64", tokenizer, target.config.vocab_size)

    def fresh() -> ModelDrafter:
        model = make_tiny_model("llama", seed=1, num_layers=1, dtype=torch.float64)
        return ModelDrafter(SimpleNamespace(name="model"), context, model=model, tokenizer=tokenizer)

    state = SequenceState.allocate(2, 64)
    state.tokens[:, :6] = torch.tensor([[5, 9, 17, 33, 2, 8], [40, 41, 42, 43, 44, 45]])
    state.lengths[:] = state.prompt_lengths[:] = 6
    state.seq_keys[:] = torch.tensor([3, 4])
    slots, request = torch.arange(2), DraftRequest(torch.arange(2), torch.tensor([3, 3]), SamplingParams(1.0))
    steady, behind = fresh(), fresh()
    for drafter in (steady, behind):
        drafter.allocate(2, 64)
        drafter.add_rows(state, slots)
    for round_index in range(6):  # `steady` drafts every round; `behind` only in the first and the last
        steady_drafts = steady.propose(state, request).token_ids
        assert steady.catch_up_s == 0.0
        if round_index in (0, 5):
            assert torch.equal(behind.propose(state, request).token_ids, steady_drafts)
            assert (behind.catch_up_s > 0) == (round_index == 5)
        state.append(slots, torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.tensor([3, 2]))
        for drafter in (steady, behind):
            drafter.observe_commit(state, slots)
            drafter.check_invariants(state, slots)


def two_model_drafters() -> list[ModelDrafter]:
    """Two fp64 model drafters with the same weights (one kept as the reference for the other)."""
    context = DrafterContext("cpu", "float64", make_tokenizer(), VOCAB_SIZE)
    return [ModelDrafter(SimpleNamespace(name="model"), context, tokenizer=make_tokenizer(),
                         model=make_tiny_model("llama", seed=1, num_layers=1, dtype=torch.float64))
            for _ in range(2)]


def test_a_model_drafter_admitted_without_prefill_drafts_the_same_after_catching_up():
    """`add_rows(..., prefill=False)` (the engine defers a costly draft model's prefill while it is out of use):
    the rows start empty and the first propose feeds prompt and outputs in its catch-up, drafting exactly what a
    drafter that prefilled drafts (fp64)."""
    drafters = two_model_drafters()
    state = SequenceState.allocate(2, 64)
    state.tokens[:, :6] = torch.tensor([[5, 9, 17, 33, 2, 8], [5, 9, 17, 33, 2, 8]])  # a group of two
    state.lengths[:] = state.prompt_lengths[:] = 6
    state.seq_keys[:] = torch.tensor([3, 4])
    slots, request = torch.arange(2), DraftRequest(torch.arange(2), torch.tensor([3, 3]), SamplingParams(1.0))
    prefilled, deferred = drafters
    for drafter, prefill in ((prefilled, True), (deferred, False)):
        drafter.allocate(2, 64)
        drafter.add_rows(state, slots, prefill=prefill)
    assert prefilled.runner.lengths[slots].tolist() == [5, 5] and deferred.runner.lengths[slots].tolist() == [0, 0]
    state.append(slots, torch.tensor([[7, 8, 9], [10, 11, 12]]), torch.tensor([3, 2]))  # rounds of other methods
    for drafter in drafters:
        drafter.observe_commit(state, slots)
    assert torch.equal(deferred.propose(state, request).token_ids, prefilled.propose(state, request).token_ids)
    assert deferred.catch_up_s > 0


def test_a_deferred_group_catches_up_its_prompt_once_and_its_estimate_counts_it_once():
    """Rows of a GRPO group admitted without the draft model's prefill: their catch-up prefills the group's prompt
    once and copies its KV (trace D: a group of 4 fed its 85-token prompt 4 times over, 0.46 s against ~0.12 s),
    drafting what a drafter that prefilled drafts (fp64); the catch-up estimate the verify length weighs counts the
    shared prompt once, and rows of separate admissions (a leader's slot taken by a later row) apart."""
    drafters = two_model_drafters()
    state = SequenceState.allocate(4, 64)
    group, other = [5, 9, 17, 33, 2, 8], [40, 41, 42, 43]
    for row in range(3):
        state.tokens[row, :6] = torch.tensor(group)
    state.tokens[3, :4] = torch.tensor(other)
    state.lengths[:] = state.prompt_lengths[:] = torch.tensor([6, 6, 6, 4])
    state.seq_keys[:] = torch.tensor([3, 4, 5, 6])
    slots = torch.arange(4)
    prefilled, deferred = drafters
    for drafter, prefill in ((prefilled, True), (deferred, False)):
        drafter.allocate(4, 64)
        drafter.add_rows(state, slots, prefill=prefill)
    state.append(slots, torch.tensor([[7, 8, 9, 0], [10, 11, 0, 0], [12, 13, 14, 0], [15, 16, 17, 18]]),
                 torch.tensor([3, 2, 3, 4]))  # rounds of other methods
    for drafter in drafters:
        drafter.observe_commit(state, slots)
    deferred.feed, deferred.feed_s_prior = None, 1.0  # a second per token fed: the estimate in tokens
    # behind 8, 7, 8, 7 (no prompt in its cache); rows 1 and 2 share row 0's 5 prompt tokens
    assert deferred.catch_up_estimate_s(state, slots) == pytest.approx(8 + 2 + 3 + 7)
    prefills: list[int] = []
    original = deferred._prefill
    deferred._prefill = lambda tokens, rows, lengths: (prefills.extend(lengths.tolist()), original(tokens, rows, lengths))
    request = DraftRequest(slots, torch.tensor([2] * 4), SamplingParams(1.0))
    assert torch.equal(deferred.propose(state, request).token_ids, prefilled.propose(state, request).token_ids)
    assert sorted(prefills) == [3, 5]  # each distinct prompt once, without its last token
    assert deferred.catch_up_s > 0
    apart = two_model_drafters()[1]
    apart.allocate(4, 64)
    for row in range(4):  # one admission a row: nothing known shared
        apart.add_rows(state, slots[row:row + 1], prefill=False)
    apart.feed, apart.feed_s_prior = None, 1.0
    assert apart.catch_up_estimate_s(state, slots) == pytest.approx(8 + 7 + 8 + 7)


@needs_int8
def test_a_model_drafter_quantizes_its_weights_where_it_is_built(target):
    """The int8 weights are made when the drafter is built (and again on a weight update), not in its first
    drafting round: trace D's 0.5B paid 2.6 s there, inside `specactor`'s timed rollout when the benchmark's warm-up
    had not drafted with it (ModelRunner.pack)."""
    model_drafter = drafter(target, "int8")
    linears = [linear for layer in model_drafter.runner.projections for linear in layer.linears()]
    assert linears and all(linear._weight is not None for linear in linears)
    packs: list[int] = []
    for linear in linears:
        original = linear._pack
        linear._pack = lambda original=original: (packs.append(1), original())
    _drafts(model_drafter)
    assert packs == []


def test_rows_far_apart_catch_up_in_forwards_that_fit_the_cache():
    """A deferred row catches up from position 0 while another is near the cache's end: one forward would pad the
    far row to the deferred row's width and write past the cache (trace D: 'KV cache overflow: position 362 >=
    344'); the catch-up splits them, and both draft what a drafter that prefilled and kept up drafts."""
    from specactor_engine.drafters.model import fitting_batches

    assert [b.tolist() for b in fitting_batches(torch.tensor([0, 30, 2]), torch.tensor([30, 4, 20]), 40)] == \
        [[0, 2], [1]]
    drafters = two_model_drafters()
    state = SequenceState.allocate(2, 48)
    state.tokens[:, :4] = torch.tensor([[5, 9, 17, 33], [40, 41, 42, 43]])
    state.lengths[:] = state.prompt_lengths[:] = 4
    state.seq_keys[:] = torch.tensor([3, 4])
    keeping_up, late = drafters
    one, both = torch.tensor([0]), torch.arange(2)
    for drafter in drafters:
        drafter.allocate(2, 48)
    keeping_up.add_rows(state, both)
    late.add_rows(state, one)
    late.add_rows(state, torch.tensor([1]), prefill=False)
    request_one = DraftRequest(one, torch.tensor([2]), SamplingParams(1.0))
    for step in range(14):  # `late` drafts row 0 in the first 10 rounds only, row 1 never: both fall behind
        if step < 10:
            late.propose(state, request_one)
        keeping_up.propose(state, DraftRequest(both, torch.tensor([2, 2]), SamplingParams(1.0)))
        state.append(both, torch.tensor([[7, 8, 9], [10 + step, 11, 12]]), torch.tensor([3, 3]))
        for drafter in drafters:
            drafter.observe_commit(state, both)
    assert int(late.runner.lengths[0]) + int(state.lengths[1]) > 48  # one padded forward would overflow
    request = DraftRequest(both, torch.tensor([2, 2]), SamplingParams(1.0))
    assert torch.equal(late.propose(state, request).token_ids, keeping_up.propose(state, request).token_ids)


def test_the_engine_defers_the_prefill_of_a_costly_draft_model_out_of_use_and_stays_exact():
    """Rows admitted while the policy measures the draft model as costly and does not use it start without its
    prefill; outputs stay those of plain decoding (fp64), and rows it later drafts for catch up first."""
    from specactor_engine.policies.verify_length import AcceptanceStats, VerifyLengthPolicy
    from tests.engine.test_dynamic_verify_length import table

    target = make_tiny_model("qwen2", seed=3, num_layers=2, dtype=torch.float64)
    params = sampling(1.0, n=2, max_new_tokens=24)
    reference = token_ids(run(target, ragged_requests(6), params))
    tokenizer = make_tokenizer()
    context = DrafterContext("cpu", "float64", tokenizer, target.config.vocab_size)
    model = ModelDrafter(SimpleNamespace(name="model"), context, tokenizer=tokenizer,
                         model=make_tiny_model("llama", seed=1, num_layers=1, dtype=torch.float64))
    calls: list[bool] = []
    original = model.add_rows
    model.add_rows = lambda state, slots, prefill=True: (calls.append(prefill), original(state, slots, prefill))
    from tests.engine.test_exactness import make_drafter
    config = rollout("specactor", num_draft_tokens=3, max_batch_size=4, verify_length="dynamic")
    engine = Engine(target, tokenizer, config, max_model_len=MAX_LEN, check_invariants=True,
                    drafters=[model, make_drafter("suffix", target, torch.float64)])
    # probe_budget=1 and a clock that stands still (below): the probes fall due by their interval alone. On the wall
    # clock they wait for the measured round seconds to outweigh the catch-up a probe would pay, a race of two clocks:
    # at the default 5% CI's machine ran all 69 rounds without one (session 53's commits), this one probed at round
    # 50; at 1 a probe still waits as many rounds as that catch-up takes rounds, and it grows with every round the
    # model is out (the budget has its own test, test_verify_length.py)
    engine.length_policy = VerifyLengthPolicy(table(0.01, 0.0001), AcceptanceStats(max_k=3), probe_every=4,
                                              probe_budget=1.0)
    engine.length_policy.draft_s_by_method["model"] = 1.0  # measured costly, and not in use
    # probed all the same (a model this costly could not pay, so the probe gate would keep it out; this test is about
    # what its probes do, the gate has its own test in test_verify_length.py)
    engine.length_policy._probe_may_pay = lambda *args: True
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    assert False in calls  # some admissions deferred its prefill
    assert engine.length_policy.shadowed == {"suffix"}  # its deep positions are its shadows' to measure, not probes'
    assert result.stats.drafted_per_drafter.get("model", 0) > 0  # and it drafted (probes), catching up first


@pytest.mark.parametrize("quantize", ["none", pytest.param("int8", marks=needs_int8)])
def test_a_growing_vocabulary_keeps_new_tokens_beside_the_head_then_rebuilds_it(target, quantize):
    """Tokens the vocabulary takes in go to a small float head beside the compact one, which is rebuilt over
    all of them once they exceed EXTRA_ROWS; drafting stays exact throughout."""
    params = sampling(1.0, n=3, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(6), params))
    draft = drafter(target, quantize, draft_vocab=40)
    draft.head.EXTRA_ROWS = 8
    assert draft.head._base_rows == len(draft.vocab)  # built with the drafter, not in its first round
    engine = Engine(target, make_tokenizer(), rollout("coupled", num_draft_tokens=4, max_batch_size=16),
                    max_model_len=MAX_LEN, drafters=[draft], check_invariants=True)
    assert token_ids(engine.generate(ragged_requests(6), params)) == reference
    assert draft.head._base_rows > 40 + 8  # rebuilt at least once
