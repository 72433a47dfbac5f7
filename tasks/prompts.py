"""Prompt files from reasoning-gym: verifiable tasks generated offline from a seed.

A prompt file holds only what the engine reads (`{"id", "messages"}` per line); the
reference answers go to a sibling `<stem>.answers.jsonl` (`{"id", "answer", "task"}`)
for reward scoring, so the engine's strict reader never sees them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import reasoning_gym

SUPPORTED_TASKS = ("chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic", "simple_equations")
INSTRUCTION = "Reason step by step, then give the final answer in \\boxed{}."


def reasoning_gym_items(task: str, count: int, seed: int, config: Mapping[str, Any] | None = None
                        ) -> list[dict[str, Any]]:
    """`count` items of `task`, deterministic for `seed` (and `config`, reasoning-gym's dataset settings of the
    task): dicts {id, question, answer, task, metadata}.

    Item i is the same whatever `count` is, so a larger count extends a smaller one.
    """
    if task not in SUPPORTED_TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of: {', '.join(SUPPORTED_TASKS)}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    try:
        dataset = reasoning_gym.create_dataset(task, size=count, seed=seed, **dict(config or {}))
    except (TypeError, AssertionError, ValueError) as error:
        raise ValueError(f"task_config of {task!r} {dict(config or {})}: reasoning-gym refused it ({error})") from error
    return [
        {
            "id": f"{task}-{seed}-{index}",
            "question": entry["question"],
            "answer": entry["answer"],
            "task": task,
            "metadata": entry["metadata"],
        }
        for index, entry in enumerate(dataset)
    ]


def build_prompt(question: str) -> list[dict[str, str]]:
    """Chat messages asking for step-by-step reasoning and a `\\boxed{}` final answer."""
    return [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}]


def answers_path(prompts_path: Path) -> Path:
    """Where the answers for a prompt file go: `prompts.jsonl` -> `prompts.answers.jsonl`."""
    return prompts_path.with_suffix(".answers.jsonl")


def write_reasoning_gym_prompts(task: str, count: int, seed: int, out: Path,
                                config: Mapping[str, Any] | None = None) -> Path:
    """Write `count` prompts of `task` (reasoning-gym settings `config`) to `out` (JSONL) and their answers beside
    it; return `out`."""
    items = reasoning_gym_items(task, count, seed, config)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out, [{"id": item["id"], "messages": build_prompt(item["question"])} for item in items])
    _write_jsonl(
        answers_path(out),
        [{"id": item["id"], "answer": item["answer"], "task": item["task"]} for item in items],
    )
    return out


def _write_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
