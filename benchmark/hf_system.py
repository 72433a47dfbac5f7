"""The `hf` system: transformers' own `generate`, the baseline outside this project's engine.

Rows are left-padded and decoded in batches of `max_batch_size` with the KV cache; a stopping
criterion that never stops stamps each row's finish, so its tail time is measured like the engine's.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from benchmark.interface import FinishClock, Generation, RunSpec, SequenceResult, System, load_target
from specactor_engine.config import SamplingConfig
from specactor_engine.types import Request


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
