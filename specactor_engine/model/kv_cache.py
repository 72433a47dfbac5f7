"""Static KV cache with a committed length per row.

Layout per layer: keys/values [num_slots, max_len, num_kv_heads, head_dim]. A row
(slot) owns positions [0, lengths[slot]); anything past that is scratch. Writing a
verify block puts k+1 entries past the committed length; committing `a` of them is
`lengths += a`, and rolling back is simply not advancing: no copy, ever.

Optionally (`feature_dim`) it also keeps each position's final hidden state, normalised (the input of
the LM head): the target's *features*, which a feature-level drafter (drafters/feature.py) reads.
They follow the same rules as the keys: valid below the committed length, copied with the prefix.
"""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer key/value buffers plus the committed length of every slot."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        feature_dim: int | None = None,
    ) -> None:
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(num_slots, dtype=torch.long)  # committed tokens per slot (host)
        self.max_len = max_len
        self.num_slots = num_slots
        # [num_slots, max_len, d] final normalised hidden state per position, or None (not recorded)
        self.features = (torch.zeros(num_slots, max_len, feature_dim, dtype=dtype, device=device)
                         if feature_dim else None)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new entries.

        slots: [R]; positions: [R, T] absolute positions; k, v: [R, T, H_kv, D].
        """
        index = (slots.to(self.keys[layer].device)[:, None], positions.to(self.keys[layer].device))
        self.keys[layer][index] = k
        self.values[layer][index] = v

    def write_features(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """slots [R], positions [R, T], features [R, T, d] (no-op when features are not recorded)."""
        if self.features is not None:
            self.features[slots.to(self.features.device)[:, None], positions.to(self.features.device)] = features

    def read_features(self, slots: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
        """Features of positions start[i] .. start[i] + width - 1 of slot slots[i]: [R, width, d] (positions
        past the cache read as its last position; callers mask what is not theirs)."""
        assert self.features is not None, "this cache does not record features"
        positions = (start[:, None] + torch.arange(width)[None, :]).clamp(0, self.max_len - 1)
        return self.features[slots.to(self.features.device)[:, None], positions.to(self.features.device)]

    def read(self, layer: int, slots: torch.Tensor, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of `slots` for positions [0, upto): two [R, upto, H_kv, D] tensors.

        Contiguous slot ranges are views; anything else is gathered.
        """
        keys, values = self.keys[layer], self.values[layer]
        first = int(slots[0])
        if int(slots[-1]) - first + 1 == len(slots) and bool((slots.diff() == 1).all()):
            return keys[first : first + len(slots), :upto], values[first : first + len(slots), :upto]
        idx = slots.to(keys.device)
        return keys[idx, :upto], values[idx, :upto]

    def copy_prefix(self, src: torch.Tensor, dst: torch.Tensor, length: torch.Tensor) -> None:
        """Copy the first `length[i]` positions of slot src[i] into slot dst[i] (prompt sharing)."""
        upto = int(length.max())
        for keys, values in zip(self.keys, self.values):
            keys[dst, :upto] = keys[src, :upto]
            values[dst, :upto] = values[src, :upto]
        if self.features is not None:
            self.features[dst, :upto] = self.features[src, :upto]
        self.lengths[dst] = length

    def copy_range(self, src: int, dst: int, start: int, count: int) -> None:
        """Copy positions [start, start + count) of slot `src` into slot `dst` (a verified candidate's
        new entries; lengths are not changed)."""
        for keys, values in zip(self.keys, self.values):
            keys[dst, start : start + count] = keys[src, start : start + count]
            values[dst, start : start + count] = values[src, start : start + count]
        if self.features is not None:
            self.features[dst, start : start + count] = self.features[src, start : start + count]
