"""Training a feature-level drafter (training/feature_distill.py, training/feature_job.py) on a tiny target's
own samples, and the drafter it saves drafting exactly in the engine."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specactor_engine.drafters import DrafterContext
from specactor_engine.drafters.feature import FeatureDrafter
from specactor_engine.engine import Engine
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.model.runner import load_hf_model
from specactor_engine.training.feature_distill import (FEATURES_FILE, FeatureDistillBudget, FeatureDistiller,
                                                       distill_features, load_or_compute_features,
                                                       target_features)
from specactor_engine.training.feature_job import (FeatureJob, best_temperature_scale, held_out_acceptance,
                                                   run_feature_distill)
from specactor_engine.training.samples import DistillDataError
from tests.engine.test_exactness import MAX_LEN, ragged_requests, rollout, run, sampling, token_ids
from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer, save_tiny_model


def target_samples(target, count: int = 8, tokens: int = 24) -> list[tuple[list[int], list[int]]]:
    result = run(target, ragged_requests(count, seed=7), sampling(1.0, max_new_tokens=tokens, n=2, ignore_eos=True))
    return [(o.prompt_token_ids, o.token_ids) for o in result.outputs]


def test_features_are_the_target_s_last_hidden_states_per_sample():
    target = make_tiny_model("qwen2", seed=2)
    pairs = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10, 11])]  # unequal lengths: padded in one batch
    features = target_features(target, pairs, batch_size=2)
    for (prompt, output), f in zip(pairs, features):
        with torch.no_grad():
            want = target.model(input_ids=torch.tensor([prompt + output])).last_hidden_state[0]
        assert f.dtype == torch.float16 and f.shape == want.shape
        torch.testing.assert_close(f.float(), want, atol=2e-3, rtol=2e-3)


def test_the_feature_cache_serves_the_samples_it_has_and_computes_only_those_appended(tmp_path: Path):
    target = make_tiny_model("qwen2", seed=2)
    pairs = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10, 11]), ([3, 4], [5]), ([9], [8, 7, 6])]
    first = load_or_compute_features(tmp_path, target, pairs[:2])
    marked = [torch.full_like(f, 7.0) for f in first]  # cached values no forward computes
    torch.save(marked, tmp_path / FEATURES_FILE)
    computed: list[int] = []
    features = load_or_compute_features(tmp_path, lambda: target, pairs, on_batch=computed.append)
    assert all(torch.equal(f, m) for f, m in zip(features[:2], marked))  # served from the cache
    assert all(torch.equal(f, w) for f, w in zip(features[2:], target_features(target, pairs[2:])))
    assert computed[-1] == len(pairs)  # progress counts the served samples too
    saved = torch.load(tmp_path / FEATURES_FILE, weights_only=True)
    assert len(saved) == len(pairs) and torch.equal(saved[0], marked[0])
    # a cache that does not match the first samples (other lengths) is recomputed whole
    served = load_or_compute_features(tmp_path, target, [pairs[1], pairs[0]])
    assert all(torch.equal(f, w) for f, w in zip(served, target_features(target, [pairs[1], pairs[0]])))


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_distillation_lowers_the_loss_and_raises_the_greedy_agreement(autocast):
    """Steps on the target's own samples: on a fixed batch (no input noise), the loss falls and the drafter's
    greedy token agrees with the target's more often than before, with fp32 steps and with bf16-autocast ones."""
    target = make_tiny_model("qwen2", seed=2, num_layers=2)
    pairs = target_samples(target)
    features = target_features(target, pairs)
    model = FeatureDraftModel(target)
    distiller = FeatureDistiller(model, target, lr=3e-3, seed=0, autocast=autocast)
    probe = distiller.batch(pairs, features, len(pairs))
    with torch.no_grad():
        loss_before, before = distiller.loss(*probe, noise=False)
    for _ in range(60):
        distiller.step(pairs, features, batch_size=8)
    distiller.finish()
    with torch.no_grad():
        loss_after, after = distiller.loss(*probe, noise=False)
    assert float(loss_after) < 0.7 * float(loss_before)
    assert after["top1"] > before["top1"] + 0.1, (before, after)
    assert not any(p.requires_grad for p in model.parameters())


def test_an_autocast_step_computes_in_bf16_and_keeps_fp32_weights_and_optimizer():
    """The same first step with and without bf16 autocast: the loss is the fp32 one to bf16's precision but not
    bit-equal (the matmuls did run in bf16), and the weights and Adam's moments stay fp32."""
    target = make_tiny_model("qwen2", seed=2, num_layers=2)
    pairs = target_samples(target, count=4)
    features = target_features(target, pairs)
    losses, models = {}, {}
    for name, autocast in (("fp32", None), ("bf16", torch.bfloat16)):
        models[name] = FeatureDraftModel(target)
        distiller = FeatureDistiller(models[name], target, lr=3e-3, seed=0, passes=2, autocast=autocast)
        losses[name] = distiller.step(pairs, features, batch_size=4)["loss"]
        assert all(p.dtype == torch.float32 for p in models[name].parameters())
        moments = [t for s in distiller.optimizer.state.values() for t in s.values() if t.dim() > 0]
        assert moments and all(t.dtype == torch.float32 for t in moments)
    assert losses["bf16"] != losses["fp32"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    changed = [(a - b).abs().max().item() for a, b in zip(models["fp32"].parameters(), models["bf16"].parameters())]
    assert max(changed) > 0  # the bf16 step's update differs, as its gradients do


def test_unrolled_passes_are_the_drafting_steps():
    """Training-time test: pass p of `forward_unrolled` at position j is what drafting computes for the p-th draft
    there: a teacher-forced pass over positions <= j (the drafter's cache: the target's features at committed
    positions) in which the last p - 1 positions read the drafter's own predicted feature of the position before
    (drafts/feature.py feeds its drafts so; test_feature_drafter checks that against the engine)."""
    target = make_tiny_model("qwen2", seed=2, num_layers=2, dtype=torch.float64)
    model = FeatureDraftModel(target)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param += 0.05 * torch.randn_like(param)
        B, T, d = 2, 9, target.config.hidden_size
        embeds = torch.randn(B, T, d, dtype=torch.float64)
        features = torch.randn(B, T, d, dtype=torch.float64)
        prev = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
        passes = model.forward_unrolled(embeds, prev, 3)
        torch.testing.assert_close(passes[0], model(embeds, prev))
        for j in range(2, T):
            fed = prev[:, : j + 1].clone()
            fed[:, j] = passes[0][:, j - 1]  # second draft at j: reads the first draft's predicted feature
            torch.testing.assert_close(passes[1][:, j], model(embeds[:, : j + 1], fed)[:, j])
            fed = prev[:, : j + 1].clone()
            fed[:, j - 1] = passes[0][:, j - 2]  # third draft at j: drafts at j - 1 and j
            fed[:, j] = model(embeds[:, :j], fed[:, :j])[:, j - 1]
            torch.testing.assert_close(passes[2][:, j], model(embeds[:, : j + 1], fed)[:, j])


def test_training_the_later_steps_raises_their_agreement():
    """The same steps from the same drafter with passes=2 against passes=1: the second draft step (reading the
    drafter's own feature) agrees with the target more often, and the report has each pass's figures."""
    target = make_tiny_model("qwen2", seed=2, num_layers=2)
    pairs = target_samples(target)
    features = target_features(target, pairs)
    results = {}
    for passes in (1, 2):
        torch.manual_seed(0)
        distiller = FeatureDistiller(FeatureDraftModel(target), target, lr=3e-3, seed=0, passes=passes)
        for _ in range(40):
            distiller.step(pairs, features, batch_size=8)
        distiller.finish()
        probe = FeatureDistiller(distiller.model, target, lr=0.0, seed=0, passes=2)
        with torch.no_grad():
            _, results[passes] = probe.loss(*probe.batch(pairs, features, len(pairs)), noise=False)
    assert set(results[2]) >= {"top1", "top1_2", "ce_2", "feature_2"}
    assert results[2]["top1_2"] > results[1]["top1_2"] + 0.05, results
    with pytest.raises(ValueError, match="passes"):
        FeatureDistiller(FeatureDraftModel(target), target, lr=1e-3, passes=0)


def test_held_out_acceptance_is_one_for_a_drafter_that_computes_the_target_s_features():
    """A one-layer target and a drafter that is its layer reading the token alone (fc = [I | 0]): every draft step
    computes the target's own distribution, so each is accepted with probability 1 at scale 1 and less when
    sharpened, and the scale kept is 1. A head over part of the vocabulary loses the mass outside it."""
    target = make_tiny_model("llama", seed=5, num_layers=1)
    model = FeatureDraftModel(target)
    d = target.config.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, :d] = torch.eye(d)
    pairs = target_samples(target, count=3, tokens=10)
    features = target_features(target, pairs)
    distiller = FeatureDistiller(model, target, lr=0.0)
    every = target.config.vocab_size  # a random tiny model's distributions are flat: sum over every token
    acceptance = held_out_acceptance(distiller, target, pairs, features, scales=(0.5, 1.0), steps=3, candidates=every)
    assert acceptance[1.0] == pytest.approx([1.0, 1.0, 1.0], abs=2e-3)  # fp16 features: not to the last bit
    assert all(a < 0.99 for a in acceptance[0.5])
    assert best_temperature_scale(acceptance) == 1.0
    compact = FeatureDistiller(model, target, lr=0.0, vocab_ids=torch.arange(0, 64))
    assert all(a < 0.99 for a in held_out_acceptance(compact, target, pairs, features, scales=(1.0,),
                                                     candidates=every)[1.0])


def test_the_kept_scale_makes_the_most_accepted_tokens_per_round():
    assert best_temperature_scale({1.0: [0.80, 0.60, 0.50], 0.7: [0.81, 0.65, 0.55]}) == 0.7
    assert best_temperature_scale({1.0: [0.85, 0.60], 0.7: [0.80, 0.66]}) == 1.0  # 1.36 > 1.33: the first step first
    assert best_temperature_scale({}) == 1.0


def test_the_bounded_refresh_stops_at_its_step_budget_over_a_compact_head():
    target = make_tiny_model("qwen2", seed=2, num_layers=2)
    model = FeatureDraftModel(target)
    start = {n: p.clone() for n, p in model.named_parameters()}
    vocab = torch.arange(0, 200)
    metrics = distill_features(model, target, target_samples(target, count=4), FeatureDistillBudget(max_steps=3),
                               vocab_ids=vocab)
    assert metrics["feature_distill_steps"] == 3.0
    assert any(not torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert distill_features(model, target, [([1, 2], [])])["feature_distill_steps"] == 0.0  # nothing usable


def test_a_resumed_trainer_takes_its_own_learning_rate():
    """A drafter trained at a constant rate is annealed by resuming it at a lower one (`--lr` of a resumed run); the
    optimizer's saved state carried the earlier rate back, so the lower one was ignored. Steps and moments are
    resumed, the rate is the new trainer's."""
    target = make_tiny_model("qwen2", seed=2, num_layers=2)
    pairs = target_samples(target, count=4)
    features = target_features(target, pairs)
    first = FeatureDistiller(FeatureDraftModel(target), target, lr=3e-3, seed=0)
    for _ in range(2):
        first.step(pairs, features, batch_size=4)
    resumed = FeatureDistiller(FeatureDraftModel(target), target, lr=1e-4, seed=0)
    resumed.load_state_dict(first.state_dict())
    assert resumed.steps == 2 and resumed.lr == 1e-4
    assert resumed.optimizer.state_dict()["state"][0]["step"] == first.optimizer.state_dict()["state"][0]["step"]


def _records(path: Path, pairs) -> Path:
    path.write_text("".join(json.dumps({"prompt_token_ids": p, "token_ids": o}) + "\n" for p, o in pairs))
    return path


def test_a_job_trains_saves_resumes_and_its_drafter_drafts_exactly(tmp_path: Path):
    target_dir = save_tiny_model(tmp_path / "target", "qwen2", seed=2, num_layers=2)
    target = load_hf_model(target_dir, "float32")
    records = _records(tmp_path / "rollouts.jsonl", target_samples(target, count=10, tokens=16))
    out = tmp_path / "feature"
    job = FeatureJob(target=str(target_dir), data=records, out=out, steps=4, batch_size=4, save_every=2,
                     draft_vocab=128)
    first = run_feature_distill(job)
    assert (first.steps, first.trained_steps) == (4, 4) and first.held_out_top1 is not None
    report = json.loads((out / "feature_report.json").read_text())
    assert report["steps"] == 4 and report["draft_vocab"] <= 128
    assert set(first.held_out_acceptance) == {0.6, 0.7, 0.8, 0.9, 1.0}
    assert all(len(rates) == 3 and all(0.0 <= a <= 1.0 for a in rates) for rates in first.held_out_acceptance.values())
    assert report["temperature_scale"] == first.temperature_scale == best_temperature_scale(first.held_out_acceptance)
    resumed = run_feature_distill(FeatureJob(**{**job.__dict__, "steps": 6}))
    assert (resumed.steps, resumed.trained_steps) == (6, 2)
    # the saved drafter, with its draft vocabulary, in the engine: output equals plain decoding
    context = DrafterContext("cpu", "float32", make_tokenizer(), target.config.vocab_size)
    drafter = FeatureDrafter(SimpleNamespace(name="feature", path=str(out), quantize="none", draft_vocab=None),
                             context)
    engine = Engine(target, make_tokenizer(), rollout("coupled", num_draft_tokens=3), max_model_len=MAX_LEN,
                    drafters=[drafter], check_invariants=True)
    params = sampling(1.0, n=2, max_new_tokens=20)
    assert token_ids(engine.generate(ragged_requests(4), params)) == token_ids(run(target, ragged_requests(4), params))
    assert drafter.vocab is not None and not drafter.grows and len(drafter.vocab) == report["draft_vocab"]


def test_a_job_computes_its_features_with_the_target_in_the_feature_dtype(tmp_path: Path):
    target_dir = save_tiny_model(tmp_path / "target", "qwen2", seed=2, num_layers=2)
    target = load_hf_model(target_dir, "float32")
    pairs = target_samples(target, count=4, tokens=12)
    records = _records(tmp_path / "rollouts.jsonl", pairs)
    out = tmp_path / "feature"
    run_feature_distill(FeatureJob(target=str(target_dir), data=records, out=out, steps=1, draft_vocab=128,
                                   feature_dtype="bfloat16"))
    cached = torch.load(out / FEATURES_FILE, weights_only=True)
    in_bf16 = target_features(load_hf_model(target_dir, "bfloat16"), pairs)
    in_fp32 = target_features(target, pairs)
    assert all(torch.equal(c, b) for c, b in zip(cached, in_bf16))
    assert not all(torch.equal(c, f) for c, f in zip(cached, in_fp32))
    model = FeatureDraftModel.load(out, target)  # the drafter trains (and is saved) in --dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_job_names_bad_data(tmp_path: Path):
    target_dir = save_tiny_model(tmp_path / "target", "qwen2", seed=2, num_layers=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1, 2], "token_ids": [3]}\nnot json\n')
    with pytest.raises(DistillDataError, match="bad.jsonl:2: not JSON"):
        run_feature_distill(FeatureJob(target=str(target_dir), data=bad, out=tmp_path / "o"))
    with pytest.raises(DistillDataError, match="no such file"):
        run_feature_distill(FeatureJob(target=str(target_dir), data=tmp_path / "missing.jsonl", out=tmp_path / "o"))
