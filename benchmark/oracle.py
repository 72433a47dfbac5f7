"""The oracle systems' own plumbing: a drafter that proposes the reference run's outputs, the
reference files it reads, and the extra untimed passes that refresh them.

The oracle is an engine variant like any other (benchmark/engine_systems.py); what differs is that its
drafter is not a config kind, so `OracleSystem` builds it from the `ar` run's outputs and hands it to
`Engine.from_config` through `drafters=`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from benchmark.engine_systems import EngineSystem, EngineVariant
from benchmark.interface import RunSpec
from specactor_engine.config import SamplingConfig
from specactor_engine.drafters import DraftRequest, Drafter
from specactor_engine.sampling import sequence_key
from specactor_engine.state import SequenceState
from specactor_engine.types import DraftProposal, Request


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


class OracleSystem(EngineSystem):
    """An engine variant fed the target's own final outputs: the ceiling at its verify length.

    The references start as the `ar` run's outputs. In bf16 a verify block's logits differ in the
    last bits from single-token decoding (and with the batch's row count), so at near-ties the
    oracle emits another token than `ar` did and the rest of that sequence's references are
    useless. With `oracle_passes` > 1, `prepare` runs the oracle untimed and takes its outputs
    as the next references; a pass reproduces the previous one at least until their block
    boundaries or batch shapes part, so every pass accepts more.
    """

    def __init__(self, variant: EngineVariant, spec: RunSpec) -> None:
        if spec.reference_path is None:
            raise ValueError("the oracle system needs an `ar` run's outputs (reference_path)")
        self.passes = spec.oracle_passes
        self.oracle = OracleDrafter(load_references(spec.reference_path))
        super().__init__(variant, spec, drafters=[self.oracle])

    def prepare(self, requests: Sequence[Request], sampling: SamplingConfig) -> None:
        super().prepare(requests, sampling)
        for _ in range(self.passes - 1):
            outputs = self.engine.generate(requests, sampling).outputs
            self.oracle.references = {sequence_key(sampling.seed, o.request_id, o.sample_index): o.token_ids
                                      for o in outputs}
