"""Which of the feature drafter's linears can draft on int8 weights without losing acceptance.

    PYTHONPATH=. .venv/bin/python bench/session52/int8_acceptance.py [RUN.json] > int8_acceptance.txt

Teacher-forced over 4 of a trace D `ar` run's outputs (default: bench/session51/D-paired/runs/ar-0.json, sequences
0, 4, 8, 12): the target's features and next-token distribution p_target at every position, and the drafter's first
draft distribution p_draft from the same features (pass 1, at its temperature scale; T = 1). The score is the mean
over positions (from the 9th) of sum_v min(p_target, p_draft): the chance a draft sampled with the target's noise
is accepted, for a first draft. Each variant swaps some linears for the engine's int8 kernel (per-channel weights,
activations quantized per row: kernels/int8_linear.py), computed in float32 and cast back to bf16.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch import nn

from benchmark.interface import RunSpec, load_target
from benchmark.traces import get_trace
from specactor_engine.kernels.int8_linear import Int8Linear
from specactor_engine.model.draft_vocab import load_draft_vocab
from specactor_engine.model.feature_draft import FeatureDraftModel

DRAFTER = "runs/drafters/qwen1.5b-feature-v4"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class Int8(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.q = Int8Linear(linear.weight.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x.float()).to(x.dtype)


class Int8Halves(nn.Module):
    """fc with its embedding half and its feature half quantized apart (each its own row scale)."""

    def __init__(self, linear: nn.Linear, d: int) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.a, self.b, self.d = Int8Linear(w[:, :d]), Int8Linear(w[:, d:]), d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.a(x[..., :self.d].float()) + self.b(x[..., self.d:].float())).to(x.dtype)


def variant(model: FeatureDraftModel, names: tuple[str, ...], fc: str) -> FeatureDraftModel:
    m = copy.deepcopy(model)
    for name in names:
        parent = m.layer.self_attn if name in ATTENTION else m.layer.mlp
        setattr(parent, name, Int8(getattr(parent, name)))
    if fc == "int8":
        m.fc = Int8(m.fc)
    elif fc == "halves":
        m.fc = Int8Halves(m.fc, m.config.hidden_size)
    return m


def main() -> None:
    torch.set_num_threads(2)
    run_file = sys.argv[1] if len(sys.argv) > 1 else "bench/session51/D-paired/runs/ar-0.json"
    trace = get_trace("D")
    target, _ = load_target(RunSpec(system="ar", trace=trace, target=trace.model.target, drafter=None,
                                    dtype=trace.dtype, threads=2))
    drafter = FeatureDraftModel.load(DRAFTER, target)
    vocab = load_draft_vocab(DRAFTER)
    ids = torch.as_tensor(vocab.ids if hasattr(vocab, "ids") else vocab)
    variants = {
        "float": variant(drafter, (), "float"),
        "q/k/v/o + MLP + fc": variant(drafter, ATTENTION + MLP, "int8"),
        "q/k/v/o + MLP, fc in halves": variant(drafter, ATTENTION + MLP, "halves"),
        "q/k/v/o + MLP": variant(drafter, ATTENTION + MLP, "float"),
        "q/k/v": variant(drafter, ATTENTION[:3], "float"),
        "q": variant(drafter, ("q_proj",), "float"),
        "k": variant(drafter, ("k_proj",), "float"),
        "v": variant(drafter, ("v_proj",), "float"),
        "o": variant(drafter, ("o_proj",), "float"),
        "MLP": variant(drafter, MLP, "float"),
        "fc in halves": variant(drafter, (), "halves"),
        "o + MLP (the engine's quantize: int8)": variant(drafter, ("o_proj",) + MLP, "float"),
    }
    sequences = json.load(open(run_file))["sequences"][::4][:4]
    embed, head = target.get_input_embeddings(), target.lm_head.weight[ids].float()
    scores: dict[str, list[torch.Tensor]] = {name: [] for name in variants}
    with torch.inference_mode():
        for sequence in sequences:
            tokens = torch.tensor(sequence["token_ids"])[None]
            features = target.model(input_ids=tokens).last_hidden_state  # normalised: the head's input
            p_target = torch.softmax(target.lm_head(features).float()[0], -1)[:-1]
            prev = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
            for name, model in variants.items():
                g = model(embed(tokens), prev)[0].float()
                p_draft = torch.zeros_like(p_target)
                p_draft[:, ids] = torch.softmax(g @ head.T / drafter.temperature_scale, -1)[:-1]
                scores[name].append(torch.minimum(p_target, p_draft).sum(-1)[8:])
    print(f"{run_file}: {sum(len(s['token_ids']) for s in sequences)} positions of {len(sequences)} outputs, "
          f"drafter {DRAFTER} (temperature scale {drafter.temperature_scale})\n")
    print("| linears in int8 | mean sum min(p_target, p_draft) |\n|---|---|")
    for name, values in scores.items():
        print(f"| {name} | {torch.cat(values).mean():.4f} |")


if __name__ == "__main__":
    main()
