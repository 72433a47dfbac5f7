"""The feature drafter's draft step at 4 rows (context 300), bf16 against `quantize: int8` (o and the MLP in int8).

    PYTHONPATH=. .venv/bin/python bench/session52/draft_step.py > draft_step.txt

Both runners share the trained drafter's model (v4); a step is fc over [embedding; feature], one layer and the
1,272-token head. Repeats alternate the two runners, 8 steps each; medians of 8 repeats of the mean step.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmark.interface import RunSpec, load_target
from benchmark.traces import get_trace
from specactor_engine.drafters.feature import INT8_PROJECTIONS
from specactor_engine.model.draft_vocab import load_draft_vocab
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.model.packed_linear import PackedLinear
from specactor_engine.model.runner import ModelRunner

DRAFTER = "runs/drafters/qwen1.5b-feature-v4"
ROWS, CONTEXT, STEPS, REPEATS = 4, 300, 8, 8


def main() -> None:
    torch.set_num_threads(2)
    trace = get_trace("D")
    target, _ = load_target(RunSpec(system="ar", trace=trace, target=trace.model.target, drafter=None,
                                    dtype=trace.dtype, threads=2))
    model = FeatureDraftModel.load(DRAFTER, target)
    vocab = load_draft_vocab(DRAFTER)
    ids = torch.as_tensor(vocab.ids if hasattr(vocab, "ids") else vocab)
    d = model.config.hidden_size
    head = torch.nn.Linear(d, len(ids), bias=False, dtype=target.lm_head.weight.dtype)
    head.weight.data = target.lm_head.weight[ids].contiguous()
    embed, slots = target.get_input_embeddings(), torch.arange(ROWS)
    fc = PackedLinear([model.fc])
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1000, (ROWS, CONTEXT), generator=generator)
    features = torch.randn(ROWS, CONTEXT, d, generator=generator).to(target.lm_head.weight.dtype)
    runners = {}
    with torch.inference_mode():
        for name, projections in (("bf16", ()), ("int8 (o, MLP)", INT8_PROJECTIONS)):
            runner = ModelRunner(model, int8_projections=projections)
            runner.head = head
            runner.pack()
            runner.allocate(ROWS, CONTEXT + STEPS + 1)
            logits = runner.forward(tokens, slots, embeds=fc(torch.cat([embed(tokens), features], -1)),
                                    logits_at="last")
            runner.commit(slots, torch.full((ROWS,), CONTEXT))
            runners[name] = (runner, logits.float())
        reference = runners["bf16"][1]
        print(f"{DRAFTER}, {ROWS} rows, context {CONTEXT}: last logits of the prefill, int8 against bf16: max |diff| "
              f"{(runners['int8 (o, MLP)'][1] - reference).abs().max():.3f} (bf16 logits' max |x| "
              f"{reference.abs().max():.1f})\n")
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(REPEATS):
            for name, (runner, _) in runners.items():
                feature = torch.randn(ROWS, d, generator=generator).to(features.dtype)
                runner.set_lengths(slots, torch.full((ROWS,), CONTEXT))
                started = time.perf_counter()
                for _ in range(STEPS):
                    token = torch.randint(1000, (ROWS, 1), generator=generator)
                    x = fc(torch.cat([embed(token), feature[:, None]], -1))
                    _, feature = runner.forward(token, slots, embeds=x, logits_at="last", return_features=True)
                    runner.commit(slots, torch.ones_like(slots))
                times[name].append((time.perf_counter() - started) / STEPS * 1e3)
    print("| runner | weights a step | step ms, median (min-max) |\n|---|---|---|")
    for name, (runner, _) in runners.items():
        values = times[name]
        print(f"| {name} | {(runner.step_bytes() + model.fc.weight.numel() * model.fc.weight.element_size()) / 1e6:.0f} MB | "
              f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}) |")


if __name__ == "__main__":
    main()
