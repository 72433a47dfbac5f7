"""The systems compared by the benchmark, behind one interface and a registry.

A system is built from a `RunSpec` (this loads its models: load time is measured by the
caller and kept out of the makespan) and then generates a trace's requests. Every system
emits the same thing, a `Generation`, and marks each sequence's finish on a `FinishClock`,
so tail time, identity to `ar` and tokens/s are computed the same way for all.

New systems (`vllm`, `vllm-spec`, `decoupled`, `specactor`, `coupled-suffix`) are one `@register_system` each.
"""

from __future__ import annotations

import dataclasses
import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from benchmark.traces import Trace
from specactor_engine.config import SamplingConfig
from specactor_engine.drafters import DraftRequest, Drafter
from specactor_engine.sampling import sequence_key
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal, Request

ALL_AT_ONCE = 1 << 16  # engine max_batch_size meaning "every sequence in one batch"


@dataclass(frozen=True)
class RunSpec:
    """Everything a worker needs to run one system once (JSON round-trip for the subprocess)."""

    system: str
    trace: Trace
    target: str  # registry name or local HF dir
    drafter: str | None  # draft model (name or dir); None: the n-gram drafter
    dtype: str
    max_batch_size: int | None = None  # None: all sequences at once
    num_draft_tokens: int = 4
    threads: int = 2
    reference_path: str | None = None  # `ar` outputs, for the oracle drafter
    oracle_passes: int = 1  # >1: untimed oracle runs that replace the references with their own outputs
    profile_path: str | None = None  # write a cProfile of the timed run here
    history_path: str | None = None  # trace C: the earlier rollout's outputs, {request_id: [token_ids, ...]}

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "trace": self.trace.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunSpec":
        return cls(**{**data, "trace": Trace.from_dict(data["trace"])})


@dataclass
class SequenceResult:
    """One generated sample, as every system reports it."""

    request_id: str
    sample_index: int
    token_ids: list[int]  # up to and including the stop token, like the engine
    text: str
    finish_reason: str


@dataclass
class Generation:
    sequences: list[SequenceResult]
    engine_stats: dict[str, Any] | None = None  # EngineStats.to_dict() for engine systems


@dataclass
class FinishClock:
    """Seconds from `start()` at which each sequence finished (in finishing order)."""

    started: float = 0.0
    times: list[float] = field(default_factory=list)

    def start(self) -> float:
        self.started = time.perf_counter()
        self.times = []
        return self.started

    def mark(self, count: int = 1) -> None:
        now = time.perf_counter() - self.started
        self.times.extend([now] * count)

    def progress(self, finished: int, total: int) -> None:
        """`Engine.generate` progress callback: (finished sequences, total)."""
        if finished > len(self.times):
            self.mark(finished - len(self.times))


class System(ABC):
    """A way to roll out a trace; the constructor loads the models."""

    needs_reference = False  # drafts from the `ar` run's outputs (the oracles): `ar` runs first

    @abstractmethod
    def __init__(self, spec: RunSpec) -> None: ...

    @abstractmethod
    def generate(self, requests: Sequence[Request], sampling: SamplingConfig, clock: FinishClock) -> Generation:
        """Roll out `sampling.n` samples of every request; mark each finish on `clock`."""

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        """Untimed work on the trace itself before the timed run (default: none)."""

    def set_history(self, requests: Sequence[Request], history: dict[str, list[list[int]]] | None) -> None:
        """Before the timed run: history drafters forget the warm-up and, with `history`
        ({request_id: earlier outputs}), know the earlier rollout of each prompt (default: nothing)."""

    def close(self) -> None:
        """Release what the system holds outside this process (default: nothing)."""

    def external_cpu_s(self) -> float:
        """CPU seconds used so far by processes this system drives (counted as its own, not others')."""
        return 0.0


SYSTEMS: dict[str, Callable[[RunSpec], System]] = {}


def register_system(name: str) -> Callable[[type[System]], type[System]]:
    def wrap(cls: type[System]) -> type[System]:
        SYSTEMS[name] = cls
        return cls

    return wrap


def build_system(spec: RunSpec) -> System:
    if spec.system not in SYSTEMS:
        raise ValueError(f"unknown system {spec.system!r}; known: {', '.join(SYSTEMS)}")
    return SYSTEMS[spec.system](spec)


def system_unavailable(name: str) -> str | None:
    """Why system `name` cannot run here (None: it can); checked before a plan starts."""
    cls = SYSTEMS.get(name)
    if isinstance(cls, type) and issubclass(cls, VLLMSystem):
        return vllm_available()
    return None


def _resolve(name: str, dtype: str) -> Path:
    from specactor_engine.model.registry import resolve_model

    return resolve_model(name, dtype, pull=False)


def load_target(spec: RunSpec) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of the spec's target, in its dtype; never downloads."""
    from transformers import AutoTokenizer

    from specactor_engine.model.runner import load_hf_model

    path = _resolve(spec.target, spec.dtype)
    return load_hf_model(path, spec.dtype), AutoTokenizer.from_pretrained(path)


# ---------------------------------------------------------------------------------------- hf
class _FinishWatcher:
    """A generate() stopping criterion that never stops: it stamps the step each row ends."""

    def __init__(self, stop_ids: Sequence[int], num_rows: int, clock: FinishClock) -> None:
        self.stop_ids = torch.tensor(sorted(stop_ids))
        self.done = torch.zeros(num_rows, dtype=torch.bool)
        self.clock = clock

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        ended = torch.isin(input_ids[:, -1], self.stop_ids) & ~self.done
        if ended.any():
            self.clock.mark(int(ended.sum()))
            self.done |= ended
        return torch.zeros(len(self.done), dtype=torch.bool, device=input_ids.device)

    def finish_rest(self) -> None:
        """Rows that ran to max_new_tokens end with the call."""
        self.clock.mark(int((~self.done).sum()))


@register_system("hf")
class HFGenerate(System):
    """transformers `generate`: rows left-padded, KV cache, batches of `max_batch_size` rows."""

    def __init__(self, spec: RunSpec) -> None:
        from specactor_engine.tokenize import eos_token_ids

        self.model, self.tokenizer = load_target(spec)
        self.tokenizer.padding_side = "left"
        self.stop_ids = eos_token_ids(self.tokenizer, self.model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.stop_ids[0]
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token_id = self.pad_id
        self.batch_size = spec.max_batch_size

    def generate(self, requests: Sequence[Request], sampling: SamplingConfig, clock: FinishClock) -> Generation:
        from specactor_engine.tokenize import encode_request

        prompts = {}
        for request in requests:
            ids, error = encode_request(request, self.tokenizer, chat_template=True)
            if error is not None:
                raise ValueError(error)
            prompts[request.request_id] = ids
        rows = [(r.request_id, j) for r in requests for j in range(sampling.n)]
        torch.manual_seed(sampling.seed)
        size = self.batch_size or len(rows)
        sequences: list[SequenceResult] = []
        for start in range(0, len(rows), size):
            sequences += self._generate_rows(rows[start : start + size], prompts, sampling, clock)
        return Generation(sequences)

    def _generate_rows(self, rows: list[tuple[str, int]], prompts: dict[str, list[int]], sampling: SamplingConfig,
                       clock: FinishClock) -> list[SequenceResult]:
        from transformers import StoppingCriteriaList

        batch = self.tokenizer.pad({"input_ids": [prompts[rid] for rid, _ in rows]}, padding=True,
                                   return_tensors="pt")
        watcher = _FinishWatcher(self.stop_ids, len(rows), clock)
        with torch.inference_mode():
            generated = self.model.generate(**batch, generation_config=self._generation_config(sampling),
                                            stopping_criteria=StoppingCriteriaList([watcher]))
        watcher.finish_rest()
        new_tokens = generated[:, batch["input_ids"].shape[1] :].tolist()  # [R, <=max_new_tokens]
        return [self._result(rid, j, ids) for (rid, j), ids in zip(rows, new_tokens)]

    def _generation_config(self, sampling: SamplingConfig) -> Any:
        from transformers import GenerationConfig

        common = dict(max_new_tokens=sampling.max_new_tokens, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                      use_cache=True)
        if sampling.greedy:
            return GenerationConfig(do_sample=False, **common)
        return GenerationConfig(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k, **common)

    def _result(self, request_id: str, sample_index: int, ids: list[int]) -> SequenceResult:
        """Cut the padded row after its first stop token (kept, as the engine keeps it)."""
        stops = set(self.stop_ids)
        end = next((i + 1 for i, token in enumerate(ids) if token in stops), None)
        kept = ids if end is None else ids[:end]
        return SequenceResult(request_id, sample_index, kept, self.tokenizer.decode(kept, skip_special_tokens=True),
                              "length" if end is None else "stop")


# ---------------------------------------------------------------------------------------- engine
class EngineSystem(System):
    """This project's engine in `mode`, with the drafters `_drafters` builds."""

    mode = "ar"
    verify_length = "fixed"
    cpu_kernels = True  # oneDNN pre-packed linears and the paged attention kernel for the target

    def __init__(self, spec: RunSpec) -> None:
        from specactor_engine.engine import Engine

        model, tokenizer = load_target(spec)
        self.engine = Engine(model, tokenizer, mode=self.mode, num_draft_tokens=spec.num_draft_tokens,
                             max_batch_size=spec.max_batch_size or ALL_AT_ONCE,
                             drafters=self._drafters(spec, model, tokenizer), verify_length=self.verify_length,
                             cpu_kernels=self.cpu_kernels)

    def _drafters(self, spec: RunSpec, model: torch.nn.Module, tokenizer: Any) -> list[Drafter]:
        return []

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        # the KV caches are sized at start-up, as vLLM sizes its own: not part of the makespan
        self.engine.reserve(requests, sampling)

    def set_history(self, requests: Sequence[Request], history: dict[str, list[list[int]]] | None) -> None:
        from specactor_engine.drafters.suffix import SuffixDrafter, SuffixHistory
        from specactor_engine.tokenize import encode_request

        for drafter in self.engine.drafters:
            if not isinstance(drafter, SuffixDrafter):
                continue
            drafter.history = SuffixHistory(drafter.history.max_per_prompt)  # the warm-up is not history
            for request in requests if history else ():
                prompt_ids, _ = encode_request(request, self.engine.tokenizer, self.engine.chat_template)
                for output in history.get(request.request_id, []):
                    drafter.history.add(prompt_ids or [], output)

    def generate(self, requests: Sequence[Request], sampling: SamplingConfig, clock: FinishClock) -> Generation:
        result = self.engine.generate(requests, sampling, progress=clock.progress)
        sequences = [SequenceResult(o.request_id, o.sample_index, o.token_ids, o.text, o.finish_reason)
                     for o in result.outputs]
        return Generation(sequences, result.stats.to_dict())


@register_system("ar")
class AutoregressiveEngine(EngineSystem):
    """The engine without speculation: the speed and identity reference."""

    mode = "ar"


@register_system("ar-torch")
class AutoregressiveTorchOps(AutoregressiveEngine):
    """`ar` with torch's own linear and attention ops (model.cpu_kernels=false): what the kernels buy."""

    cpu_kernels = False


def _drafter_context(spec: RunSpec, model: torch.nn.Module, tokenizer: Any) -> Any:
    from specactor_engine.drafters import DrafterContext

    return DrafterContext(device="cpu", dtype=spec.dtype, target_tokenizer=tokenizer,
                          target_vocab_size=model.config.vocab_size)


@register_system("coupled")
class CoupledEngine(EngineSystem):
    """Draft-then-verify with the trace's draft model (or the n-gram drafter) at a fixed k."""

    mode = "coupled"

    def _drafters(self, spec: RunSpec, model: torch.nn.Module, tokenizer: Any) -> list[Drafter]:
        from specactor_engine.config import ModelDrafterConfig, NgramDrafterConfig
        from specactor_engine.drafters import build_drafter

        context = _drafter_context(spec, model, tokenizer)
        if spec.drafter is None:
            return [build_drafter(NgramDrafterConfig(), context)]
        path = _resolve(spec.drafter, spec.dtype)
        return [build_drafter(ModelDrafterConfig(model=str(path), dtype=spec.dtype), context)]


@register_system("coupled-dynamic")
class CoupledDynamicEngine(CoupledEngine):
    """Coupled, with the verify length chosen per round by the cost model (0..k; 0 = plain decoding).

    The cost profile is measured at load time (or read from the cache), not in the makespan.
    """

    verify_length = "dynamic"

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        self.engine.prepare_length_policy(requests, sampling)
        super().prepare(requests, sampling)


@register_system("coupled-suffix")
class CoupledSuffixEngine(CoupledDynamicEngine):
    """The suffix drafter alone (prompt, group siblings, earlier rollouts), dynamic verify length:
    a single-drafter baseline for `specactor`."""

    def _drafters(self, spec: RunSpec, model: torch.nn.Module, tokenizer: Any) -> list[Drafter]:
        from specactor_engine.config import SuffixDrafterConfig
        from specactor_engine.drafters import build_drafter

        context = _drafter_context(spec, model, tokenizer)
        return [build_drafter(SuffixDrafterConfig(), context)]


@register_system("coupled-ngram")
class CoupledNgramEngine(CoupledDynamicEngine):
    """The n-gram drafter alone, dynamic verify length: a single-drafter baseline for `specactor`
    (on traces without a draft model `coupled-dynamic` is the same system)."""

    def _drafters(self, spec: RunSpec, model: torch.nn.Module, tokenizer: Any) -> list[Drafter]:
        from specactor_engine.config import NgramDrafterConfig
        from specactor_engine.drafters import build_drafter

        context = _drafter_context(spec, model, tokenizer)
        return [build_drafter(NgramDrafterConfig(), context)]


def _start_drafter_worker(spec: RunSpec, vocab_size: int) -> Any:
    """One drafter worker process (1 thread) on the trace's draft model; returns its coordinator once ready."""
    from specactor_engine.decoupled.coordinator import DecoupledCoordinator
    from specactor_engine.decoupled.transport import LocalWorker, WorkerSpec

    assert spec.drafter is not None
    worker = WorkerSpec(str(_resolve(spec.drafter, spec.dtype)), spec.dtype, 1, vocab_size)
    coordinator = DecoupledCoordinator(lambda index: LocalWorker(worker), 1)
    if not coordinator.wait_ready(600):
        coordinator.close()
        raise RuntimeError("the drafter worker did not start")
    return coordinator


@register_system("decoupled")
class DecoupledEngine(EngineSystem):
    """Drafter (the trace's draft model) in a worker process with its own threads; the verifier
    never waits; dynamic verify length and dynamic decoupling. Thread budget: 1 drafter thread,
    the rest verify (all of them in the phases where the drafter is paused)."""

    mode = "decoupled"
    verify_length = "dynamic"

    def __init__(self, spec: RunSpec) -> None:
        from specactor_engine.engine import Engine

        if spec.drafter is None:
            raise RuntimeError("decoupled needs a draft model (this trace has none)")
        model, tokenizer = load_target(spec)
        self.coordinator = _start_drafter_worker(spec, model.config.vocab_size)
        self.engine = Engine(model, tokenizer, mode=self.mode, num_draft_tokens=spec.num_draft_tokens,
                             max_batch_size=spec.max_batch_size or ALL_AT_ONCE, verify_length="dynamic",
                             coordinator=self.coordinator, verifier_threads=max(spec.threads - 1, 1),
                             dynamic_decoupling=True, drafters=self._drafters(spec, model, tokenizer))

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        # the cost profile belongs to start-up, at the verifier's thread count
        previous = torch.get_num_threads()
        torch.set_num_threads(self.engine.verifier_threads or previous)
        try:
            self.engine.prepare_length_policy(requests, sampling)
        finally:
            torch.set_num_threads(previous)
        super().prepare(requests, sampling)

    def external_cpu_s(self) -> float:
        return sum(w.transport.cpu_s() for w in self.coordinator.workers) if self.coordinator is not None else 0.0

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()


COMBINE_BELOW = 8  # the config's default (rollout.combine_below)


@register_system("specactor")
class SpecActorEngine(DecoupledEngine):
    """Mode specactor: per request, Fastest-of-N over the suffix and n-gram drafters (in process)
    and, when the trace has a draft model, a drafter worker streaming its drafts (1 thread, as in
    `decoupled`); dynamic verify length and dynamic decoupling."""

    mode = "specactor"

    def __init__(self, spec: RunSpec) -> None:
        from specactor_engine.engine import Engine

        model, tokenizer = load_target(spec)
        self.coordinator = _start_drafter_worker(spec, model.config.vocab_size) if spec.drafter else None
        decoupled = self.coordinator is not None
        self.engine = Engine(model, tokenizer, mode=self.mode, num_draft_tokens=spec.num_draft_tokens,
                             max_batch_size=spec.max_batch_size or ALL_AT_ONCE, verify_length="dynamic",
                             coordinator=self.coordinator, verifier_threads=max(spec.threads - 1, 1) if decoupled
                             else None, dynamic_decoupling=decoupled, drafters=self._drafters(spec, model, tokenizer),
                             combine_below=COMBINE_BELOW)

    def _drafters(self, spec: RunSpec, model: torch.nn.Module, tokenizer: Any) -> list[Drafter]:
        from specactor_engine.config import NgramDrafterConfig, SuffixDrafterConfig
        from specactor_engine.drafters import build_drafter

        context = _drafter_context(spec, model, tokenizer)
        return [build_drafter(SuffixDrafterConfig(), context), build_drafter(NgramDrafterConfig(), context)]


class OracleDrafter(Drafter):
    """Proposes the reference run's own next tokens, so every draft is accepted.

    references: sequence key (see `sequence_key`) -> that sequence's reference output tokens.
    """

    name = "oracle"
    model_free = True  # a lookup: it may draft past the verify length for the shadow statistics

    def __init__(self, references: dict[int, list[int]]) -> None:
        self.references = references

    def propose(self, state: SequenceState, request: DraftRequest) -> DraftProposal:
        k = int(request.max_draft_tokens.max()) if len(request.slots) else 0
        token_ids = torch.zeros(len(request.slots), k, dtype=torch.long)
        num_tokens = torch.zeros(len(request.slots), dtype=torch.long)
        keys = state.seq_keys[request.slots].tolist()
        positions = state.output_positions(request.slots).tolist()
        for row, (key, position, cap) in enumerate(zip(keys, positions, request.max_draft_tokens.tolist())):
            found = self.references.get(key, [])[position : position + cap]
            token_ids[row, : len(found)] = torch.tensor(found, dtype=torch.long)
            num_tokens[row] = len(found)
        return DraftProposal(token_ids=token_ids, num_tokens=num_tokens)


def load_references(path: str | Path) -> dict[int, list[int]]:
    """Read a reference file written by `write_references`: sequence key -> token ids."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {sequence_key(data["seed"], s["id"], s["sample"]): s["token_ids"] for s in data["sequences"]}


def write_references(path: str | Path, seed: int, sequences: list[dict[str, Any]]) -> None:
    """Store a run's outputs ({id, sample, token_ids} dicts) as oracle drafts for sampling `seed`."""
    records = [{"id": s["id"], "sample": s["sample"], "token_ids": s["token_ids"]} for s in sequences]
    Path(path).write_text(json.dumps({"seed": seed, "sequences": records}), encoding="utf-8")


@register_system("oracle")
class OracleEngine(EngineSystem):
    """Coupled mode fed the target's own final outputs: the ceiling at this verify length.

    The references start as the `ar` run's outputs. In bf16 a verify block's logits differ in the
    last bits from single-token decoding (and with the batch's row count), so at near-ties the
    oracle emits another token than `ar` did and the rest of that sequence's references are
    useless. With `oracle_passes` > 1, `prepare` runs the oracle untimed and takes its outputs
    as the next references; a pass reproduces the previous one at least until their block
    boundaries or batch shapes part, so every pass accepts more.
    """

    mode = "coupled"
    needs_reference = True

    def __init__(self, spec: RunSpec) -> None:
        self.passes = spec.oracle_passes
        super().__init__(spec)

    def _drafters(self, spec: RunSpec, model: torch.nn.Module, tokenizer: Any) -> list[Drafter]:
        if spec.reference_path is None:
            raise ValueError("the oracle system needs an `ar` run's outputs (reference_path)")
        self.oracle = OracleDrafter(load_references(spec.reference_path))
        return [self.oracle]

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        super().prepare(requests, sampling)
        for _ in range(self.passes - 1):
            outputs = self.engine.generate(requests, sampling).outputs
            self.oracle.references = {sequence_key(sampling.seed, o.request_id, o.sample_index): o.token_ids
                                      for o in outputs}


@register_system("oracle-dynamic")
class OracleDynamicEngine(OracleEngine):
    """The oracle with the cost-model verify length: free drafts that are always accepted, k chosen per
    round as for a real drafter. No drafter can beat it on this machine, so it bounds every speed goal."""

    verify_length = "dynamic"

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        self.engine.prepare_length_policy(requests, sampling)
        super().prepare(requests, sampling)


# ---------------------------------------------------------------------------------------- vllm
def vllm_python() -> Path:
    """The interpreter of vLLM's own venv: $SPECACTOR_VLLM_PYTHON, else `make vllm-env`'s .venv-vllm."""
    import os

    from benchmark.machine import REPO_ROOT

    return Path(os.environ.get("SPECACTOR_VLLM_PYTHON") or REPO_ROOT / ".venv-vllm" / "bin" / "python")


def vllm_available() -> str | None:
    """None when vLLM can run, else why not (the harness reports it and runs the rest)."""
    python = vllm_python()
    if not python.exists():
        return f"no vLLM environment at {python} (run `make vllm-env` or set SPECACTOR_VLLM_PYTHON)"
    return None


class _GenerationConfigHolder:
    """What `eos_token_ids` reads from a model, without loading its weights."""

    def __init__(self, path: Path) -> None:
        from transformers import GenerationConfig

        try:
            self.generation_config = GenerationConfig.from_pretrained(path)
        except OSError:  # no generation_config.json: the tokenizer's EOS alone
            self.generation_config = None


class VLLMSystem(System):
    """vLLM's CPU build in its own venv, driven through `benchmark/vllm_driver.py` (JSON lines).

    Same prompt token ids as the engine (this side applies the chat template), EOS ids as stop
    ids, one request per sample, vLLM's engine-wide seed (its sampler: texts at temperature > 0
    are not expected to match `ar`). All requests are submitted at once; vLLM schedules them.
    """

    speculative = False
    KV_CACHE_GIB = 4
    PROMPT_ROOM = 2048  # max_model_len = this + max_new_tokens

    def __init__(self, spec: RunSpec) -> None:
        import os
        import subprocess

        from transformers import AutoTokenizer

        from benchmark.machine import REPO_ROOT
        from specactor_engine.tokenize import eos_token_ids

        reason = vllm_available()
        if reason is not None:
            raise RuntimeError(reason)
        path = _resolve(spec.target, spec.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.stop_ids = eos_token_ids(self.tokenizer, _GenerationConfigHolder(path))
        cache = Path(os.environ.get("XDG_CACHE_HOME") or REPO_ROOT / ".cache")
        env = os.environ | {
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(self.KV_CACHE_GIB),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "OMP_NUM_THREADS": str(spec.threads), "PYTHONPATH": "",
        }
        self.proc = subprocess.Popen([str(vllm_python()), str(REPO_ROOT / "benchmark" / "vllm_driver.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        settings = {"model": str(path), "dtype": spec.dtype, "max_model_len": self.PROMPT_ROOM
                    + spec.trace.max_new_tokens, "seed": spec.trace.seed, "threads": spec.threads,
                    "speculative_config": self._speculative_config(spec), "max_num_seqs": spec.max_batch_size}
        loaded = self._ask(settings)
        self.version = loaded["version"]

    def _speculative_config(self, spec: RunSpec) -> dict[str, Any] | None:
        return None

    def _ask(self, message: dict[str, Any], on_finish: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Send one command; relay `finish` events; return the closing event."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            event = json.loads(line)
            if event["event"] == "finish":
                if on_finish is not None:
                    on_finish(event["count"])
                continue
            return event
        raise RuntimeError(f"the vLLM driver exited (code {self.proc.wait()}); see this run's log")

    def generate(self, requests: Sequence[Request], sampling: SamplingConfig, clock: FinishClock) -> Generation:
        from specactor_engine.tokenize import encode_request

        items = []
        for request in requests:
            ids, error = encode_request(request, self.tokenizer, chat_template=True)
            if error is not None:
                raise ValueError(error)
            for j in range(sampling.n):
                items.append({"id": request.request_id, "sample": j, "prompt_token_ids": ids})
        params = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
                  "max_tokens": sampling.max_new_tokens, "stop_token_ids": sorted(self.stop_ids)}
        done = self._ask({"cmd": "generate", "requests": items, "sampling": params}, on_finish=clock.mark)
        sequences = [SequenceResult(s["id"], s["sample"], s["token_ids"], s["text"], s["finish_reason"])
                     for s in done["sequences"]]
        self.peak_rss_mb = done["peak_rss_mb"]
        return Generation(sequences, self._stats(done.get("spec"), sequences))

    def _stats(self, spec: dict[str, float] | None, sequences: list[SequenceResult]) -> dict[str, Any]:
        """Engine-like stats: vLLM's version, and its speculative counters when it speculated."""
        stats: dict[str, Any] = {"vllm_version": self.version, "drafted_tokens": 0}
        if spec and spec.get("drafts"):
            accepted, drafts = spec.get("accepted_tokens", 0.0), spec["drafts"]
            stats |= {"drafted_tokens": spec.get("draft_tokens", 0.0), "accepted_tokens": accepted,
                      "mean_acceptance_length": 1.0 + accepted / drafts,
                      "acceptance_rate": accepted / spec["draft_tokens"] if spec.get("draft_tokens") else 0.0}
        return stats

    def external_cpu_s(self) -> float:
        import psutil

        try:
            times = psutil.Process(self.proc.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return times.user + times.system + times.children_user + times.children_system

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


@register_system("vllm")
class VLLMPlain(VLLMSystem):
    """vLLM without speculation."""


@register_system("vllm-spec")
class VLLMSpeculative(VLLMSystem):
    """vLLM's own speculative decoding: the trace's draft model, or n-gram when it has none."""

    def _speculative_config(self, spec: RunSpec) -> dict[str, Any] | None:
        if spec.drafter is None:
            return VLLMNgram._speculative_config(self, spec)
        return {"model": str(_resolve(spec.drafter, spec.dtype)), "num_speculative_tokens": spec.num_draft_tokens}


@register_system("vllm-ngram")
class VLLMNgram(VLLMSystem):
    """vLLM's n-gram (prompt lookup) speculation."""

    def _speculative_config(self, spec: RunSpec) -> dict[str, Any] | None:
        return {"method": "ngram", "num_speculative_tokens": spec.num_draft_tokens, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
