"""Dynamic verify length: how many draft tokens per row the next verify round should check.

A pure policy over statistics (no torch, no engine), so it can be unit-tested on its own:

- `CostTable`: measured seconds of one verify round (target forward + sampling) by rows in the
  batch and tokens per row (k + 1), interpolated between the measured batch sizes, at one
  committed context length. `CostProfile`: tables at several context lengths, interpolated
  linearly in context (attention reads every row up to the batch's longest context).
- `AcceptanceStats`: exponential moving averages, per draft position j, of the chance that a
  row verified with at least j drafts accepts its first j drafts (supply and acceptance in one:
  a row whose drafter supplied fewer than j drafts counts as not accepting the j-th).
- `VerifyLengthPolicy.choose(rows)`: the k in 0..max_k maximising expected emitted tokens per
  second, rows * E[k] / (verify(rows, k+1) x calibration(k+1) + draft(k)), where
  E[k] = 1 + sum_{j<=k} q_j. k = 0 is plain decoding.
- Per draft method: where the rows are drafted by different methods (Fastest-of-N), `choose` is
  given one or more *assignments* (a method per row: the selector's choice, and the same with
  every costly method replaced by a model-free one) and keeps acceptance statistics and drafting
  seconds per draft position for each method. A round of assignment a is expected to emit
  sum_rows E_{a(r)}[k] tokens in verify(rows, k+1) + k x sum_{m in a} draft_m seconds (a method
  drafts all its rows in one call, so its cost is paid once per round, not per row), and the
  policy picks the best (k, assignment) pair; an assignment that trailed the chosen round by more than `far_share` is
  weighed again only `far_every` rounds later (`far_options`). One pooled drafting cost would let an expensive
  draft model's seconds stick to the free methods (its cost is only re-measured in rounds that
  draft with it), and the free methods' drafts would never be verified again. The current k changes only when another
  is better by more than the hysteresis. Once every `probe_every` rounds it verifies max_k (so
  the statistics of the deeper positions stay fresh) or 0 (so the calibration below knows what
  plain rounds really cost), whichever ran least recently; a probe that changes nothing doubles
  the interval (up to `max_probe_every`), since a probe round costs what a deep verify costs. A probe of a
  deeper length runs only where that length could pay in a better stretch (each position's conditional acceptance
  raised `probe_optimism` of the way to 1): at 32 rows on a CPU past its ridge a deep verify is a slow round whatever
  it reveals.
  Besides, while a shorter length is in force, max_k runs whenever it is expected within `cheap_probe`
  of the current rate and has not run for `cheap_probe_every` rounds: such a round costs little, and
  only running it refreshes the deep positions (trace D: a k = 3 round at the start whose drafts were
  unluckily short held `specactor` at k = 1 for 80 rounds, the model's deep positions never verified).
  In a draft-trimmed batch max_k also runs, whatever its estimate, once a narrower width was measured in the
  batch's bucket and no width that deep was (`_unseen_trimmed`).
  While plain decoding is in force, the best speculative length runs on the same terms (with the
  assignment best at that length), so a method that fell just behind in a poor stretch is measured again.
  With `probe_deep` off (the engine scores shadow drafts, shadow.py, which keep the deep
  positions' statistics fresh without verifying them) only plain rounds are probed, and only
  while speculating. With it on but some methods `shadowed` (the engine shadow-drafts its model-free
  methods beside a draft model, which shadows cannot measure), a deep probe runs only for an assignment
  with a method that is not: a probe of n-gram and suffix drafts learns what their shadows already tell.
- The profile is measured once (once per thread arrangement: `regime_costs` holds the profiles of regimes whose
  rounds run on other threads than `cost`'s), on an idle model and maybe another load of the machine; what a
  round really costs drifts from it (host work, sampling, other processes), and not by the same
  factor at every width. Each finished round therefore updates an EMA of observed / profiled
  seconds for its width (per `regime`: the engine's thread arrangement, e.g. workers running or
  paused), and every prediction is scaled by it. A width not observed yet is read off the line through
  the observed widths' seconds against their profiled seconds (part of a round's excess is fixed, part
  proportional, so one width's factor does not carry to another); a width that has not run for a while
  follows that line as the widths observed since draw it (nearer widths more), so one stray round cannot
  price a width for the rest of a run. One additive correction for every width would not do: a profile
  that overestimates plain rounds would then make every wider round look cheaper than it is.
- The factor also differs with the batch: host work weighs more at one row than at 32, so a
  factor learned in one step's long tail (or a one-row warm-up) misjudges the next step's full
  batch. Factors are therefore kept per batch bucket (the profile's nearest measured batch size,
  in log scale); a width not observed in a bucket is read off the same bucket's line, and a bucket with
  nothing observed borrows the nearest bucket's.
- Where the engine trims drafts (a few rows on a CPU: `trimmed_rows`) and the profile measured packed rounds, a round
  verifies only the drafts that pay, so its width says little of its cost. There it is priced by the packed cost of
  the real tokens it verifies (a length run: the mean share of its whole round that its rounds' tokens cost,
  `row_cost_share`; a length not run: the tokens read between the lengths run, `row_tokens`, `_tokens_per_row`), and
  its factor is observed / that cost: the machine's drift and the host work, not the trimming, so a width not run is
  read off a line that trimming does not bend.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

MIN_SCALE, MAX_SCALE = 0.25, 4.0  # bounds of one round's observed / profiled time


@dataclass(frozen=True)
class CostTable:
    """seconds[b][w]: one verify round of batch_sizes[b] rows, widths[w] tokens per row.

    Widths run 1..max_k+1 (a row verifies its last committed token plus k drafts).
    """

    batch_sizes: tuple[int, ...]
    widths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    context: int = 0  # committed tokens per row when measured (0: unknown)
    # packed[b][n]: a packed round (ModelRunner.forward_packed) of batch_sizes[b] rows and batch_sizes[b] + n real
    # tokens, n = 0 .. batch_sizes[b] x (widths[-1] - 1); () for a batch size not measured so (`packed_cost`)
    packed: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self) -> None:
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or not self.batch_sizes:
            raise ValueError(f"batch_sizes must be ascending and distinct, got {self.batch_sizes}")
        if len(self.seconds) != len(self.batch_sizes) or any(len(r) != len(self.widths) for r in self.seconds):
            raise ValueError("seconds must be [len(batch_sizes)][len(widths)]")
        if self.packed and len(self.packed) != len(self.batch_sizes):
            raise ValueError("packed must be [len(batch_sizes)][...] (or empty)")

    def packed_cost(self, rows: int, tokens: int, context: int | None = None) -> float:
        """Seconds of a packed round of `rows` rows and `tokens` real tokens (rows <= tokens): measured where `rows`
        is a batch size measured so, else the round of width tokens / rows, interpolated between the two widths
        around it. The measured cost is not linear in tokens: oneDNN blocks a GEMM's rows (on the AMD EPYC of
        session 32, 4, 5 and 6 tokens of Qwen2.5-1.5B cost the same ~118 ms, and 13 cost 16 ms more than 12). (One
        table has one context: `context` is accepted for the `CostProfile` interface and ignored.)"""
        if rows in self.batch_sizes and self.packed:
            measured = self.packed[self.batch_sizes.index(rows)]
            if 0 <= tokens - rows < len(measured):
                return measured[tokens - rows]
        width = min(max(tokens / max(rows, 1), self.widths[0]), self.widths[-1])
        lo = max(w for w in self.widths if w <= width)
        hi = min(w for w in self.widths if w >= width)
        c0, c1 = self.cost(rows, lo), self.cost(rows, hi)
        return c0 if hi == lo else c0 + (c1 - c0) * (width - lo) / (hi - lo)

    @property
    def max_context(self) -> int:
        return self.context

    def cost(self, rows: int, width: int, context: int | None = None) -> float:
        """Seconds of a round of `rows` rows x `width` tokens: linear in rows between (and beyond)
        the measured batch sizes; width must be one of the measured widths. (One table has one
        context: `context` is accepted for the `CostProfile` interface and ignored.)"""
        column = self.widths.index(width)
        sizes = self.batch_sizes
        if len(sizes) == 1:
            return self.seconds[0][column] * rows / sizes[0]
        i = min(max(bisect.bisect_left(sizes, rows), 1), len(sizes) - 1)
        (b0, b1), (c0, c1) = (sizes[i - 1], sizes[i]), (self.seconds[i - 1][column], self.seconds[i][column])
        return max(c0 + (c1 - c0) * (rows - b0) / (b1 - b0), 1e-9)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "widths": list(self.widths),
                "seconds": [list(r) for r in self.seconds], "context": self.context,
                "packed": [list(r) for r in self.packed]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostTable":
        return cls(tuple(data["batch_sizes"]), tuple(data["widths"]), tuple(tuple(r) for r in data["seconds"]),
                   int(data.get("context", 0)), tuple(tuple(r) for r in data.get("packed", ())))

    def save(self, path: Path) -> None:
        _write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> "CostTable":
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(path)


@dataclass(frozen=True)
class CostProfile:
    """Cost tables measured at ascending committed contexts, with the same batch sizes and widths.

    Between two measured contexts the cost is interpolated linearly, and beyond the longest it is
    extrapolated along the last two (attention grows linearly with context); below the shortest
    it is the shortest's cost.
    """

    tables: tuple[CostTable, ...]

    def __post_init__(self) -> None:
        contexts = [t.context for t in self.tables]
        if not self.tables or contexts != sorted(set(contexts)):
            raise ValueError(f"tables must have ascending, distinct contexts, got {contexts}")
        first = self.tables[0]
        if any(t.batch_sizes != first.batch_sizes or t.widths != first.widths for t in self.tables):
            raise ValueError("every table of a profile must have the same batch sizes and widths")

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        return self.tables[0].batch_sizes

    @property
    def widths(self) -> tuple[int, ...]:
        return self.tables[0].widths

    @property
    def max_context(self) -> int:
        return self.tables[-1].context

    def cost(self, rows: int, width: int, context: int | None = None) -> float:
        """Seconds of a round of `rows` x `width` tokens after `context` committed tokens (the
        batch's longest; None: the shortest measured context)."""
        return self._in_context(context, lambda table: table.cost(rows, width))

    def packed_cost(self, rows: int, tokens: int, context: int | None = None) -> float:
        """`CostTable.packed_cost` after `context` committed tokens, interpolated in context as `cost` is."""
        return self._in_context(context, lambda table: table.packed_cost(rows, tokens))

    def _in_context(self, context: int | None, seconds: Callable[[CostTable], float]) -> float:
        """A table's `seconds` at `context`: interpolated between the tables around it (the shortest's below it)."""
        tables = self.tables
        if context is None or len(tables) == 1 or context <= tables[0].context:
            return seconds(tables[0])
        i = min(bisect.bisect_left([t.context for t in tables], context), len(tables) - 1)
        lo, hi = tables[i - 1], tables[i]
        c0, c1 = seconds(lo), seconds(hi)
        return max(c0 + (c1 - c0) * (context - lo.context) / (hi.context - lo.context), 1e-9)

    def to_dict(self) -> dict[str, Any]:
        return {"tables": [t.to_dict() for t in self.tables]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CostProfile":
        if "tables" not in data:  # a single table (older cache files)
            return cls((CostTable.from_dict(data),))
        return cls(tuple(CostTable.from_dict(t) for t in data["tables"]))

    def save(self, path: Path) -> None:
        _write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: Path) -> "CostProfile":
        return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))


@dataclass
class AcceptanceStats:
    """EMAs per draft position j = 1..max_k of P(first j drafts accepted | row verified >= j drafts).

    A position's estimate starts at the prior and becomes the running mean of its first 1/decay
    observed rounds, then an EMA (so one round does not outweigh a start it knows nothing about, and a
    slow EMA does not drag a prior along for tens of rounds). Positions never observed (deeper than any
    round verified so far) are extrapolated from the deepest observed one, at its conditional rate
    q_j / q_{j-1}: a drafter whose first two drafts are accepted 87% and 75% of the time is not assumed
    to fall to the prior's 12% at the third just because no round has verified a third yet.
    """

    max_k: int
    decay: float = 0.1  # weight of the newest round (once a position has 1/decay observed rounds)
    prior: float = 0.5  # optimistic start, so speculation gets tried
    accept_through: list[float] = field(default_factory=list)
    observed: list[int] = field(default_factory=list)  # rounds that observed each position
    long_decay: float = 0.05  # the long-run mean's weight of the newest round (`relax`; 0.05: ~20 rounds)
    long_run: list[float] = field(default_factory=list)  # per position: the same rate over many more rounds
    trusted_rounds: int = 4  # rounds that make a position's estimate its own (`rates`)

    def __post_init__(self) -> None:
        if not self.accept_through:
            self.accept_through = [self.prior**j for j in range(1, self.max_k + 1)]
        if not self.observed:
            self.observed = [0] * self.max_k
        if not self.long_run:
            self.long_run = list(self.accept_through)

    def observe(self, verified_with: Sequence[int], accepted: Sequence[int], decay: float | None = None) -> None:
        """One round: per row, how many drafts it verified and how many of them it accepted.

        verified_with counts the row's draft *slots* (its cap k), not what its drafter supplied:
        a missing draft is a rejected one, so supply is folded into the estimate. decay: this
        observation's weight (once a position has enough rounds), default `self.decay`.
        """
        decay = self.decay if decay is None else decay
        verified, took = np.asarray(verified_with), np.asarray(accepted)
        for j in range(1, self.max_k + 1):
            rows = verified >= j
            if rows.any():
                rate = float((took[rows] >= j).mean())
                self.observed[j - 1] += 1
                weight = max(decay, 1.0 / self.observed[j - 1])
                self.accept_through[j - 1] += weight * (rate - self.accept_through[j - 1])
                weight = max(self.long_decay, 1.0 / self.observed[j - 1])
                self.long_run[j - 1] += weight * (rate - self.long_run[j - 1])

    def relax(self, share: float) -> None:
        """Move each observed position's estimate `share` of the way back to its long-run mean: a round in which
        nothing observed this method. Acceptance comes in stretches (a drafter that accepts 3 of 4 drafts in
        prose may accept none over a table of digits), so a method dropped after a bad stretch would otherwise be
        judged by that stretch for as long as it stays out of use: trace D's feature-level drafter accepted 1, 1
        and 0 of 12 drafts in three rounds, and `specactor` then verified plain rounds and n-gram drafts for 130
        rounds (83 plain) where the feature drafter had been emitting 8-9 tokens a round before and after."""
        for j in range(self.max_k):
            if self.observed[j]:
                self.accept_through[j] += share * (self.long_run[j] - self.accept_through[j])

    def rates(self) -> list[float]:
        """q_j for j = 1..max_k. Past the deepest position observed in at least `trusted_rounds` rounds, positions are
        extrapolated from it at its conditional rate, and one observed in fewer rounds is blended with that
        extrapolation by its share of `trusted_rounds` (nothing observed: the extrapolation alone). A position two
        rounds saw is no estimate to keep a length out by: trace D, session 41, the 0.5B's second to fourth positions
        stood at 0.25 after its one-row warm-up round and one 4-row round, its first at 0.85-0.9 over hundreds, and
        `specactor` verified one draft a row for 250 rounds where `coupled-cheap` verified three."""
        q = list(self.accept_through)
        seen = [j for j in range(self.max_k) if self.observed[j]]
        if not seen:
            return q  # nothing observed: the prior (or rates set by hand)
        anchor = max((j for j in seen if self.observed[j] >= self.trusted_rounds), default=seen[-1])
        before = q[anchor - 1] if anchor > 0 else 1.0
        ratio = min(q[anchor] / before, 1.0) if before > 0 else 0.0
        for j in range(anchor + 1, self.max_k):
            weight = min(self.observed[j] / max(self.trusted_rounds, 1), 1.0)
            q[j] = weight * q[j] + (1.0 - weight) * q[j - 1] * ratio
        return q

    def expected_tokens(self, k: int, optimism: float = 0.0) -> float:
        """E[tokens emitted per row] when verifying k drafts (a prefix chain never gains depth). optimism: each
        position's conditional acceptance (given the drafts before it accepted) raised this share of the way to 1,
        for a bound on what a stretch better than the estimates could give (`VerifyLengthPolicy.probe_optimism`)."""
        total, best, lifted = 1.0, 1.0, 1.0
        for q in self.rates()[:k]:
            conditional = min(q / best, 1.0) if best > 0 else 0.0
            best = min(best, q)
            lifted *= conditional + optimism * (1.0 - conditional)
            total += lifted
        return total


POOLED = "*pooled*"  # `cost_warmed`'s key for the pooled drafting cost (`draft_s_per_token`)


@dataclass
class VerifyLengthPolicy:
    """Chooses k each round from a cost table and live acceptance statistics (module docstring)."""

    cost: CostTable | CostProfile
    stats: AcceptanceStats
    hysteresis: float = 0.05  # switch only when another k is this much faster
    probe_every: int = 16  # rounds before the first probe at max_k while k < max_k (0: never)
    max_probe_every: int = 256
    draft_s_per_token: float = 0.0  # EMA of drafting seconds per draft position (all rows at once)
    # (regime, batch bucket, width) -> EMA of observed / profiled seconds of a round's verify and host work
    scale: dict[tuple[str, int, int], float] = field(default_factory=dict)
    # a costly method set's factor (`_calibration_regime`) over the pooled factor of its regime at the same bucket
    # and width, over many rounds (`realised_decay`): while no round observes the method set its factor relaxes to
    # the pooled factor times this (`_relax_unobserved`), as its realised factor does. Trace D, session 47: three
    # of the 0.5B's rounds met a slow spell (0.29-0.5 s where rounds took ~0.15 s; the other systems' rounds slowed
    # too; 2.2-4x the profile at width 2), raising its own factor, plain rounds brought the pooled one back, and it stayed
    # out for ~420 of 509 rounds while n-gram and suffix drafts gave 1.24x `ar` where `coupled-cheap` gave 1.38x
    scale_long: dict[tuple[str, int, int], float] = field(default_factory=dict)
    scale_fresh: set[tuple[str, int, int]] = field(default_factory=set)  # costly keys observed since the last `choose`
    decay: float = 0.2
    current: int | None = None
    rounds_since_probe: int = 0
    probe_interval: int = 0  # current interval (starts at probe_every)
    probe_from: int | None = None  # the length in force when the last probe ran, until the next choice
    probe_deep: bool = True  # probe max_k too (off when shadow drafts supply the deep positions' statistics)
    # methods whose deep positions shadow drafts keep measured (the engine's model-free drafters while it shadow-drafts):
    # a deep probe whose assignment drafts with these alone is skipped (`_deep_probe_learns`). Trace A, session 45: with
    # the 0.5B beside n-gram and suffix drafts, two repeats of three ran a k = 4 probe of n-gram and suffix drafts at 32
    # rows (1.06-1.09 s against 0.31 s for a plain round, 52 tokens) and two one at 15 rows (0.58-0.65 s, ~0.2 s lost)
    shadowed: frozenset[str] = frozenset()
    # (regime, batch bucket, width) -> round last observed
    seen_at: dict[tuple[str, int, int], int] = field(default_factory=dict)
    history: list[int] = field(default_factory=list)
    by_method: dict[str, AcceptanceStats] = field(default_factory=dict)  # acceptance per draft method
    draft_s_by_method: dict[str, float] = field(default_factory=dict)  # EMA drafting seconds per position, per method
    option: int = 0  # the assignment (index into `choose`'s options) of the last choice
    models_in_use: frozenset[str] = field(default_factory=frozenset)  # the methods of the last choice on its merits
    cost_warmed: set[str] = field(default_factory=set)  # methods (POOLED: all) whose first drafting cost was left out
    # per-method statistics follow at the pooled statistics' pace per round, `1 - (1 - stats.decay)^gap` for an
    # observation `gap` rounds after the method's last one, and at most this (the selector's 0.3): a costly method
    # is measured only in the rounds that draft with it, a few probes apart, so its estimate must move on each,
    # while one observed every round would otherwise be three times as noisy as the pooled one. Trace D, session 27:
    # at 0.3 a round, `specactor` drafting with the feature-level drafter alone verified k = 2 in 360 of 468 rounds
    # where `coupled-feature` (the pooled 0.1) verified k = 1 in 413 of 480, 4% more tokens for 10% more verify time
    method_decay: float = 0.3
    method_seen_at: dict[str, int] = field(default_factory=dict)  # method -> the round (len(history)) last observed
    rounds_off_first: int = 0  # rounds since the first assignment last ran (-1: it just ran as a probe)
    option_interval: int = 0  # rounds between probes of the first assignment (0: probe_every)
    first_score_at_probe: float = 0.0  # the first assignment's best expected rate when it was last probed
    # a probe of the first assignment waits until its last probe's seconds are at most this share of the rounds'
    # seconds since (`_probe_first_option`)
    probe_budget: float = 0.05
    round_s: float = 0.0  # EMA of the seconds of rounds that were no such probe
    first_probe_s: float = 0.0  # the seconds of the last probe of the first assignment
    first_catch_up_s: float = 0.0  # the catch-up a probe of the first assignment would pay now (`choose`)
    probing_first: bool = False  # the round just chosen is such a probe
    # a probe (of a length, or of the first assignment) runs only where some length it covers could beat the length
    # in force once each position's conditional acceptance is raised this share of the way to 1 (`_probe_may_pay`):
    # trace D, session 28, the feature drafter's per-draft acceptance over 16-round stretches was 0.52-0.59 at the
    # median and 0.65-0.78 at the best, about halfway from its mean to 1
    probe_optimism: float = 0.5
    cheap_probe: float = 0.15  # a probe expected within this share of the current rate is cheap ...
    cheap_probe_every: int = 8  # ... and runs this often at max_k (0: never; docstring)
    # a method drafting one position in more than this share of a width-1 round calibrates its rounds' verify and
    # host time apart (`_calibration_regime`)
    costly_share: float = 0.01
    # regime, method set and batch bucket (`_realised_key`) -> EMA of realised / expected tokens per second of the
    # rounds drafted with it (probes left out): what the per-part estimates still miss
    realised: dict[str, float] = field(default_factory=dict)
    # the same ratio over many more rounds (`realised_decay`, from 1): what a key's factor relaxes back to while no round
    # observes it (`_relax_unobserved`), as a method's acceptance does. The ratio counts tokens, so a poor stretch of
    # acceptance lowers the factor as well as the acceptance estimates, and a factor no round updates kept it: trace
    # D, session 30, the feature drafter's factor stood at 0.85 after such a stretch (its mean over the run 0.99)
    # and `specactor` decoded plainly or with n-gram drafts in 215 of 466 rounds where drafting with it paid
    realised_long: dict[str, float] = field(default_factory=dict)
    realised_decay: float = 0.05
    realised_fresh: set[str] = field(default_factory=set)  # keys observed since the last `choose`
    # keys whose first round was seen and left out: it pays one-time costs (trace D, session 28: in a debug run the
    # feature drafter's first 4-row round realised 0.655 of its estimate, which put every k below plain decoding; in a
    # repeat that went plain after that round, `specactor` drafted with it in 14 rounds of 669)
    realised_warmed: set[str] = field(default_factory=set)
    expected: tuple[str, float] | None = None  # the key and expected tokens/s of the round just chosen
    idle_share: float = 0.1  # ... and one out of use that drafts a position in more than this share has its prefill deferred
    # method -> a draft step's expected seconds as a share of a plain (width-1) round, used until the method is
    # measured (the engine's size-based Drafter.cost_share); a method with none counts as free until measured
    prior_share: dict[str, float] = field(default_factory=dict)
    catch_up_s: list[float] = field(default_factory=list)  # per option of the current `choose`: its catch-up
    # a catch-up is paid once for the stretch of rounds that follows it, so a round is charged this share of it
    # (`throughput`). Charged whole to one round, it kept a model out for good once it was out: what it would
    # catch up grows with every round drafted otherwise (trace D, session 27: the feature drafter's, from 7 to
    # 121 ms over 14 rounds, against rounds of ~150 ms), so its rounds looked dearer the longer it stayed out, and
    # `specactor` decoded plainly for most of the run (mean k 0.3-0.7, median 113.8 s) where `coupled-feature`,
    # drafting with it every round, took 94.0 s
    catch_up_rounds: int = 8
    # ... or, where the rows have more tokens left (`choose`'s remaining_tokens), the rounds they would take at the
    # option's expected tokens a row, up to this: a catch-up grows with every round a method is out (trace D, the
    # feature drafter's by ~1 ms a round at 4 rows), and spread over a fixed 8 rounds, one out for 100 rounds carried
    # ~14 ms a round against rounds of ~160 ms it gained ~10% in, where the 60-odd rounds the rows had left would
    # have carried ~2 ms
    max_catch_up_rounds: int = 64
    remaining_tokens: float | None = None  # mean tokens the rows of the round being chosen have left (`choose`)
    # methods chosen on their merits for a round that drafted: a catch-up is spread over the rows' remaining rounds
    # only for an option whose draft models all held rows before (the catch-up of coming back after a poor stretch);
    # a model never in use pays to enter on its estimates alone, over `catch_up_rounds` (trace D, session 31: spread
    # over 64 rounds, the 0.5B's first catch-up, 0.78 s of deferred prompts, let it in at round 12 of a repeat and it
    # kept the rows for the run at 49.5 tokens/s where the feature drafter's rounds made 53.8)
    held: set[str] = field(default_factory=set)
    # each round a method's acceptance goes unobserved (no verify, no shadow draft), its statistics move this
    # share of the way back to their long-run means (`AcceptanceStats.relax`)
    relax_rate: float = 0.1
    speculation_margin: float = 1.0  # the last choice's best expected rate at k > 0 over its rate at k = 0
    scores: tuple[float, ...] = ()  # the last choice's expected tokens/s per k (its best assignment's); () after hold()
    factors: tuple[float, ...] = ()  # the calibration each of those rates used per k (`verify_factor`); () after hold()
    priced: tuple[float, ...] = ()  # and the verify seconds each priced its round at (`verify_seconds`); () after hold()
    # regime -> the profile measured on that regime's threads (the engine: the drafter workers' arm runs the verifier
    # on fewer threads than plain decoding); a regime not named here is priced by `cost`. One profile for both
    # priced trace D's 4-row width-3 verify at 1.68x a width-1 round (measured on the verifier's one thread) where
    # the solo arm's two threads take 1.3x, and only the widths the rounds ran were corrected by calibration
    regime_costs: dict[str, Any] = field(default_factory=dict)
    # a width's calibration not observed for this many rounds follows the widths observed since (`_pull_stale`),
    # the more the nearer their width
    stale_rounds: int = 32
    neighbour_share: float = 0.5
    # rounds of at most this many rows are draft-trimmed (the engine's `Run._trims`; 0: none): a width k + 1 round
    # verifies only the drafts trimming keeps, so wide widths run far below the profile's line through the narrow,
    # untrimmed ones, and a stale width wider than every fresh one is not pulled to their line there but follows the
    # widest fresh width's drift (`_pull_stale`). Trace D, session 58: one `specactor` run of six held k = 1 for 193
    # of 378 rounds once a slow spell had it decode narrow; widths 4-5, last run at 0.66 and 0.59 of the profile,
    # were pulled to the line through widths 1-2 (1.09-1.07), so deeper drafts looked dear and were not run to show
    # otherwise (accept len 2.03 against 2.26-2.41)
    trimmed_rows: int = 0
    # (calibration key, batch bucket, width) -> EMA of the real tokens a row verified in the rounds of that width, in
    # token-priced buckets (`_token_priced`: draft-trimmed, with a profile of packed rounds). There a round is priced
    # by the packed cost of the tokens it verifies, not by its width, and its calibration is observed / that cost:
    # the factor is then the machine's drift alone, the same for every width, and a width not run is read off a line
    # that trimming does not bend (`_tokens_per_row` estimates its tokens). Priced by width, each width's factor
    # carried its own trimming (trace D, session 60: widths 4-5 at 0.7-0.8 of the profile, widths 1-2 at 1.1-1.3),
    # and k = 3, never run, read off the line through the others at 1.2-1.36x: one paired `specactor` run spent 134
    # of its 4-row rounds at k = 2 where `coupled-feature` spent 57
    row_tokens: dict[tuple[str, int, int], float] = field(default_factory=dict)
    # the same keys -> the mean share of the width's whole round (rows x (k + 1) tokens) that the packed cost of its rounds'
    # real tokens came to: a width run is priced at that share of its whole round, the mean of what its rounds cost, not
    # the cost of their mean tokens (`_profiled`). The packed cost is a staircase (oneDNN blocks a GEMM's rows: on the Zen
    # 5 CPU 12 tokens of 4 rows cost ~55 ms and 13 ~75 ms) and trimmed rounds sit on its steps. Trace D, session 62: one
    # run's first k = 4 round verified all 20 of its tokens and its later ones 12; the mean tokens (~16 after four, the
    # first taken whole) priced k = 4 at ~80 ms where those rounds took 52-67, and the run held k = 2 for 157 rounds.
    # Both are running means over a width's first 1 / decay rounds, then EMAs (`row_rounds` counts them)
    row_cost_share: dict[tuple[str, int, int], float] = field(default_factory=dict)
    row_rounds: dict[tuple[str, int, int], int] = field(default_factory=dict)
    fresh: set[str] = field(default_factory=set)  # methods observed since the last `choose`
    # an assignment whose best expected rate at its last weighing was below `far_share` of the chosen round's is
    # weighed again only `far_every` rounds later (`far_options`), unless its methods are in use or it is the first
    # (the probed one): weighing 3-4 assignments at every length each round was most of `specactor`'s extra host
    # work on trace D (session 53: ~0.45 s a run over `coupled-feature`'s, `choose` the largest part); in a replay of
    # D the 0.5B's and the model-free assignments were then weighed in 218 of 816 chances, the rest far behind
    far_share: float = 0.8
    far_every: int = 4
    far_until: dict[frozenset[str], int] = field(default_factory=dict)  # method set -> round it is weighed again
    # within one `choose` (nothing it evaluates changes meanwhile): calibrations already looked up
    _memo: dict[tuple[Any, ...], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def max_k(self) -> int:
        return self.stats.max_k

    def cost_for(self, regime: str = "") -> Any:
        """The cost profile (`CostTable` or `CostProfile`) of rounds run under `regime`."""
        return self.regime_costs.get(regime, self.cost)

    def bucket(self, rows: int) -> int:
        """The profile's measured batch size nearest to `rows` (in log scale): calibration is kept per bucket."""
        return _nearest_bucket(tuple(self.cost.batch_sizes), rows)

    def calibration(self, width: int, regime: str = "", rows: int = 1) -> float:
        """Observed / profiled round time at `width` for a batch of `rows` under `regime`: the width's own factor in
        the nearest batch bucket with observations; a width not observed there takes the factor that puts it on the
        line through the observed widths' seconds (`_line_factor`), else the nearest bucket's; with nothing
        observed it is 1."""
        return self._memoised(("calibration", width, regime, rows), self._calibration, width, regime, rows)

    def _memoised(self, key: tuple[Any, ...], compute: Callable[..., Any], *args: Any) -> Any:
        """compute(*args), kept under `key` for the rest of the current `choose` (where nothing it reads changes)."""
        if self._memo is None:
            return compute(*args)
        if key not in self._memo:
            self._memo[key] = compute(*args)
        return self._memo[key]

    def _calibration(self, width: int, regime: str, rows: int) -> float:
        bucket = self._calibration_bucket(regime, rows)
        if bucket is None:
            return 1.0
        own = self.scale.get((regime, bucket, width))
        return own if own is not None else self._line_factor(regime, bucket, width)

    def _calibration_bucket(self, regime: str, rows: int) -> int | None:
        """The bucket whose factors calibrate a round of `rows` rows under `regime`: the nearest (in log scale) with
        observations, None with none."""
        return self._memoised(("bucket", regime, rows), self._nearest_observed, regime, rows)

    def _nearest_observed(self, regime: str, rows: int) -> int | None:
        buckets = {b for (r, b, _) in self.scale if r == regime}
        if not buckets:
            return None
        here, log = self.bucket(rows), np.log
        return min(buckets, key=lambda b: (abs(log(b) - log(here)), b))

    def _token_priced(self, bucket: int, regime: str) -> bool:
        """Rounds of this bucket are priced by the tokens they verify (`row_tokens`): draft-trimmed (`trimmed_rows`), and
        the regime's profile measured packed rounds."""
        if bucket > self.trimmed_rows:
            return False
        base = regime.split("|", 1)[0]
        return self._memoised(("packed", base), _has_packed, self.cost_for(base))

    def _tokens_per_row(self, regime: str, bucket: int, k: int) -> float:
        """The real tokens a row of a round verifying k drafts is expected to verify in `bucket` (`row_tokens`): observed
        at k, else on the line between the observed lengths around k (k = 0 verifies 1), else, past the deepest
        observed length k', k' 's tokens plus as many per further position as k' kept per drafted one (deeper drafts are
        kept less often: an upper estimate); k + 1 (the whole width) with none observed, and never more."""
        if k == 0:
            return 1.0
        return self._memoised(("row_tokens", regime, bucket, k), self._row_tokens, regime, bucket, k)

    def _row_tokens(self, regime: str, bucket: int, k: int) -> float:
        seen = {w - 1: t for (r, b, w), t in self.row_tokens.items() if r == regime and b == bucket}
        if k in seen:
            return seen[k]
        lower, upper = [j for j in seen if j < k], [j for j in seen if j > k]
        lo = max(lower, default=0)
        t_lo = seen.get(lo, 1.0)
        if upper:
            hi = min(upper)
            estimate = t_lo + (seen[hi] - t_lo) * (k - lo) / (hi - lo)
        elif lower:
            estimate = t_lo + (t_lo - 1.0) / lo * (k - lo)
        else:
            return k + 1.0
        return min(estimate, k + 1.0)

    def _profiled(self, regime: str, rows: int, k: int, context: int | None, bucket: int | None) -> float:
        """The profile's seconds of a round of `rows` rows verifying k drafts: its width's (rows x (k + 1) tokens), or
        in a token-priced bucket (`_token_priced`) the mean share of that its rounds' real tokens cost (`row_cost_share`)
        for a width run, else a packed round of the tokens such rounds are expected to verify (`_tokens_per_row`).
        regime: a calibration key (its methods' part names no profile)."""
        return self._memoised(("profiled", regime, rows, k, context, bucket), self._profiled_seconds, regime, rows, k,
                              context, bucket)

    def _profiled_seconds(self, regime: str, rows: int, k: int, context: int | None, bucket: int | None) -> float:
        cost = self.cost_for(regime.split("|", 1)[0])
        if k == 0 or bucket is None or not self._token_priced(bucket, regime):
            return cost.cost(rows, k + 1, context)
        share = self.row_cost_share.get((regime, bucket, k + 1))
        if share is not None:  # a width run: the mean share of its whole round that its rounds' tokens cost
            return cost.cost(rows, k + 1, context) * share
        return _round_cost(cost, rows, k, rows * self._tokens_per_row(regime, bucket, k), context)

    def _line_factor(self, regime: str, bucket: int, width: int) -> float:
        """The factor of `width` read off the line through the other observed widths' seconds against their profiled
        seconds, observed = a + b x profiled (least squares; the widths observed within `stale_rounds` when there are
        any, else all). A round's time over the profile is part fixed (host work, sampling, what the machine's
        memory state adds to streaming the weights) and part proportional, so widths' factors differ and one
        width's factor does not carry to another: on trace D (session 50) plain 4-row rounds ran at ~1.7x the
        profile, k = 1 at ~1.5x and k = 3-4 at ~0.9-1.0x (trimmed), and k = 2, never observed, borrowed k = 1's
        factor; it was rated below both k = 1 and k = 3 and no 4-row round of six runs ran it. One width alone gives its
        own factor; a line that falls with the profile (noise) gives the widths' pooled ratio, and its slope is at most
        the smallest observed factor (the fixed part is not negative)."""
        now = len(self.history)
        widths = [w for (r, b, w) in self.scale if r == regime and b == bucket and w != width]
        fresh = [w for w in widths if now - self.seen_at.get((regime, bucket, w), -1) <= self.stale_rounds]
        points = [(self._profiled(regime, bucket, w - 1, None, bucket), self.scale[(regime, bucket, w)])
                  for w in (fresh or widths)]
        if not points:
            return 1.0
        profiled = self._profiled(regime, bucket, width - 1, None, bucket)
        xs, ys = [p for p, _ in points], [p * f for p, f in points]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mean_x) ** 2 for x in xs)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread > 0 else -1.0
        if slope < 0:  # one width, or a line no cost curve has: the pooled ratio
            return mean_y / max(mean_x, 1e-12)
        # the fixed part is not negative, so the proportional part is at most the smallest observed factor: two
        # nearby widths met in a slow spell draw a steep line that prices the widest rounds far above them (trace D's
        # profile, session 50: plain rounds at ~126 ms and k = 1 ones at ~175 ms, as in a slow spell of one repeat,
        # put k = 4 at ~0.51 s on the free line and ~0.32 s on the bounded one)
        slope = min(slope, min(f for _, f in points))
        seconds = mean_y + slope * (profiled - mean_x)
        return min(max(seconds / max(profiled, 1e-12), MIN_SCALE), MAX_SCALE)

    def verify_seconds(self, rows: int, k: int, context: int | None = None, regime: str = "",
                       methods: Sequence[str | None] | None = None) -> float:
        """Predicted seconds of a verify round (forward, sampling, host work) with k drafts per row (methods:
        each row's draft method; rounds of costly methods have their own calibration once observed)."""
        keyed = self._verify_key(rows, k, regime, methods)
        profiled = self._profiled(keyed, rows, k, context, self._calibration_bucket(keyed, rows))
        return profiled * self.calibration(k + 1, keyed, rows)

    def verify_factor(self, rows: int, k: int, regime: str = "", methods: Sequence[str | None] | None = None) -> float:
        """The calibration `verify_seconds` scales the profile by (`_verify_key`); in a token-priced bucket it
        scales the packed cost of the tokens such rounds verify (`_profiled`)."""
        return self.calibration(k + 1, self._verify_key(rows, k, regime, methods), rows)

    def _verify_key(self, rows: int, k: int, regime: str, methods: Sequence[str | None] | None) -> str:
        """The calibration key of a round verifying k drafts: the costly methods' in `methods` once observed
        (`_calibration_regime`), else the regime's."""
        keyed = self._calibration_regime(regime, methods, rows) if k > 0 else None
        if keyed is None or not any(r == keyed for r, _, _ in self.scale):
            return regime
        return keyed

    def packed_verify_seconds(self, rows: int, tokens: int, context: int | None = None, regime: str = "") -> float:
        """Predicted seconds of a packed verify round of `rows` rows and `tokens` real tokens (draft trimming:
        policies/draft_trim.py), scaled as plain rounds are (trimmed rounds must not price their own cut)."""
        return self.cost_for(regime).packed_cost(rows, tokens, context) * self.calibration(1, regime, rows)

    def padded_verify_seconds(self, rows: int, k: int, context: int | None = None, regime: str = "") -> float:
        """Predicted seconds of one padded forward verifying k drafts on every one of `rows` rows (rows x (k + 1)
        tokens, none cut): the profile's width, scaled by that width's factor, or in a token-priced bucket (whose
        factors scale packed costs) by plain rounds', as `packed_verify_seconds`."""
        bucket = self._calibration_bucket(regime, rows)
        width = 1 if bucket is not None and self._token_priced(bucket, regime) else k + 1
        return self.cost_for(regime).cost(rows, k + 1, context) * self.calibration(width, regime, rows)

    def combination_pays(self, rows: int, extra: int, k: int, context: int | None = None, regime: str = "",
                         methods: Sequence[str | None] | None = None, max_extra: float = 0.1) -> bool:
        """Combination's candidates, up to `extra` rows of k drafts verified beside the `rows` rows' own in the same
        forward, add at most `max_extra` to the round as priced (`verify_seconds` of its assignment `methods`). The
        verifier runs such a round as one padded forward of rows + extra rows of k + 1 tokens (`padded_verify_seconds`):
        nearly free where the forward is memory-bound, not past the compute ridge. Trace D on the Zen 5 CPU of session
        62: a 4-row round priced at ~57 ms by the ~12 tokens it verified took 115-175 ms with 1-4 candidates, where the
        check had weighed 8 rows of the same trimmed tokens per row; ~50 such rounds in one run (+2.7 s), and the
        feature drafter's slow rounds handed stretches to suffix and n-gram drafts."""
        if k == 0 or extra <= 0:
            return False
        alone = self.verify_seconds(rows, k, context, regime, methods)
        return self.padded_verify_seconds(rows + extra, k, context, regime) <= (1 + max_extra) * alone

    def idle_and_costly(self, method: str, rows: int) -> bool:
        """`method` is not in use and drafts a position in more than `idle_share` of a width-1 round of `rows`
        rows: the engine defers its prefill of newly admitted rows (a draft model out of use may never draft
        for them; trace D's 0.5B prefilled every group's prompt, ~1.1 s a run, and drafted in 2 probes)."""
        if method in self.models_in_use:
            return False
        return self.method_draft_s(method, rows) > self.idle_share * self.cost.cost(rows, 1)

    def _calibration_regime(self, regime: str, methods: Sequence[str | None] | None, rows: int) -> str | None:
        """The calibration key of rounds drafted by `methods`: the regime and its costly methods (None when it
        has none). A draft model's rounds cost more than their drafting: its forwards evict the target's
        weights from the cache before the verify, and its bookkeeping adds host time (trace D: ~20 ms more
        per round of the 0.5B than of the feature drafter at the same width, ~12% of the round). Pooled, that
        difference made the 0.5B look cheaper than it was and won it long stretches it lost."""
        if not methods:
            return None
        floor = self.costly_share * self.cost.cost(rows, 1)
        costly = sorted(m for m in set(methods) if m is not None and self.draft_s_by_method.get(m, 0.0) > floor)
        return f"{regime}|{'+'.join(costly)}" if costly else None

    def method_stats(self, method: str) -> AcceptanceStats:
        """The acceptance statistics of one draft method (the optimistic prior until it is observed)."""
        stats = self.by_method.get(method)
        if stats is None:
            stats = self.by_method[method] = AcceptanceStats(self.max_k, self.method_decay, self.stats.prior)
        return stats

    def expected_tokens(self, rows: int, k: int, methods: Sequence[str | None] | None = None,
                        optimism: float = 0.0) -> float:
        """Tokens a round of `rows` rows verifying k drafts is expected to emit; methods: each row's draft
        method (None: the row drafts nothing), else every row by the pooled statistics; optimism:
        `AcceptanceStats.expected_tokens`."""
        if methods is None:
            return rows * self.stats.expected_tokens(k, optimism)
        counts = Counter(methods)  # one estimate per method, not per row (rounds of 128 rows weigh 10 options)
        return sum(n * (1.0 if m is None else self._method_tokens(m, k, optimism)) for m, n in counts.items())

    def _method_tokens(self, method: str, k: int, optimism: float = 0.0) -> float:
        return self._memoised(("tokens", method, k, optimism), self.method_stats(method).expected_tokens, k, optimism)

    def method_draft_s(self, method: str, rows: int) -> float:
        """Seconds `method` takes to draft one position for a round of `rows` rows: measured, else its prior
        (`prior_share` of a plain round: a draft model is priced by its size before its first round, so one
        that cannot beat what is measured is never tried, trace D's 0.5B beside the feature-level drafter),
        else 0 (a model-free method: free until measured, so it gets tried)."""
        measured = self.draft_s_by_method.get(method)
        if measured is not None:
            return measured
        share = self.prior_share.get(method)
        return share * self.cost.cost(rows, 1) if share else 0.0

    def drafting_seconds(self, k: int, methods: Sequence[str | None] | None = None) -> float:
        """In-line drafting seconds of k draft positions: each method in the assignment drafts its rows in one call
        (`method_draft_s`)."""
        if methods is None:
            return k * self.draft_s_per_token
        return k * sum(self.method_draft_s(m, len(methods)) for m in set(methods) if m is not None)

    def throughput(self, rows: int, k: int, context: int | None = None, regime: str = "",
                   drafting: bool = True, methods: Sequence[str | None] | None = None,
                   catch_up_s: float = 0.0, optimism: float = 0.0) -> float:
        """Expected tokens per second of a round verifying k drafts on each of `rows` rows whose
        longest committed context is `context` (drafting=False: without the in-line drafting time,
        as when drafts stream in from concurrent workers; methods: each row's draft method; catch_up_s: what
        its draft models would first spend feeding what they missed, spread over the stretch after it
        (`_catch_up_horizon`) for a round that drafts; optimism: `AcceptanceStats.expected_tokens`)."""
        catch_up = catch_up_s / self._catch_up_horizon(rows, k, methods) if k > 0 and catch_up_s else 0.0
        seconds = self.verify_seconds(rows, k, context, regime, methods) + \
            (self.drafting_seconds(k, methods) + catch_up if drafting else 0.0)
        return self.expected_tokens(rows, k, methods, optimism) / max(seconds, 1e-6) * \
            self._realised(regime, methods, k, rows)

    def _catch_up_horizon(self, rows: int, k: int, methods: Sequence[str | None] | None) -> float:
        """Rounds a catch-up is spread over (`catch_up_rounds`, `max_catch_up_rounds`): catch_up_rounds; where the rows'
        remaining tokens are known, the rounds they take at the expected tokens a row of k drafts if fewer (a
        one-time cost is won back over the rounds the rows have left or not at all: trace A, session 45, the 0.5B
        caught a last row up over 0.80-0.89 s, 300-odd tokens, to draft for the 6 tokens it had left), and if the
        option's draft models all held rows before (`held`), those rounds if more, up to max_catch_up_rounds."""
        floor = float(max(self.catch_up_rounds, 1))
        left = self._rounds_left(rows, k, methods)
        if left is None:
            return floor
        if self.max_catch_up_rounds > floor and _models_of(methods or ()) <= self.held:
            return min(left, float(self.max_catch_up_rounds))
        return min(floor, left)

    def _rounds_left(self, rows: int, k: int, methods: Sequence[str | None] | None,
                     optimism: float = 0.0) -> float | None:
        """Rounds the rows' remaining tokens (`remaining_tokens`) take at the expected tokens a row of k drafts (at
        least 1; None: unknown)."""
        if self.remaining_tokens is None:
            return None
        per_row = self.expected_tokens(rows, k, methods, optimism) / max(rows, 1)
        return max(self.remaining_tokens / max(per_row, 1.0), 1.0)

    def _realised(self, regime: str, methods: Sequence[str | None] | None, k: int, rows: int) -> float:
        """The realised / expected throughput factor of rounds of about `rows` rows drafted by this method set (1
        until observed). Trace D: the 0.5B's late-phase rounds ran at 44.5 tokens/s where the estimates put it ahead
        of the feature drafter's 48.1, so whole phases went to it; the factor charges such misses to the method."""
        key = self._realised_key(regime, methods, self.bucket(rows)) if k > 0 else None
        return self.realised.get(key, 1.0) if key is not None else 1.0

    @staticmethod
    def _realised_key(regime: str, methods: Sequence[str | None] | None, bucket: int) -> str | None:
        """Every assignment's own record, model-free ones too (correcting only the costly ones handed trace D's
        second half to suffix and n-gram drafts whose estimates erred the other way), per batch bucket: what the
        estimates miss at a few rows says nothing of a batch of 95. Trace B: n-gram rounds of the engine's warm-up
        call, on one row, realised 1.8x their estimate; the policy keeps its statistics across calls, and at 95
        rows that factor chose a k = 1 round that took 0.32 s where a plain round took 0.19 s."""
        used = sorted({m for m in methods or () if m is not None})
        return f"{regime}|{'+'.join(used)}@{bucket}" if used else None

    def _best_option(self, rows: int, k: int, context: int | None, regime: str,
                     options: Sequence[Sequence[str | None]] | None, skip: frozenset[int] = frozenset(),
                     rates: dict[int, float] | None = None) -> tuple[float, int]:
        """(throughput, option index) of the best assignment at verify length k (the first on a tie); skip: options
        not weighed this round (`far_options`); rates: each weighed option's best throughput so far, raised here."""
        if not options:
            return self.throughput(rows, k, context, regime), 0
        catch_up = self.catch_up_s if len(self.catch_up_s) == len(options) else [0.0] * len(options)
        scores = [-math.inf if i in skip else self.throughput(rows, k, context, regime, methods=o, catch_up_s=c)
                  for i, (o, c) in enumerate(zip(options, catch_up))]
        if rates is not None:
            for i, score in enumerate(scores):
                if i not in skip:
                    rates[i] = max(rates.get(i, -math.inf), score)
        best = max(range(len(options)), key=lambda i: (scores[i], -i))
        # hysteresis on the methods in use, as on k: switching to another draft model pays a catch-up forward
        # over what it has not seen, which the per-round estimates leave out (trace D: near ties between the 0.5B
        # and the feature drafter flipped into long stretches on the slower one)
        if self.models_in_use and _models_of(options[best]) != self.models_in_use:
            held = [i for i, o in enumerate(options) if _models_of(o) == self.models_in_use]
            kept = max(held, key=lambda i: (scores[i], -i)) if held else best
            if scores[best] <= (1 + self.hysteresis) * scores[kept]:
                best = kept
        return scores[best], best

    def best(self, rows: int, context: int | None = None, regime: str = "",
             options: Sequence[Sequence[str | None]] | None = None,
             score: Callable[[int], float] | None = None) -> int:
        """The k of the highest expected rate (the shortest on a tie); score: k -> that rate, when the caller
        already has it (`choose` evaluates each k once)."""
        score = score or (lambda k: self._best_option(rows, k, context, regime, options)[0])
        return max(range(self.max_k + 1), key=lambda k: (score(k), -k))

    def far_options(self, options: Sequence[Sequence[str | None]] | None) -> frozenset[int]:
        """Indices of the options this round's `choose` will not weigh (`far_share`): the ones whose method set trailed
        the chosen round by that much within the last `far_every` rounds, but for the first (the probed one) and any
        whose methods are in use. The engine leaves their catch-up estimates out too."""
        if not options or not self.far_until:
            return frozenset()
        now = len(self.history)
        return frozenset(i for i, option in enumerate(options) if i > 0 and (key := _models_of(option))
                         and key != self.models_in_use and self.far_until.get(key, -1) > now)

    def _mark_far(self, options: Sequence[Sequence[str | None]], rates: Mapping[int, float], chosen: float) -> None:
        """After a choice at expected rate `chosen`: each weighed option's method set is far (skipped for `far_every`
        rounds) if its best rate was below `far_share` of it, else weighed again next round."""
        now = len(self.history)
        for i, rate in rates.items():
            key = _models_of(options[i])
            if rate < self.far_share * chosen:
                self.far_until[key] = now + self.far_every
            else:
                self.far_until.pop(key, None)

    def choose(self, rows: int, context: int | None = None, regime: str = "",
               options: Sequence[Sequence[str | None]] | None = None,
               catch_up_s: Sequence[float] | None = None, remaining_tokens: float | None = None) -> int:
        """The verify length for the next round of `rows` rows (recorded in `history`). options: the
        assignments of a draft method per row to choose among; the chosen one's index is left in `option`.
        catch_up_s: per option, what its draft models would spend catching up before drafting: charged to the
        option's round (trace D's 0.5B won rounds on a few rows of a mixed assignment by its per-round estimate
        and fed their whole context each time), and the first option's weighs in its probe budget.
        remaining_tokens: the mean tokens the rows have left to generate (None: unknown), which bounds the stretch a
        catch-up is spread over (`max_catch_up_rounds`)."""
        self.remaining_tokens = remaining_tokens
        self._memo = {}
        try:
            return self._choose(rows, context, regime, options, catch_up_s)
        finally:
            self._memo = None

    def _choose(self, rows: int, context: int | None, regime: str,
                options: Sequence[Sequence[str | None]] | None, catch_up_s: Sequence[float] | None) -> int:
        self.catch_up_s = list(catch_up_s) if catch_up_s is not None else []
        self.first_catch_up_s = self.catch_up_s[0] if self.catch_up_s else 0.0
        self._relax_unobserved()
        evaluated: dict[int, tuple[float, int]] = {}  # k -> best option: the same call's estimates, computed once
        skip = self.far_options(options)
        rates: dict[int, float] = {}  # each weighed option's best rate over the speculative lengths

        def option_at(k: int) -> tuple[float, int]:
            if k not in evaluated:
                evaluated[k] = self._best_option(rows, k, context, regime, options, skip, rates if k else None)
            return evaluated[k]

        def score(k: int) -> float:
            return option_at(k)[0]

        best = self.best(rows, context, regime, options, score)
        self.scores = tuple(score(j) for j in range(self.max_k + 1))
        if options is not None:
            self._mark_far(options, rates, max(self.scores))
        self.factors = tuple(self.verify_factor(rows, j, regime, options[option_at(j)[1]] if options else None)
                             for j in range(self.max_k + 1))
        self.priced = tuple(self.verify_seconds(rows, j, context, regime, options[option_at(j)[1]] if options else None)
                            for j in range(self.max_k + 1))
        self.speculation_margin = max(self.scores[1:]) / max(self.scores[0], 1e-9)
        previous = self.current
        if self.current is None:
            self.current = best
        elif best != self.current and score(best) > (1 + self.hysteresis) * score(self.current):
            self.current = best
        if self.probe_from is not None:  # the round after a probe: did it change the choice?
            changed = self.current != self.probe_from
            self.probe_interval = self.probe_every if changed else min(2 * self.probe_interval, self.max_probe_every)
            self.probe_from = None
        k = self.current
        self.option = option_at(k)[1]  # a length probe below keeps it
        if options is not None:
            self.models_in_use = _models_of(options[self.option])
            if k > 0:
                self.held |= self.models_in_use
            evaluated.clear()  # the hysteresis on the methods in use now weighs from the new ones

        def learns(j: int) -> bool:  # a probe verifying j drafts (with the option it would run) tells what shadows do not
            return self._deep_probe_learns(options, lambda: option_at(j)[1] if self.current == 0 else self.option)

        target = self._probe_target(k, regime, rows, learns(self.max_k))
        # a new length in force starts its own interval (its first round counts)
        self.rounds_since_probe = 1 if k != previous else 0 if target is None else self.rounds_since_probe + 1
        self.probe_interval = self.probe_interval or self.probe_every
        cheap = None
        if target is not None and self.probe_every and self.rounds_since_probe >= self.probe_interval and \
                self.rounds_since_probe >= self._length_probe_rounds(rows, k, target, context, regime) and \
                (target < k or self._probe_may_pay(rows, range(k + 1, target + 1), score(k), context, regime,
                                                   options, self.catch_up_s)):
            self.probe_from, k, self.rounds_since_probe = k, target, 0
        elif (cheap := self._cheap_probe(k, score, learns, lambda j: self._unseen_trimmed(j, regime, rows))) \
                is not None:
            k = cheap
        if self.probe_from == 0 or (cheap is not None and self.current == 0):
            self.option = option_at(k)[1]  # from plain decoding, the assignment best at the probe's length
        self.history.append(k)
        if options is not None and len(options) > 1:
            first = [options[0]]
            k = self._probe_first_option(k, lambda: max(self._best_option(rows, j, context, regime, first)[0]
                                                        for j in range(1, self.max_k + 1)),
                                         lambda: self._probe_may_pay(rows, range(1, self.max_k + 1),
                                                                     score(self.current), context, regime, first,
                                                                     self.catch_up_s[:1]))
        chosen = options[self.option] if options else None
        # probes (of a length or of the first assignment) are left out: a deep probe's expected tokens extrapolate
        # positions no round verified yet (trace D, session 31: the feature drafter's first k = 4 probe, at round 10,
        # was expected to emit 20 tokens on one perfect k = 2 round and emitted 8; its factor fell to the 0.5 floor and
        # it was out for 230 rounds)
        in_force = k > 0 and k == self.current and not self.probing_first
        key = self._realised_key(regime, chosen, self.bucket(rows)) if in_force else None
        if key is not None and chosen is not None:
            raw = self.throughput(rows, k, context, regime, methods=chosen) / self._realised(regime, chosen, k, rows)
            self.expected = (key, raw)
        else:
            self.expected = None
        return k

    def forget_acceptance(self) -> None:
        """Back to the prior acceptance, pooled and per method, and to no length in force or methods that held rows
        (`held`: a judgment of their acceptance); what was measured of costs (calibration, drafting seconds, realised
        factors, all per batch bucket) is kept. For a caller whose
        earlier rounds say nothing of the acceptance to come: the benchmark's warm-up decodes 8 tokens of one row
        (on trace D the feature drafter's statistics after it were 1.0 at every position), and one repeat of trace A
        then verified 3-4 drafts a row at 32 rows for 12 rounds (1.2 s each against 0.31 s for a plain round)."""
        self.stats = AcceptanceStats(self.max_k, self.stats.decay, self.stats.prior)
        self.by_method, self.method_seen_at, self.fresh = {}, {}, set()
        self.current, self.probe_from, self.rounds_since_probe = None, None, 0
        self.held, self.far_until = set(), {}

    def hold(self) -> int:
        """A round decoded plainly without a new choice (the engine re-chooses only every few rounds while plain
        decoding is far ahead: policies/shadow.py `choice_due`), recorded as k = 0. It counts toward the probes'
        intervals as a chosen plain round would, so probes come as many rounds apart; one that falls due runs at
        the next choice."""
        self.history.append(0)
        self.expected, self.probing_first, self.scores, self.factors, self.priced = None, False, (), (), ()
        if self.current == 0 and self.probe_deep:  # `_probe_target`: at k = 0 only max_k is probed
            self.rounds_since_probe += 1
        self.rounds_off_first += 1
        return 0

    def _relax_unobserved(self) -> None:
        """Per-method acceptance nothing observed last round drifts back toward its long-run mean
        (`AcceptanceStats.relax`), and so does the realised factor of every assignment no round observed
        (`realised_long`): a method out of use gets tried again once its long-run record says it should, not only
        when a probe happens to land in a better stretch."""
        if self.relax_rate > 0.0:
            for name, stats in self.by_method.items():
                if name not in self.fresh:
                    stats.relax(self.relax_rate)
            for key, factor in self.realised.items():
                if key not in self.realised_fresh and key in self.realised_long:
                    self.realised[key] = factor + self.relax_rate * (self.realised_long[key] - factor)
            for key, relative in self.scale_long.items():
                pooled = self.scale.get((key[0].split("|", 1)[0], key[1], key[2]))
                if key not in self.scale_fresh and pooled is not None:
                    self.scale[key] += self.relax_rate * (pooled * relative - self.scale[key])
        self.fresh, self.realised_fresh, self.scale_fresh = set(), set(), set()

    def _probe_first_option(self, k: int, first_score: Callable[[], float], may_pay: Callable[[], bool]) -> int:
        """Keep the selector's own assignment (options[0]) measured while another wins: a method that drafts in
        line with a model is measured only in rounds that draft with it, so once it loses its statistics would
        never change again (session 15's trace D: warm-up statistics kept the draft model out for a whole run).
        Every `probe_every` rounds off it one round runs it at max_k (every position measured: a probe at its
        best length, 1 for a method that lost, would never refresh the deeper ones). The interval doubles (up
        to `max_probe_every`) after a probe that left its expected rate (`first_score()`: its best throughput
        now, evaluated only where needed) where it was, and starts over after one that raised it. A probe that falls
        due waits while `may_pay()` says it cannot find anything (`_probe_may_pay`). Returns the round's length."""
        self.probing_first = False
        if self.option == 0 and k > 0:  # chosen on its merits (after a probe too): probes start over from probe_every
            self.option_interval, self.rounds_off_first = 0, 0
            return k
        if self.rounds_off_first < 0:  # the round after a probe, and it lost again
            improved = first_score() > (1 + self.hysteresis) * self.first_score_at_probe
            self.option_interval = 0 if improved else min(2 * (self.option_interval or self.probe_every),
                                                          self.max_probe_every)
            self.rounds_off_first = 0
        self.rounds_off_first += 1
        if not self.probe_every or self.rounds_off_first < max(self.option_interval or self.probe_every,
                                                               self._probe_budget_rounds()) or not may_pay():
            return k
        self.option, self.rounds_off_first, self.first_score_at_probe = 0, -1, first_score()
        self.probing_first = True
        self.history[-1] = self.max_k
        return self.max_k

    def _probe_budget_rounds(self) -> int:
        """Rounds off the first assignment before it is probed again so that its probes take at most
        `probe_budget` of the time: a draft model's probe pays a catch-up forward over everything it missed,
        for every row (trace A, 32 rows: ~2 s per probe of the 0.5B, 8 rounds' worth, twice a run). The probe's
        seconds: the last probe's, or a round's plus the catch-up now due (`first_catch_up_s`) if more: the
        first probe after a model's first round has only that estimate (trace A: the 0.5B's first round
        drafted with nothing to catch up, its next probe caught 30 rows up over 1.8 s)."""
        if self.round_s <= 0.0:
            return 0
        probe_s = max(self.first_probe_s, self.round_s + self.first_catch_up_s if self.first_catch_up_s else 0.0)
        if probe_s <= 0.0:
            return 0
        return math.ceil(probe_s / (self.probe_budget * self.round_s))

    def _length_probe_rounds(self, rows: int, k: int, target: int, context: int | None, regime: str) -> int:
        """Rounds at length k since the last length probe before one at `target` is due, so that what a probe
        costs beyond a round at k (both as the calibrated estimates put them) stays within `probe_budget` of
        those rounds' time: a deep probe can cost several rounds where verify widths are dear (trace A on the AMD
        EPYC, session 28: a k = 4 round at 32 rows took 1.1-1.8 s against 0.31 s for a plain one, and `specactor`
        and `coupled-feature` ran 4-7 of them a run, 6% behind `ar`). A probe of a shorter length costs nothing
        extra."""
        if target <= k:
            return 0
        round_s = self.verify_seconds(rows, k, context, regime) + self.drafting_seconds(k)
        probe_s = self.verify_seconds(rows, target, context, regime) + self.drafting_seconds(target)
        return math.ceil(max(probe_s / max(round_s, 1e-9) - 1.0, 0.0) / self.probe_budget)

    def _probe_may_pay(self, rows: int, lengths: Sequence[int], rate: float, context: int | None, regime: str,
                       options: Sequence[Sequence[str | None]] | None, catch_up_s: Sequence[float]) -> bool:
        """Whether a probe could find a round faster than `rate` (the length in force's): some length in `lengths`
        with some option is, once each draft position's conditional acceptance is raised `probe_optimism` of the
        way to 1. A probe only pays by what it may reveal; where even that bound is slower than the length in
        force, it is a slow round and no more (trace A on the AMD EPYC, 32 rows: the feature drafter's best estimate
        was 0.82x plain decoding's, its bound 0.88x, and each of a run's two k = 4 probes took 2.0-2.2 s against
        0.31 s for a plain round). A probe that pays a catch-up bets it on the stretch after it: it runs only where
        the rows have `catch_up_rounds` rounds left at that bound (trace A, session 46: at a last row's 6 tokens
        left, the 0.5B's probe caught it up over 4.05 s, its first use in the run, to draft 4 tokens)."""
        options = list(options) if options else [None]
        catch_up = list(catch_up_s) if len(catch_up_s) == len(options) else [0.0] * len(options)

        def stretch_left(j: int, option: Sequence[str | None] | None) -> bool:
            left = self._rounds_left(rows, j, option, self.probe_optimism)
            return left is None or left >= self.catch_up_rounds

        return any(self.throughput(rows, j, context, regime, methods=o, catch_up_s=c, optimism=self.probe_optimism)
                   >= rate and (not c or stretch_left(j, o)) for j in lengths for o, c in zip(options, catch_up))

    def _cheap_probe(self, k: int, score: Callable[[int], float], learns: Callable[[int], bool],
                     unseen: Callable[[int], bool] = lambda j: False) -> int | None:
        """The length of a probe that costs little this round, or None. While a shorter length is in force:
        max_k, when expected within `cheap_probe` of its rate and not run for `cheap_probe_every` rounds (only
        running it refreshes the deep positions' statistics), or whatever its estimate when `unseen(max_k)`: in a
        draft-trimmed round no width was measured this wide (`_unseen_trimmed`). While plain decoding is: the best
        speculative length, on the same terms, when no round has drafted for `cheap_probe_every` rounds. A method out
        of use is otherwise judged by its last stretch for as long as it stays out: trace D, session 28, the feature
        drafter's estimate fell 4% below plain decoding's in a poor stretch, and `specactor` decoded plainly for
        150 rounds while `coupled-feature`, drafting with it throughout, ran 15% faster than plain rounds. Kept apart
        from the regular probes (no interval change). learns(j): a round verifying j drafts measures something shadow
        drafts do not (`_deep_probe_learns`)."""
        if not self.probe_deep or not self.probe_every or not self.cheap_probe_every or k >= self.max_k:
            return None
        recent = self.history[max(len(self.history) - self.cheap_probe_every + 1, 0):]
        if k == 0:
            target = max(range(1, self.max_k + 1), key=lambda j: (score(j), -j))
            if any(recent):  # a round drafted lately
                return None
        else:
            target = self.max_k
            if unseen(target) and learns(target):  # before `recent`: the warm-up's rounds ran it at other row counts
                return target
            if target in recent:
                return None
        return target if score(target) >= (1 - self.cheap_probe) * score(k) and learns(target) else None

    def _unseen_trimmed(self, k: int, regime: str, rows: int) -> bool:
        """Rounds of `rows` rows are draft-trimmed (`trimmed_rows`) and no round of their bucket verified k drafts, nor
        more, while a narrower width was measured there. Width k + 1's estimate is then the narrower widths' factor,
        which prices every drafted position though trimming verifies only those that pay, so a deep round looks dearer
        than it runs; trimmed, it costs little more than the narrow round it replaces. Trace D, session 60: every run's
        first 4-row round chose k = 2 (the profile's best at the prior acceptance), and widths 4-5 took width 3's
        factor (1.2-1.3) where they ran at 0.7-0.8 once measured. At round 1 k = 4 was expected within `cheap_probe`,
        but a k = 4 round in the last `cheap_probe_every` at any row count holds the cheap probe off (the benchmark's
        one-row warm-up ended with rounds at k = 3, 3, 4), and a few rounds later its estimate had fallen outside. `coupled-feature` ran it at
        round 16 (after a plain probe), `specactor` at rounds 49 and 87, and ran 1-3% behind."""
        bucket = self.bucket(rows)
        if bucket > self.trimmed_rows:
            return False
        widths = [w for (r, b, w) in self.scale if r == regime and b == bucket]
        return bool(widths) and max(widths) < k + 1

    def _probe_target(self, k: int, regime: str, rows: int, deep: bool = True) -> int | None:
        """The length a due probe verifies: max_k (fresh statistics for the deep positions; only where `probe_deep`
        and `deep`, the caller's `_deep_probe_learns`) or 0 (the true cost of plain rounds: the calibration only
        learns a width by running it, and a profile's error between widths is what makes speculation look cheaper
        than it is), whichever was run least recently; None when nothing is left to probe (k = 0 without deep
        probes)."""
        ends = [end for end in ((0, self.max_k) if self.probe_deep and deep else (0,)) if end != k]
        bucket = self.bucket(rows)
        return min(ends, key=lambda end: self.seen_at.get((regime, bucket, end + 1), -1)) if ends else None

    def _deep_probe_learns(self, options: Sequence[Sequence[str | None]] | None, index: Callable[[], int]) -> bool:
        """Whether a deep probe drafting with options[index()] measures what shadow drafts do not: `probe_deep`, and
        some method of the assignment is not `shadowed` (without options, or nothing shadowed: `probe_deep` alone;
        index() is called only where the assignment decides)."""
        if not self.probe_deep:
            return False
        if not options or not self.shadowed:
            return True
        return not _models_of(options[index()]) <= self.shadowed

    def observe_acceptance(self, verified_with: Sequence[int], accepted: Sequence[int],
                           methods: Sequence[str | None] | None = None) -> None:
        """Rows' drafts slots and accepted drafts (from a verify or from shadow drafts), pooled and per
        method (methods: each row's draft method; None entries are left out of the per-method statistics)."""
        self.stats.observe(verified_with, accepted)
        if methods is None:
            return
        verified, took = np.asarray(verified_with), np.asarray(accepted)
        names = np.asarray([m or "" for m in methods], dtype=object)
        now = len(self.history)
        for method in {m for m in methods if m is not None}:
            mine = names == method
            self.method_stats(method).observe(verified[mine], took[mine], self.method_weight(method, now))
            self.method_seen_at[method] = now
            self.fresh.add(method)

    def method_weight(self, method: str, now: int) -> float:
        """The weight of `method`'s observation in round `now` (`method_decay`): the pooled per-round pace
        compounded over the rounds since its last observation, at most `method_decay`."""
        last = self.method_seen_at.get(method)
        if last is None:
            return self.method_decay
        gap = max(now - last, 1)
        return min(self.method_decay, 1.0 - (1.0 - self.stats.decay) ** gap)

    def observe_round(self, k: int, verified_with: Sequence[int], accepted: Sequence[int], draft_s: float,
                      round_s: float, rows: int, context: int | None = None, regime: str = "",
                      methods: Sequence[str | None] | None = None,
                      draft_s_by_method: Mapping[str, float] | None = None, catch_up_s: float = 0.0,
                      tokens: int | None = None) -> None:
        """Fold in one finished round: its acceptance, its drafting time and how far its other time
        (verify, sampling, host work) was from the profile at its width. methods: each row's draft
        method; draft_s_by_method: the in-line drafting seconds of each method this round, without catching up;
        catch_up_s: the seconds of draft_s its models spent catching up (charged apart, `catch_up_rounds`: a round
        that paid one does not count as realising less than expected); tokens: the real tokens the round verified,
        all rows (None: its whole width), which price it in a token-priced bucket (`row_tokens`, `_profiled`)."""
        steady_s = round_s - catch_up_s
        if self.expected is not None and k > 0 and steady_s > 0:  # realised against expected tokens/s
            key, expected_tps = self.expected
            emitted = len(verified_with) + float(np.sum(accepted))
            ratio = min(max(emitted / steady_s / max(expected_tps, 1e-9), 0.5), 2.0)
            old = self.realised.get(key)
            if key not in self.realised_warmed:  # its first round pays one-time costs: left out
                self.realised_warmed.add(key)
            else:
                self.realised[key] = ratio if old is None else old + self.decay * (ratio - old)
                long = self.realised_long.get(key)
                long = 1.0 if long is None else long  # the estimates are right until rounds show otherwise
                self.realised_long[key] = long + self.realised_decay * (ratio - long)
                self.realised_fresh.add(key)
            self.expected = None
        if self.probing_first:
            self.first_probe_s, self.probing_first = round_s, False
        else:
            self.round_s = round_s if self.round_s <= 0.0 else self.round_s + self.decay * (round_s - self.round_s)
        if k > 0:
            self.observe_acceptance(verified_with, accepted, methods)
            # like each method's below: the first drafting round pays one-time costs and a catch-up is charged apart.
            # Taken whole, trace D's first `coupled-cheap` round (the warm-up's: the 0.5B's deferred prefill, its
            # int8 weights quantized, its head built) priced a draft position at 0.29 s against a ~56 ms plain step,
            # and it never drafted again (session 40)
            if POOLED in self.cost_warmed:
                steady_draft_s = max(draft_s - catch_up_s, 0.0)
                self.draft_s_per_token += self.decay * (steady_draft_s / k - self.draft_s_per_token)
            else:
                self.cost_warmed.add(POOLED)
            for method, seconds in (draft_s_by_method or {}).items():
                if method not in self.cost_warmed:  # a method's first call pays one-time costs (compiles, buffers)
                    self.cost_warmed.add(method)
                    continue
                old = self.draft_s_by_method.get(method)
                self.draft_s_by_method[method] = seconds / k if old is None else old + self.decay * (seconds / k - old)
        # clamped: one round disturbed by a collection or a page fault must not swing the estimate
        key = (regime, self.bucket(rows), k + 1)
        priced = k > 0 and self._token_priced(key[1], regime)
        if priced and tokens is None:
            return  # a round of another shape (combination's candidate rows, run.py) says nothing of these prices
        whole = self.cost_for(regime).cost(rows, k + 1, context)
        profiled = _round_cost(self.cost_for(regime), rows, k, tokens, context) if priced else whole
        ratio = min(max((round_s - draft_s) / max(profiled, 1e-9), MIN_SCALE), MAX_SCALE)
        keyed = self._calibration_regime(regime, methods, rows) if k > 0 else None
        pooled = key
        for key in [key] + ([(keyed, key[1], key[2])] if keyed is not None else []):  # pooled, and its methods'
            self.seen_at[key] = len(self.history)
            if priced:
                self._observe_tokens(key, tokens, rows, k, profiled / max(whole, 1e-12))
            previous = self.scale.get(key)
            if previous is None and priced and any(r == key[0] and b == key[1] for (r, b, _) in self.scale):
                # a width first run in a token-priced bucket where others ran starts from their line: its factor is
                # the same drift, and one disturbed round must not set it. Trace D, session 61: a first k = 3 round
                # that took 147 ms against ~65 ms set width 4 at 1.63x while the others stood at 1.0-1.2x, and one
                # paired `specactor` run never ran k = 3 again (279 of its 4-row rounds at k = 2)
                start = self._line_factor(key[0], key[1], key[2])
                self.scale[key] = start + self.decay * (ratio - start)
            else:
                self.scale[key] = ratio if previous is None else previous + self.decay * (ratio - previous)
            self._pull_stale(key, previous)
            if key is not pooled:  # the method set's factor relative to the pooled one, long-run
                relative = self.scale[key] / self.scale[pooled]
                long = self.scale_long.get(key)
                self.scale_long[key] = relative if long is None else long + self.realised_decay * (relative - long)
                self.scale_fresh.add(key)

    def _observe_tokens(self, key: tuple[str, int, int], tokens: int, rows: int, k: int, share: float) -> None:
        """Fold a token-priced round's real tokens into `row_tokens` and their packed cost's share of the whole round
        into `row_cost_share`: the running mean of the width's first 1 / decay rounds, then an EMA (one early round,
        its drafts all kept, must not hold a width's price for the dozens of rounds a rarely run width takes to forget
        it)."""
        rounds = self.row_rounds[key] = self.row_rounds.get(key, 0) + 1
        weight = max(1.0 / rounds, self.decay)
        per_row = min(max(tokens / max(rows, 1), 1.0), k + 1.0)
        share = min(max(share, 0.0), 1.0)
        for table, value in ((self.row_tokens, per_row), (self.row_cost_share, share)):
            old = table.get(key)
            table[key] = value if old is None else old + weight * (value - old)

    def _pull_stale(self, observed: tuple[str, int, int], previous: float | None = None) -> None:
        """Widths of the same regime and bucket not observed for `stale_rounds` move toward the factor the widths
        observed since put them at (`_line_factor`), `decay x neighbour_share^|width difference|` of the way: what a
        round costs against the profile drifts (the machine's load, the caches, the host work) for every width, and a
        width that stopped running would otherwise keep the factor of whatever round it last ran in. Trace D: width 3
        (k = 2) was observed once, in round 38, at 0.745x the profile; widths 1, 4 and 5 ran at 0.55-0.57x all run
        long, so k = 2 looked a third dearer than it was and `specactor` never left k = 3 where the feature drafter
        alone moved between 2 and 3 with its acceptance. Toward the line, not toward the observed width's factor:
        plain rounds carry a fixed share that wider ones do not (session 50, trace D: plain 4-row rounds at ~1.7x the
        profile, k = 3-4 at ~1.0x), and pulled to the wider widths' factor, plain decoding was expected at 43-47
        tokens/s where it ran at 32 (session 49) and at 40-45 where it ran at 33 (session 50).

        Where the engine trims drafts (`trimmed_rows`), a stale width wider than every fresh one is not pulled to the
        line: the line through narrow, untrimmed widths prices trimmed wide rounds far above what they cost (session
        58). It follows the widest fresh width's drift instead, by the same factor (`previous`: that width's factor
        before this round), so the ratio it last ran at stands while the machine's state moves every width: kept
        still, widths 4-5 last run in a slow spell (1.31-1.33x the profile) stayed there once narrow rounds were
        back at 1.13-1.18x, and a paired repeat held k = 2 (session 58). Where the bucket's rounds are priced by the
        tokens they verify (`_token_priced`, session 61) the factors carry no trimming, and stale widths are pulled to
        the line as elsewhere: following the drift kept the ratio of a width's last round for good, and one slow k = 3
        round (1.63x, the others at 1.0-1.2x) rose with a slow spell of k = 2 rounds to 1.85x (trace D, session 61)."""
        regime, bucket, width = observed
        now = len(self.history)
        # in a token-priced bucket (`_token_priced`) the factors carry no trimming: the line is right there too
        trimmed = bucket <= self.trimmed_rows and not self._token_priced(bucket, regime)
        fresh = [w for (r, b, w) in self.scale if r == regime and b == bucket
                 and now - self.seen_at.get((r, b, w), -1) <= self.stale_rounds] if trimmed else []
        widest_fresh = max(fresh + [width])
        drift = self.scale[observed] / previous if previous and width == widest_fresh else 1.0
        for other in self.scale:  # values change, keys do not
            if other[0] == regime and other[1] == bucket and other[2] != width and \
                    now - self.seen_at.get(other, -1) > self.stale_rounds:
                if trimmed and other[2] > widest_fresh:
                    self.scale[other] = min(max(self.scale[other] * drift, MIN_SCALE), MAX_SCALE)
                    continue
                share = self.decay * self.neighbour_share ** abs(other[2] - width)
                self.scale[other] += share * (self._line_factor(regime, bucket, other[2]) - self.scale[other])


def _has_packed(cost: Any) -> bool:
    """The profile (`CostTable` or `CostProfile`) measured packed rounds."""
    return any(t.packed for t in getattr(cost, "tables", (cost,)))


def _round_cost(cost: Any, rows: int, k: int, tokens: float, context: int | None) -> float:
    """The profile's seconds of a round of `rows` rows verifying k drafts with `tokens` real tokens in all: the
    whole width's round when none is cut (the verifier then runs a plain forward), else the packed rounds around
    `tokens` (fractional: an estimate), interpolated."""
    if tokens >= rows * (k + 1) - 1e-9:
        return cost.cost(rows, k + 1, context)
    tokens = max(tokens, float(rows))
    lo = int(math.floor(tokens))
    low = cost.packed_cost(rows, lo, context)
    if tokens == lo:
        return low
    return low + (cost.packed_cost(rows, lo + 1, context) - low) * (tokens - lo)


@functools.lru_cache(maxsize=1024)
def _nearest_bucket(batch_sizes: tuple[int, ...], rows: int) -> int:
    return min(batch_sizes, key=lambda b: (abs(math.log(b) - math.log(max(rows, 1))), b))


def _models_of(option: Sequence[str | None]) -> frozenset[str]:
    """The draft methods an assignment uses (rows that draft nothing left out)."""
    return frozenset(m for m in option if m is not None)
