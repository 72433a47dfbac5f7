"""Lossless acceptance rules: pure functions of tensors.

Shapes: R rows, k draft slots, V vocabulary.
    draft_token_ids  [R, k]   (padded past num_draft_tokens)
    num_draft_tokens [R]
    target_token_ids [R, k+1] the target's own choice at every verify position
Every rule returns (num_accepted [R], output_token_ids [R, k+1]); a row emits
output_token_ids[r, :num_accepted[r] + 1]: its accepted drafts, then the recovered
token (first rejected position) or the bonus token (all drafts accepted).
"""

from __future__ import annotations

import torch


def _leading_matches(match: torch.Tensor, num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Length of the all-true prefix of match [R, k], limited to each row's drafts: [R]."""
    k = match.shape[1]
    valid = torch.arange(k)[None, :].to(match.device) < num_draft_tokens[:, None]
    return (match & valid).long().cumprod(dim=1).sum(dim=1)


def accept_position_keyed(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor,
                          target_token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a draft iff it equals the target's seeded choice at its position (greedy too).

    The output is always the target's choices, so speculation cannot change the rollout.
    """
    k = draft_token_ids.shape[1]
    num_accepted = _leading_matches(draft_token_ids == target_token_ids[:, :k], num_draft_tokens)
    return num_accepted, target_token_ids


def accept_rejection(draft_token_ids: torch.Tensor, num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor, uniforms: torch.Tensor, recovery_gumbel: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Classic speculative sampling (Leviathan et al. / Chen et al.).

    draft_probs:  [R, k, V] or None for deterministic drafts (q one-hot on the draft)
    target_probs: [R, k+1, V] warped target distributions (float64)
    uniforms:     [R, k] in (0, 1): accept draft i iff u_i < p(d_i) / q(d_i)
    recovery_gumbel: [R, k+1, V] Gumbel noise to sample recovered/bonus tokens
    At the first rejection the token is drawn from norm(max(p - q, 0)); with a one-hot q
    that is p with the rejected draft removed. After k acceptances the bonus is from p.
    """
    R, k = draft_token_ids.shape
    p_draft = target_probs[:, :k].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [R, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
        q_full = torch.zeros_like(target_probs[:, :k]).scatter_(-1, draft_token_ids[..., None], 1.0)
    else:
        q_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1).to(p_draft.dtype)
        q_full = draft_probs.to(target_probs.dtype)
    accept = uniforms.to(p_draft.dtype) * q_draft < p_draft
    num_accepted = _leading_matches(accept, num_draft_tokens)
    residual = (target_probs[:, :k] - q_full).clamp_min(0.0)  # [R, k, V]
    # positions past a row's drafts are bonus positions: sample from p itself
    is_draft = torch.arange(k)[None, :].to(residual.device) < num_draft_tokens[:, None]
    residual = torch.where(is_draft[..., None], residual, target_probs[:, :k])
    recover_dist = torch.cat([residual, target_probs[:, k:]], dim=1)  # [R, k+1, V]
    scores = torch.log(recover_dist) + recovery_gumbel.to(recover_dist.dtype)
    resampled = scores.argmax(dim=-1)  # [R, k+1]
    padded_drafts = torch.cat([draft_token_ids, draft_token_ids.new_zeros(R, 1)], dim=1)
    positions = torch.arange(k + 1)[None, :].to(resampled.device)
    output = torch.where(positions < num_accepted[:, None], padded_drafts, resampled)
    return num_accepted, output
