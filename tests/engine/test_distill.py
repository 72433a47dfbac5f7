"""Drafter distillation on rollouts lowers the loss and raises acceptance."""

from __future__ import annotations

import torch

from specactor_engine.distill import DistillBudget, distill_on_rollouts
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
