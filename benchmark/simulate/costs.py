"""Cost models of a replay: seconds of the target's forwards and of each drafter's calls.

A replay's clock (replay.py) advances by what a cost model charges for every target forward (a verify
round of `rows` x `width` tokens after `context` committed ones, or a prefill of `tokens` prompt
tokens) and every drafter call (`rows` rows, `k` draft steps), plus the host work the replay really
runs (the engine's own bookkeeping, timed as it runs here). Three models:

- `profile_costs`: the engine's measured CPU profile (policies/cost_profile.py, stored in the facts), the
  target's prefill rate measured with it, and the drafters' calls timed while the facts were gathered.
  On the machine that ran the benchmark this predicts its makespans (validate).
- `table_costs`: a verify-cost table measured on a GPU by `make gpu-check` (bench/gpu/...), with
  roofline drafting and prefill for the parts the table does not cover.
- `roofline_costs`: a GPU described by its memory bandwidth and peak; a forward costs an overhead plus
  the larger of streaming its weights and KV cache and computing its FLOPs, each at an achievable
  share of the datasheet figure (GPUS below, with sources).

The verify costs of a profile or table include the sampling over the logits (the engine's profile times
forward + sampling); the replay runs its own sampling on the host, so it pauses its clock there and
the model's figure stands for both.
"""

from __future__ import annotations

import bisect
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from benchmark.simulate.facts import DrafterFacts, Facts
from benchmark.simulate.shapes import ModelShape
from specactor_engine.policies.verify_length import CostProfile, CostTable

CONTEXT_GRID = (128, 512, 1024, 2048)  # contexts a roofline profile is tabulated at
BATCH_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Gpu:
    """A GPU's datasheet figures and the shares of them a tuned decode step reaches."""

    name: str
    bandwidth_gbs: float  # HBM bandwidth, GB/s
    peak_tflops: float  # dense bf16 tensor-core peak, TFLOP/s
    source: str
    bandwidth_share: float = 0.8  # decode kernels stream weights at ~80% of HBM bandwidth
    compute_share: float = 0.6  # GEMMs of a few hundred rows reach ~60% of the dense peak
    overhead_s: float = 0.002  # per forward: kernel launches of a CUDA-graph-class engine


GPUS: dict[str, Gpu] = {
    "h100": Gpu("H100 SXM5 80GB", 3350.0, 989.0, "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 3.35 TB/s HBM3, "
                "989 TFLOP/s dense BF16)"),
    "h200": Gpu("H200 SXM 141GB", 4800.0, 989.0, "NVIDIA H200 Tensor Core GPU datasheet (4.8 TB/s HBM3e, "
                "989 TFLOP/s dense BF16)"),
}


@dataclass
class Disturbance:
    """What a shared machine does to the verify rounds that a startup profile does not show
    (`specactor simulate --width-factors --jitter --spells`): the policy still reads the profile, the clock charges
    the profile's seconds times

        width_factors[width - 1]  x  lognormal(0, jitter)  x  (spell_scale in a spell, else 1)

    width_factors: each width's steady drift from the profile (the last one carries to wider widths). Trace D on
    session 50's AMD EPYC, paired in its slow memory state: plain 4-row rounds at ~1.7x the profile, k = 1 at ~1.5x,
    k = 3-4 at ~0.9-1.0x. jitter: a round's spread around that. Spells: every `spell_every`-th verify starts
    `spell_rounds` verifies at `spell_scale` x (a slow memory state, another process). The draws are seeded per
    replay (`restart`), so replay i of two systems meets the same noise stream as far as their rounds go alike."""

    width_factors: tuple[float, ...] = ()
    jitter: float = 0.0
    spell_every: int = 0
    spell_rounds: int = 0
    spell_scale: float = 1.0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False, compare=False)
    _calls: int = field(init=False, repr=False, compare=False)  # verifies charged in this replay

    def __post_init__(self) -> None:
        if any(f <= 0 for f in self.width_factors) or self.jitter < 0 or self.spell_scale <= 0 or \
                self.spell_every < 0 or self.spell_rounds < 0:
            raise ValueError(f"{self}: factors and the spell's scale must be positive, jitter and counts not negative")
        self.restart(0)

    def restart(self, replay: int) -> None:
        """A fresh stream for replay number `replay` (of a system)."""
        self._rng = random.Random(f"{self.seed}/{replay}")
        self._calls = 0

    def factor(self, width: int) -> float:
        self._calls += 1
        scale = self.width_factors[min(width, len(self.width_factors)) - 1] if self.width_factors else 1.0
        if self.jitter:
            scale *= self._rng.lognormvariate(0.0, self.jitter)
        if self.spell_every and self._calls % self.spell_every < self.spell_rounds:
            scale *= self.spell_scale
        return scale


@dataclass
class CostModel:
    """verify(rows, width, context), prefill(tokens), draft(source, rows, k), draft_prefill(source, tokens)."""

    name: str
    profile: CostProfile  # the verify costs; also what the replayed engine's verify-length policy reads
    prefill_s_per_token: float
    drafting: dict[str, "DraftCost"]
    notes: list[str] = field(default_factory=list)
    disturbance: Disturbance | None = None  # charged on top of the profile's verify seconds, unseen by the policy

    def verify(self, rows: int, width: int, context: int) -> float:
        seconds = self.profile.cost(rows, width, context)
        return seconds * self.disturbance.factor(width) if self.disturbance is not None else seconds

    def prefill(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def draft(self, source: str, rows: int, k: int) -> float:
        cost = self.drafting.get(source)
        return cost.seconds(rows, k) if cost is not None else 0.0

    def draft_commit(self, source: str, rows: int) -> float:
        """A drafter's bookkeeping after a round's commit (observe_commit), for `rows` rows."""
        cost = self.drafting.get(source)
        return cost.commit(rows) if cost is not None else 0.0

    def draft_prefill(self, source: str, tokens: int) -> float:
        """A draft model's forward over `tokens` prompt or committed tokens (admission, catch-up)."""
        cost = self.drafting.get(source)
        return tokens * cost.prefill_s_per_token if cost is not None else 0.0


@dataclass
class DraftCost:
    """Seconds of one drafter call of `rows` rows and k draft steps: once(rows) + k x step(rows), both
    interpolated linearly over the measured row counts (held beyond them)."""

    rows: tuple[int, ...]
    step_s: tuple[float, ...]
    once_s: tuple[float, ...] = ()
    prefill_s_per_token: float = 0.0  # admission prefill and catch-up forwards, per token
    commit_rows: tuple[int, ...] = ()  # `observe_commit` after a round: seconds at these row counts
    commit_s: tuple[float, ...] = ()

    def commit(self, rows: int) -> float:
        return _interpolate(self.commit_rows, self.commit_s, rows) if self.commit_rows and rows > 0 else 0.0

    def seconds(self, rows: int, k: int) -> float:
        if k <= 0 or rows <= 0 or not self.rows:
            return 0.0
        once = _interpolate(self.rows, self.once_s, rows) if self.once_s else 0.0
        return once + k * _interpolate(self.rows, self.step_s, rows)

    @classmethod
    def from_facts(cls, facts: DrafterFacts) -> "DraftCost":
        """From the facts' timing grid: at each row count, k = 1 and k = max_k give the part paid once per call
        and the part per draft step."""
        grid: dict[int, dict[int, float]] = {}
        for rows, k, seconds in facts.timing:
            grid.setdefault(int(rows), {})[int(k)] = seconds
        steps, onces = [], []
        for r in sorted(grid):
            cells = sorted(grid[r].items())
            if len(cells) == 1:  # max_k = 1: one call shape, all of it per step
                (k, t), = cells
                steps.append(t / k)
                onces.append(0.0)
                continue
            (k1, t1), (k2, t2) = cells[0], cells[-1]
            step = max((t2 - t1) / (k2 - k1), 0.0)
            steps.append(step)
            onces.append(max(t1 - k1 * step, 0.0))
        commits = sorted((int(r), t) for r, t in facts.commit_timing)
        return cls(tuple(sorted(grid)), tuple(steps), tuple(onces), facts.prefill_s_per_token,
                   tuple(r for r, _ in commits), tuple(t for _, t in commits))

    @classmethod
    def roofline(cls, shape: ModelShape, gpu: Gpu, max_rows: int = 256) -> "DraftCost":
        rows = tuple(r for r in BATCH_GRID if r <= max_rows)
        steps = tuple(_forward_s(shape, gpu, r, 1, 256) for r in rows)
        return cls(rows, steps, (), _compute_s(shape, gpu, 1))


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: int) -> float:
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def profile_costs(facts: Facts) -> CostModel:
    """The CPU cost model of the machine the facts were gathered on."""
    if facts.cpu_profile is None:
        raise ValueError("these facts hold no CPU profile (gathered without the target?)")
    profile = CostProfile.from_dict(facts.cpu_profile)
    drafting = {source: DraftCost.from_facts(d) for source, d in facts.drafters.items() if d.timing}
    return CostModel("cpu profile", profile, facts.target_prefill_s_per_token, drafting,
                     [f"verify: the engine's profile on {facts.machine.get('cpu_model', 'this CPU')}; drafting: "
                      "calls timed while gathering the facts; host work: the replay's own, timed here"])


def roofline_profile(shape: ModelShape, gpu: Gpu, max_k: int, max_rows: int = 256) -> CostProfile:
    """A roofline verify profile on the grid the engine's policy reads."""
    rows = tuple(r for r in BATCH_GRID if r < max_rows) + (max_rows,)
    widths = tuple(range(1, max_k + 2))
    tables = tuple(CostTable(rows, widths, tuple(tuple(_forward_s(shape, gpu, r, w, c) for w in widths) for r in rows),
                             c) for c in CONTEXT_GRID)
    return CostProfile(tables)


def shapes(facts: Facts) -> tuple[ModelShape, dict[str, ModelShape]]:
    """The target's roofline shape and every draft model's (model-free sources have none)."""
    drafters = {source: ModelShape(**d.shape) for source, d in facts.drafters.items() if d.shape}
    return ModelShape.from_config(facts.target_config), drafters


def roofline_costs(facts: Facts, gpu: Gpu, max_rows: int = 256) -> CostModel:
    """A GPU's costs from first principles: the target and every draft model by roofline, the model-free
    drafters free (their host work is the replay's own)."""
    target, drafters = shapes(facts)
    profile = roofline_profile(target, gpu, facts.max_k, max_rows)
    drafting = {source: DraftCost.roofline(shape, gpu, max_rows) for source, shape in drafters.items()}
    return CostModel(f"roofline {gpu.name}", profile, _compute_s(target, gpu, 1), drafting,
                     [f"{gpu.name}: {gpu.bandwidth_gbs:.0f} GB/s x {gpu.bandwidth_share}, {gpu.peak_tflops:.0f} TFLOP/s "
                      f"x {gpu.compute_share}, {gpu.overhead_s * 1e3:.1f} ms per forward ({gpu.source})"])


def table_costs(facts: Facts, table_path: Path, gpu: Gpu) -> CostModel:
    """A GPU verify table from `make gpu-check` (a saved CostProfile), roofline for the rest."""
    target, drafters = shapes(facts)
    data = json.loads(table_path.read_text(encoding="utf-8"))
    profile = CostProfile.from_dict(data.get("profile", data))
    drafting = {source: DraftCost.roofline(shape, gpu) for source, shape in drafters.items()}
    return CostModel(f"table {table_path.name}", profile, _compute_s(target, gpu, 1), drafting,
                     [f"verify: measured table {table_path}; drafting and prefill: roofline {gpu.name}"])


def _forward_s(shape: ModelShape, gpu: Gpu, rows: int, width: int, context: int) -> float:
    memory = (shape.weight_bytes + rows * context * shape.kv_bytes_per_token) / (gpu.bandwidth_gbs * 1e9 *
                                                                               gpu.bandwidth_share)
    return gpu.overhead_s + max(memory, _compute_s(shape, gpu, rows * width))


def _compute_s(shape: ModelShape, gpu: Gpu, tokens: int) -> float:
    return 2.0 * shape.params * tokens / (gpu.peak_tflops * 1e12 * gpu.compute_share)

