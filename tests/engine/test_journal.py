"""The rollout journal (`specactor_engine/journal.py`): what a killed run leaves is resumed, a torn last line is cut
off, and a journal of another rollout or a damaged one is refused with its file and line."""

from __future__ import annotations

import json

import pytest

from specactor_engine.journal import JournalError, RolloutJournal, journal_path, rollout_fingerprint
from specactor_engine.types import SequenceOutput


def output(request_id: str, sample: int) -> SequenceOutput:
    return SequenceOutput(request_id, sample, [1, 2], [3, 4, sample], "text", [-0.5, -0.25, -1.0], "stop", 2)


def test_the_journal_lives_beside_the_output_and_its_fingerprint_sees_config_and_prompts(tmp_path):
    assert journal_path(tmp_path / "out.jsonl.partial") == tmp_path / "out.jsonl.partial.journal"
    base = rollout_fingerprint("sampling: {n: 2}\n", b'{"id": 1, "prompt": "a"}\n')
    assert base == rollout_fingerprint("sampling: {n: 2}\n", b'{"id": 1, "prompt": "a"}\n')
    assert base != rollout_fingerprint("sampling: {n: 3}\n", b'{"id": 1, "prompt": "a"}\n')
    assert base != rollout_fingerprint("sampling: {n: 2}\n", b'{"id": 1, "prompt": "b"}\n')
    assert rollout_fingerprint("ab", b"c") != rollout_fingerprint("a", b"bc")  # parts are length-prefixed


def test_samples_appended_are_there_when_it_is_opened_again(tmp_path):
    path = tmp_path / "out.jsonl.journal"
    with RolloutJournal.open(path, "f1") as journal:
        assert journal.done == {}
        journal.append(output("a", 0))
        journal.append(output("b", 1))
        journal.append(output("a", 0))  # a pool's regenerated copy is not written twice
    assert len(path.read_text().splitlines()) == 3  # header + two samples
    with RolloutJournal.open(path, "f1") as journal:
        assert set(journal.done) == {("a", 0), ("b", 1)}
        assert journal.done[("b", 1)] == output("b", 1).to_json()
        journal.append(output("c", 0))
    assert set(RolloutJournal.open(path, "f1").done) == {("a", 0), ("b", 1), ("c", 0)}


def test_a_torn_last_line_is_dropped_and_cut_off_before_appending(tmp_path):
    path = tmp_path / "out.journal"
    with RolloutJournal.open(path, "f1") as journal:
        journal.append(output("a", 0))
    whole = path.read_bytes()
    path.write_bytes(whole + json.dumps(output("a", 1).to_json()).encode()[:25])  # killed mid-write
    with RolloutJournal.open(path, "f1") as journal:
        assert set(journal.done) == {("a", 0)}
        journal.append(output("a", 2))
    lines = path.read_text().splitlines()
    assert [json.loads(line).get("sample") for line in lines[1:]] == [0, 2]


def test_a_journal_killed_before_its_header_was_whole_starts_over(tmp_path):
    path = tmp_path / "out.journal"
    path.write_bytes(b'{"format": "specactor-rollout')
    with RolloutJournal.open(path, "f1") as journal:
        assert journal.done == {}
        journal.append(output("a", 0))
    assert set(RolloutJournal.open(path, "f1").done) == {("a", 0)}


def test_another_rollout_s_journal_is_refused_unless_restarted(tmp_path):
    path = tmp_path / "out.journal"
    with RolloutJournal.open(path, "f1") as journal:
        journal.append(output("a", 0))
    with pytest.raises(JournalError, match="different config or prompt file.*--restart"):
        RolloutJournal.open(path, "f2")
    with RolloutJournal.open(path, "f2", restart=True) as journal:
        assert journal.done == {}
    assert RolloutJournal.open(path, "f2").done == {}


def test_a_damaged_journal_names_its_line(tmp_path):
    path = tmp_path / "out.journal"
    path.write_text("not json\n")
    with pytest.raises(JournalError, match=r"out.journal:1: not a rollout journal"):
        RolloutJournal.open(path, "f1")
    with RolloutJournal.open(path, "f1", restart=True) as journal:
        journal.append(output("a", 0))
    path.write_text(path.read_text() + '{"id": "b"}\n' + json.dumps(output("c", 0).to_json()) + "\n")
    with pytest.raises(JournalError, match=r"out.journal:3: not an output line"):
        RolloutJournal.open(path, "f1")
