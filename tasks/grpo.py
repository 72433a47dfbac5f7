"""GRPO as pure tensor functions: group advantages, token logprobs and the clipped loss.

Nothing here knows about models, DeepSpeed or rollouts; the trainer feeds tensors in.
Advantage estimators and loss aggregations are registries: a new variant is an entry,
not a branch. Conventions shared with the rollout engine:

- token logprobs are `log_softmax(logits / T)` in float32 at the emitted token, with T = 1
  when sampling is greedy (temperature 0); top-k/top-p are not applied;
- `mask` is 1 for output tokens that count in the loss, 0 for padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

AdvantageEstimator = Callable[..., torch.Tensor]
LossAggregation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
LOSS_AGGREGATIONS: dict[str, LossAggregation] = {}
LOG_RATIO_LIMIT = 20.0  # exp(20) ~ 5e8: keeps the ratio finite when the policies have drifted far apart


def register_adv_est(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Register `fn(rewards [N], groups, **kwargs) -> advantages [N]` under `name`."""

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


def register_loss_agg(name: str) -> Callable[[LossAggregation], LossAggregation]:
    """Register `fn(values [B, T], mask [B, T]) -> scalar` under `name`."""

    def decorator(fn: LossAggregation) -> LossAggregation:
        if name in LOSS_AGGREGATIONS:
            raise ValueError(f"loss aggregation {name!r} is already registered")
        LOSS_AGGREGATIONS[name] = fn
        return fn

    return decorator


def compute_advantages(name: str, rewards: torch.Tensor, groups: torch.Tensor | Sequence[int] | int,
                       **kwargs) -> torch.Tensor:
    """Advantages [N] from the registered estimator `name` (e.g. "grpo", "dr_grpo")."""
    if name not in ADVANTAGE_ESTIMATORS:
        known = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of: {known}")
    return ADVANTAGE_ESTIMATORS[name](rewards, groups, **kwargs)


def as_group_ids(groups: torch.Tensor | Sequence[int] | int, num_samples: int) -> torch.Tensor:
    """Group ids [N] (int64, 0..G-1): from a group size (consecutive samples) or from arbitrary ids."""
    if isinstance(groups, int):
        if groups < 1 or num_samples % groups:
            raise ValueError(f"group_size {groups} must be >= 1 and divide the number of samples ({num_samples})")
        return torch.arange(num_samples) // groups
    ids = torch.as_tensor(groups)
    if ids.shape != (num_samples,):
        raise ValueError(f"group_ids must have shape ({num_samples},), got {tuple(ids.shape)}")
    return torch.unique(ids, return_inverse=True)[1]


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor | Sequence[int] | int, eps: float = 1e-6,
                     normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantages: (r - mean_group) / (std_group + eps), or r - mean_group without std.

    rewards: [N]; groups: a group size (consecutive samples) or group ids [N] -> [N] float32.
    std is the unbiased sample std; a group of one sample gets advantage 0.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    ids = as_group_ids(groups, rewards.numel()).to(rewards.device)
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    count = torch.zeros(num_groups, device=rewards.device).index_add_(0, ids, torch.ones_like(rewards))  # [G]
    mean = torch.zeros(num_groups, device=rewards.device).index_add_(0, ids, rewards) / count  # [G]
    centered = rewards - mean[ids]  # [N]
    if not normalize_std:
        return centered
    sq_sum = torch.zeros(num_groups, device=rewards.device).index_add_(0, ids, centered.square())  # [G]
    std = (sq_sum / (count - 1).clamp(min=1)).sqrt()  # [G]
    return centered / (std[ids] + eps)


@register_adv_est("grpo")
def grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor | Sequence[int] | int,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-normalised advantages (Shao et al. 2024)."""
    return group_advantages(rewards, groups, eps=eps, normalize_std=True)


@register_adv_est("dr_grpo")
def dr_grpo_advantages(rewards: torch.Tensor, groups: torch.Tensor | Sequence[int] | int,
                       eps: float = 1e-6) -> torch.Tensor:
    """Group-centred advantages without the std division (Dr. GRPO, Liu et al. 2025)."""
    return group_advantages(rewards, groups, eps=eps, normalize_std=False)


def token_logprobs_from_logits(logits: torch.Tensor, target_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at `target_ids`, in float32 (T = 1 when temperature is 0, i.e. greedy).

    logits: [B, T, V]; target_ids: [B, T] -> [B, T]. Differentiable; matches the engine's logprobs.
    """
    scale = temperature if temperature > 0 else 1.0
    scores = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(scores / scale if scale != 1.0 else scores, dim=-1)  # [B, T, V]; x / 1 is x
    return logp.gather(-1, target_ids[..., None]).squeeze(-1).float()


def entropy_from_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position: [B, T, V] -> [B, T] float32."""
    scale = temperature if temperature > 0 else 1.0
    scores = logits.float()
    logp = torch.log_softmax(scores / scale if scale != 1.0 else scores, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@register_loss_agg("token_mean")
def token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over every valid token of the batch (DAPO): long answers weigh more."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


@register_loss_agg("seq_mean")
def seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over sequences of each sequence's token mean; sequences without valid tokens are skipped."""
    lengths = mask.sum(-1)  # [B]
    per_seq = (values * mask).sum(-1) / lengths.clamp(min=1)  # [B]
    return per_seq.sum() / (lengths > 0).sum().clamp(min=1)


def grpo_loss(new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_eps: float = 0.2, clip_eps_high: float | None = None,
              ref_logprobs: torch.Tensor | None = None, kl_coef: float = 0.0, loss_agg: str = "token_mean",
              entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level clipped policy-gradient loss with an optional k3 KL penalty to a reference.

    new_logprobs, old_logprobs, mask: [B, T]; advantages: [B]; ref_logprobs, entropy: [B, T] or None.
    Per token: ratio = exp(new - old); pg = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high));
    kl = exp(ref - new) - (ref - new) - 1. Loss = agg(pg) + kl_coef * agg(kl).
    Returns the scalar loss and float metrics: loss, pg_loss, kl, clip_fraction, ratio_mean (+ entropy).
    """
    if loss_agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; expected one of: {', '.join(sorted(LOSS_AGGREGATIONS))}")
    aggregate = LOSS_AGGREGATIONS[loss_agg]
    mask = mask.to(new_logprobs.dtype)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = (new_logprobs - old_logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = log_ratio.exp()  # [B, T]
    adv = advantages.to(new_logprobs.dtype)[:, None]  # [B, 1]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    pg_loss = aggregate(torch.maximum(unclipped, clipped), mask)
    loss = pg_loss
    kl = torch.zeros((), dtype=new_logprobs.dtype, device=new_logprobs.device)
    if ref_logprobs is not None:
        delta = ref_logprobs - new_logprobs
        kl = aggregate(delta.exp() - delta - 1.0, mask)
        loss = loss + kl_coef * kl
    metrics = {
        "loss": loss.item(),
        "pg_loss": pg_loss.item(),
        "kl": kl.item(),
        "clip_fraction": aggregate((clipped > unclipped).to(mask.dtype), mask).item(),
        "ratio_mean": aggregate(ratio.detach(), mask).item(),
    }
    if entropy is not None:
        metrics["entropy"] = aggregate(entropy.detach(), mask).item()
    return loss, metrics
