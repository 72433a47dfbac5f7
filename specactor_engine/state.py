"""Host-side token state of the rows being decoded (shared read-only with drafters)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SequenceState:
    """Committed tokens of every slot.

    tokens:         [S, max_len] int64, prompt then output; valid up to lengths
    lengths:        [S] int64 committed tokens (the target KV holds lengths - 1 of them)
    prompt_lengths: [S] int64
    seq_keys:       [S] int64 32-bit sampling keys (seed, request, sample)
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    seq_keys: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, max_len: int) -> "SequenceState":
        zeros = torch.zeros(num_slots, dtype=torch.long)
        return cls(torch.zeros(num_slots, max_len, dtype=torch.long), zeros.clone(), zeros.clone(), zeros.clone())

    def output_positions(self, slots: torch.Tensor) -> torch.Tensor:
        """Output index of the next token of each slot: [R]."""
        return self.lengths[slots] - self.prompt_lengths[slots]

    def gather(self, slots: torch.Tensor, start: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [start, lengths) of each slot, right-padded to `width`: ([R, width], counts [R])."""
        counts = self.lengths[slots] - start
        index = (start[:, None] + torch.arange(width)[None, :]).clamp(max=self.tokens.shape[1] - 1)
        return self.tokens[slots[:, None], index], counts

    def append(self, slots: torch.Tensor, new_tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Write new_tokens[r, :counts[r]] after each slot's committed tokens and advance."""
        width = new_tokens.shape[1]
        cols = self.lengths[slots][:, None] + torch.arange(width)[None, :]
        keep = torch.arange(width)[None, :] < counts[:, None]
        rows = slots[:, None].expand_as(cols)
        self.tokens[rows[keep], cols[keep]] = new_tokens[keep]
        self.lengths[slots] += counts
