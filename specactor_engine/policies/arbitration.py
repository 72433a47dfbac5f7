"""Draft arbitration: per row, verify whichever draft is expected to emit more, the draft model's or a free one's.

Fastest-of-N gives a round's rows one assignment of methods, chosen with the verify length from each method's
pooled acceptance (run.py `_schedule`). At a few rows that is usually the draft model for every row: its drafting
costs about the same at 1 row as at 4, and its drafts are accepted most (trace D: the feature drafter, ~0.77 of
its verified drafts, against ~0.5 for suffix drafts). A model-free draft costs the critical path next to nothing,
though, and on some rows in some rounds it is the better one: where a sibling or an earlier repeat already wrote
what comes next, a suffix draft is accepted whole while the model is unsure. Both drafts are in hand after
drafting; the verify costs the same whichever of two equally long drafts a row verifies.

So after the round's drafting, rows drafted by a model that reports its confidence are also drafted by the
model-free methods that report one (suffix drafts: `drafters/suffix.py` `draft_score`), and each row verifies the
draft with the larger expected tokens: the sum over its positions of the chance that the position is reached and
accepted, the product of the confidences mapped to acceptance rates by draft trimming's calibration
(`draft_trim.ConfidenceCalibration`, learned per method and bucket from the verified rounds, so a method whose
confident drafts are not in fact accepted stops winning). Output is unchanged: the verifier's acceptance is exact
for any draft.

A calibration that learned only from the drafts that won would learn slowly where it matters: an offer that
starts out over-rated keeps winning rows it loses until its few buckets have seen enough rejections. Under
position-keyed acceptance the tokens a row emits are the target's own samples whatever it verified, so the drafts
a row did not verify are scored against them too (`observe_unverified`), as far as the row emitted.

An offer's acceptance is calibrated per context (`offer_key`): the method and the bucket of the model's confidence in
the row's first draft. One rate per score bucket over all rows (session 68) was learned mostly where the model was
sure, where the text is predictable and suffix drafts do well too; but an offer wins only where the model is unsure,
where the text is least predictable for any drafter. On trace D that swapped rows to suffix drafts accepted at 0.52
in place of feature drafts accepted at 0.76, and the runs took more rounds (docs/architecture.md 8.7).

Off by default (`rollout.draft_arbitration`).

Pure numpy, no engine: unit-tested on its own (tests/engine/test_arbitration.py).
"""

from __future__ import annotations

import numpy as np

from specactor_engine.policies.draft_trim import ConfidenceCalibration

# the model's confidence in its first draft, bucketed: an offer's acceptance is learned per such context
CONTEXT_EDGES = (0.3, 0.6, 0.9)


def offer_key(method: str, model_confidence: float) -> str:
    """The calibration key of `method`'s offer to a row whose model drafted first with `model_confidence`:
    'suffix|0' for a model below 0.3 sure, ... 'suffix|3' at 0.9 and above (module docstring)."""
    return f"{method}|{int(np.searchsorted(CONTEXT_EDGES, model_confidence, side='right'))}"


def expected_tokens(calibration: ConfidenceCalibration, method: str, confidence: np.ndarray,
                    num: np.ndarray) -> np.ndarray:
    """Each row's expected accepted drafts [R]: sum_j prod_{i<=j} rate(confidence[i]) over its first num[r]
    positions. confidence [R, k] (NaN: no confidence: the row's expectation is NaN), num [R]."""
    confidence = np.asarray(confidence, dtype=np.float64)
    rows, width = confidence.shape
    if width == 0:
        return np.zeros(rows)
    inside = np.arange(width)[None, :] < np.asarray(num)[:, None]
    rates = np.where(inside, calibration.rates(method, np.nan_to_num(confidence)), 0.0)
    expected = np.cumprod(rates, axis=1).sum(axis=1)
    unknown = np.isnan(np.where(inside, confidence, 0.0)).any(axis=1)
    return np.where(unknown, np.nan, expected)


def better_offers(own: np.ndarray, offers: np.ndarray) -> np.ndarray:
    """Rows [R] bool whose offered draft is expected to emit more than their own (NaN on either side: keep own)."""
    own, offers = np.asarray(own, dtype=np.float64), np.asarray(offers, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return ~np.isnan(own) & ~np.isnan(offers) & (offers > own)


def observe_unverified(calibration: ConfidenceCalibration, methods: tuple[str, ...], tokens: np.ndarray,
                       confidence: np.ndarray, emitted: np.ndarray) -> None:
    """Score a draft the row did not verify (tokens [n], its confidences [n]) against the tokens the row emitted
    [m] (accepted drafts and the one after: the target's own samples, whatever was drafted, under position-keyed
    acceptance): position j counts where every earlier one matched and j < m, accepted iff it matches too. Booked
    under each of `methods` (calibration keys: an offer's method and its `offer_key`)."""
    reached = min(len(tokens), len(emitted))
    hits = np.asarray(tokens[:reached]) == np.asarray(emitted[:reached])
    decided = reached if hits.all() else int(np.argmin(hits)) + 1  # up to and including the first miss
    if decided:
        for method in methods:
            calibration.observe(method, np.asarray(confidence[:decided], dtype=np.float64).tolist(),
                                hits[:decided].tolist())
