"""Draft trimming: each round verifies the draft positions whose expected tokens pay for their verify time.

Past the compute ridge (a CPU at a few rows: 4 rows x 3 tokens of Qwen2.5-1.5B are compute-bound on 2 cores)
every verified token costs real time, while it emits a token only if it and every draft before it are
accepted. A model drafter knows how sure it is of each draft: the probability its own distribution gave the
token it drafted (`DraftProposal.confidence`). On trace D, feature drafts drafted with confidence >= 0.9 were
accepted 92-97% of the time, those below 0.1 17-29% (session 32). `ConfidenceCalibration` learns that map per
draft method and confidence bucket from the rounds' outcomes; the product of the mapped rates along a row is
the chance that its j-th draft is reached and accepted, i.e. the tokens that position adds.

`choose_tokens` ranks every drafted position of the round by that chance and keeps the best n, for the n that
maximises expected tokens per second: (rows + the kept chances) / (drafting + the verify of rows + n real
tokens). The verify's cost comes from the startup profile of packed rounds (`CostTable.packed`), which is not
linear in tokens: oneDNN blocks a GEMM's rows, so on session 32's machine 4 rows x 1-1.5 tokens cost what 4 x 1
do and a 13th token costs 16 ms. Rows of different lengths verify in one packed forward
(`ModelRunner.forward_packed`): a cut position costs nothing. Output is unchanged: a row verifies a prefix of
its drafts (the chances fall along a row, so the best n are prefixes).

Trimmed positions stay within the rows' caps and count as not accepted in the verify-length policy's statistics
(run.py): a length's statistics are what rounds drafting that deep and trimming emit, and its calibration what they
cost. (Left out instead, the statistics described only the confident rows and the policy chose k = 4 rounds whose
two extra draft steps cost more than they emitted; session 32.)

Pure numpy, no engine: unit-tested on its own (tests/engine/test_draft_trim.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

BUCKETS = 10  # confidence buckets of width 0.1
PRIOR_WEIGHT = 2.0  # the prior (acceptance = the bucket's mid confidence) counts as this many outcomes
HORIZON = 400.0  # a bucket's outcomes are scaled down past this many: acceptance drifts (a policy update)


class ConfidenceCalibration:
    """P(a draft is accepted | the drafts before it were, its drafter's confidence), per method and bucket."""

    def __init__(self, buckets: int = BUCKETS, prior_weight: float = PRIOR_WEIGHT, horizon: float = HORIZON) -> None:
        self.buckets, self.prior_weight, self.horizon = buckets, prior_weight, horizon
        self._accepted: dict[str, np.ndarray] = {}
        self._seen: dict[str, np.ndarray] = {}

    def _counts(self, method: str) -> tuple[np.ndarray, np.ndarray]:
        if method not in self._seen:
            middle = (np.arange(self.buckets) + 0.5) / self.buckets
            self._accepted[method] = middle * self.prior_weight
            self._seen[method] = np.full(self.buckets, self.prior_weight)
        return self._accepted[method], self._seen[method]

    def bucket(self, confidence: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(confidence, dtype=np.float64) * self.buckets).astype(np.int64), 0,
                       self.buckets - 1)

    def rates(self, method: str, confidence: np.ndarray) -> np.ndarray:
        """The acceptance chance of drafts of `method` with these confidences: same shape."""
        accepted, seen = self._counts(method)
        b = self.bucket(confidence)
        return accepted[b] / seen[b]

    def outcomes(self, method: str) -> float:
        """The outcomes observed for `method` (those past the horizon scaled down; 0 for a method never seen)."""
        if method not in self._seen:
            return 0.0
        return float((self._seen[method] - self.prior_weight).sum())

    def observe(self, method: str, confidence: Sequence[float], accepted: Sequence[bool]) -> None:
        """Outcomes of verified drafts that were reached (every draft before them accepted)."""
        counts_accepted, seen = self._counts(method)
        for b, hit in zip(self.bucket(np.asarray(confidence)).tolist(), accepted):
            seen[b] += 1.0
            counts_accepted[b] += float(hit)
            if seen[b] > self.horizon:
                counts_accepted[b] *= self.horizon / seen[b]
                seen[b] = self.horizon

    def observe_round(self, confidence: np.ndarray, methods: Sequence[str | None], verified: np.ndarray,
                      accepted: np.ndarray) -> None:
        """One round: confidence [R, k] (NaN: none), each row's method, drafts verified [R] and accepted [R]."""
        for row, method in enumerate(methods):
            reached = min(int(accepted[row]) + 1, int(verified[row]))  # drafts 0..reached-1 were decided
            if method is None or reached <= 0 or np.isnan(confidence[row, 0]):
                continue
            self.observe(method, confidence[row, :reached], [j < int(accepted[row]) for j in range(reached)])


def choose_tokens(num_tokens: np.ndarray, confidence: np.ndarray, methods: Sequence[str | None],
                  calibration: ConfidenceCalibration, seconds: Callable[[int], float]) -> np.ndarray:
    """Each row's drafts kept [R] (module docstring): num_tokens [R] drafted, confidence [R, k] (NaN: a row whose
    drafter reports none, kept whole), seconds(n): a round verifying n real tokens, drafting included."""
    kept = np.asarray(num_tokens, dtype=np.int64).copy()
    fixed = len(kept)  # every row verifies its last token
    ranked: list[tuple[float, int, int]] = []  # (-chance, position, row): the best first, a row's earlier first
    for row, method in enumerate(methods):
        n = int(kept[row])
        if n == 0:
            continue
        if method is None or np.isnan(confidence[row, 0]):
            fixed += n
            continue
        chance = np.cumprod(calibration.rates(method, confidence[row, :n]))
        ranked.extend((-float(c), j, row) for j, c in enumerate(chance))
        kept[row] = 0
    if not ranked:
        return kept
    ranked.sort()
    gains = np.concatenate([[0.0], np.cumsum([-c for c, _, _ in ranked])])
    rates = [(len(kept) + gains[n]) / max(seconds(fixed + n), 1e-9) for n in range(len(ranked) + 1)]
    best = int(np.argmax(rates))  # the first of equals: the fewer tokens
    for _, _, row in ranked[:best]:
        kept[row] += 1
    return kept
