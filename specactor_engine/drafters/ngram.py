"""Prompt-lookup / n-gram drafter: copy what followed the latest earlier occurrence
of the sequence's last n tokens (prompt + generated text), longest n first."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from specactor_engine.drafters.base import DraftRequest, Drafter, DrafterContext, register_drafter
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal


def lookup_continuation(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram.

    tokens: [L] committed tokens. Returns [<=k] (empty when nothing matches).
    """
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows must end before the last token so a match has a continuation
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


@register_drafter("ngram")
class NgramDrafter(Drafter):
    """Model-free drafter; deterministic drafts (q is one-hot under rejection sampling)."""

    model_free = True

    def __init__(self, config: Any, context: DrafterContext) -> None:
        self.name = getattr(config, "name", None) or "ngram"
        self.min_n = int(getattr(config, "min_n", 1))
        self.max_n = int(getattr(config, "max_n", 4))

    def propose(self, state: SequenceState, request: DraftRequest) -> DraftProposal:
        k = int(request.max_draft_tokens.max()) if len(request.slots) else 0
        token_ids = torch.zeros(len(request.slots), k, dtype=torch.long)
        num_tokens = torch.zeros(len(request.slots), dtype=torch.long)
        lengths = state.lengths[request.slots].tolist()
        caps = request.max_draft_tokens.tolist()
        for row, (slot, length, cap) in enumerate(zip(request.slots.tolist(), lengths, caps)):
            if cap <= 0:
                continue
            found = lookup_continuation(state.tokens[slot, :length].numpy(), cap, self.min_n, self.max_n)
            token_ids[row, : len(found)] = torch.from_numpy(found)
            num_tokens[row] = len(found)
        return DraftProposal(token_ids=token_ids, num_tokens=num_tokens)
