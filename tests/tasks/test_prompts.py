import json
from pathlib import Path

import pytest

from tasks.prompts import (
    INSTRUCTION,
    SUPPORTED_TASKS,
    answers_path,
    build_prompt,
    reasoning_gym_items,
    write_reasoning_gym_prompts,
)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("task", SUPPORTED_TASKS)
def test_items_are_deterministic_for_a_seed(task):
    first = reasoning_gym_items(task, count=6, seed=7)
    second = reasoning_gym_items(task, count=6, seed=7)
    assert first == second
    assert len(first) == 6
    assert all(item["question"] and item["answer"] and item["task"] == task for item in first)


@pytest.mark.parametrize("task", SUPPORTED_TASKS)
def test_ids_are_unique_and_keyed_by_task_seed_index(task):
    items = reasoning_gym_items(task, count=20, seed=3)
    ids = [item["id"] for item in items]
    assert len(set(ids)) == len(ids)
    assert ids[:2] == [f"{task}-3-0", f"{task}-3-1"]


def test_other_seed_gives_other_questions():
    questions_0 = [item["question"] for item in reasoning_gym_items("chain_sum", count=8, seed=0)]
    questions_1 = [item["question"] for item in reasoning_gym_items("chain_sum", count=8, seed=1)]
    assert questions_0 != questions_1


def test_larger_count_extends_smaller():
    small = reasoning_gym_items("basic_arithmetic", count=3, seed=5)
    large = reasoning_gym_items("basic_arithmetic", count=9, seed=5)
    assert large[:3] == small


def test_unknown_task_lists_valid_names():
    with pytest.raises(ValueError, match="unknown task 'no_such_task'") as error:
        reasoning_gym_items("no_such_task", count=2, seed=0)
    assert all(name in str(error.value) for name in SUPPORTED_TASKS)


def test_bad_count_is_refused():
    with pytest.raises(ValueError, match="count must be >= 1"):
        reasoning_gym_items("chain_sum", count=0, seed=0)


def test_build_prompt_is_one_user_message_with_the_instruction():
    messages = build_prompt("What is 2 + 3?")
    assert messages == [{"role": "user", "content": f"What is 2 + 3?\n\n{INSTRUCTION}"}]
    assert "\\boxed{}" in messages[0]["content"]


def test_write_prompts_keeps_answers_out_of_the_prompt_file(tmp_path):
    out = write_reasoning_gym_prompts("gsm_symbolic", count=4, seed=0, out=tmp_path / "demo" / "prompts.jsonl")
    prompts = _read_jsonl(out)
    answers = _read_jsonl(answers_path(out))
    items = reasoning_gym_items("gsm_symbolic", count=4, seed=0)

    assert answers_path(out) == tmp_path / "demo" / "prompts.answers.jsonl"
    assert all(set(line) == {"id", "messages"} for line in prompts)
    assert [line["messages"] for line in prompts] == [build_prompt(item["question"]) for item in items]
    assert answers == [{"id": item["id"], "answer": item["answer"], "task": "gsm_symbolic"} for item in items]
    assert [line["id"] for line in prompts] == [line["id"] for line in answers]


def test_write_prompts_is_byte_identical_across_runs(tmp_path):
    first = write_reasoning_gym_prompts("countdown", count=5, seed=11, out=tmp_path / "a.jsonl")
    second = write_reasoning_gym_prompts("countdown", count=5, seed=11, out=tmp_path / "b.jsonl")
    assert first.read_bytes() == second.read_bytes()
    assert answers_path(first).read_bytes() == answers_path(second).read_bytes()


def test_write_prompts_applies_the_task_config(tmp_path):
    out = write_reasoning_gym_prompts("chain_sum", count=6, seed=3, out=tmp_path / "p.jsonl",
                                      config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    questions = [json.loads(line)["messages"][0]["content"] for line in out.read_text().splitlines()]
    expressions = [q.split(": ", 1)[1].split(" =")[0] for q in questions]
    assert all(len(e.split()) == 3 and all(len(t) == 1 for t in e.split()[::2]) for e in expressions), expressions
