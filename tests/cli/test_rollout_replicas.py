"""`specactor rollout --set rollout.replicas=2` (a local Ray instance, the tiny fp32 target): the same records
as one in-process engine, line for line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specactor.cli import app
from tests.engine.test_replicas import local_ray  # noqa: F401 - fixture

pytest.importorskip("ray")


def write_config(path: Path, model_dir: Path) -> Path:
    path.write_text(f"""model: {{target: {model_dir}, max_model_len: 160}}
rollout:
  mode: specactor
  verify_length: fixed
  drafters: [{{kind: suffix, max_depth: 12, min_match: 1}}, {{kind: ngram, min_n: 1, max_n: 3}}]
  replica_threads: 1
sampling: {{temperature: 1.0, n: 3, max_new_tokens: 12, seed: 5}}
threads: 1
""")
    return path


def test_two_replicas_write_the_same_records_as_one(local_ray, tiny_model_dir, tmp_path):  # noqa: F811
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in [
        {"id": f"p{i}", "prompt": "say " + "ab" * i} for i in range(5)] + [{"id": 9, "prompt_token_ids": [1, 2, 3]}]))
    config = write_config(tmp_path / "config.yaml", tiny_model_dir)
    lines = {}
    for replicas in (1, 2):
        out = tmp_path / f"out{replicas}.jsonl"
        result = CliRunner().invoke(app, ["rollout", "--config", str(config), "--set", f"rollout.replicas={replicas}",
                                          "--prompts", str(prompts), "--out", str(out)])
        assert result.exit_code == 0, result.output
        lines[replicas] = out.read_text().splitlines()
    assert len(lines[1]) == 18
    assert lines[2] == lines[1]
