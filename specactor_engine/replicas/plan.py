"""How a call's requests are shared among rollout replicas: whole GRPO groups, longest first, in chunks.

A group (all `n` samples of one request) always goes to one replica: the suffix drafter drafts from a
group's siblings, and a group is the unit GRPO normalises over. Groups are queued by expected cost,
longest first (the longest-processing-time rule: the long ones start early, the short ones fill the
gaps), and handed out a chunk at a time, so a replica that frees up takes the next chunk (a work queue)
while each call on a replica still decodes a batch of groups together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Chunk:
    """Groups for one `generate` call on one replica: indices into the call's requests."""

    indices: tuple[int, ...]
    cost: float  # the groups' expected cost (token positions to decode and attend over)


def group_cost(prompt_len: int, n: int, max_new_tokens: int) -> float:
    """Expected cost of a group: n samples of at most prompt + max_new_tokens positions (the outputs' lengths
    are unknown before decoding; the prompt's is the part that differs between groups)."""
    return float(n * (prompt_len + max_new_tokens))


def groups_per_chunk(num_groups: int, num_replicas: int, n: int, max_batch_size: int) -> int:
    """About two chunks per replica (a replica that finishes early takes a third, so the tail shrinks), and no
    more rows in a chunk than a replica decodes at once."""
    per_chunk = math.ceil(num_groups / (2 * num_replicas)) if num_groups else 1
    return max(1, min(per_chunk, max_batch_size // max(n, 1)))


def plan_chunks(costs: Sequence[float], per_chunk: int) -> list[Chunk]:
    """The queue of chunks: groups by expected cost, longest first (ties in request order), `per_chunk` each."""
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    return [Chunk(tuple(order[s:s + per_chunk]), sum(costs[i] for i in order[s:s + per_chunk]))
            for s in range(0, len(order), per_chunk)]
