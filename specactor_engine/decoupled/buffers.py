"""The verifier's per-row draft buffers: streamed drafts in, verify blocks out, commits reconciled.

Everything is a numpy array indexed by slot and updated for whole batches at once:

    pending [S, W]   drafts continuing the committed output, oldest first; count [S] of them
    committed_len    output tokens committed per slot
    committed_hash   rolling hash of the committed output; pending_hash: of committed + pending

`ingest` appends a streamed draft only if it sits right after the row's pending drafts and was
drafted from exactly that chain (its parent hash); anything else is stale and dropped. After a
verify round `reconcile` commits the emitted tokens: if a row accepted every draft it verified
and its next pending draft equals the target's own token, the rest of its pending drafts stay
valid (shifted). In general a row keeps its pending drafts exactly when they begin with the tokens
it committed (so a row verified with another drafter's block keeps the worker's chain when the
target agreed with it); otherwise they are dropped and the worker realigns from the commit.
"""

from __future__ import annotations

import numpy as np

from specactor_engine.decoupled.protocol import EMPTY_HASH, Commits, Drafts, extend_hash, extend_hash_many


class DraftBuffers:
    def __init__(self, num_slots: int, width: int) -> None:
        self.width = width
        self.pending = np.zeros((num_slots, width), dtype=np.int64)
        self.count = np.zeros(num_slots, dtype=np.int64)
        self.committed_len = np.zeros(num_slots, dtype=np.int64)
        self.committed_hash = np.zeros(num_slots, dtype=np.int64)
        self.pending_hash = np.zeros(num_slots, dtype=np.int64)
        self.arrived = 0  # drafts received
        self.kept = 0  # drafts that joined a pending chain

    def add_rows(self, slots: np.ndarray) -> None:
        """Fresh rows (nothing committed yet)."""
        self.count[slots] = 0
        self.committed_len[slots] = 0
        self.committed_hash[slots] = 0
        self.pending_hash[slots] = 0

    def resync(self, slots: np.ndarray, outputs: list[np.ndarray]) -> None:
        """Rows whose rounds were not reconciled (the workers were paused): their committed output as it is now,
        outputs [R] one array each, and no pending drafts (a worker realigns from the commits it is sent)."""
        lengths = np.array([len(o) for o in outputs], dtype=np.int64)
        tokens = np.zeros((len(slots), int(lengths.max(initial=0))), dtype=np.int64)
        for row, output in enumerate(outputs):
            tokens[row, : len(output)] = output
        self.committed_hash[slots] = extend_hash_many(np.full(len(slots), EMPTY_HASH, dtype=np.int64), tokens, lengths)
        self.committed_len[slots] = lengths
        self.count[slots] = 0
        self.pending_hash[slots] = self.committed_hash[slots]

    def drop_pending(self, slots: np.ndarray) -> None:
        """Forget the rows' drafts (their worker is gone)."""
        self.count[slots] = 0
        self.pending_hash[slots] = self.committed_hash[slots]

    def ingest(self, drafts: Drafts, owned: np.ndarray) -> None:
        """Append the drafts that continue their rows' chains; owned [S] bool marks live rows."""
        slots, tokens = drafts.slots, drafts.tokens
        self.arrived += len(slots)
        fits = owned[slots] & (self.count[slots] < self.width)
        fits &= drafts.positions == self.committed_len[slots] + self.count[slots]
        fits &= drafts.parent_hashes == self.pending_hash[slots]
        slots, tokens = slots[fits], tokens[fits]
        self.pending[slots, self.count[slots]] = tokens
        self.pending_hash[slots] = extend_hash(self.pending_hash[slots], tokens)
        self.count[slots] += 1
        self.kept += len(slots)

    def take(self, slots: np.ndarray, caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Drafts to verify now: (tokens [R, k], num [R]) with num <= caps and what has arrived."""
        num = np.minimum(self.count[slots], caps)
        k = int(num.max()) if len(num) else 0
        tokens = self.pending[slots, :k].copy()
        tokens[np.arange(k)[None, :] >= num[:, None]] = 0
        return tokens, num

    def reconcile(self, slots: np.ndarray, output: np.ndarray, emitted: np.ndarray) -> Commits:
        """Commit a round: output [R, k+1] target tokens, emitted [R] of them kept (stops may cut);
        returns the `Commits` message for the workers."""
        count = self.count[slots]
        # The pending chain survives iff it begins with exactly the emitted tokens: the row verified
        # these drafts, accepted all it verified and the target's own next token is the next pending
        # draft; or another drafter's block was verified and the committed tokens happen to match.
        depth = min(self.width, output.shape[1])
        columns = np.arange(depth)[None, :]
        inside = columns < emitted[:, None]
        agree = np.where(inside, self.pending[slots, :depth] == output[:, :depth], True).all(axis=1)
        keep = (emitted > 0) & (count >= emitted) & agree
        shift = np.where(keep, emitted, 0)
        # shift the kept rows' remaining drafts to the front
        columns = np.minimum(np.arange(self.width)[None, :] + shift[:, None], self.width - 1)
        self.pending[slots] = np.take_along_axis(self.pending[slots], columns, axis=1)
        self.count[slots] = np.where(keep, count - emitted, 0)
        new_hash = extend_hash_many(self.committed_hash[slots], output, emitted)
        self.pending_hash[slots] = np.where(keep, self.pending_hash[slots], new_hash)
        starts = self.committed_len[slots].copy()
        self.committed_hash[slots] = new_hash
        self.committed_len[slots] += emitted
        offsets = np.concatenate([[0], np.cumsum(emitted)])
        tokens = output[np.arange(output.shape[1])[None, :] < emitted[:, None]]  # row-major: row by row
        return Commits(slots.copy(), starts, offsets, tokens)
