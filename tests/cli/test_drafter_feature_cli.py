"""`specactor drafter feature` on a tiny model: prompts in (rolled out with the target), a resumable feature-level
drafter out; bad data named, exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from typer.testing import CliRunner

from specactor.cli import app
from specactor_engine.model.feature_draft import WEIGHTS_FILE
from specactor_engine.training.feature_distill import FEATURES_FILE, STATE_FILE
from tests.fixtures.tiny_models import save_tiny_model

runner = CliRunner()


def feature_args(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["drafter", "feature", "--target", str(target), "--data", str(data), "--out", str(out), "--samples", "2",
            "--max-new-tokens", "8", "--batch-size", "2", "--save-every", "2", "--draft-vocab", "64", *extra]


def test_from_prompts_then_resume(tmp_path: Path):
    target = save_tiny_model(tmp_path / "target", "qwen2", seed=4, num_layers=2)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count {i}"}) + "\n" for i in range(6)))
    out = tmp_path / "feature"
    first = runner.invoke(app, feature_args(target, prompts, out, "--steps", "2"))
    assert first.exit_code == 0, first.output
    assert (out / WEIGHTS_FILE).is_file() and (out / FEATURES_FILE).is_file() and (out / "draft_vocab.json").is_file()
    assert len((out / "target_samples.jsonl").read_text().splitlines()) == 12  # 6 prompts x 2 samples
    assert "held-out top-1 agreement" in " ".join(first.output.split())
    # not a terminal: each phase's progress as lines, not a bar that prints nothing until the end
    assert "target features: 12/12," in first.output and "training: 2/2, " in first.output and "loss " in first.output
    assert json.loads((out / "feature_drafter.json").read_text())["bf16_autocast"] is True  # the default
    second = runner.invoke(app, feature_args(target, prompts, out, "--steps", "4", "--no-bf16-autocast"))
    assert second.exit_code == 0, second.output
    assert json.loads((out / "feature_drafter.json").read_text())["bf16_autocast"] is False
    text = " ".join(second.output.split())
    assert "resuming the feature drafter" in text and "after 4 steps (2 now" in text
    assert torch.load(out / STATE_FILE, weights_only=False)["steps"] == 4


def test_bad_data_is_named_with_exit_code_2(tmp_path: Path):
    target = save_tiny_model(tmp_path / "target", "qwen2", seed=4, num_layers=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_token_ids": [1], "token_ids": [2]}\n{"prompt_token_ids": [3]}\n')
    result = runner.invoke(app, feature_args(target, bad, tmp_path / "out"))
    assert result.exit_code == 2
    assert "bad.jsonl:2" in " ".join(result.output.split())
