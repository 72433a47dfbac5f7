"""Dynamic decoupling: per phase of a rollout, decide whether running the drafter workers pays.

On a small machine a drafter worker takes cores from the verifier: with the workers running the
verifier decodes on fewer threads, with them paused it decodes plainly on all of them (exactly
`ar`). Which is faster depends on the batch (compute-bound verifies suffer most from losing a
core), on acceptance and on the context length, all of which change as the rollout goes on.
`DecouplingPolicy` measures instead of guessing: it runs each arm for `explore_rounds` rounds,
then the faster one (tokens per second, measured) for `exploit_rounds` rounds, then explores
again. Exploring the losing arm costs time, so each time the same arm wins again its exploit
period doubles (up to `max_exploit_rounds`); a change of winner resets it. The first `warmup_rounds` of an explored arm are not measured: a drafter resumed after a
pause first catches up on the tokens committed meanwhile. A pure policy over observations,
unit-tested on its own.
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
    arm: str = DECOUPLED
    rounds_in_arm: int = 0
    exploring: bool = True
    measured: dict[str, tuple[int, float]] = field(default_factory=dict)  # arm -> (tokens, seconds) this cycle
    history: list[str] = field(default_factory=list)
    exploit_limit: int = 0  # the current exploit period (0: not set yet, starts at exploit_rounds)
    last_winner: str | None = None

    def choose(self) -> str:
        """The arm for the next round."""
        limit = self.explore_rounds if self.exploring else self.exploit_limit
        if self.rounds_in_arm >= limit:
            self._advance()
        self.rounds_in_arm += 1
        self.history.append(self.arm)
        return self.arm

    def observe(self, arm: str, tokens: int, seconds: float) -> None:
        """One finished round of `arm`: tokens emitted and its wall time (first rounds of an arm
        after a switch included: switching costs are part of the arm)."""
        if self.exploring and self.rounds_in_arm > self.warmup_rounds:
            done, spent = self.measured.get(arm, (0, 0.0))
            self.measured[arm] = (done + tokens, spent + seconds)

    def rate(self, arm: str) -> float | None:
        done, spent = self.measured.get(arm, (0, 0.0))
        return done / spent if spent > 0 else None

    def _advance(self) -> None:
        self.rounds_in_arm = 0
        if not self.exploring:  # an exploit period ended: measure both arms again
            self.exploring, self.measured = True, {}
            self.arm = DECOUPLED
            return
        if self.arm == DECOUPLED and SOLO not in self.measured:
            self.arm = SOLO
            return
        decoupled, solo = self.rate(DECOUPLED), self.rate(SOLO)
        better = decoupled is not None and (solo is None or decoupled > (1 + self.margin) * solo)
        self.arm = DECOUPLED if better else SOLO
        self.exploring = False
        repeated = self.arm == self.last_winner
        self.exploit_limit = min(2 * self.exploit_limit, self.max_exploit_rounds) if repeated else self.exploit_rounds
        self.last_winner = self.arm
