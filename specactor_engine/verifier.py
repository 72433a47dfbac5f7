"""The scorer and the rejection sampler: one target forward over every row's [last, d1..dk], and the
acceptance rule that turns its logits into accepted, recovered and bonus tokens.

With combination candidates (proposer.py) the same forward also scores a second draft per row on a
scratch slot; the longer accepted path wins and its KV is copied back (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specactor_engine import acceptance
from specactor_engine.model.runner import ModelRunner
from specactor_engine.policies.selector import FastestOfNSelector
from specactor_engine.proposer import RoundDrafts
from specactor_engine.sampling import (STREAM_ACCEPT, STREAM_RECOVER, SamplingParams, gumbel_noise, sample_tokens,
                                       uniform_noise, warped_probs)
from specactor_engine.state import SequenceState
from specactor_engine.types import EngineStats


# Packed verify rounds (ModelRunner.forward_packed) only up to this many rows. The dynamic verify length prices a
# round by its padded width; packed, trace C's ragged k = 1 rounds at 96-127 rows (half the rows drafting) looked
# cheaper to its calibration than they were, and it chose them: 359 ms for 121 tokens against 215 ms for 102 plain,
# `specactor` 0.91x `ar` (padded: 1.03-1.05x). Trace A's 32-row rounds packed: 1.02x in every repeat; padded 0.97x
# (session 32).
PACK_MAX_ROWS = 32


@dataclass
class Verified:
    """The target's view of one round's drafts."""

    logits: torch.Tensor  # [R, k+1, V] at [last, d1..dk] of each row's (winning) draft
    own_accepted: torch.Tensor | None  # [R] each row's own draft's acceptance, where candidates competed


class Verifier:
    """Scores drafts with the target and applies the acceptance rule, for one `generate` call."""

    def __init__(self, runner: ModelRunner, state: SequenceState, params: SamplingParams, stats: EngineStats,
                 rejection: bool, vocab_size: int, scratch: torch.Tensor, selector: FastestOfNSelector | None,
                 pack: bool = False) -> None:
        """rejection: classic min(1, p/q) acceptance (else position-keyed); scratch [S]: target-cache slots
        for combination's candidates, one each (past the real ones, or free real slots: the run sets them each
        round it combines, `Run._scratch`); pack: run a ragged block's real tokens only
        (`_packed_forward`), where padding costs compute (a CPU)."""
        self.runner = runner
        self.state = state
        self.params = params
        self.stats = stats
        self.rejection = rejection
        self.vocab_size = vocab_size
        self.scratch = scratch
        self.selector = selector
        self.pack = pack

    def verify(self, slots: torch.Tensor, drafts: RoundDrafts) -> Verified:
        """One target forward over the rows' drafts (and their candidates, if any)."""
        if drafts.candidates is not None:
            return self._verify_candidates(slots, drafts)
        proposal = drafts.proposal
        last = self.state.tokens[slots, self.state.lengths[slots] - 1]  # [R]
        inputs = torch.cat([last[:, None], proposal.token_ids], dim=1)  # [R, k+1]
        widths = proposal.num_tokens + 1  # [R]
        if self.pack and len(slots) <= PACK_MAX_ROWS and int(widths.sum()) < inputs.numel():
            return Verified(self.runner.forward_packed(inputs, slots, widths), None)
        return Verified(self.runner.forward(inputs, slots, widths), None)  # [R, k+1, V]

    def accept(self, slots: torch.Tensor, logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
               draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The acceptance rule over logits [R, k+1, V] and drafts [R, k]: (num_accepted [R], output tokens
        [R, k+1]: the accepted drafts, then the recovered or bonus token).

        The rule runs where the logits are (a GPU's: the drafts go there, not [R, k+1, V] floats to the
        host); its two small results come back to the host, where the engine keeps its state."""
        device = logits.device
        positions = self.state.output_positions(slots)[:, None] + torch.arange(logits.shape[1])[None, :]
        keys = self.state.seq_keys[slots]
        drafts, num_drafts = drafts.to(device), num_drafts.to(device)
        if not self.rejection:
            targets = sample_tokens(logits, self.params, keys, positions)
            num_accepted, output = acceptance.accept_position_keyed(drafts, num_drafts, targets)
            return num_accepted.cpu(), output.cpu()
        k = drafts.shape[1]
        target_probs = warped_probs(logits, self.params)
        keys, positions = keys.to(device), positions.to(device)  # the noise is the same bits on every device
        uniforms = uniform_noise(keys, positions[:, :k], 1, STREAM_ACCEPT)[..., 0]
        recovery = gumbel_noise(keys, positions, self.vocab_size, STREAM_RECOVER)
        draft_probs = draft_probs.to(device) if draft_probs is not None else None
        num_accepted, output = acceptance.accept_rejection(drafts, num_drafts, draft_probs, target_probs, uniforms,
                                                           recovery)
        return num_accepted.cpu(), output.cpu()

    def _verify_candidates(self, slots: torch.Tensor, drafts: RoundDrafts) -> Verified:
        """One target forward over the rows' own drafts and the candidates; each row keeps the longer
        accepted continuation (its winning candidate replaces the row's draft in `drafts`).

        A candidate runs on a scratch slot holding a copy of its row's KV prefix. Acceptance is
        position-keyed: along either path, accepted tokens are exactly what plain decoding would
        emit, so keeping the longer path is exact. The winner's new KV entries are copied back.
        """
        assert drafts.candidates is not None
        proposal, candidates = drafts.proposal, drafts.candidates
        rows, offers, methods = candidates.rows, candidates.offers, candidates.methods  # [E], [E, k], [E]
        R, E = len(slots), len(rows)
        scratch = self.scratch[:E]
        owners = slots[rows]
        kv_lengths = self.runner.lengths[owners].clone()
        self.runner.cache.copy_prefix(owners, scratch, kv_lengths)
        last = self.state.tokens[slots, self.state.lengths[slots] - 1]
        tokens = torch.cat([proposal.token_ids, offers.token_ids])  # [R + E, k]
        num = torch.cat([proposal.num_tokens, offers.num_tokens])
        inputs = torch.cat([torch.cat([last, last[rows]])[:, None], tokens], dim=1)
        logits = self.runner.forward(inputs, torch.cat([slots, scratch]), num + 1)  # [R + E, k+1, V]
        accepted, _ = self.accept(torch.cat([slots, owners]), logits, tokens, num, None)
        own_accepted = accepted[:R].clone()
        if self.selector is not None:  # the tail's spare capacity buys statistics for the other methods
            self.selector.observe(self.state.seq_keys[owners].tolist(), methods, accepted[R:].tolist())
        wins = (accepted[R:] > accepted[rows]).nonzero().flatten()
        self.stats.candidate_rows += E
        self.stats.candidate_wins += len(wins)
        pick = torch.arange(R)  # which verified row's logits each row keeps
        for i in wins.tolist():
            row, start, count = int(rows[i]), int(kv_lengths[i]), int(accepted[R + i]) + 1
            self.runner.cache.copy_range(int(scratch[i]), int(slots[row]), start, count)
            pick[row] = R + i
            proposal.token_ids[row], proposal.num_tokens[row] = offers.token_ids[i], offers.num_tokens[i]
            if proposal.confidence is not None:  # the row's own drafter's confidence no longer describes its drafts
                proposal.confidence[row] = float("nan")
            drafts.sources[row] = methods[i]
        self.runner.set_lengths(scratch, torch.zeros_like(scratch))
        return Verified(logits[pick], own_accepted)
