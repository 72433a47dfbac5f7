"""Typed containers passed between the engine's stages and returned to callers.

Vocabulary (docs/architecture.md section 3.5): draft/target; a verify round emits the
accepted draft tokens plus one target token (recovered at the first rejected
position, or bonus after all drafts were accepted).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Request:
    """One prompt to roll out `n` times.

    `request_id` keys the sampling noise (with the sample index and position), so a
    request's samples do not depend on which other requests share the batch.
    `prompt_token_ids` is set when the caller already tokenized; otherwise `prompt`
    (plain text) or `messages` (chat) is tokenized by the engine.
    """

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None


@dataclass
class SequenceOutput:
    """One generated sample of one request."""

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    logprobs: list[float]  # target log-probability of each emitted token (temperature-scaled)
    finish_reason: str  # "stop" | "length" | "context" | "error"
    policy_version: int
    error: str | None = None
    # with sampling.top_logprobs = N: per emitted token, the N most likely ids (int32 [n, N]) and
    # their log-probs (float32 [n, N]); None otherwise
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "sample": self.sample_index,
            "prompt_token_ids": self.prompt_token_ids,
            "token_ids": self.token_ids,
            "text": self.text,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "policy_version": self.policy_version,
            **({"error": self.error} if self.error else {}),
            **({"top_logprobs": _top_pairs(*self.top_logprobs)} if self.top_logprobs is not None else {}),
        }


def _top_pairs(ids: torch.Tensor, values: torch.Tensor) -> list[list[list[float | int]]]:
    """Per position, [[token_id, logprob], ...] (JSON)."""
    return [[[i, round(v, 6)] for i, v in zip(row_ids, row_values)]
            for row_ids, row_values in zip(ids.tolist(), values.tolist())]


@dataclass
class DraftProposal:
    """Draft tokens for a set of rows; rows may propose fewer than k tokens.

    token_ids:   [R, k] int64, padded with 0 past num_tokens
    num_tokens:  [R]    int64, 0 <= num_tokens[r] <= k
    probs:       [R, k, V] float draft distributions, or None for deterministic drafts
    confidence:  [R, k] float32, the drafter's own probability of each token it drafted (NaN: a row whose
                 drafter reports none, e.g. n-gram drafts), or None; draft trimming reads it
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    @staticmethod
    def empty(num_rows: int) -> "DraftProposal":
        return DraftProposal(
            token_ids=torch.zeros(num_rows, 0, dtype=torch.long),
            num_tokens=torch.zeros(num_rows, dtype=torch.long),
        )


@dataclass
class EngineStats:
    """Counters of one `generate` call (all plain numbers, JSON-serialisable)."""

    mode: str = "ar"
    num_sequences: int = 0
    output_tokens: int = 0
    verify_rounds: int = 0  # target forwards after prefill
    row_rounds: int = 0  # sum over verify rounds of the rows verified
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_drafter: dict[str, int] = field(default_factory=dict)
    accepted_per_drafter: dict[str, int] = field(default_factory=dict)
    draft_s_per_drafter: dict[str, float] = field(default_factory=dict)  # in-process drafters' drafting time
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    # One entry per verify round, for plots over rollout progress: seconds since `generate`
    # began, rows verified, draft width k (drafts verified by the longest row), the verify length
    # chosen (cap), tokens emitted, tokens drafted and accepted, the rows each drafter
    # supplied ({name: rows}), each in-process drafter's drafting seconds ({name: s}), and the shadow
    # drafts scored in the round ({name: [drafts, accepted tokens]}).
    timeline: list[dict[str, Any]] = field(default_factory=list)
    decoupled: dict[str, float] = field(default_factory=dict)  # decoupled mode: worker figures
    arm_rounds: dict[str, int] = field(default_factory=dict)  # dynamic decoupling: rounds per arm
    arm_skips: int = 0  # ... and explorations of the workers' arm skipped (its best case could not win)
    candidate_rows: int = 0  # combination: second candidates verified beside a row's own drafts
    candidate_wins: int = 0  # ... and how many of them were accepted further than the row's own
    trimmed_tokens: int = 0  # drafts cut before the verify as not worth their verify time (policies/draft_trim.py)
    draft_stops: int = 0  # draft-model calls that draft trimming ended before the round's verify length (run.py)
    arbitrated_rows: int = 0  # rows that verified a model-free draft in place of their model's (arbitration.py)
    shadow_drafts: int = 0  # drafts scored against the committed tokens instead of verified (shadow.py)
    shadow_accepted: int = 0  # ... and the tokens of them a verify would have accepted
    shadow_drafts_per_drafter: dict[str, int] = field(default_factory=dict)  # ... by method
    shadow_accepted_per_drafter: dict[str, int] = field(default_factory=dict)
    # rollout replicas (replicas/): per replica, its chunks, busy / prefill / draft / verify seconds, sequences,
    # output tokens and restarts in this call; empty for one in-process engine
    replicas: list[dict[str, float]] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / row-rounds: tokens emitted per row per verify round."""
        return 1.0 + self.accepted_tokens / self.row_rounds if self.row_rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["mean_acceptance_length"] = self.mean_acceptance_length
        out["acceptance_rate"] = self.acceptance_rate
        out["tokens_per_s"] = self.tokens_per_s
        return out


@dataclass
class RolloutResult:
    outputs: list[SequenceOutput]
    stats: EngineStats
