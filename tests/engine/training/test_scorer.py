"""Teacher-forced acceptance of a drafter: the Gumbel-coupling closed form against simulation."""

from __future__ import annotations

import torch

from specactor_engine.training.scorer import coupled_acceptance, score_drafter
from tests.fixtures.tiny_models import make_tiny_model


def test_the_closed_form_matches_shared_gumbel_noise_sampling():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 12, generator=gen, dtype=torch.float64) * 2, dim=-1)
    q = torch.softmax(torch.randn(3, 12, generator=gen, dtype=torch.float64) * 2, dim=-1)
    exact = coupled_acceptance(p, q, candidates=12)
    noise = -torch.log(-torch.log(torch.rand(200_000, 1, 12, generator=gen, dtype=torch.float64)))
    simulated = ((p.log() + noise).argmax(-1) == (q.log() + noise).argmax(-1)).double().mean(0)
    torch.testing.assert_close(exact.double(), simulated, atol=5e-3, rtol=0)
    assert torch.all(exact <= torch.minimum(p, q).sum(-1) + 1e-6)  # never above the rejection rule's
    assert torch.allclose(coupled_acceptance(p, p, candidates=12).double(), torch.ones(3, dtype=torch.float64))


def test_a_drafter_that_is_the_target_scores_one_and_another_scores_less():
    target = make_tiny_model("llama", seed=1, num_layers=2)
    other = make_tiny_model("llama", seed=2, num_layers=1)
    pairs = [([1, 2, 3], [4, 5, 6, 7]), ([3, 2], [9, 8])]
    vocab = target.config.vocab_size  # a tiny model is nearly flat: sum over every token
    same = score_drafter(target, target, pairs, candidates=vocab)
    assert same.positions == 6 and abs(same.coupled - 1) < 1e-5 and abs(same.rejection - 1) < 1e-5
    assert abs(same.acceptance_length(4) - 5.0) < 1e-4
    worse = score_drafter(target, other, pairs, candidates=vocab)
    assert worse.coupled < worse.rejection < 1.0
    assert score_drafter(target, other, pairs, temperature=0).coupled in {i / 6 for i in range(7)}
