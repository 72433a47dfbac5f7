"""Held-out chance of acceptance per draft step of a trained feature drafter on another drafter's held-out samples
(session 38: v4 on v5's 116, which hold v4's 64), as `specactor drafter feature` reports it
(training/feature_job.py `held_out_acceptance`, `held_out_top1`), at the drafting temperature scale both keep,
separately on the held-out samples of the first 640 (v4's own held-out set) and of the 512 appended for v5.

    PYTHONPATH=. .venv/bin/python bench/session38/score_on_held_out.py runs/drafters/qwen1.5b-feature-v4 \
        runs/drafters/qwen1.5b-feature-v5 runs/drafters/feature-v5-data/all.jsonl

The held-out pairs are the job's: every tenth sample of the data, with the target's features cached in the second
drafter's directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specactor_engine.model.draft_vocab import load_draft_vocab
from specactor_engine.model.feature_draft import FeatureDraftModel
from specactor_engine.training.feature_distill import FEATURES_FILE, FeatureDistiller
from specactor_engine.training.feature_job import FeatureJob, held_out_acceptance, held_out_top1
from specactor_engine.training.job import load_target
from specactor_engine.training.report import LogReporter
from specactor_engine.training.samples import target_pairs

TARGET = "qwen2.5-coder-1.5b-instruct"
SCALE = 0.6  # both drafters' kept drafting temperature scale


def main(drafter: Path, features_dir: Path, data: Path) -> None:
    job = FeatureJob(target=TARGET, data=data, out=features_dir)
    target, tokenizer = load_target(job)
    pairs = [p for p in target_pairs(data, features_dir, target, tokenizer, samples=2, max_new_tokens=256, seed=0,
                                      soft_top_k=0, reporter=LogReporter()) if p[1]]
    features = torch.load(features_dir / FEATURES_FILE, weights_only=True)
    assert len(features) == len(pairs), f"{len(features)} cached features for {len(pairs)} samples"
    held = [p for i, p in enumerate(pairs) if not i % 10]
    held_f = [f for i, f in enumerate(features) if not i % 10]
    model = FeatureDraftModel.load(drafter, target).eval().requires_grad_(False)
    scorer = FeatureDistiller(model, target, lr=0.0, vocab_ids=load_draft_vocab(drafter))
    first = [i for i in range(len(held)) if i * 10 < 640]  # the held-out samples of the first 640 (v4's data)
    rest = [i for i in range(len(held)) if i not in first]
    with torch.no_grad():
        top1 = held_out_top1(scorer, held, held_f)
        scored = {name: held_out_acceptance(scorer, target, [held[i] for i in part], [held_f[i] for i in part],
                                            scales=(SCALE,))[SCALE] for name, part in (("first", first), ("rest", rest))}
    print(json.dumps({"drafter": str(drafter), "held_out_pairs": len(held), "held_out_top1": round(top1, 4),
                      "scale": SCALE, "first_640_held_out_pairs": len(first),
                      "first_640_acceptance": [round(a, 4) for a in scored["first"]],
                      "appended_acceptance": [round(a, 4) for a in scored["rest"]]}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
