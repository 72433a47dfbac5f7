"""A drafter-distillation run as a library call (`training.job`), and the teacher cache it relies on.

The CLI's own behaviour (options, messages, exit codes, resuming) is in tests/cli/test_drafter_distill_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specactor_engine.model.runner import load_hf_model
from specactor_engine.training.job import DistillJob, DistillJobError, run_distill, special_ids
from specactor_engine.training.samples import DistillDataError
from specactor_engine.training.teacher import TEACHER_FILE, load_or_compute_teacher, teacher_topk
from tests.fixtures.tiny_models import EOS_ID, make_tiny_model, make_tokenizer, save_tiny_model


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, "give exactly one of --init and --init-layers"),
    ({"init": "a", "init_layers": 1}, "give exactly one of --init and --init-layers"),
    ({"init_layers": 2, "freeze_layers": 2}, "--freeze-layers 2 leaves nothing to train in a 2-layer drafter"),
    ({"init_layers": 1, "loss": "coupled", "soft_top_k": 0}, "--loss coupled needs --soft-top-k > 0"),
    ({"init_layers": 1, "student_rounds": 1, "soft_top_k": 0}, "--student-rounds needs --soft-top-k > 0"),
])
def test_options_that_make_no_run_are_refused_before_loading(tmp_path: Path, fields: dict, expected: str):
    job = DistillJob(target="not-loaded", data=tmp_path / "data.jsonl", out=tmp_path / "out", **fields)
    with pytest.raises(DistillJobError, match=expected):
        job.check()


def test_a_job_trains_and_saves_a_drafter_without_the_cli(tmp_path: Path):
    target = save_tiny_model(tmp_path / "target", "llama", seed=4, num_layers=2)
    records = tmp_path / "rollouts.jsonl"
    records.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, 7], "token_ids": [8, 9, 10, i]}) + "\n"
                               for i in range(4)))
    job = DistillJob(target=str(target), data=records, out=tmp_path / "drafter", init_layers=1, steps=2,
                     batch_size=2, save_every=1, soft_top_k=4, draft_vocab=0, bf16_autocast=False)
    result = run_distill(job)  # the default reporter logs
    assert (result.steps, result.trained_steps, result.student_rounds) == (2, 2, 0)
    assert result.loss_first is not None and result.out == job.out
    assert load_hf_model(job.out, "float32").config.num_hidden_layers == 1
    assert len(torch.load(job.out / TEACHER_FILE, weights_only=True)) == 4


def test_a_missing_data_file_is_named(tmp_path: Path):
    target = save_tiny_model(tmp_path / "target", "llama", seed=4, num_layers=2)
    job = DistillJob(target=str(target), data=tmp_path / "missing.jsonl", out=tmp_path / "drafter", init_layers=1)
    with pytest.raises(DistillDataError, match="--data .*missing.jsonl: no such file"):
        run_distill(job)


def test_a_teacher_cache_that_does_not_match_the_samples_is_recomputed(tmp_path: Path):
    target = make_tiny_model("llama", seed=2)
    pairs = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])]
    stale = teacher_topk(target, [([1, 2, 3], [4])], k=3)  # another run's samples: one pair, one position
    torch.save(stale, tmp_path / TEACHER_FILE)
    soft = load_or_compute_teacher(tmp_path, target, pairs, k=3)
    expected = teacher_topk(target, pairs, k=3)
    assert len(soft) == 2 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(soft, expected))
    # and the recomputed cache is what a resumed run loads, without a target
    assert all(torch.equal(a[0], b[0]) for a, b in zip(load_or_compute_teacher(tmp_path, None, pairs, k=3), expected))


def test_a_draft_head_always_covers_the_special_tokens():
    ids = special_ids(make_tokenizer())
    assert EOS_ID in ids and ids == sorted(set(ids))
