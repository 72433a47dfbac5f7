"""Drafter distillation on rollouts lowers the loss and raises acceptance."""

from __future__ import annotations

import pytest
import torch

from specactor_engine.training.distill import DistillBudget, distill_on_rollouts
from tests.engine.test_exactness import make_drafter, ragged_requests, run, sampling
from tests.fixtures.tiny_models import make_tiny_model


def test_distillation_raises_acceptance_on_the_targets_own_samples():
    target = make_tiny_model("llama", seed=0, init_range=0.5)
    requests = ragged_requests(8, seed=9)
    params = sampling(0.0, max_new_tokens=16, ignore_eos=True)
    rollouts = run(target, requests, params).outputs
    drafter = make_drafter("model", target, torch.float32)
    before = run(target, requests, params, "coupled", [drafter], k=3).stats.acceptance_rate
    metrics = distill_on_rollouts(drafter.runner.model, [(o.prompt_token_ids, o.token_ids) for o in rollouts],
                                  DistillBudget(max_steps=60, lr=3e-3, batch_size=8))
    after = run(target, requests, params, "coupled", [drafter], k=3).stats.acceptance_rate
    assert metrics["distill_loss_last"] < metrics["distill_loss_first"]
    assert after > before + 0.2
    assert not any(p.requires_grad for p in drafter.runner.model.parameters())


def test_soft_targets_bring_the_drafter_closer_to_the_target_than_sampled_tokens():
    """Same samples, same steps: the target's top-k distributions teach more than its samples alone."""
    from specactor_engine.training.distill import Distiller, pad_batch
    from specactor_engine.training.teacher import teacher_topk

    target = make_tiny_model("llama", seed=0, init_range=0.5)
    requests = ragged_requests(8, seed=9)
    rollouts = run(target, requests, sampling(1.0, max_new_tokens=16, ignore_eos=True)).outputs
    pairs = [(o.prompt_token_ids, o.token_ids) for o in rollouts]
    soft = teacher_topk(target, pairs, k=8)
    assert [len(ids) for ids, _ in soft] == [len(o) for _, o in pairs]

    def kl_to_target(draft: torch.nn.Module) -> float:
        ids, attention, where = pad_batch(pairs, torch.device("cpu"))
        with torch.no_grad():
            log_p = target(input_ids=ids, attention_mask=attention).logits[where].log_softmax(-1)
            log_q = draft(input_ids=ids, attention_mask=attention).logits[where].log_softmax(-1)
        return float((log_p.exp() * (log_p - log_q)).sum(-1).mean())

    results = {}
    for name, targets in (("hard", None), ("soft", soft)):
        draft = make_tiny_model("llama", seed=1, num_layers=1)
        distiller = Distiller(draft, lr=3e-3, seed=0)
        for _ in range(40):
            distiller.step(pairs, 8, targets)
        distiller.finish()
        results[name] = kl_to_target(draft)
    assert results["soft"] < 0.8 * results["hard"], results


def test_learning_rate_warms_up_then_decays_to_the_floor_by_the_first_horizon():
    from specactor_engine.training.offline import DistillSettings, scheduled_lr

    settings = DistillSettings(steps=100, lr=1e-3, lr_decay=True, warmup_steps=10, lr_floor=0.1)
    assert scheduled_lr(settings, 0, 0.0) == pytest.approx(1e-4)  # warm-up: 1/10 of the rate
    assert scheduled_lr(settings, 9, 0.0) == pytest.approx(1e-3)
    assert scheduled_lr(settings, 50, 0.0) == pytest.approx(1e-3 * (1 - 0.9 * 0.5))  # halfway by steps
    assert scheduled_lr(settings, 100, 0.0) == pytest.approx(1e-4)  # the floor at the last step
    timed = DistillSettings(steps=1000, lr=1e-3, lr_decay=True, max_seconds=60.0)
    assert scheduled_lr(timed, 20, 45.0) == pytest.approx(1e-3 * (1 - 0.9 * 0.75))  # the budget comes first
    assert scheduled_lr(timed, 20, 90.0) == pytest.approx(1e-4)
    assert scheduled_lr(DistillSettings(lr=1e-3), 50, 30.0) == 1e-3  # lr_decay off: constant


def test_the_pipeline_refresh_trains_on_the_new_policys_distributions_with_embeddings_fixed():
    from specactor_engine.training.teacher import teacher_topk

    target = make_tiny_model("llama", seed=0, init_range=0.5)
    rollouts = run(target, ragged_requests(8, seed=9), sampling(1.0, max_new_tokens=16, ignore_eos=True)).outputs
    pairs = [(o.prompt_token_ids, o.token_ids) for o in rollouts]
    drafter = make_drafter("model", target, torch.float32)
    model = drafter.runner.model
    embeddings = model.get_input_embeddings().weight.detach().clone()
    metrics = distill_on_rollouts(model, pairs, DistillBudget(max_steps=30, lr=3e-3, freeze_embeddings=True),
                                  soft=teacher_topk(target, pairs, k=8))
    assert metrics["distill_loss_last"] < metrics["distill_loss_first"]
    assert torch.equal(model.get_input_embeddings().weight, embeddings)


def test_topk_coupled_acceptance_equals_the_full_vocabulary_closed_form():
    """With k = V nothing is cut off, so the training objective is exactly `scorer.coupled_acceptance`'s closed form."""
    from specactor_engine.training.distill import coupled_acceptance_from_topk
    from specactor_engine.training.scorer import coupled_acceptance

    gen = torch.Generator().manual_seed(0)
    p = (torch.randn(6, 12, generator=gen, dtype=torch.float64) * 2).softmax(-1)
    log_q = (torch.randn(6, 12, generator=gen, dtype=torch.float64) * 2).log_softmax(-1)
    full = coupled_acceptance(p, log_q.exp(), candidates=12)
    # top-k = the whole vocabulary, in a shuffled order; the drafter's rest mass is then 0
    order = torch.randperm(12, generator=gen)
    topk = coupled_acceptance_from_topk(p[:, order], log_q[:, order], torch.full((6,), -60.0, dtype=torch.float64))
    torch.testing.assert_close(topk.float(), full, rtol=1e-5, atol=1e-6)
    # identical distributions are always accepted; a cut-off top-k is a lower bound of the full form
    assert torch.allclose(coupled_acceptance_from_topk(p, p.log(), torch.full((6,), -60.0, dtype=torch.float64)),
                          torch.ones(6, dtype=torch.float64))
    top = p.topk(4, dim=-1)
    q_top = log_q.gather(1, top.indices)
    rest = (1 - q_top.exp().sum(1)).log()
    cut = coupled_acceptance_from_topk(top.values / top.values.sum(1, keepdim=True), q_top, rest)
    assert bool((cut <= 1.0 + 1e-12).all()) and bool((cut >= 0).all())


def test_the_coupled_loss_raises_the_engines_acceptance_probability_more_than_kl():
    """Same samples, steps and start: training on the acceptance itself ends with higher coupled acceptance."""
    from specactor_engine.training.distill import Distiller, pad_batch
    from specactor_engine.training.scorer import coupled_acceptance
    from specactor_engine.training.teacher import teacher_topk

    target = make_tiny_model("llama", seed=0, init_range=0.5)
    requests = ragged_requests(8, seed=9)
    rollouts = run(target, requests, sampling(1.0, max_new_tokens=16, ignore_eos=True)).outputs
    pairs = [(o.prompt_token_ids, o.token_ids) for o in rollouts]
    soft = teacher_topk(target, pairs, k=16)

    def acceptance(draft: torch.nn.Module) -> float:
        ids, attention, where = pad_batch(pairs, torch.device("cpu"))
        with torch.no_grad():
            p = target(input_ids=ids, attention_mask=attention).logits[where].double().softmax(-1)
            q = draft(input_ids=ids, attention_mask=attention).logits[where].double().softmax(-1)
        return float(coupled_acceptance(p, q).mean())

    results = {}
    for loss in ("kl", "coupled"):
        draft = make_tiny_model("llama", seed=1, num_layers=1)
        distiller = Distiller(draft, lr=3e-3, seed=0, loss=loss, kl_weight=0.1)
        for _ in range(40):
            distiller.step(pairs, 8, soft)
        distiller.finish()
        results[loss] = acceptance(draft)
    assert results["coupled"] > results["kl"] + 0.01, results
    with pytest.raises(ValueError, match="expected one of kl, coupled"):
        Distiller(make_tiny_model("llama", seed=1, num_layers=1), lr=1e-3, loss="tvd")


def test_frozen_layers_stay_as_they_are_and_the_rest_trains():
    from specactor_engine.training.distill import Distiller
    from specactor_engine.training.job import truncated_copy
    from specactor_engine.training.teacher import teacher_topk

    target = make_tiny_model("llama", seed=0, num_layers=3, init_range=0.5)
    pairs = [(o.prompt_token_ids, o.token_ids)
             for o in run(target, ragged_requests(6, seed=2), sampling(1.0, max_new_tokens=12, ignore_eos=True)).outputs]
    draft = truncated_copy(target, 2)
    before = {name: p.detach().clone() for name, p in draft.named_parameters()}
    distiller = Distiller(draft, lr=3e-3, seed=0, loss="coupled", freeze_layers=1)
    for _ in range(3):
        distiller.step(pairs, 4, teacher_topk(target, pairs, k=8))
    distiller.finish()
    for name, param in draft.named_parameters():
        frozen = name.startswith("model.layers.0.")
        assert torch.equal(param, before[name]) == frozen or name.startswith("model.embed"), name


def test_the_sync_budget_carries_the_loss_and_the_frozen_layers():
    from specactor_engine.config import DrafterSyncConfig

    budget = DrafterSyncConfig(distill_loss="coupled", freeze_layers=4).budget()
    assert budget.loss == "coupled" and budget.freeze_layers == 4
    assert DrafterSyncConfig().budget().loss == "kl"
