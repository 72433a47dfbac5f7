"""The end-to-end benchmark's pure parts: the commands it runs and how it reads and reports the runs' steps
(the timing itself is a benchmark, not a test)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark.e2e import report, step_metrics, summarize, train_command


def test_the_two_runs_differ_only_in_the_rollout_mode(tmp_path):
    speculative = train_command("c.yaml", tmp_path / "s", 5, None, ["sampling.n=2"])
    plain = train_command("c.yaml", tmp_path / "a", 5, "ar", ["sampling.n=2"])
    assert speculative[1:3] == ["train", "--config"] and "train.eval.enabled=false" in speculative
    assert "rollout.mode=ar" in plain and not any(a.startswith("rollout.mode") for a in speculative)
    assert "sampling.n=2" in speculative and "sampling.n=2" in plain
    assert [a for a in plain if "run_dir" not in a and "rollout.mode" not in a and a != "--set"] == \
        [a for a in speculative if "run_dir" not in a and a != "--set"]


def _write_steps(root: Path, steps: list[dict]) -> None:
    for metrics in steps:
        path = root / "steps" / f"{metrics['step']:06d}" / "metrics.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(metrics))


def test_steps_are_read_without_the_initial_evaluation_and_summarised_by_medians(tmp_path):
    parts = ("step", "rollout", "reward", "update", "sync")
    _write_steps(tmp_path, [{"step": 0, "eval/reward/mean": 0.1}] + [
        {"step": s, **{f"time/{p}_s": float(s * (i + 1)) for i, p in enumerate(parts)},
         "rollout/mean_acceptance_length": 1.0 + s / 10, "reward/mean": 0.2} for s in (1, 2, 3)])
    steps = step_metrics(tmp_path)
    assert [m["step"] for m in steps] == [1, 2, 3]
    summary = summarize(steps)
    assert summary["steps"] == 3 and summary["step_s"] == 2.0 and summary["sync_s"] == 10.0
    assert summary["accept_len"] == 1.2


def test_the_report_names_both_modes_and_the_ratios():
    spec = {"step_s": 10.0, "rollout_s": 4.0, "reward_s": 0.1, "update_s": 5.0, "sync_s": 0.9, "accept_len": 1.5}
    plain = {**spec, "step_s": 12.0, "rollout_s": 6.0, "accept_len": 1.0}
    text = report({"config": "c.yaml", "runs_per_mode": 1, "steps": 5, "others_cpu_share": 0.01,
                   "command": "python -m benchmark.e2e", "modes": {"speculative": spec, "ar": plain},
                   "speculative_mode": "specactor", "step_speedup": 1.2, "rollout_speedup": 1.5})
    assert "| speculative (`specactor`) | 10.0 | 4.0 | 0.1 | 5.0 | 0.9 | 1.50 |" in text
    assert "| plain decoding (`ar`) | 12.0 | 6.0 |" in text and "**1.20x**" in text and "**1.50x**" in text
