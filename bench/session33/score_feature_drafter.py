"""Held-out chance of acceptance per draft step of a trained feature drafter, as `specactor drafter feature` reports
it at the end of a run (training/feature_job.py `held_out_acceptance`), for a drafter trained before the job
reported it (session 33: v3 beside v4).

    PYTHONPATH=. .venv/bin/python bench/session33/score_feature_drafter.py runs/drafters/qwen1.5b-feature-v3

The held-out pairs are the job's: every tenth sample of the drafter's training data (here `make drafter-feature`'s
runs/drafters/feature-v2-data/all.jsonl), with the target's features cached in the drafter's directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specactor_engine.model.draft_vocab import load_draft_vocab
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.training.feature_distill import FEATURES_FILE, FeatureDistiller
from specactor_engine.training.feature_job import FeatureJob, best_temperature_scale, held_out_acceptance
from specactor_engine.training.job import load_target
from specactor_engine.training.report import LogReporter
from specactor_engine.training.samples import target_pairs

DATA = Path("runs/drafters/feature-v2-data/all.jsonl")
TARGET = "qwen2.5-coder-1.5b-instruct"


def main(drafter: Path, data: Path = DATA) -> None:
    job = FeatureJob(target=TARGET, data=data, out=drafter)
    target, tokenizer = load_target(job)
    pairs = [p for p in target_pairs(data, drafter, target, tokenizer, samples=2, max_new_tokens=256, seed=0,
                                      soft_top_k=0, reporter=LogReporter()) if p[1]]
    features = torch.load(drafter / FEATURES_FILE, weights_only=True)
    held = [p for i, p in enumerate(pairs) if not i % 10]
    held_f = [f for i, f in enumerate(features) if not i % 10]
    model = FeatureDraftModel.load(drafter, target).eval().requires_grad_(False)
    scorer = FeatureDistiller(model, target, lr=0.0, vocab_ids=load_draft_vocab(drafter))
    with torch.no_grad():
        acceptance = held_out_acceptance(scorer, target, held, held_f)
    print(json.dumps({"drafter": str(drafter), "held_out_pairs": len(held),
                      "held_out_acceptance": {str(s): [round(a, 4) for a in rates] for s, rates in acceptance.items()},
                      "temperature_scale": best_temperature_scale(acceptance)}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
