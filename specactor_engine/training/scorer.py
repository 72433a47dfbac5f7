"""How well a drafter matches its target, without running the engine: teacher-forced acceptance.

At every output position of target samples, both models see the same prefix. With p the target's and
q the drafter's (temperature-warped) next-token distribution, one drafted token is accepted with
probability

- `coupled` (the engine's position-keyed rule: drafter and target take the Gumbel-max choice under
  the same noise): P(both choose i) = 1 / sum_j max(p_j / p_i, q_j / q_i), summed over i;
- `rejection` (the classic rule, independent noise): sum_i min(p_i, q_i), an upper bound of the above;
- greedy (temperature 0): 1 when the argmaxes agree.

Means over held-out samples rank drafters in seconds instead of a benchmark run, and held-in against
held-out samples shows over-fitting. `acceptance_length(alpha, k)` = 1 + sum_{j<=k} alpha^j is the
engine's mean acceptance length if positions were independent; acceptance is correlated along a draft,
so this is an estimate (the benchmark's figure is the measurement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from specactor_engine.training.distill import pad_batch

Pair = tuple[list[int], list[int]]


@dataclass(frozen=True)
class DrafterScore:
    positions: int
    coupled: float  # mean acceptance probability of one draft token, position-keyed (Gumbel) coupling
    rejection: float  # ... under the classic rejection rule (sum of min(p, q))

    def acceptance_length(self, k: int, rule: str = "coupled") -> float:
        alpha = self.coupled if rule == "coupled" else self.rejection
        return 1.0 + sum(alpha**j for j in range(1, k + 1))


def coupled_acceptance(p: torch.Tensor, q: torch.Tensor, candidates: int = 64) -> torch.Tensor:
    """P(argmax(log p + G) == argmax(log q + G)) for shared Gumbel noise G: [N] from p, q [N, V].

    Closed form: both choose i with probability 1 / sum_j max(p_j / p_i, q_j / q_i). The sum over i
    runs over the `candidates` most likely tokens of p and of q (the rest carry negligible mass), so
    the result is a lower bound that is tight in practice.
    """
    top = torch.cat([p.topk(min(candidates, p.shape[-1]), dim=-1).indices,
                     q.topk(min(candidates, q.shape[-1]), dim=-1).indices], dim=-1)
    top = torch.sort(top, dim=-1).values
    unique = torch.ones_like(top, dtype=torch.bool)
    unique[:, 1:] = top[:, 1:] != top[:, :-1]  # count each candidate once
    p, q = p.float(), q.float()  # [N, C, V] intermediates: fp32 halves the memory, ample precision for a mean
    p_i, q_i = p.gather(1, top), q.gather(1, top)  # [N, C]
    usable = unique & (p_i > 0) & (q_i > 0)  # a token one side never picks cannot be picked by both
    ratio_p = p[:, None, :] / p_i.clamp_min(1e-30)[..., None]  # [N, C, V]
    ratio_q = q[:, None, :] / q_i.clamp_min(1e-30)[..., None]
    both = 1.0 / torch.maximum(ratio_p, ratio_q).sum(dim=-1)
    return torch.where(usable, both, 0.0).sum(dim=-1)


@torch.no_grad()
def score_drafter(target: nn.Module, drafter: nn.Module, pairs: Sequence[Pair], temperature: float = 1.0,
                  batch_size: int = 4, chunk: int = 4, on_batch: Callable[[int], None] | None = None,
                  candidates: int = 64) -> DrafterScore:
    """Mean acceptance probabilities of one drafted token over every output position of `pairs`.

    candidates: tokens of each side summed over in the coupled form (`coupled_acceptance`).
    """
    device = next(target.parameters()).device
    coupled_sum, rejection_sum, positions = 0.0, 0.0, 0
    for start in range(0, len(pairs), batch_size):
        batch = [pair for pair in pairs[start : start + batch_size] if pair[1]]
        if not batch:
            continue
        ids, attention, where = pad_batch(batch, device)
        target_logits = target(input_ids=ids, attention_mask=attention).logits[where].double()
        draft_logits = drafter(input_ids=ids, attention_mask=attention).logits[where].double()
        for lo in range(0, len(target_logits), chunk):
            t, d = target_logits[lo : lo + chunk], draft_logits[lo : lo + chunk]
            if temperature == 0:
                agree = (t.argmax(-1) == d.argmax(-1)).double()
                coupled_sum += float(agree.sum())
                rejection_sum += float(agree.sum())
                continue
            p, q = (t / temperature).softmax(-1), (d / temperature).softmax(-1)
            coupled_sum += float(coupled_acceptance(p, q, candidates).sum())
            rejection_sum += float(torch.minimum(p, q).sum())
        positions += len(target_logits)
        if on_batch is not None:
            on_batch(min(start + batch_size, len(pairs)))
    if not positions:
        raise ValueError("no output positions to score")
    return DrafterScore(positions, coupled_sum / positions, rejection_sum / positions)
