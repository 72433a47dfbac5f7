"""JSONL prompt files (parsing and file:line errors) and atomic output/stats writing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specactor_engine.io import PromptFileError, read_requests, write_outputs, write_stats
from specactor_engine.types import Request, SequenceOutput

OUTPUT_KEYS = {"id", "sample", "prompt_token_ids", "token_ids", "text", "logprobs", "finish_reason", "policy_version"}
GOOD_LINES = [
    '{"id": 1, "prompt": "What is 2+2?", "answer": "4"}',
    "",
    '{"id": "chat", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}',
    "   ",
    '{"id": "tok", "prompt_token_ids": [1, 2, 3]}',
]


def write_lines(tmp_path: Path, lines: list[str], name: str = "prompts.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def make_output(request_id: str = "a", sample_index: int = 0, text: str = "ok") -> SequenceOutput:
    return SequenceOutput(request_id, sample_index, [1, 2], [5, 6], text, [-0.5, -0.25], "stop", 3)


def test_read_requests_all_three_forms(tmp_path: Path) -> None:
    requests = read_requests(write_lines(tmp_path, GOOD_LINES))
    assert requests == [
        Request("1", prompt="What is 2+2?"),
        Request(
            "chat",
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        ),
        Request("tok", prompt_token_ids=[1, 2, 3]),
    ]


def test_message_extra_keys_are_kept(tmp_path: Path) -> None:
    line = '{"id": 0, "messages": [{"role": "user", "content": "x", "name": "bob"}]}'
    (request,) = read_requests(write_lines(tmp_path, [line]))
    assert request.messages == [{"role": "user", "content": "x", "name": "bob"}]


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"id": 9, "prompt": "x"', "invalid JSON: Expecting ',' delimiter (column 24)"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt": "x"}', "'id' is required"),
        ('{"id": null, "prompt": "x"}', "'id' must be a string or an integer (got None)"),
        ('{"id": 1.5, "prompt": "x"}', "'id' must be a string or an integer (got 1.5)"),
        ('{"id": true, "prompt": "x"}', "'id' must be a string or an integer (got True)"),
        ('{"id": 9}', "expected exactly one of 'prompt', 'messages', 'prompt_token_ids' (found none)"),
        ('{"id": 9, "prompt": "a", "prompt_token_ids": [1]}', "(found 'prompt', 'prompt_token_ids')"),
        ('{"id": 9, "prompt": 5}', "'prompt': must be a string (got 5)"),
        ('{"id": 9, "prompt": ""}', "'prompt': must not be empty"),
        ('{"id": 9, "prompt_token_ids": []}', "'prompt_token_ids': must not be empty (got [])"),
        ('{"id": 9, "prompt_token_ids": [1, 2.5]}', "'prompt_token_ids.1': must be an integer (got 2.5)"),
        ('{"id": 9, "prompt_token_ids": [1, "2"]}', "'prompt_token_ids.1': must be an integer (got '2')"),
        ('{"id": 9, "prompt_token_ids": [-1]}', "'prompt_token_ids.0': must be >= 0 (got -1)"),
        ('{"id": 9, "messages": "hi"}', "'messages': must be a list (got 'hi')"),
        ('{"id": 9, "messages": []}', "'messages': must not be empty"),
        ('{"id": 9, "messages": [{"role": "user"}]}', "'messages.0.content' is required"),
        ('{"id": 9, "messages": [{"role": "user", "content": 3}]}', "'messages.0.content': must be a string (got 3)"),
    ],
)
def test_bad_line_reports_file_and_line(tmp_path: Path, line: str, expected: str) -> None:
    path = write_lines(tmp_path, GOOD_LINES + [line])
    with pytest.raises(PromptFileError) as info:
        read_requests(path)
    assert str(info.value).startswith(f"{path}:6: ")
    assert expected in str(info.value)


def test_duplicate_id_names_the_first_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path, GOOD_LINES + ['{"id": "1", "prompt": "again"}'])
    with pytest.raises(PromptFileError, match=r"prompts\.jsonl:6: duplicate id '1' \(first used on line 1\)"):
        read_requests(path)


def test_non_utf8_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": 1, "prompt": "ok"}\n{"id": 2, "prompt": "caf\xe9"}\n')
    with pytest.raises(PromptFileError, match=r"latin1\.jsonl:2: not UTF-8 text"):
        read_requests(path)


def test_empty_file(tmp_path: Path) -> None:
    with pytest.raises(PromptFileError, match=r"empty\.jsonl: no requests in file"):
        read_requests(write_lines(tmp_path, ["", ""], "empty.jsonl"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_requests(tmp_path / "missing.jsonl")


def test_write_outputs_lines(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "out.jsonl"
    outputs = [make_output("a", 0, "héllo"), make_output("a", 1), make_output("b", 0)]
    assert write_outputs(path, outputs) == 3
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [set(r) for r in records] == [OUTPUT_KEYS] * 3
    assert records[0] == {
        "id": "a", "sample": 0, "prompt_token_ids": [1, 2], "token_ids": [5, 6], "text": "héllo",
        "logprobs": [-0.5, -0.25], "finish_reason": "stop", "policy_version": 3,
    }
    assert [(r["id"], r["sample"]) for r in records] == [("a", 0), ("a", 1), ("b", 0)]
    assert sorted(p.name for p in path.parent.iterdir()) == ["out.jsonl"]


def test_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old\n")

    def outputs():
        yield make_output()
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        write_outputs(path, outputs())
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def test_write_stats(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    stats = {"mode": "coupled", "accepted_per_position": [3, 2], "acceptance_rate": 0.625}
    write_stats(path, stats)
    assert json.loads(path.read_text()) == stats
    write_stats(path, {"mode": "ar"})
    assert json.loads(path.read_text()) == {"mode": "ar"}
    assert path.stat().st_mode & 0o777 == 0o644
