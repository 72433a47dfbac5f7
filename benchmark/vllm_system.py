"""The vLLM systems: vLLM's CPU build in its own venv, the outside baseline with and without its own
speculative decoding.

The three rows differ only in what vLLM speculates with (`VLLMVariant.speculation`); the process,
the JSON-lines protocol (`benchmark/vllm_driver.py`) and the result are the same for all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from benchmark.interface import FinishClock, Generation, RunSpec, SequenceResult, System, resolve_local
from specactor_engine.config import SamplingConfig
from specactor_engine.types import Request

Speculation = Literal["none", "trace", "ngram"]


@dataclass(frozen=True)
class VLLMVariant:
    """One vLLM system: its name and what vLLM drafts with ('trace': the trace's draft model, or n-gram
    when it has none; 'ngram': prompt lookup; 'none': no speculation)."""

    name: str
    speculation: Speculation
    description: str


VLLM_VARIANTS: tuple[VLLMVariant, ...] = (
    VLLMVariant("vllm", "none", "vLLM without speculation."),
    VLLMVariant("vllm-spec", "trace", "vLLM's own speculative decoding: the trace's draft model, or n-gram when it "
                "has none."),
    VLLMVariant("vllm-ngram", "ngram", "vLLM's n-gram (prompt lookup) speculation."),
)


def speculative_config(speculation: Speculation, spec: RunSpec) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for a variant on this run (None: no speculation)."""
    if speculation == "ngram" or (speculation == "trace" and spec.drafter is None):
        return {"method": "ngram", "num_speculative_tokens": spec.num_draft_tokens, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    if speculation == "trace":
        assert spec.drafter is not None
        return {"model": str(resolve_local(spec.drafter, spec.dtype)), "num_speculative_tokens": spec.num_draft_tokens}
    return None


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

    KV_CACHE_GIB = 4
    PROMPT_ROOM = 2048  # max_model_len = this + max_new_tokens

    def __init__(self, variant: VLLMVariant, spec: RunSpec) -> None:
        import subprocess

        from transformers import AutoTokenizer

        from benchmark.machine import REPO_ROOT
        from specactor_engine.tokenize import eos_token_ids

        reason = vllm_available()
        if reason is not None:
            raise RuntimeError(reason)
        path = resolve_local(spec.target, spec.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.stop_ids = eos_token_ids(self.tokenizer, _GenerationConfigHolder(path))
        self.proc = subprocess.Popen([str(vllm_python()), str(REPO_ROOT / "benchmark" / "vllm_driver.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._driver_env(spec),
                                     text=True, bufsize=1)
        settings = {"model": str(path), "dtype": spec.dtype, "max_model_len": self.PROMPT_ROOM
                    + spec.trace.max_new_tokens, "seed": spec.trace.seed, "threads": spec.threads,
                    "speculative_config": speculative_config(variant.speculation, spec),
                    "max_num_seqs": spec.max_batch_size}
        self.version = self._ask(settings)["version"]

    def _driver_env(self, spec: RunSpec) -> dict[str, str]:
        """The driver's environment: offline, this run's threads, no CPUs held back, a fixed KV cache size."""
        import os

        from benchmark.machine import REPO_ROOT

        cache = Path(os.environ.get("XDG_CACHE_HOME") or REPO_ROOT / ".cache")
        return os.environ | {
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": str(self.KV_CACHE_GIB),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CACHE_ROOT": str(cache / "vllm"),
            "OMP_NUM_THREADS": str(spec.threads), "PYTHONPATH": "",
        }

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
