import math

import pytest
import torch

from specactor_engine.sampling import token_logprobs
from tasks.grpo import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGGREGATIONS,
    compute_advantages,
    entropy_from_logits,
    group_advantages,
    grpo_loss,
    register_adv_est,
    token_logprobs_from_logits,
)


def _loop_advantages(rewards: list[float], group_ids: list[int], eps: float, normalize_std: bool) -> list[float]:
    """Reference: one group at a time, with Python floats."""
    out = [0.0] * len(rewards)
    for group in set(group_ids):
        members = [i for i, g in enumerate(group_ids) if g == group]
        values = [rewards[i] for i in members]
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
        for i in members:
            out[i] = (rewards[i] - mean) / (math.sqrt(var) + eps) if normalize_std else rewards[i] - mean
    return out


def _loop_grpo_loss(new, old, adv, mask, clip_low, clip_high, ref, kl_coef):
    """Reference: token by token, token-mean aggregation."""
    pg_total, kl_total, clipped, count = 0.0, 0.0, 0, 0
    for b in range(len(new)):
        for t in range(len(new[b])):
            if not mask[b][t]:
                continue
            ratio = math.exp(new[b][t] - old[b][t])
            plain = -adv[b] * ratio
            clip = -adv[b] * min(max(ratio, 1 - clip_low), 1 + clip_high)
            pg_total += max(plain, clip)
            clipped += clip > plain
            if ref is not None:
                delta = ref[b][t] - new[b][t]
                kl_total += math.exp(delta) - delta - 1
            count += 1
    return pg_total / count + kl_coef * kl_total / count, pg_total / count, kl_total / count, clipped / count


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    adv = group_advantages(rewards, 3, eps=0.0)
    # group 1: mean 1/3, std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3); group 2: mean 5/3, std sqrt(4/3)
    expected = [(2 / 3) / math.sqrt(1 / 3), -(1 / 3) / math.sqrt(1 / 3), -(1 / 3) / math.sqrt(1 / 3),
                (-2 / 3) / math.sqrt(4 / 3), (4 / 3) / math.sqrt(4 / 3), (-2 / 3) / math.sqrt(4 / 3)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    centred = group_advantages(rewards, 3, normalize_std=False)
    assert centred.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -2 / 3, 4 / 3, -2 / 3], abs=1e-6)


def test_equal_rewards_give_zero_advantages():
    rewards = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 0.0, 0.0])
    for name in ("grpo", "dr_grpo"):
        assert compute_advantages(name, rewards, [0, 0, 0, 1, 1, 1, 2, 2]).abs().max() == 0


def test_single_sample_group_has_zero_advantage():
    assert group_advantages(torch.tensor([3.0, 1.0, 2.0]), [7, 9, 9]).tolist()[0] == 0.0


def test_group_ids_need_not_be_contiguous_or_sorted():
    rewards = torch.tensor([1.0, 5.0, 0.0, 7.0, 2.0])
    ids = [42, 3, 42, 3, 42]
    adv = group_advantages(rewards, ids)
    assert adv.tolist() == pytest.approx(_loop_advantages(rewards.tolist(), ids, 1e-6, True), abs=1e-6)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_advantages_loop_vs_vectorized(normalize_std):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(60, generator=gen)
    ids = torch.randint(0, 9, (60,), generator=gen)
    adv = group_advantages(rewards, ids, eps=1e-6, normalize_std=normalize_std)
    reference = _loop_advantages(rewards.tolist(), ids.tolist(), 1e-6, normalize_std)
    assert adv.tolist() == pytest.approx(reference, abs=1e-5)


def test_bad_group_size_and_unknown_estimator_are_refused():
    with pytest.raises(ValueError, match="divide"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*dr_grpo, grpo"):
        compute_advantages("ppo", torch.zeros(4), 2)
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda rewards, groups: rewards)
    assert {"grpo", "dr_grpo"} <= set(ADVANTAGE_ESTIMATORS)
    assert {"token_mean", "seq_mean"} <= set(LOSS_AGGREGATIONS)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_token_logprobs_match_the_engine_convention(temperature):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=gen) * 3
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    got = token_logprobs_from_logits(logits, targets, temperature)
    scale = temperature if temperature > 0 else 1.0
    by_hand = [logits[b, t, targets[b, t]].item() / scale - torch.logsumexp(logits[b, t] / scale, 0).item()
               for b in range(2) for t in range(5)]
    assert got.flatten().tolist() == pytest.approx(by_hand, abs=1e-5)
    assert torch.equal(got, token_logprobs(logits, targets, temperature))  # the rollout engine's function
    assert got.dtype == torch.float32
    assert token_logprobs_from_logits(logits.bfloat16(), targets, temperature).dtype == torch.float32


def test_entropy_of_uniform_logits_is_log_vocab():
    assert entropy_from_logits(torch.zeros(1, 2, 8), 1.0).flatten().tolist() == pytest.approx([math.log(8)] * 2)


def test_grpo_loss_hand_computed():
    # token ratios: exp(0) = 1; exp(ln 1.5) = 1.5, clipped at 1.2 for A > 0; exp(ln 0.5) = 0.5, clipped at 0.8 for A < 0
    new = torch.tensor([[0.0, math.log(1.5)], [math.log(0.5), 0.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, metrics = grpo_loss(new, old, adv, mask, clip_eps=0.2)
    # per token: -2 * 1 = -2; max(-3, -2.4) = -2.4; max(0.5, 0.8) = 0.8 -> mean over 3 tokens
    assert loss.item() == pytest.approx((-2.0 - 2.4 + 0.8) / 3, abs=1e-6)
    assert metrics["pg_loss"] == pytest.approx(loss.item())
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)
    assert metrics["ratio_mean"] == pytest.approx((1 + 1.5 + 0.5) / 3)
    assert metrics["kl"] == 0.0
    seq_loss, _ = grpo_loss(new, old, adv, mask, clip_eps=0.2, loss_agg="seq_mean")
    assert seq_loss.item() == pytest.approx(((-2.0 - 2.4) / 2 + 0.8) / 2, abs=1e-6)


def test_clip_eps_high_widens_only_the_upper_range():
    new = torch.tensor([[math.log(1.5), math.log(0.5)]])
    loss, metrics = grpo_loss(new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                              clip_eps=0.2, clip_eps_high=0.28)
    # A > 0: upper clip at 1.28 -> -1.28; lower side stays unclipped for A > 0 -> -0.5
    assert loss.item() == pytest.approx((-1.28 - 0.5) / 2, abs=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.5)


@pytest.mark.parametrize(("advantage", "log_ratio", "zero_grad"), [
    (1.0, math.log(1.5), True),    # A > 0, ratio beyond 1 + eps: clipped, no gradient
    (1.0, math.log(0.5), False),   # A > 0, ratio below 1 - eps: still pushed up
    (-1.0, math.log(0.5), True),   # A < 0, ratio below 1 - eps: clipped, no gradient
    (-1.0, math.log(1.5), False),  # A < 0, ratio beyond 1 + eps: still pushed down
    (1.0, math.log(1.1), False),   # inside the trust region
])
def test_gradient_vanishes_only_beyond_the_clip_on_the_advantage_side(advantage, log_ratio, zero_grad):
    new = torch.tensor([[log_ratio]], requires_grad=True)
    loss, _ = grpo_loss(new, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1), clip_eps=0.2)
    loss.backward()
    if zero_grad:
        assert new.grad.item() == 0.0
    else:
        # d/dlogp of -A * exp(logp - old) is -A * ratio
        assert new.grad.item() == pytest.approx(-advantage * math.exp(log_ratio), rel=1e-6)


def test_masked_tokens_get_no_gradient():
    new = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    loss, _ = grpo_loss(new, new.detach(), torch.tensor([1.0, -1.0]), mask)
    loss.backward()
    assert torch.all(new.grad[mask == 0] == 0)
    assert torch.all(new.grad[mask == 1] != 0)


def test_kl_is_zero_when_reference_equals_policy_and_positive_otherwise():
    new = torch.randn(3, 5)
    _, same = grpo_loss(new, new, torch.ones(3), torch.ones(3, 5), ref_logprobs=new.clone(), kl_coef=0.1)
    assert same["kl"] == 0.0
    ref = new + torch.randn(3, 5) * 0.3
    _, moved = grpo_loss(new, new, torch.ones(3), torch.ones(3, 5), ref_logprobs=ref, kl_coef=0.1)
    assert moved["kl"] > 0


def test_grpo_loss_loop_vs_vectorized():
    gen = torch.Generator().manual_seed(3)
    new = torch.randn(5, 7, generator=gen) * 0.3 - 2
    old = new + torch.randn(5, 7, generator=gen) * 0.3
    ref = new + torch.randn(5, 7, generator=gen) * 0.2
    adv = torch.randn(5, generator=gen)
    mask = (torch.rand(5, 7, generator=gen) > 0.3).float()
    loss, metrics = grpo_loss(new, old, adv, mask, clip_eps=0.2, clip_eps_high=0.3, ref_logprobs=ref, kl_coef=0.05)
    expected = _loop_grpo_loss(new.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.3, ref.tolist(), 0.05)
    got = (loss.item(), metrics["pg_loss"], metrics["kl"], metrics["clip_fraction"])
    assert got == pytest.approx(expected, abs=1e-5)


def test_unknown_loss_aggregation_is_refused():
    with pytest.raises(ValueError, match="unknown loss_agg 'sum'"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), loss_agg="sum")
