"""Dynamic decoupling: per phase of a rollout, decide whether running the drafter workers pays.

On a small machine a drafter worker takes cores from the verifier: with the workers running the
verifier decodes on fewer threads, with them paused it decodes plainly on all of them (exactly
`ar`). Which is faster depends on the batch (compute-bound verifies suffer most from losing a
core), on acceptance and on the context length, all of which change as the rollout goes on.
`DecouplingPolicy` measures instead of guessing: each cycle it runs plain decoding (`solo`) for
`explore_rounds` rounds, then the workers' arm for as long (unless it cannot win, below), then the
faster one (tokens per second, measured) for an exploit period. The first `warmup_rounds` of an
explored arm are not measured: a drafter resumed after a pause first catches up on the tokens
committed meanwhile. Exploring the losing arm costs time, so each time the same arm wins again its
exploit period doubles (up to `max_exploit_rounds`); a change of winner resets it. Before exploring
the workers' arm the caller may give the rate it expects of that arm at best (the engine: the best
verify length for the acceptance seen so far, at the verify cost on the verifier's threads, scaled
by what that arm's rounds took once it has run); when even that is below the measured plain rate
the exploration is skipped, which is what keeps a compute-bound full batch at `ar` speed; the caller may also
give the rate the paused arm is expected to keep up with its in-process drafters, and the bound must clear that
too (a paused arm measured while its in-process draft model still caught up looks no faster than plain decoding).
A pure policy over observations, unit-tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECOUPLED = "decoupled"
SOLO = "solo"  # workers paused, the verifier decodes plainly on every thread


@dataclass
class DecouplingPolicy:
    explore_rounds: int = 12
    exploit_rounds: int = 64
    warmup_rounds: int = 3  # first rounds of an explored arm not measured (a resumed drafter catches up)
    margin: float = 0.03  # prefer decoupled only when faster by this much (it costs a process)
    max_exploit_rounds: int = 512
    arm: str = SOLO
    rounds_in_arm: int = 0
    exploring: bool = True
    measured: dict[str, tuple[int, float]] = field(default_factory=dict)  # arm -> (tokens, seconds) this cycle
    history: list[str] = field(default_factory=list)
    exploit_limit: int = 0  # the current exploit period (0: not set yet, starts at exploit_rounds)
    last_winner: str | None = None
    skipped: int = 0  # explorations of the workers' arm skipped because its optimistic rate could not win

    def choose(self, decoupled_bound: float | None = None, solo_expected: float | None = None) -> str:
        """The arm for the next round; decoupled_bound: the workers' arm's optimistic tokens per second now;
        solo_expected: the rate the paused-workers arm is expected to keep up (the engine: its best verify length
        and in-process draft methods, without the one-time catch-ups of a phase's start). Both matter only on the
        rounds where `deciding()`."""
        if self.deciding():
            self._advance(decoupled_bound, solo_expected)
        self.rounds_in_arm += 1
        self.history.append(self.arm)
        return self.arm

    def deciding(self) -> bool:
        """Whether the next `choose` ends the current exploration or exploit period (and reads its arguments)."""
        return self.rounds_in_arm >= (self.explore_rounds if self.exploring else self.exploit_limit)

    def observe(self, arm: str, tokens: int, seconds: float) -> None:
        """One finished round of `arm`: tokens emitted and its wall time (first rounds of an arm
        after a switch included: switching costs are part of the arm)."""
        if self.exploring and self.rounds_in_arm > self.warmup_rounds:
            done, spent = self.measured.get(arm, (0, 0.0))
            self.measured[arm] = (done + tokens, spent + seconds)

    def rate(self, arm: str) -> float | None:
        done, spent = self.measured.get(arm, (0, 0.0))
        return done / spent if spent > 0 else None

    def _advance(self, decoupled_bound: float | None, solo_expected: float | None = None) -> None:
        self.rounds_in_arm = 0
        if not self.exploring:  # an exploit period ended: measure both arms again, plain decoding first
            self.exploring, self.measured = True, {}
            self.arm = SOLO
            return
        solo = self.rate(SOLO)
        if self.arm == SOLO and DECOUPLED not in self.measured:
            # the bar the workers' best case must clear: the paused arm's measured rate, or what it is expected to
            # keep up where that is more. Trace D, session 41: the paused arm's first rounds decoded plainly while
            # the in-process 0.5B waited to catch up on the group's prompts, its measured rate was plain decoding's,
            # and the workers (the verifier on one thread of two) held the rows for 80 rounds at ~52 tokens/s where
            # the in-process model went on at ~70
            bar = max((r for r in (solo, solo_expected) if r is not None), default=None)
            if decoupled_bound is not None and bar is not None and decoupled_bound < (1 + self.margin) * bar:
                self.skipped += 1
                self._exploit(SOLO)
            else:
                self.arm = DECOUPLED
            return
        decoupled = self.rate(DECOUPLED)
        better = decoupled is not None and (solo is None or decoupled > (1 + self.margin) * solo)
        self._exploit(DECOUPLED if better else SOLO)

    def _exploit(self, winner: str) -> None:
        self.arm, self.exploring = winner, False
        repeated = winner == self.last_winner
        self.exploit_limit = min(2 * self.exploit_limit, self.max_exploit_rounds) if repeated else self.exploit_rounds
        self.last_winner = winner
