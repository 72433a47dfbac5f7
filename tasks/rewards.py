"""Reward functions in a registry, all with the TRL signature `fn(completions, **columns)`.

`columns` are per-row lists aligned with `completions` (e.g. `id=[...]`, `answer=[...]`, `task=[...]`,
`metadata=[...]`); a reward ignores the columns it does not use. A reward returns one value per row:
a float, or None when it does not apply to the row (e.g. a reasoning-gym scorer on a row that is not
a reasoning-gym item). `combine_rewards` counts None as 0 in the weighted total but reports it.

Final answers are read from the last `\\boxed{...}` (nested braces allowed), else the last `Answer:`
line, else the last number in the completion.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Mapping
from functools import cache, partial
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS as REASONING_GYM_DATASETS

from tasks.prompts import reasoning_gym_items

RewardFn = Callable[..., list[float | None]]
REWARDS: dict[str, RewardFn] = {}

MATH_VERIFY_TIMEOUT_S = 5
# Tasks whose reference answer is not a value to compare: a countdown answer is any expression that
# uses the given numbers, so math-verify (which would accept the bare target) does not apply.
MATH_VERIFY_SKIPPED_TASKS = frozenset({"countdown"})
FORMAT_PARTIAL_CREDIT = 0.5

_BOXED_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_LINE = re.compile(r"^[ \t>*_#-]*(?:final[ \t]+)?answer[ \t*_]*:[ \t*_]*(.*)$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_LATEX_REPLACEMENTS = (
    ("\\times", "*"),
    ("\\cdot", "*"),
    ("\\div", "/"),
    ("\\!", ""),
    ("\\,", ""),
    ("\\$", ""),
    ("\u2212", "-"),  # unicode minus: reasoning-gym's decimal scorers score it 0
)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding `fn(completions, **columns) -> list[float | None]` to `REWARDS` under `name`."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The registered reward `name`; a ValueError lists the known names."""
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


def validate_reward_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Check names and weights before any work; return them as `{name: float}`.

    A zero weight is allowed: the reward is computed and reported but does not train.
    """
    if not weights:
        raise ValueError(f"no rewards configured; known rewards: {', '.join(sorted(REWARDS))}")
    unknown = [name for name in weights if name not in REWARDS]
    if unknown:
        raise ValueError(
            f"unknown reward(s) {', '.join(map(repr, unknown))} in reward weights; "
            f"known rewards: {', '.join(sorted(REWARDS))}"
        )
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ValueError(f"weight of reward {name!r} must be a finite number, got {weight!r}")
    if all(weight == 0 for weight in weights.values()):
        raise ValueError("all reward weights are 0: the policy would get no learning signal")
    return {name: float(weight) for name, weight in weights.items()}


def combine_rewards(
    completions: list[str], columns: dict[str, list[Any]], weights: Mapping[str, float]
) -> tuple[list[float], dict[str, list[float | None]]]:
    """Weighted sum of the rewards per row (None counts as 0) and each reward's own values."""
    weights = validate_reward_weights(weights)
    for column, values in columns.items():
        if len(values) != len(completions):
            raise ValueError(f"column {column!r} has {len(values)} rows, expected {len(completions)}")
    per_reward = {name: _checked(name, get_reward(name)(completions, **columns), len(completions)) for name in weights}
    totals = [
        sum(weight * (per_reward[name][row] or 0.0) for name, weight in weights.items())
        for row in range(len(completions))
    ]
    return totals, per_reward


def _checked(name: str, values: list[float | None], num_rows: int) -> list[float | None]:
    if len(values) != num_rows:
        raise ValueError(f"reward {name!r} returned {len(values)} values for {num_rows} completions")
    for value in values:
        if value is not None and not (isinstance(value, int | float) and math.isfinite(value)):
            raise ValueError(f"reward {name!r} returned {value!r}; expected a finite float or None")
    return [None if value is None else float(value) for value in values]


# ---------------------------------------------------------------------------------------------
# Answer extraction


def boxed_contents(text: str) -> list[str | None]:
    """Contents of every `\\boxed{...}` in order (nested braces kept); None for an unclosed one."""
    contents: list[str | None] = []
    for match in _BOXED_OPEN.finditer(text):
        depth, start = 1, match.end()
        for position in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth == 0:
                contents.append(text[start:position])
                break
        else:
            contents.append(None)
    return contents


def answer_lines(text: str) -> list[str]:
    """What follows `Answer:` on each answer line (markdown emphasis around the label allowed)."""
    return [match.group(1).strip().strip("*_").strip() for match in _ANSWER_LINE.finditer(text)]


def extract_final_answer(text: str) -> str | None:
    """The completion's final answer, normalised: last closed `\\boxed{}`, else last `Answer:` line,
    else the last number; None when there is none."""
    closed = [content for content in boxed_contents(text) if content is not None]
    lines = [line for line in answer_lines(text) if line]
    if closed:
        answer = closed[-1]
    elif lines:
        answer = lines[-1]
    else:
        numbers = _NUMBER.findall(text)
        answer = numbers[-1] if numbers else ""
    return normalize_answer(answer) or None


def normalize_answer(answer: str) -> str:
    """Surface clean-up only: math delimiters, LaTeX operators, `\\text{}`, thousands commas,
    a trailing period. Values are left to the scorers."""
    answer = answer.strip()
    for latex, plain in _LATEX_REPLACEMENTS:
        answer = answer.replace(latex, plain)
    answer = re.sub(r"\\(?:left|right)(?=[()\[\]|.])", "", answer)
    answer = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", answer)
    answer = answer.strip().rstrip(".").strip().strip("$").strip().rstrip(".").strip()
    if _THOUSANDS.match(answer):
        answer = answer.replace(",", "")
    return answer


# ---------------------------------------------------------------------------------------------
# Rewards


@register_reward("reasoning_gym")
def reasoning_gym_reward(
    completions: list[str],
    *,
    task: list[str],
    id: list[str] | None = None,  # noqa: A002 (the column's name)
    answer: list[str] | None = None,
    metadata: list[dict[str, Any] | str | None] | None = None,
    question: list[str] | None = None,
    **_: Any,
) -> list[float | None]:
    """reasoning-gym's own `score_answer` for each row's task; None for rows of other data.

    The scorer needs the item (answer and metadata): from the `metadata` column (dict or JSON) with
    `answer`, else rebuilt from the row id `<task>-<seed>-<index>`. A completion without an answer
    gets the scorer's floor (0.0; countdown gives 0.01).
    """
    rewards: list[float | None] = []
    for row, completion in enumerate(completions):
        if task[row] not in REASONING_GYM_DATASETS:
            rewards.append(None)
            continue
        entry = _entry(row, task, id, answer, metadata, question)
        rewards.append(float(_scorer(task[row])(extract_final_answer(completion), entry)))
    return rewards


@register_reward("math_verify")
def math_verify_reward(
    completions: list[str], *, answer: list[str], task: list[str] | None = None, **_: Any
) -> list[float | None]:
    """1.0 when math-verify finds the extracted final answer equal to `answer`, else 0.0.

    None for tasks whose reference is not a value (countdown) and for rows without a reference.
    """
    from math_verify import parse, verify  # imports sympy (~0.4 s); only when this reward is used

    # math-verify times out with SIGALRM, which only the main thread may set; elsewhere (Prefect
    # thread runners) the timeout is off, and parsing stays cheap because only the answer is parsed.
    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    rewards: list[float | None] = []
    for row, completion in enumerate(completions):
        if (task and task[row] in MATH_VERIFY_SKIPPED_TASKS) or answer[row] is None or answer[row] == "":
            rewards.append(None)
            continue
        predicted = extract_final_answer(completion)
        if predicted is None:
            rewards.append(0.0)
            continue
        gold = parse(str(answer[row]), parsing_timeout=timeout)
        guess = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
        rewards.append(1.0 if verify(gold, guess, timeout_seconds=timeout) else 0.0)
    return rewards


@register_reward("numeric_closeness")
def numeric_closeness_reward(completions: list[str], answer: list[Any], **_: Any) -> list[float | None]:
    """Partial credit for numeric answers: 1 / (1 + |pred - answer| / (|answer| + 1)).

    1.0 for the exact value, decaying smoothly with the relative error; 0.0 without a number.
    Dense enough that a small model gets reward variance within its groups (GRPO needs it).
    None for rows whose reference answer is not a number.
    """
    scores: list[float | None] = []
    for completion, reference in zip(completions, answer):
        target = _as_number(None if reference is None else str(reference))
        if target is None:
            scores.append(None)
            continue
        predicted = _as_number(extract_final_answer(completion))
        scores.append(0.0 if predicted is None else 1.0 / (1.0 + abs(predicted - target) / (abs(target) + 1.0)))
    return scores


def _as_number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(normalize_answer(text).replace(",", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


@register_reward("format")
def format_reward(completions: list[str], *, partial_credit: float = 0.0, **_: Any) -> list[float | None]:
    """1.0 for exactly one non-empty `\\boxed{}` (or, without a box, exactly one non-empty `Answer:`
    line); `partial_credit` when answer markup is there but malformed (several, empty, unclosed); else 0.0."""
    return [_format_score(completion, partial_credit) for completion in completions]


register_reward("format_partial")(partial(format_reward, partial_credit=FORMAT_PARTIAL_CREDIT))


def _format_score(completion: str, partial_credit: float) -> float:
    boxes = boxed_contents(completion)
    if boxes:
        well_formed = len(boxes) == 1 and boxes[0] is not None and boxes[0].strip() != ""
        return 1.0 if well_formed else partial_credit
    lines = answer_lines(completion)
    if lines:
        return 1.0 if len(lines) == 1 and lines[0] != "" else partial_credit
    return 0.0


# ---------------------------------------------------------------------------------------------
# reasoning-gym items


@cache
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    return reasoning_gym.get_score_answer_fn(task)


def _entry(
    row: int,
    task: list[str],
    ids: list[str] | None,
    answers: list[str] | None,
    metadata: list[dict[str, Any] | str | None] | None,
    questions: list[str] | None,
) -> dict[str, Any]:
    """The reasoning-gym entry a scorer reads: {question, answer, metadata}."""
    if metadata is not None and metadata[row] is not None and answers is not None:
        meta = json.loads(metadata[row]) if isinstance(metadata[row], str) else metadata[row]
        question = questions[row] if questions is not None else ""
        return {"question": question, "answer": answers[row], "metadata": meta}
    if ids is None:
        raise ValueError("the reasoning_gym reward needs a 'metadata' and an 'answer' column, or an 'id' column")
    item = _item_from_id(str(ids[row]), task[row])
    if answers is not None and str(answers[row]) != item["answer"]:
        raise ValueError(
            f"row {ids[row]!r}: answer {answers[row]!r} differs from the regenerated item's {item['answer']!r}; "
            "the ids do not match the data (pass a 'metadata' column instead)"
        )
    return item


_ITEMS: dict[tuple[str, int], list[dict[str, Any]]] = {}
_ITEMS_LOCK = threading.Lock()


def _item_from_id(row_id: str, task: str) -> dict[str, Any]:
    """Regenerate the item of id `<task>-<seed>-<index>` (cached per (task, seed), grown on demand)."""
    match = re.fullmatch(re.escape(task) + r"-(?P<seed>-?\d+)-(?P<index>\d+)", row_id)
    if match is None:
        raise ValueError(
            f"cannot rebuild the reasoning-gym item of row {row_id!r} (task {task!r}): "
            f"expected an id '{task}-<seed>-<index>' or a 'metadata' column"
        )
    seed, index = int(match["seed"]), int(match["index"])
    with _ITEMS_LOCK:
        items = _ITEMS.get((task, seed), [])
        if index >= len(items):
            items = reasoning_gym_items(task, max(index + 1, 2 * len(items)), seed)
            _ITEMS[(task, seed)] = items
    return items[index]
