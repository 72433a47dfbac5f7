"""The feature-level drafter (EAGLE-style, drafters/feature.py): the target's recorded features, the drafts
they give, and exactness against plain decoding in fp64."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specactor_engine import clock
from specactor_engine.drafters import DrafterContext
from specactor_engine.drafters.feature import FeatureDrafter
from specactor_engine.engine import Engine
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.model.runner import ModelRunner
from tests.engine.test_cheap_drafting import needs_int8
from tests.engine.test_exactness import MAX_LEN, make_drafter, ragged_requests, rollout, run, sampling, token_ids
from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("qwen2", seed=3, num_layers=2, dtype=torch.float64)


def feature_drafter(target, model: FeatureDraftModel | None = None, **config) -> FeatureDrafter:
    context = DrafterContext("cpu", "float64", make_tokenizer(), target.config.vocab_size)
    fields = {"name": "feature", "path": None, "quantize": "none", "draft_vocab": None, **config}
    return FeatureDrafter(SimpleNamespace(**fields), context, model=model)


def engine_with(target, drafters, mode: str = "coupled", k: int = 4, cost_table=None, **fields) -> Engine:
    config = rollout(mode, num_draft_tokens=k, max_batch_size=16, **fields)
    return Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN, drafters=drafters, cost_table=cost_table,
                  check_invariants=True)


def hf_features(target, tokens: list[int]) -> torch.Tensor:
    """The target's normalised final hidden states at every position, by Hugging Face: [T, d]."""
    with torch.no_grad():
        return target.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]


def test_the_runner_records_the_target_s_features_at_committed_positions(target):
    """Prefill, then a verify block of which part is committed: every committed position's recorded feature
    is Hugging Face's last hidden state there (the input of the LM head)."""
    runner = ModelRunner(target, record_features=True)
    runner.allocate(2, 32)
    prompts = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    runner.forward(prompts, torch.tensor([0, 1]), torch.tensor([5, 3]), logits_at="last")
    runner.commit(torch.tensor([0, 1]), torch.tensor([5, 3]))
    block = torch.tensor([[20, 21, 22], [23, 24, 25]])
    runner.forward(block, torch.tensor([0, 1]), torch.tensor([3, 3]))
    runner.commit(torch.tensor([0, 1]), torch.tensor([2, 3]))
    for slot, tokens in ((0, [5, 6, 7, 8, 9, 20, 21]), (1, [10, 11, 12, 23, 24, 25])):
        recorded = runner.features(torch.tensor([slot]), torch.tensor([0]), len(tokens))[0]
        torch.testing.assert_close(recorded, hf_features(target, tokens))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_feature_drafter_that_is_the_target_s_only_layer_has_every_draft_accepted(temperature):
    """A one-layer target and a drafter whose layer and norm are the target's, with fc = [I | 0] (the token's
    embedding alone): the drafter computes exactly the target's features, so each of its drafts is what the
    target samples, and every one is accepted. Any slip in positions, rotary angles or KV bookkeeping would
    show as a rejection."""
    one_layer = make_tiny_model("llama", seed=5, num_layers=1, dtype=torch.float64)
    model = FeatureDraftModel(one_layer)
    d = one_layer.config.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, :d] = torch.eye(d, dtype=torch.float64)
    params = sampling(temperature, n=2, max_new_tokens=26, ignore_eos=True)
    reference = token_ids(run(one_layer, ragged_requests(4), params))
    result = engine_with(one_layer, [feature_drafter(one_layer, model)]).generate(ragged_requests(4), params)
    assert token_ids(result) == reference
    assert result.stats.drafted_tokens > 0 and result.stats.acceptance_rate == 1.0


def test_drafts_are_the_model_s_prediction_from_the_target_s_features(target, monkeypatch):
    """Each round's first two greedy drafts equal a teacher-forced pass of the draft model over the committed
    tokens with Hugging Face's features one position behind (zeros at position 0), the second draft fed
    the first one's predicted feature: the features are paired with the right tokens."""
    drafter = feature_drafter(target)
    checked = []
    propose = FeatureDrafter.propose

    def spying(self, state, request):
        out = propose(self, state, request)
        for row, slot in enumerate(request.slots.tolist()):
            if int(out.num_tokens[row]) < 2:
                continue
            n = int(state.lengths[slot])
            tokens = state.tokens[slot, :n].tolist()
            embed = self.target.model.get_input_embeddings()
            with torch.no_grad():
                f = hf_features(target, tokens)
                prev = torch.cat([torch.zeros(1, f.shape[1], dtype=f.dtype), f[:-1]])
                g = self.model(embed(torch.tensor([tokens])), prev[None])[0]
                first = int(target.lm_head(g[-1]).argmax())
                prev2 = torch.cat([prev, g[-1:]])
                g2 = self.model(embed(torch.tensor([tokens + [first]])), prev2[None])[0]
                second = int(target.lm_head(g2[-1]).argmax())
            checked.append((out.token_ids[row, :2].tolist(), [first, second]))
        return out

    monkeypatch.setattr(FeatureDrafter, "propose", spying)
    engine = engine_with(target, [drafter])
    model = drafter.model
    assert model is not None
    engine.generate(ragged_requests(3), sampling(0.0, max_new_tokens=12, ignore_eos=True))
    assert len(checked) >= 6
    assert all(got == want for got, want in checked), checked


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_feature_drafter_beside_model_free_methods_is_exact(target, temperature):
    """Fastest-of-N over the feature drafter, suffix and n-gram with a dynamic verify length: rows switch
    methods, so the feature drafter catches up rows it did not draft for; output equals plain decoding."""
    from tests.engine.test_dynamic_verify_length import table

    params = sampling(temperature, n=3, max_new_tokens=30)
    reference = token_ids(run(target, ragged_requests(6), params))
    drafters = [feature_drafter(target), make_drafter("suffix", target, torch.float64),
                make_drafter("ngram", target, torch.float64)]
    # the table prices a plain round at 10 ms, where the tiny models take well under 1: priced by its share of the
    # tiny target's bytes (most of it), or with its catch-ups timed in real seconds, it would never be tried
    drafters[0].cost_share = 0.01
    drafters[0].catch_up_estimate_s = lambda state, slots, steady=0: 0.0
    engine = engine_with(target, drafters, "specactor", cost_table=table(0.01, 0.0001), verify_length="dynamic")
    # a clock that stands still: drafting costs nothing and every width calibrates alike, so the feature drafter is
    # weighed by the table and its acceptance, not by its steps timed on a machine that may be busy with other work
    # (its catch-ups are still timed by the drafter, on the wall clock)
    with clock.replaced(lambda: 0.0):
        result = engine.generate(ragged_requests(6), params)
    assert token_ids(result) == reference
    assert result.stats.drafted_per_drafter.get("feature", 0) > 0


def test_rejection_sampling_and_a_compact_vocabulary_stay_exact(target):
    """Classic rejection sampling needs the drafter's probabilities (over the target's vocabulary, zero outside
    a compact one): greedy output equals plain decoding; sampled output finishes."""
    requests = ragged_requests(5, seed=2)
    plain = token_ids(run(target, requests, sampling(0.0)))
    for vocab in (None, 64):
        drafter = feature_drafter(target, draft_vocab=vocab)
        result = engine_with(target, [drafter], acceptance="rejection").generate(requests, sampling(0.0))
        assert token_ids(result) == plain
        sampled = engine_with(target, [feature_drafter(target, draft_vocab=vocab)], acceptance="rejection") \
            .generate(requests, sampling(1.0, n=2))
        assert all(o.finish_reason in ("stop", "length") for o in sampled.outputs)


def test_a_drafter_at_a_scaled_temperature_stays_exact_and_takes_its_file_s_scale(target, tmp_path):
    """Drafting at T x temperature_scale changes the drafts, never the output (coupled rule at T = 1); without a
    configured scale the drafter takes the one saved with it (feature_drafter.json), and a configured one wins."""
    params = sampling(1.0, n=2, max_new_tokens=24, ignore_eos=True)
    reference = token_ids(run(target, ragged_requests(4), params))
    drafted = {}
    for scale in (1.0, 0.5):
        drafter = feature_drafter(target, temperature_scale=scale)
        result = engine_with(target, [drafter]).generate(ragged_requests(4), params)
        assert token_ids(result) == reference
        assert drafter.temperature_scale == scale and result.stats.drafted_tokens > 0
        drafted[scale] = (result.stats.drafted_tokens, result.stats.accepted_tokens)
    assert drafted[0.5] != drafted[1.0]  # the scale reached the drafts
    model = FeatureDraftModel(target)
    model.save(tmp_path, extra={"temperature_scale": 0.7, "passes": 3})
    loaded = FeatureDraftModel.load(tmp_path, target)
    assert (loaded.temperature_scale, loaded.trained_passes) == (0.7, 3)
    saved = feature_drafter(target, path=str(tmp_path))
    engine_with(target, [saved])
    assert saved.temperature_scale == 0.7
    chosen = feature_drafter(target, path=str(tmp_path), temperature_scale=1.0)
    engine_with(target, [chosen])
    assert chosen.temperature_scale == 1.0


def test_saved_drafter_loads_for_its_target_only(target, tmp_path):
    model = FeatureDraftModel(target)
    with torch.no_grad():
        model.fc.weight.mul_(0.5)
    model.save(tmp_path / "fd", extra={"note": "test"})
    loaded = FeatureDraftModel.load(tmp_path / "fd", target)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    other = make_tiny_model("qwen2", seed=3, num_layers=2, hidden=96, dtype=torch.float64)
    with pytest.raises(ValueError, match="built for a target"):
        FeatureDraftModel.load(tmp_path / "fd", other)
    with pytest.raises(FileNotFoundError, match="no feature drafter"):
        FeatureDraftModel.load(tmp_path / "missing", target)


def test_a_float32_drafter_s_fc_is_packed_and_follows_its_weights():
    """On a float32 target the drafter's fc [2d -> d] runs oneDNN-packed (one per draft step); its input x equals
    the model's own fc, and still does after the weights change in place (a drafter refresh or training step)."""
    from specactor_engine.model.packed_linear import PackedLinear, packing_supported

    target32 = make_tiny_model("qwen2", seed=3, num_layers=2, dtype=torch.float32)
    if not packing_supported(torch.float32, torch.device("cpu")):
        pytest.skip("this torch has no oneDNN packing")
    drafter = feature_drafter(target32)
    drafter.bind_target(ModelRunner(target32))
    assert isinstance(drafter.fc, PackedLinear)
    tokens = torch.tensor([[3, 9, 27]])
    prev = torch.randn(1, 3, target32.config.hidden_size, generator=torch.Generator().manual_seed(0))
    embeds = target32.get_input_embeddings()(tokens)
    with torch.no_grad():
        torch.testing.assert_close(drafter._inputs(tokens, prev), drafter.model.inputs(embeds, prev))
        drafter.model.fc.weight.mul_(-0.5)
        torch.testing.assert_close(drafter._inputs(tokens, prev), drafter.model.inputs(embeds, prev))


@needs_int8
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_int8_drafting_stays_exact_and_keeps_most_drafts(temperature):
    """quantize: int8 runs the layer's MLP and output projection on int8 weights. The one-layer drafter that computes
    the target's own features (above: every draft accepted) keeps most of its drafts accepted, output equals plain
    decoding (float32), and the model it trains stays as it was."""
    from specactor_engine.model.quantize import Int8PackedLinear

    one_layer = make_tiny_model("llama", seed=5, num_layers=1, dtype=torch.float32)
    model = FeatureDraftModel(one_layer)
    d = one_layer.config.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, :d] = torch.eye(d)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    params = sampling(temperature, n=2, max_new_tokens=26, ignore_eos=True)
    reference = token_ids(run(one_layer, ragged_requests(4), params))
    drafter = feature_drafter(one_layer, model, quantize="int8")
    result = engine_with(one_layer, [drafter]).generate(ragged_requests(4), params)
    assert token_ids(result) == reference
    assert isinstance(drafter.runner.projections[0].down, Int8PackedLinear)
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())
    assert result.stats.drafted_tokens > 0 and result.stats.acceptance_rate > 0.5  # float: 1.0; broken: ~0


def _first_logits(drafter: FeatureDrafter, tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The drafter's logits after feeding `tokens` [1, T] with features `prev` [1, T, d] from an empty cache: [V]."""
    drafter.runner.allocate(1, 16)
    x = drafter._inputs(tokens, prev)
    return drafter.runner.forward(tokens, torch.tensor([0]), embeds=x, logits_at="last")[0].float()


@needs_int8
def test_int8_drafting_over_a_bfloat16_target_tracks_the_float_drafter_and_its_weight_updates():
    """Over a bf16 target (trace D's) the int8 drafter's logits stay within int8's error of the bf16 drafter's, and
    a weight update reaches its int8 projections."""
    from specactor_engine.model.packed_linear import packing_supported

    if not packing_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU does not pack bfloat16")
    target16 = make_tiny_model("qwen2", seed=3, num_layers=2, dtype=torch.bfloat16)
    model = FeatureDraftModel(target16)
    runner = ModelRunner(target16, record_features=True)
    quantized, plain = feature_drafter(target16, model, quantize="int8"), feature_drafter(target16, model)
    quantized.bind_target(runner)
    plain.bind_target(runner)
    d = target16.config.hidden_size
    tokens = torch.tensor([[3, 9, 27, 81]])
    prev = torch.randn(1, 4, d, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    before = _first_logits(plain, tokens, prev)
    torch.testing.assert_close(_first_logits(quantized, tokens, prev), before, atol=0.05 * before.abs().max().item(),
                               rtol=0)
    mlp = model.layer.mlp.down_proj.weight
    update = {"model.layers.0.mlp.down_proj.weight": -2 * mlp.detach().clone()}
    quantized.update_weights(update.items(), version=1)
    after = _first_logits(plain, tokens, prev)
    assert (after - before).abs().max() > 0.2 * before.abs().max()  # the update moved the drafts
    torch.testing.assert_close(_first_logits(quantized, tokens, prev), after, atol=0.05 * after.abs().max().item(),
                               rtol=0)
