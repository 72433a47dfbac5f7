"""The engine's own decode loop on a simulated clock, against a run's acceptance facts.

`replay(system, facts, costs)` builds the real `Engine` with the system's rollout config (mode, verify
length, draft sources, batch size) and runs the real `Run`: admission and continuous batching, the
verify-length policy, Fastest-of-N, shadow drafts, combination, stop rules and statistics. Two parts
are stood in for:

- the target (`ReplayRunner`): its forward returns logits that put all mass on the recorded output
  token at every position, so the engine accepts exactly the drafts that equal the outputs and emits
  the outputs (checked); it charges the cost model's seconds for the forward;
- the drafters (`ReplayDrafter`): each proposes, at a row's output position p with room for k drafts,
  the facts' min(accepted[p], k) output tokens followed by a wrong one, and charges the cost model's
  drafting seconds.

The clock (`SimClock`, installed as the engine's clock: specactor_engine/clock.py) is modelled seconds
plus the host time the replay really spends in the engine's code, scaled by `host_scale` (1: the host
work costs here what it costs in the engine; 0: a free host), and paused inside the stand-ins. That host
work includes the acceptance rule's sampling over the stand-in's full-vocabulary logits, unless the cost
model's verify figure already holds it (`sampling_in_profile`; `calibrate_sampling` decides from a
directory's `ar` run, docs/simulate.md section 2). A draft model's catch-up forward (rows it has not fed
since rounds other methods drafted, or a deferred prefill) is charged at its prefill rate. Not replayed:
drafter worker processes (dynamic decoupling; the replay runs their modes in process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from benchmark.engine_systems import ALL_AT_ONCE, ENGINE_VARIANTS, EngineVariant
from benchmark.simulate.costs import CostModel
from benchmark.simulate.facts import ORACLE, DrafterFacts, Facts
from benchmark.traces import Trace, sampling_config
from specactor_engine import clock as engine_clock
from specactor_engine.config import RolloutConfig
from specactor_engine.drafters import DraftRequest, Drafter
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal, EngineStats, Request

NEVER = -1e9  # logit of every token but the recorded one


class SimClock:
    """Modelled seconds plus the host seconds spent outside paused blocks (times `host_scale`)."""

    def __init__(self, host_scale: float = 1.0) -> None:
        self.host_scale = host_scale
        self.modelled = 0.0
        self.host = 0.0
        self._depth = 0
        self._mark = time.perf_counter()

    def now(self) -> float:
        running = time.perf_counter() - self._mark if self._depth == 0 else 0.0
        return self.modelled + (self.host + running) * self.host_scale

    def advance(self, seconds: float) -> None:
        self.modelled += seconds

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        if self._depth == 0:
            self.host += time.perf_counter() - self._mark
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._mark = time.perf_counter()


class _Cache:
    """The bits of a KV cache the engine touches on the target: lengths, prefix copies."""

    def __init__(self, num_slots: int, max_len: int, owner: dict[int, int]) -> None:
        self.lengths = torch.zeros(num_slots, dtype=torch.long)
        self.owner = owner

    def copy_prefix(self, src: torch.Tensor, dst: torch.Tensor, counts: torch.Tensor) -> None:
        for s, d, n in zip(src.tolist(), dst.tolist(), counts.tolist()):
            self.owner[d] = self.owner.get(s, s)
            self.lengths[d] = n

    def copy_range(self, src: int, dst: int, start: int, count: int) -> None:
        pass  # positions hold no data here


class ReplayRunner:
    """The target of a replay: logits that reproduce the recorded outputs, at the cost model's price."""

    def __init__(self, truth: dict[int, list[int]], vocab_size: int, costs: CostModel, clock: SimClock) -> None:
        self.truth = truth  # sequence key -> prompt + output token ids
        self.vocab_size = vocab_size
        self.costs = costs
        self.clock = clock
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.owner: dict[int, int] = {}  # scratch slot -> the row whose prefix it holds
        self.cache = _Cache(0, 0, self.owner)
        self.state: SequenceState | None = None  # the run's committed tokens (set before decoding)
        self.prefilled: set[tuple[int, ...]] = set()  # prompts prefilled in the current admission

    @property
    def lengths(self) -> torch.Tensor:
        return self.cache.lengths

    def allocate(self, num_slots: int, max_len: int) -> None:
        self.owner.clear()
        self.cache = _Cache(num_slots, max_len, self.owner)

    def set_lengths(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        self.cache.lengths[slots] = lengths

    def commit(self, slots: torch.Tensor, num_new: torch.Tensor) -> None:
        self.cache.lengths[slots] += num_new

    def forward(self, input_ids: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor | None = None,
                logits_at: str = "all", embeds: torch.Tensor | None = None, return_features: bool = False
                ) -> torch.Tensor:
        assert self.state is not None, "ReplayRunner.state is set by replay() before decoding"
        with self.clock.paused():
            rows, width = input_ids.shape
            counts = num_tokens if num_tokens is not None else torch.full((rows,), width)
            start = self.cache.lengths[slots]
            keys = [int(self.state.seq_keys[self.owner.get(s, s)]) for s in slots.tolist()]
            if logits_at == "last":  # prefill: a forward per prompt (Run._prefill), the next token's logits
                # each sample is its own Request here (see replay()), so an admission prefills a group's prompt once
                # per sample where the engine would once per group: a prompt is charged once per admission (the
                # prefill forwards of one admission come with no verify forward between them)
                distinct = {tuple(input_ids[r, : int(counts[r])].tolist()) for r in range(rows)} - self.prefilled
                self.prefilled |= distinct
                self.clock.advance(self.costs.prefill(sum(len(p) for p in distinct)))
                wanted = [self._token(key, int(s + n)) for key, s, n in zip(keys, start.tolist(), counts.tolist())]
                logits = torch.full((rows, self.vocab_size), NEVER)
                logits[torch.arange(rows), torch.tensor(wanted)] = 0.0
                return logits
            self.prefilled.clear()  # a verify round: the next prefill is another admission's
            context = int(start.max())
            self.clock.advance(self.costs.verify(rows, width, context))
            logits = torch.full((rows, width, self.vocab_size), NEVER)
            for r, (key, s) in enumerate(zip(keys, start.tolist())):
                wanted = [self._token(key, s + j + 1) for j in range(width)]
                logits[r, torch.arange(width), torch.tensor(wanted)] = 0.0
            return logits

    def forward_packed(self, input_ids: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """A ragged round (the engine's packed verify) priced as its padded block: the replay's cost model is per
        width, as the startup profile it comes from is."""
        return self.forward(input_ids, slots, num_tokens)

    def _token(self, key: int, position: int) -> int:
        tokens = self.truth[key]
        return tokens[position] if position < len(tokens) else 0


class ReplayDrafter(Drafter):
    """A draft source replaying its facts: the accepted drafts, then a wrong one, at the cost model's price."""

    def __init__(self, source: str, facts: DrafterFacts, index: dict[int, int], outputs: list[list[int]],
                 costs: CostModel, clock: SimClock, vocab_size: int) -> None:
        self.source = source
        self.facts = facts
        self.name = facts.name
        self.model_free = facts.model_free
        self.defers_prefill = facts.defers_prefill
        self.cost_share = facts.cost_share  # the real drafter's size-based prior, as the engine set it
        self.index = index  # sequence key -> sequence index in the facts
        self.outputs = outputs
        self.costs = costs
        self.clock = clock
        self.vocab_size = vocab_size
        self.fed: dict[int, int] = {}  # a draft model's KV length per slot (what a catch-up must feed)

    def add_rows(self, state: SequenceState, slots: torch.Tensor, prefill: bool = True) -> None:
        if self.model_free:
            return
        with self.clock.paused():
            for slot in slots.tolist():
                self.fed[slot] = int(state.prompt_lengths[slot]) if prefill else 0
            if prefill:
                prompts = {tuple(state.tokens[s, : int(state.prompt_lengths[s])].tolist()) for s in slots.tolist()}
                tokens = sum(len(p) for p in prompts)
                seconds = self.costs.draft_prefill(self.source, tokens)
                self.clock.advance(seconds)
                self.observe_feed(seconds, tokens)

    def behind(self, state: SequenceState, slots: torch.Tensor) -> torch.Tensor:
        if self.model_free:
            return super().behind(state, slots)
        return torch.tensor([max(int(state.lengths[s]) - self.fed.get(s, 0), 0) for s in slots.tolist()],
                            dtype=torch.long)

    def observe_commit(self, state: SequenceState, slots: torch.Tensor) -> None:
        with self.clock.paused():
            self.clock.advance(self.costs.draft_commit(self.source, len(slots)))

    def _catch_up(self, state: SequenceState, slots: list[int], k: int) -> float:
        """A draft model's rows that fell behind (rounds drafted by another method, a deferred prefill) are fed
        up to their last k + 1 committed tokens first, as the engine's drafters do: seconds of that forward."""
        behind = 0
        for slot in slots:
            committed = int(state.lengths[slot])
            behind += max(committed - self.fed.get(slot, 0) - (k + 1), 0)
            self.fed[slot] = committed
        if not behind:
            return 0.0
        seconds = self.costs.draft_prefill(self.source, behind)
        self.observe_feed(seconds, behind)
        return seconds

    def propose(self, state: SequenceState, request: DraftRequest) -> DraftProposal:
        with self.clock.paused():
            self.catch_up_s = 0.0
            caps = request.max_draft_tokens
            k = int(caps.max()) if len(caps) else 0
            tokens = torch.zeros(len(caps), k, dtype=torch.long)
            supplied = torch.zeros(len(caps), dtype=torch.long)
            positions = state.output_positions(request.slots).tolist()
            keys = state.seq_keys[request.slots].tolist()
            for row, (key, p, cap) in enumerate(zip(keys, positions, caps.tolist())):
                if cap <= 0:
                    continue
                i = self.index[int(key)]
                out = self.outputs[i]
                known = p < len(self.facts.accepted[i])
                accepted = min(self.facts.accepted[i][p] if known else 0, cap)
                offered = min(self.facts.supplied[i][p] if known else 0, cap) if self.model_free else cap
                offered = max(offered, accepted)
                row_tokens = out[p: p + accepted]
                if offered > accepted:  # the first draft that differs from the output, then filler
                    miss = out[p + accepted] if p + accepted < len(out) else 0
                    row_tokens = row_tokens + [(miss + 1) % self.vocab_size] * (offered - accepted)
                if row_tokens:
                    tokens[row, : len(row_tokens)] = torch.tensor(row_tokens)
                supplied[row] = offered
            rows = int((caps > 0).sum())
            if rows and k:
                if not self.model_free:
                    self.catch_up_s = self._catch_up(state, request.slots[caps > 0].tolist(), k)
                self.clock.advance(self.catch_up_s + self.costs.draft(self.source, rows, k))
        return DraftProposal(token_ids=tokens, num_tokens=supplied)


class _Tokenizer:
    """What the engine asks of a tokenizer when prompts come as token ids: length, EOS, decode."""

    chat_template = None

    def __init__(self, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_ids[0] if eos_ids else None

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def _stand_in_target(vocab_size: int, eos_ids: list[int]) -> torch.nn.Module:
    """A one-layer, 8-wide model with the target's vocabulary: the engine builds its runner from it, and
    the replay swaps that runner for a ReplayRunner."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, eos_token_id=eos_ids or None)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos_ids or None
    return model.eval()


def variant(system: str) -> EngineVariant:
    for v in ENGINE_VARIANTS:
        if v.name == system:
            return v
    raise ValueError(f"unknown system {system!r}; the replay knows {', '.join(v.name for v in ENGINE_VARIANTS)}")


def sources_of(system: str, facts: Facts | None = None) -> list[str]:
    """The draft sources a system drafts with (those the facts hold, when given)."""
    v = variant(system)
    sources = [ORACLE] if v.needs_reference else list(v.drafters)
    return [s for s in sources if facts is None or s in facts.drafters]


@dataclass
class Replayed:
    """A replay's figures, named like the benchmark's."""

    system: str
    makespan_s: float
    modelled_s: float
    host_s: float
    rounds: int
    mean_accept_len: float
    output_tokens: int
    identical: bool
    stats: dict[str, Any]
    sampling_s: float = 0.0  # wall seconds the acceptance rule's sampling took (charged or not: sampling_in_profile)


@contextlib.contextmanager
def _timed_sampling(clock: SimClock, paused: bool, spent: list[float]) -> Iterator[None]:
    """Time the acceptance rule's sampling (`spent[0]`), with the clock paused when the cost model's verify
    figure already holds it."""
    import specactor_engine.verifier as verifier

    original = verifier.sample_tokens

    def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
        with clock.paused() if paused else contextlib.nullcontext():
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - started

    verifier.sample_tokens = timed
    try:
        yield
    finally:
        verifier.sample_tokens = original


_warmed: set[tuple[int, int, int]] = set()


def _warm_up(sampling: Any, vocab_size: int, rows: int, max_k: int) -> None:
    """Run the sampling kernels once per shape before the clock starts, as a benchmark's warm-up does: the
    first call compiles the fused Gumbel-max kernel (seconds), which would land in the first rounds' host
    time and set the verify-length policy's calibration off."""
    from specactor_engine.sampling import SamplingParams, sample_tokens, token_logprobs

    params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p)
    for r in sorted({1, rows}):
        for width in range(1, max_k + 2):
            if (vocab_size, r, width) in _warmed:
                continue
            logits = torch.zeros(r, width, vocab_size)
            positions = torch.arange(width)[None, :].expand(r, width)
            out = sample_tokens(logits, params, torch.arange(r), positions)
            token_logprobs(logits, out, sampling.temperature)
            _warmed.add((vocab_size, r, width))


def replay(system: str, facts: Facts, costs: CostModel, max_batch_size: int | None = None,
           host_scale: float = 1.0, compact_vocab: bool = False, truth: list[list[int]] | None = None,
           sampling_in_profile: bool = False, number: int = 0) -> Replayed:
    """Replay `system` on the facts' sequences under `costs` (module docstring); number: which replay of the system
    this is (it seeds the cost model's disturbance, if any: `Disturbance.restart`).

    sampling_in_profile: the cost model's verify figure stands for the forward and its sampling (the clock
    pauses while the replay samples); False: for the forward alone (the sampling is run as host work).
    `calibrate_sampling` tells which reading matches a machine's measured forwards.

    compact_vocab: logits over only the ids the facts use (Facts.compact): much less host work per round at
    many rows, so the host time measured leaves out the log-probabilities over the full vocabulary a real
    run computes (validation keeps the full vocabulary; projections to a GPU, where that work is the
    device's, use the compact one)."""
    if truth is not None and len(truth) != len(facts.sequences):
        raise ValueError(f"{system}: {len(truth)} outputs given for {len(facts.sequences)} sequences")
    if compact_vocab:
        facts, truth = facts.compact(extra=truth)
    from specactor_engine.engine import Engine
    from specactor_engine.run import Run, SampleRecord

    v = variant(system)
    if costs.disturbance is not None:
        costs.disturbance.restart(number)
    trace = Trace.from_dict(facts.trace)
    sources = sources_of(system, facts)
    if v.mode != "ar" and not sources:
        raise ValueError(f"{system}: the facts hold none of its draft sources {list(v.drafters) or [ORACLE]} "
                         f"(they hold {sorted(facts.drafters)}); gather them with this system")
    batch = max_batch_size or trace.max_batch_size or ALL_AT_ONCE
    clock = SimClock(host_scale)
    index = {s.key: i for i, s in enumerate(facts.sequences)}
    outputs = [s.output_ids for s in facts.sequences]
    drafters = [ReplayDrafter(source, facts.drafters[source], index, outputs, costs, clock, facts.vocab_size)
                for source in sources]
    mode = "coupled" if v.mode == "decoupled" else v.mode  # drafter workers are not replayed
    rollout = RolloutConfig(mode=mode, num_draft_tokens=facts.max_k, verify_length=v.verify_length,
                            max_batch_size=batch)
    engine = Engine(_stand_in_target(facts.vocab_size, facts.eos_ids), _Tokenizer(facts.vocab_size, facts.eos_ids),
                    rollout, max_model_len=facts.max_model_len, chat_template=False, cpu_kernels=False,
                    drafters=drafters, cost_table=costs.profile)
    # the target emits `truth` (default: the `ar` outputs the facts hold); the drafters draft from the facts'
    # outputs, so where a system's own outputs part from `ar`'s (bf16 near-ties) its drafts stop matching
    emitted = truth if truth is not None else outputs
    runner = ReplayRunner({s.key: s.prompt_ids + list(t) for s, t in zip(facts.sequences, emitted)},
                          facts.vocab_size, costs, clock)
    engine.runner = runner  # type: ignore[assignment]
    sampling = sampling_config(trace)  # the real sampling runs on the stand-in's logits: host work as in a run
    # one Request object per sample: the engine shares a prefill within a Request, and the replayed target
    # must see each sample's key to give its own first token (ReplayRunner charges distinct prompts once)
    sequences = [SampleRecord(Request(s.id, prompt_token_ids=s.prompt_ids), s.sample, s.prompt_ids, s.key)
                 for s in facts.sequences]
    stats = EngineStats(mode=engine.mode.name, drafted_per_position=[0] * engine.num_draft_tokens,
                        accepted_per_position=[0] * engine.num_draft_tokens)
    longest = max(len(s.prompt_ids) + len(s.output_ids) for s in facts.sequences)
    if engine.verify_length == "dynamic":
        table = costs.profile
        if table.batch_sizes[-1] < min(len(sequences), batch) or (table.max_context and table.max_context < longest):
            raise ValueError(f"the cost model's verify profile covers {table.batch_sizes[-1]} rows and context "
                             f"{table.max_context}; this replay needs {min(len(sequences), batch)} rows and {longest}")
        engine._ensure_length_policy(min(len(sequences), batch), longest)
    _warm_up(sampling, facts.vocab_size, min(len(sequences), batch), engine.num_draft_tokens)
    spent = [0.0]
    with engine_clock.replaced(clock.now), _timed_sampling(clock, sampling_in_profile, spent):
        started = clock.now()
        run = Run(engine, sampling, stats, engine._reserve(sequences, sampling), started)
        runner.state = run.state
        run.decode(sequences)
        stats.total_s = clock.now() - started
    identical = all(seq.output_ids == list(t) for seq, t in zip(sequences, emitted))
    stats.num_sequences = len(sequences)
    stats.output_tokens = sum(len(seq.output_ids) for seq in sequences)
    return Replayed(system, stats.total_s, clock.modelled, clock.host * host_scale, stats.verify_rounds,
                    stats.to_dict().get("mean_acceptance_length", 0.0), stats.output_tokens, identical,
                    stats.to_dict(), spent[0])


def calibrate_sampling(facts: Facts, costs: CostModel, measured_forward_s: float) -> tuple[bool, str]:
    """Whether the cost model's verify figure holds the sampling on this machine: an `ar` replay's summed
    verify charges P and its sampling time S against the forward seconds an `ar` run measured (its
    `verify_s`, the forward alone). The engine's profile times a forward and its sampling in isolation; on
    the bf16 traces of this machine the runs' forwards alone come out at that figure (P, so the sampling is
    extra), on the fp32 SmolLM2 trace at the figure less the sampling (P - S). Returns the reading and why."""
    # verify_s: the profile's charges alone (a disturbance is what the runs add to the profile, not what it measures)
    result = replay("ar", facts, dataclasses.replace(costs, disturbance=None), host_scale=0.0)
    charged, sampled = result.stats["verify_s"], result.sampling_s
    holds = abs(measured_forward_s - (charged - sampled)) < abs(measured_forward_s - charged)
    return holds, (f"`ar`: measured forwards {measured_forward_s:.1f} s; profile {charged:.1f} s, less its "
                   f"sampling {charged - sampled:.1f} s: the profile {'holds' if holds else 'leaves out'} the sampling")
