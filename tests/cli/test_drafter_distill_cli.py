"""`specactor drafter distill` on a tiny model: prompts or rollout records in, a resumable HF drafter out."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specactor.cli import app
from specactor_engine.model.draft_vocab import SubsetHead
from specactor_engine.training.job import truncated_copy
from specactor_engine.training.offline import STATE_FILE
from specactor_engine.model.runner import load_hf_model
from specactor_engine.training.on_policy import StudentRounds
from specactor_engine.training.teacher import TEACHER_FILE
from tests.fixtures.tiny_models import make_tiny_model, save_tiny_model

runner = CliRunner()


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("distill") / "target", "llama", seed=4, num_layers=3)


def distill_args(target: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["drafter", "distill", "--target", str(target), "--data", str(data), "--out", str(out),
            "--samples", "2", "--max-new-tokens", "8", "--batch-size", "4", "--save-every", "2", *extra]


def test_from_prompts_with_init_layers_then_resume(target_dir: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "drafter"
    first = runner.invoke(app, distill_args(target_dir, prompts, out, "--init-layers", "1", "--steps", "3"))
    assert first.exit_code == 0, first.output
    assert (out / "model.safetensors").is_file() and (out / STATE_FILE).is_file()
    assert len((out / "target_samples.jsonl").read_text().splitlines()) == 6  # 3 prompts x 2 samples
    assert torch.load(out / STATE_FILE, weights_only=False)["steps"] == 3
    drafter = load_hf_model(out, "float32")
    assert drafter.config.num_hidden_layers == 1
    # a second run with a larger budget resumes at step 3 (no --init needed)
    second = runner.invoke(app, distill_args(target_dir, prompts, out, "--steps", "5"))
    assert second.exit_code == 0, second.output
    text = " ".join(second.output.split())  # rich wraps lines
    assert "resuming" in text and "after 5 steps (2 now" in text
    assert torch.load(out / STATE_FILE, weights_only=False)["steps"] == 5


def test_sampled_prompts_keep_the_rollouts_top_k_as_soft_targets(target_dir: Path, tmp_path: Path):
    """No teacher pass after sampling: the cache holds the rollout's own top-k, which is the teacher's."""
    from specactor_engine.training.teacher import teacher_topk

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"add {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "drafter"
    args = ("--init-layers", "1", "--soft-top-k", "6", "--steps", "1", "--no-bf16-autocast")
    result = runner.invoke(app, distill_args(target_dir, prompts, out, *args))
    assert result.exit_code == 0, result.output
    pairs = [(r["prompt_token_ids"], r["token_ids"])
             for r in map(json.loads, (out / "target_samples.jsonl").read_text().splitlines())]
    cached = torch.load(out / TEACHER_FILE, weights_only=True)
    expected = teacher_topk(load_hf_model(target_dir, "float32"), pairs, k=6)
    assert len(cached) == len(expected) == 6
    for (ids, values), (want_ids, want_values) in zip(cached, expected):
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(values.float(), want_values.float(), atol=2e-3, rtol=0)


def test_rollout_records_with_top_logprobs_are_their_own_soft_targets(target_dir: Path, tmp_path: Path):
    """`specactor rollout --set sampling.top_logprobs=N` output trains without a teacher pass."""
    from specactor_engine.training.teacher import teacher_topk

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": [3 + i, 4, 5]}) + "\n" for i in range(3)))
    records = tmp_path / "rollouts.jsonl"
    rolled = runner.invoke(app, ["rollout", "--prompts", str(prompts), "--out", str(records), "--set",
                                 f"model.target={target_dir}", "--set", "rollout.mode=ar", "--set",
                                 "model.chat_template=false", "--set",
                                 "sampling.top_logprobs=6", "--set", "sampling.n=2", "--set", "sampling.max_new_tokens=6"])
    assert rolled.exit_code == 0, rolled.output
    out = tmp_path / "drafter"
    result = runner.invoke(app, distill_args(target_dir, records, out, "--init-layers", "1", "--soft-top-k", "4",
                                             "--steps", "1", "--no-bf16-autocast"))
    assert result.exit_code == 0, result.output
    assert "the records' own top-4 log-probs" in " ".join(result.output.split())
    pairs = [(r["prompt_token_ids"], r["token_ids"]) for r in map(json.loads, records.read_text().splitlines())]
    expected = teacher_topk(load_hf_model(target_dir, "float32"), pairs, k=4)
    for (ids, values), (want_ids, want_values) in zip(torch.load(out / TEACHER_FILE, weights_only=True), expected):
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(values.float(), want_values.float(), atol=2e-3, rtol=0)


def test_from_rollout_records_with_an_init_model(target_dir: Path, tmp_path: Path):
    init = save_tiny_model(tmp_path / "init", "llama", seed=9, num_layers=1)
    records = tmp_path / "rollouts.jsonl"
    records.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, 7], "token_ids": [8, 9, 10, 11]}) + "\n"
                               for _ in range(4)))
    out = tmp_path / "drafter"
    result = runner.invoke(app, distill_args(target_dir, records, out, "--init", str(init), "--steps", "4"))
    assert result.exit_code == 0, result.output
    before = load_hf_model(init, "float32").state_dict()
    after = load_hf_model(out, "float32").state_dict()
    assert any(not torch.equal(before[name], after[name]) for name in before)  # it trained
    assert not (out / "target_samples.jsonl").exists()  # records were used as they are


@pytest.mark.parametrize(("lines", "extra", "expected"), [
    (['{"prompt_token_ids": [1], "token_ids": [2]}', '{"prompt": "x"}'], ["--init-layers", "1"],
     "rollouts.jsonl:2: a prompt line among rollout records"),
    (['{"token_ids": [2]}'], ["--init-layers", "1"], "rollouts.jsonl:1: a rollout record needs 'prompt_token_ids'"),
    (['not json'], ["--init-layers", "1"], "rollouts.jsonl:1: not JSON"),
    (['{"prompt_token_ids": [1], "token_ids": [2]}'], [], "give exactly one of --init and --init-layers"),
    (['{"prompt_token_ids": [1], "token_ids": [2]}'], ["--init-layers", "3"], "--init-layers must be between 1 and 2"),
    (['{"prompt_token_ids": [1], "token_ids": [2]}'], ["--init-layers", "1", "--freeze-layers", "1"],
     "--freeze-layers 1 leaves nothing to train in a 1-layer drafter"),
])
def test_bad_input_fails_with_a_clear_message(target_dir: Path, tmp_path: Path, lines, extra, expected):
    data = tmp_path / "rollouts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    result = runner.invoke(app, distill_args(target_dir, data, tmp_path / "out", *extra))
    assert result.exit_code == 2, result.output
    assert expected in " ".join(result.output.split())


def test_truncated_copy_keeps_the_targets_first_layers():
    target = make_tiny_model("qwen2", seed=1, num_layers=3)
    draft = truncated_copy(target, 2)
    assert len(draft.model.layers) == 2 and draft.config.num_hidden_layers == 2
    assert target.config.num_hidden_layers == 3  # the target is untouched
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)


def test_soft_targets_and_a_draft_vocabulary_are_saved_and_resumed(target_dir: Path, tmp_path: Path):
    records = tmp_path / "rollouts.jsonl"
    records.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, 7], "token_ids": [8, 9, 10, 11, i]}) + "\n"
                               for i in range(4)))
    out = tmp_path / "drafter"
    args = ("--init-layers", "1", "--soft-top-k", "4", "--draft-vocab", "24", "--steps", "2")
    result = runner.invoke(app, distill_args(target_dir, records, out, *args))
    assert result.exit_code == 0, result.output
    assert "draft head over 24 of" in " ".join(result.output.split())
    soft = torch.load(out / TEACHER_FILE, weights_only=True)
    assert [tuple(ids.shape) for ids, _ in soft] == [(5, 4)] * 4  # 5 output positions, top-4 each
    drafter = load_hf_model(out, "float32")
    assert isinstance(drafter.lm_head, SubsetHead) and len(drafter.lm_head.token_ids) == 24
    chosen = set(drafter.lm_head.token_ids.tolist())
    assert {5, 6, 7}.issubset(chosen)  # prompt tokens count towards the choice
    resumed = runner.invoke(app, distill_args(target_dir, records, out, "--steps", "3"))
    assert resumed.exit_code == 0, resumed.output
    assert set(load_hf_model(out, "float32").lm_head.token_ids.tolist()) == chosen  # kept, not re-chosen


def test_on_policy_rounds_add_the_drafters_own_samples_labelled_by_the_target(target_dir: Path, tmp_path: Path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"count {i}"}) + "\n" for i in range(3)))
    out = tmp_path / "drafter"
    args = ("--init-layers", "1", "--soft-top-k", "4", "--draft-vocab", "0", "--steps", "6",
            "--student-rounds", "2", "--student-samples", "1", "--no-bf16-autocast")  # exact labels to compare
    result = runner.invoke(app, distill_args(target_dir, prompts, out, *args))
    assert result.exit_code == 0, result.output
    assert "2 on-policy rounds" in " ".join(result.output.split())
    target = load_hf_model(target_dir, "float32")
    target_prompts = {tuple(json.loads(line)["prompt_token_ids"])
                      for line in (out / "target_samples.jsonl").read_text().splitlines()}
    rounds = [torch.load(out / f"student_round{r}.pt", weights_only=True) for r in range(2)]
    for data in rounds:
        assert len(data["pairs"]) == 3  # 3 prompts x 1 sample, on the same prompts as the target's samples
        assert {tuple(p) for p, _ in data["pairs"]} == target_prompts
        # every position is labelled with the target's own top-4
        assert_soft_targets_are_the_targets(target, data["pairs"], data["soft"], k=4)
    assert rounds[0]["pairs"] != rounds[1]["pairs"]  # a new seed per round (and a drafter that trained on)
    # a resumed run reuses the cached rounds instead of sampling again
    stamps = [(out / f"student_round{r}.pt").stat().st_mtime_ns for r in range(2)]
    resumed = runner.invoke(app, distill_args(target_dir, prompts, out, "--steps", "8", "--soft-top-k", "4",
                                              "--student-rounds", "2", "--student-samples", "1", "--no-bf16-autocast"))
    assert resumed.exit_code == 0, resumed.output
    assert "2 on-policy rounds" in " ".join(resumed.output.split())
    assert [(out / f"student_round{r}.pt").stat().st_mtime_ns for r in range(2)] == stamps


def assert_soft_targets_are_the_targets(target, pairs, soft, k: int) -> None:
    with torch.no_grad():
        for (prompt, output), (ids, log_probs) in zip(pairs, soft):
            logits = target(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
            expected = logits.float().log_softmax(-1).topk(k, dim=-1)
            assert torch.equal(ids.long(), expected.indices)
            torch.testing.assert_close(log_probs.float(), expected.values, atol=2e-3, rtol=0)


def test_on_policy_rounds_need_soft_targets(target_dir: Path, tmp_path: Path):
    data = tmp_path / "rollouts.jsonl"
    data.write_text('{"prompt_token_ids": [1], "token_ids": [2]}\n')
    result = runner.invoke(app, distill_args(target_dir, data, tmp_path / "out", "--init-layers", "1",
                                             "--soft-top-k", "0", "--student-rounds", "1"))
    assert result.exit_code == 2, result.output
    assert "--student-rounds needs --soft-top-k > 0" in " ".join(result.output.split())


def test_coupled_loss_trains_a_sub_vocabulary_head_and_needs_soft_targets(target_dir: Path, tmp_path: Path):
    """Top-k entries outside the draft head (column -1) must not turn the acceptance objective into NaN."""
    records = tmp_path / "rollouts.jsonl"
    records.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, 7], "token_ids": [8, 9, 10, 11, i]}) + "\n"
                               for i in range(4)))
    out = tmp_path / "drafter"
    args = ("--init-layers", "1", "--soft-top-k", "8", "--draft-vocab", "12", "--steps", "3", "--loss", "coupled")
    result = runner.invoke(app, distill_args(target_dir, records, out, *args))
    assert result.exit_code == 0, result.output
    losses = re.search(r"loss (\S+) -> (\S+)\)", " ".join(result.output.split()))
    assert losses is not None and all(math.isfinite(float(v)) for v in losses.groups()), result.output
    drafter = load_hf_model(out, "float32")
    assert all(torch.isfinite(p).all() for p in drafter.parameters())
    refused = runner.invoke(app, distill_args(target_dir, records, tmp_path / "other", "--init-layers", "1",
                                              "--soft-top-k", "0", "--loss", "coupled"))
    assert refused.exit_code == 2, refused.output
    assert "--loss coupled needs --soft-top-k > 0" in " ".join(refused.output.split())


def test_student_rounds_are_spread_evenly_over_the_run():
    rounds = StudentRounds(rounds=2)
    assert not rounds.due(0, 0.3) and rounds.due(0, 1 / 3)
    assert not rounds.due(1, 0.6) and rounds.due(1, 0.7)
    assert not rounds.due(2, 1.0)  # all collected
    assert not StudentRounds(rounds=0).due(0, 1.0)
