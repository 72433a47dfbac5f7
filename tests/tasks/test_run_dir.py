"""Run directory bookkeeping: atomic writes, publish, resume point."""

from __future__ import annotations

from pathlib import Path

import pytest

from specactor_engine.files import atomic_write_text
from tasks.run_dir import RunDir, read_jsonl, write_jsonl


def complete_checkpoint(run: RunDir, version: int) -> None:
    path = run.checkpoint(version)
    path.mkdir(parents=True)
    (path / "COMPLETE").write_text("ok")


def test_new_run_starts_at_step_one(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    assert run.next_step() == 1 and run.latest_version() == 0


def test_step_counts_only_when_metrics_and_checkpoint_are_published(tmp_path: Path):
    run = RunDir(tmp_path)
    write_jsonl(run.rollouts(1), [{"id": "a"}])
    run.write_metrics(1, {"reward": 0.5})
    assert run.next_step() == 1  # metrics but nothing published: redo step 1
    complete_checkpoint(run, 1)
    run.publish(1)
    assert run.completed_steps() == [1] and run.next_step() == 2
    write_jsonl(run.rollouts(2), [{"id": "b"}])  # step 2 crashed before metrics
    assert run.next_step() == 2
    assert read_jsonl(run.rollouts(1)) == [{"id": "a"}]


def test_publish_refuses_an_incomplete_checkpoint(tmp_path: Path):
    run = RunDir(tmp_path)
    run.checkpoint(1).mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not complete"):
        run.publish(1)
    assert run.latest_version() == 0


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path: Path, monkeypatch):
    target = atomic_write_text(tmp_path / "f.txt", "old")

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("specactor_engine.files.os.replace", boom)
    with pytest.raises(OSError):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_jsonl_records_whose_text_holds_unicode_line_separators_read_back_whole(tmp_path: Path):
    """A rollout's text may hold U+2028, U+2029 or U+0085 (SmolLM2 produced one at step 9 of a run): JSON keeps
    them unescaped, and `str.splitlines` would cut the record there."""
    records = [{"id": "a", "text": "one\u2028two\u2029three\x85four\x1cfive"}, {"id": "b", "text": "plain"}]
    path = write_jsonl(tmp_path / "rollouts.jsonl", records)
    assert "\u2028" in path.read_text(encoding="utf-8")  # written as is, not escaped
    assert read_jsonl(path) == records


def test_prune_checkpoints_keeps_the_newest_published_and_any_staged(tmp_path: Path):
    run = RunDir(tmp_path)
    for version in (1, 2, 3, 4):
        complete_checkpoint(run, version)
    run.publish(3)  # v4 staged by a step not yet published
    assert run.prune_checkpoints(3, keep=2) == [1]
    assert [v for v in (1, 2, 3, 4) if run.checkpoint(v).exists()] == [2, 3, 4]
    assert run.prune_checkpoints(3, keep=2) == []  # idempotent
    assert run.prune_checkpoints(4, keep=1) == [2, 3] and run.checkpoint(4).exists()
    assert RunDir(tmp_path / "none").prune_checkpoints(5, keep=1) == []
