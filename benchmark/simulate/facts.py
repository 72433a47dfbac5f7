"""Acceptance facts: for every sequence, output position and drafter, how many drafts would be accepted.

Position-keyed sampling makes the target's token at a position a function of (seed, request, sample,
position) and the committed prefix only, so a run's outputs are what any system emits, and a draft
token is accepted exactly when it equals the output token at its position. Drafted at output
position p (p tokens committed) with room for k drafts, a drafter has min(accepted[p], k) accepted,
where accepted[p] counts the leading drafts of its max_k-token proposal that equal output[p:p+max_k].

Gathering runs the engine's real drafters over the outputs in lockstep: every sequence is a row,
every round each drafter proposes max_k tokens for every row and then every row commits exactly one
output token, so each drafter is asked at every position of every sequence with the prefix committed
(and, for a draft model, its KV and growing vocabulary) as the engine would have them. A model
drafter's k-th draft depends on its own earlier drafts; since a draft only counts when those were
accepted (equal to the output), drafting from the committed prefix is what the engine would do. A
feature-level drafter reads the target's hidden states: one teacher-forced target pass over every
sequence records them first. One approximation (docs/simulate.md): the suffix drafter's corpus holds
the group siblings as far as lockstep has taken them (the engine's siblings run at their own pace). A
draft model's catch-up after rounds it did not draft is no acceptance fact: the replay charges it.

Each drafter's `propose` calls are timed during the pass (rows x k x seconds): the CPU cost model's
drafting costs, measured on the same machine as the profile (costs.py).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from benchmark.interface import RunSpec
from benchmark.traces import build_requests, sampling_config
from specactor_engine.policies.shadow import matched_prefix
from specactor_engine.sampling import SamplingParams, sequence_key
from specactor_engine.tokenize import encode_request

FACTS_FILE = "facts.json"
FACTS_FORMAT = 1
ORACLE = "oracle"
TEACHER_FORCED_ROWS = 4  # rows per teacher-forced target forward (bounds its attention temporaries)


@dataclass
class SequenceFacts:
    """One sampled sequence of the run: its key, prompt and the output every system emits."""

    id: str
    sample: int
    key: int
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass
class DrafterFacts:
    """One draft source over every sequence.

    accepted[i][p], supplied[i][p]: of the max_k drafts asked for at output position p of sequence i
    (p >= 1: the first output token comes from prefill), how many leading ones equal the output, and how
    many were offered (a model-free drafter may find fewer). calls: (rows, k, seconds) of each timed
    `propose`; prefill_s_per_token: seconds per prompt token of its row admission (0: none).
    """

    name: str
    model_free: bool
    defers_prefill: bool
    accepted: list[list[int]]
    supplied: list[list[int]]
    calls: list[tuple[int, int, float]] = field(default_factory=list)
    prefill_s_per_token: float = 0.0
    shape: dict[str, int] | None = None  # a draft model's roofline shape (costs.ModelShape), None: model-free
    timing: list[tuple[int, int, float]] = field(default_factory=list)  # (rows, k, seconds per call): the grid
    commit_timing: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds) of `observe_commit`
    cost_share: float | None = None  # a draft model's size-based prior cost (Drafter.cost_share), None: model-free


@dataclass
class Facts:
    """Everything a replay needs from a run directory, without its models (saved as facts.json)."""

    trace: dict[str, Any]
    max_k: int
    seed: int
    vocab_size: int
    eos_ids: list[int]
    max_model_len: int
    sequences: list[SequenceFacts]
    drafters: dict[str, DrafterFacts]  # draft source (benchmark/engine_systems.py DraftSource) -> facts
    cpu_profile: dict[str, Any] | None = None  # the engine's verify-cost profile of the target on this machine
    target_prefill_s_per_token: float = 0.0  # measured on this machine with the profile
    target_config: dict[str, Any] = field(default_factory=dict)  # the target's Hugging Face config
    machine: dict[str, Any] = field(default_factory=dict)
    format: int = FACTS_FORMAT

    def tiled(self, times: int) -> "Facts":
        """The sequences repeated `times` times as new requests (ids `ID~t`, their own noise keys) with the same
        outputs and acceptance: a trace's recorded acceptance at batch sizes above its sequence count."""
        if times <= 1:
            return self
        sequences = [dataclasses.replace(s, id=f"{s.id}~{t}" if t else s.id,
                                         key=sequence_key(self.seed, f"{s.id}~{t}", s.sample) if t else s.key)
                     for t in range(times) for s in self.sequences]
        drafters = {source: dataclasses.replace(d, accepted=d.accepted * times, supplied=d.supplied * times)
                    for source, d in self.drafters.items()}
        return dataclasses.replace(self, sequences=sequences, drafters=drafters)

    def compact(self, extra: list[list[int]] | None = None) -> tuple["Facts", list[list[int]] | None]:
        """The same facts over a vocabulary of only the ids they (and `extra` token lists) use, plus one spare
        id, and `extra` in it: replays build logits over the vocabulary, which at 128 rows of a 152k
        vocabulary means 400 MB a round."""
        used = {t for s in self.sequences for t in (*s.prompt_ids, *s.output_ids)} | set(self.eos_ids)
        used |= {t for tokens in extra or [] for t in tokens}
        index = {t: i for i, t in enumerate(sorted(used))}
        sequences = [dataclasses.replace(s, prompt_ids=[index[t] for t in s.prompt_ids],
                                         output_ids=[index[t] for t in s.output_ids]) for s in self.sequences]
        facts = dataclasses.replace(self, sequences=sequences, eos_ids=[index[t] for t in self.eos_ids],
                                    vocab_size=len(used) + 1)
        return facts, ([[index[t] for t in tokens] for tokens in extra] if extra is not None else None)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)), encoding="utf-8")
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Facts":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable facts file ({exc}); gather them again with `specactor simulate "
                             "--from DIR --gather`") from None
        if data.get("format") != FACTS_FORMAT:
            raise ValueError(f"{path}: facts format {data.get('format')}, this version reads {FACTS_FORMAT}; gather "
                             "them again with --gather")
        data["sequences"] = [SequenceFacts(**s) for s in data["sequences"]]
        data["drafters"] = {k: DrafterFacts(**{**d, "calls": [tuple(c) for c in d["calls"]],
                                               "timing": [tuple(c) for c in d.get("timing", [])],
                                               "commit_timing": [tuple(c) for c in d.get("commit_timing", [])]})
                            for k, d in data["drafters"].items()}
        return cls(**data)


def oracle_facts(sequences: Sequence[SequenceFacts], max_k: int) -> DrafterFacts:
    """The oracle proposes the outputs themselves: everything left is accepted, at no drafting cost."""
    accepted = [[min(max_k, len(s.output_ids) - p - 1) if p else 0 for p in range(len(s.output_ids))]
                for s in sequences]
    return DrafterFacts(ORACLE, model_free=True, defers_prefill=False, accepted=accepted,
                        supplied=[list(a) for a in accepted])


def load_run_outputs(run_dir: Path, reference: str = "ar") -> tuple[RunSpec, list[dict[str, Any]]]:
    """The spec and outputs of the directory's first `reference` run: runs/<reference>-0.json, its spec from
    runs/<reference>-0.spec.json, or from a paired run's runs/paired-0.spec.json (one [system, spec] pair per
    system of that repeat: `python -m benchmark --paired`)."""
    runs = run_dir / "runs"
    candidates = sorted(runs.glob(f"{reference}-*.spec.json"))
    if candidates:
        spec_path = candidates[0]
        result_path = spec_path.with_name(spec_path.name.replace(".spec.json", ".json"))
        spec = RunSpec.from_dict(json.loads(spec_path.read_text(encoding="utf-8")))
    else:
        result_path = runs / f"{reference}-0.json"
        spec = _paired_spec(runs / "paired-0.spec.json", reference) if result_path.exists() else None
        if spec is None:
            raise FileNotFoundError(f"{runs}: no `{reference}` run (expected {reference}-0.spec.json, or a paired "
                                    f"run's paired-0.spec.json naming it, and {reference}-0.json from `python -m "
                                    f"benchmark ... --out {run_dir}`)")
    result = json.loads(result_path.read_text(encoding="utf-8"))
    return spec, result["sequences"]


def _paired_spec(path: Path, system: str) -> RunSpec | None:
    """`system`'s spec in a paired repeat's spec file (benchmark/paired.py), None when it is not there."""
    if not path.exists():
        return None
    for name, spec in json.loads(path.read_text(encoding="utf-8")):
        if name == system:
            return RunSpec.from_dict(spec)
    return None


def gather(run_dir: Path, sources: Sequence[str], progress: Callable[[str], None] = print) -> Facts:
    """Acceptance facts of `sources` (draft sources of engine_systems.py, "oracle" included) over the
    directory's `ar` outputs, with the drafters' measured costs and the target's CPU verify profile."""
    from benchmark.engine_systems import _drafter_config
    from benchmark.machine import machine_info
    from specactor_engine.config import ModelConfig, RolloutConfig, SpecActorConfig
    from specactor_engine.engine import Engine
    from benchmark.interface import resolve_local
    from specactor_engine.policies.cost_profile import load_or_measure

    spec, outputs = load_run_outputs(run_dir)
    trace, sampling = spec.trace, sampling_config(spec.trace)
    by_id = {(o["id"], o["sample"]): o["token_ids"] for o in outputs}
    configs: dict[str, Any] = {}
    for source in sources:
        if source == ORACLE:
            continue
        if source == "model" and spec.drafter is None or source == "feature" and spec.feature_drafter is None:
            continue  # a system without this source leaves it out (engine_systems.engine_config)
        configs[source] = _drafter_config(source, spec)  # type: ignore[arg-type]
    distinct: list[Any] = []
    for config in configs.values():
        if config not in distinct:
            distinct.append(config)
    # two sources may draft with one model in two set-ups (coupled's bf16 model, specactor's cheap one) under
    # one name; the gathering engine needs distinct names, the facts keep the names the systems report
    names = [c.name for c in distinct]
    gathering = [c if names.index(c.name) == i else c.model_copy(update={"name": f"{c.name}#{i}"})
                 for i, c in enumerate(distinct)]
    target = str(resolve_local(spec.target, spec.dtype))
    rollout = RolloutConfig(mode="coupled", drafters=gathering, verify_length="fixed",
                            num_draft_tokens=spec.num_draft_tokens) if distinct else RolloutConfig(mode="ar")
    config = SpecActorConfig(model=ModelConfig(target=target, dtype=spec.dtype), rollout=rollout, threads=spec.threads)
    progress(f"loading {spec.target} ({spec.dtype}) and {len(distinct)} drafter(s)")
    engine = Engine.from_config(config)
    try:
        sequences = []
        for request in build_requests(trace):  # prompts and noise keys as the engine makes them (engine.py)
            prompt_ids, error = encode_request(request, engine.tokenizer, engine.chat_template)
            if error is not None:
                raise ValueError(f"{run_dir}: {error}")
            for j in range(sampling.n):
                sequences.append(SequenceFacts(request.request_id, j, sequence_key(sampling.seed, request.request_id, j),
                                               list(prompt_ids), list(by_id[(request.request_id, j)])))
        max_k = spec.num_draft_tokens
        # the profile the benchmarked engine itself used (the same key: cached, not measured again)
        longest = min(engine.max_model_len, max(len(s.prompt_ids) for s in sequences) + trace.max_new_tokens)
        rows = min(len(sequences), spec.max_batch_size or len(sequences))
        progress(f"verify-cost profile of the target: rows up to {rows}, widths 1..{max_k + 1}")
        profile = load_or_measure(engine.runner, rows, max_k, max_context=longest)
        prefill_rate = _prefill_rate(engine.runner, sequences[0].prompt_ids)
        params = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p)
        facts_of = _lockstep(engine, sequences, max_k, params, progress)
        progress(f"timing the drafters' calls at rows {_timing_rows(len(sequences), rows)} x k in (1, {max_k})")
        for fact, (timing, commits) in zip(facts_of, _time_calls(engine, sequences, max_k, params, rows)):
            fact.timing, fact.commit_timing = timing, commits
    finally:
        engine.close()
    drafters = {}
    for source, cfg in configs.items():
        drafters[source] = facts_of[distinct.index(cfg)]
        drafters[source].name = cfg.name
    if ORACLE in sources:
        drafters[ORACLE] = oracle_facts(sequences, max_k)
    return Facts(trace.to_dict(), max_k, sampling.seed, engine.vocab_size, list(engine.eos_ids),
                 engine.max_model_len, sequences, drafters, profile.to_dict(), prefill_rate,
                 engine.runner.model.config.to_dict(), machine_info(spec.threads))


def _prefill_rate(runner: Any, prompt: list[int], repeats: int = 2) -> float:
    """Seconds per token of the target's prefill of one prompt (the least disturbed of a few)."""
    runner.allocate(1, len(prompt) + 1)
    slots, tokens = torch.zeros(1, dtype=torch.long), torch.tensor([prompt])
    timings = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            runner.set_lengths(slots, torch.zeros(1, dtype=torch.long))
            started = time.perf_counter()
            runner.forward(tokens, slots, torch.tensor([len(prompt)]), logits_at="last")
            timings.append(time.perf_counter() - started)
    return min(timings[1:]) / len(prompt)


def _shape(drafter: Any) -> dict[str, int] | None:
    """A draft model's roofline shape: its decoder layers, its head over the vocabulary it drafts from (and
    a feature-level drafter's input projection); None for model-free drafters."""
    from benchmark.simulate.shapes import ModelShape

    if drafter.model_free or getattr(drafter, "runner", None) is None:
        return None
    config = drafter.runner.model.config.to_dict()
    vocab = getattr(drafter, "vocab", None)
    if vocab is not None:
        config["vocab_size"] = len(vocab.ids)
    shape = ModelShape.from_config(config)
    fc = getattr(drafter, "fc", None)
    from specactor_engine.model.packed_linear import PackedLinear

    # the input projection: an nn.Linear, or a PackedLinear over its source linears (the CPU kernels' packing)
    sources = fc.modules if isinstance(fc, PackedLinear) else [fc] if fc is not None else []
    extra = sum(p.numel() for m in sources for p in m.parameters())
    return {"params": shape.params + extra, "weight_bytes": shape.weight_bytes + 2 * extra,
            "kv_bytes_per_token": shape.kv_bytes_per_token}


def lockstep_state(engine: Any, sequences: list[SequenceFacts], max_k: int) -> tuple[Any, torch.Tensor, int]:
    """A SequenceState holding every sequence's prompt, one slot each, and the engine's target allocated to match:
    (state, slots, tokens per slot), where a lockstep over the sequences' outputs starts."""
    from specactor_engine.state import SequenceState

    slots = torch.arange(len(sequences))
    max_len = max(len(s.prompt_ids) + len(s.output_ids) for s in sequences) + max_k + 2
    state = SequenceState.allocate(len(sequences), max_len)
    for i, s in enumerate(sequences):
        state.tokens[i, : len(s.prompt_ids)] = torch.tensor(s.prompt_ids)
        state.lengths[i] = state.prompt_lengths[i] = len(s.prompt_ids)
        state.seq_keys[i] = s.key
    engine.runner.allocate(len(sequences), max_len)
    return state, slots, max_len


def _lockstep(engine: Any, sequences: list[SequenceFacts], max_k: int, params: SamplingParams,
              progress: Callable[[str], None]) -> list[DrafterFacts]:
    """Every engine drafter asked for max_k drafts at every position of every sequence (module docstring)."""
    from specactor_engine.drafters import DraftRequest

    n = len(sequences)
    state, slots, max_len = lockstep_state(engine, sequences, max_k)
    drafters = engine.drafters
    if any(d.needs_target for d in drafters):
        progress(f"teacher-forced target pass over {n} sequences (the feature-level drafter reads its hidden states)")
        _teacher_forced(engine.runner, sequences)
    facts = [DrafterFacts(d.name, d.model_free, d.defers_prefill, [[0] * len(s.output_ids) for s in sequences],
                          [[0] * len(s.output_ids) for s in sequences], shape=_shape(d), cost_share=d.cost_share)
             for d in drafters]
    for drafter, fact in zip(drafters, facts):
        drafter.allocate(n, max_len)
        started = time.perf_counter()
        drafter.add_rows(state, slots)
        # rows with one prompt (a GRPO group) share one prefill: the rate is per distinct prompt token
        distinct = {tuple(s.prompt_ids) for s in sequences}
        fact.prefill_s_per_token = (time.perf_counter() - started) / float(sum(len(p) for p in distinct))
    first = torch.tensor([s.output_ids[0] for s in sequences])
    state.append(slots, first[:, None], torch.ones(n, dtype=torch.long))
    for d in drafters:
        d.observe_commit(state, slots)
    lengths = torch.tensor([len(s.output_ids) for s in sequences])
    outputs = [s.output_ids for s in sequences]
    finished: set[int] = set()
    position, last_note = 1, time.perf_counter()
    while True:
        done = [i for i in range(n) if position >= lengths[i] and i not in finished]
        if done:
            for d in drafters:
                d.finish_rows(state, torch.tensor(done))
            finished.update(done)
        active = slots[position < lengths]
        if len(active) == 0:
            break
        caps = (lengths[active] - position - 1).clamp(0, max_k)
        request = DraftRequest(active, caps, params, coupled_noise=True)
        for drafter, fact in zip(drafters, facts):
            started = time.perf_counter()
            proposal = drafter.propose(state, request)
            spent = time.perf_counter() - started
            k = int(caps.max())
            if k:
                fact.calls.append((int((caps > 0).sum()), k, round(spent, 6)))
            tokens, supplied = proposal.token_ids.tolist(), proposal.num_tokens.tolist()
            for row, i in enumerate(active.tolist()):
                got = min(int(supplied[row]), int(caps[row]))
                fact.supplied[i][position] = got
                fact.accepted[i][position] = matched_prefix(tokens[row][:got], outputs[i][position: position + got])
        nxt = torch.tensor([outputs[i][position] for i in active.tolist()])
        state.append(active, nxt[:, None], torch.ones(len(active), dtype=torch.long))
        for d in drafters:
            d.observe_commit(state, active)
        position += 1
        if time.perf_counter() - last_note > 30:
            progress(f"  position {position} of {int(lengths.max())}, {len(active)} rows drafting")
            last_note = time.perf_counter()
    return facts


TIMING_ROUNDS = 6  # rounds per (rows, k) cell of the timing grid; the first is left out (set-up)


def _timing_rows(num_sequences: int, max_rows: int) -> list[int]:
    return sorted({r for r in (1, 4, 16, 64) if r < min(num_sequences, max_rows)} | {min(num_sequences, max_rows)})


def _time_calls(engine: Any, sequences: list[SequenceFacts], max_k: int, params: SamplingParams, max_rows: int
                ) -> list[tuple[list[tuple[int, int, float]], list[tuple[int, float]]]]:
    """Each drafter's `propose` timed at a grid of row counts, at k = 1 and k = max_k: a call costs a
    part paid once (feeding the tokens committed since the last call, reading features, set-up) and a part
    per draft step, which the lockstep's max_k calls alone cannot tell apart. Each cell is a few rounds of
    the lockstep on the first `rows` sequences (median of the rounds after the first). Its `observe_commit`
    after every round (a draft model rolls back its rejected drafts, grows its vocabulary) is timed too:
    host work of every round a replay's stand-in does not do."""
    from specactor_engine.drafters import DraftRequest
    from specactor_engine.state import SequenceState

    out: list[list[tuple[int, int, float]]] = [[] for _ in engine.drafters]
    commits: list[list[tuple[int, float]]] = [[] for _ in engine.drafters]
    usable = [s for s in sequences if len(s.output_ids) > TIMING_ROUNDS + max_k + 1]
    for rows in _timing_rows(len(usable), max_rows):
        part = usable[:rows]
        slots = torch.arange(rows)
        max_len = max(len(s.prompt_ids) + len(s.output_ids) for s in part) + max_k + 2
        for k in (1, max_k):
            state = SequenceState.allocate(rows, max_len)
            for i, s in enumerate(part):
                state.tokens[i, : len(s.prompt_ids)] = torch.tensor(s.prompt_ids)
                state.lengths[i] = state.prompt_lengths[i] = len(s.prompt_ids)
                state.seq_keys[i] = s.key
            for d in engine.drafters:
                d.allocate(rows, max_len)
                d.add_rows(state, slots)
            state.append(slots, torch.tensor([[s.output_ids[0]] for s in part]), torch.ones(rows, dtype=torch.long))
            for d in engine.drafters:
                d.observe_commit(state, slots)
            times: list[list[float]] = [[] for _ in engine.drafters]
            commit_times: list[list[float]] = [[] for _ in engine.drafters]
            request = DraftRequest(slots, torch.full((rows,), k), params, coupled_noise=True)
            for position in range(1, TIMING_ROUNDS + 1):
                for j, d in enumerate(engine.drafters):
                    started = time.perf_counter()
                    d.propose(state, request)
                    times[j].append(time.perf_counter() - started)
                state.append(slots, torch.tensor([[s.output_ids[position]] for s in part]),
                             torch.ones(rows, dtype=torch.long))
                for j, d in enumerate(engine.drafters):
                    started = time.perf_counter()
                    d.observe_commit(state, slots)
                    commit_times[j].append(time.perf_counter() - started)
            for d in engine.drafters:
                d.finish_rows(state, slots)
            for j in range(len(engine.drafters)):
                out[j].append((rows, k, round(statistics.median(times[j][1:]), 6)))
                if k == max_k:
                    commits[j].append((rows, round(statistics.median(commit_times[j][1:]), 6)))
    return list(zip(out, commits))


def _teacher_forced(runner: Any, sequences: list[SequenceFacts]) -> None:
    """Forward every sequence's prompt and output through the target, so its recorded features cover them."""
    with torch.inference_mode():
        for start in range(0, len(sequences), TEACHER_FORCED_ROWS):
            part = list(range(start, min(start + TEACHER_FORCED_ROWS, len(sequences))))
            ids = [sequences[i].prompt_ids + sequences[i].output_ids for i in part]
            width = max(len(t) for t in ids)
            tokens = torch.zeros(len(part), width, dtype=torch.long)
            for row, t in enumerate(ids):
                tokens[row, : len(t)] = torch.tensor(t)
            counts = torch.tensor([len(t) for t in ids])
            slots = torch.tensor(part)
            runner.set_lengths(slots, torch.zeros_like(slots))
            runner.forward(tokens, slots, counts, logits_at="none")
            runner.commit(slots, counts)
