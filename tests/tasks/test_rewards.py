import math
import threading

import pytest

from tasks.prompts import reasoning_gym_items
from tasks.rewards import (
    REWARDS,
    combine_rewards,
    extract_final_answer,
    get_reward,
    register_reward,
    validate_reward_weights,
)

SCORED_TASKS = ("chain_sum", "basic_arithmetic", "countdown", "gsm_symbolic")
# What reasoning-gym's scorers give a completion with no answer at all (countdown has a 0.01 floor).
NO_ANSWER_REWARD = {"chain_sum": 0.0, "basic_arithmetic": 0.0, "countdown": 0.01, "gsm_symbolic": 0.0}


def _item(task: str, index: int = 3, seed: int = 11) -> dict:
    return reasoning_gym_items(task, count=index + 1, seed=seed)[index]


def _wrong_answer(task: str, item: dict) -> str:
    if task == "countdown":  # uses every number once but misses the target
        return " + ".join(str(number) for number in item["metadata"]["numbers"])
    return str(int(item["answer"]) + 1)


def _columns(item: dict, rows: int) -> dict[str, list]:
    return {"id": [item["id"]] * rows, "answer": [item["answer"]] * rows, "task": [item["task"]] * rows}


@pytest.mark.parametrize("task", SCORED_TASKS)
def test_reasoning_gym_reward_right_wrong_and_missing(task):
    item = _item(task)
    assert _wrong_answer(task, item) != item["answer"]
    completions = [
        f"Let me work it out.\nThe result is \\boxed{{{item['answer']}}}.",
        f"Let me work it out.\nAnswer: {item['answer']}",
        f"Let me work it out.\n\\boxed{{{_wrong_answer(task, item)}}}",
        "I am not sure.",
        "",
    ]
    rewards = get_reward("reasoning_gym")(completions, **_columns(item, len(completions)))
    assert rewards[:2] == [1.0, 1.0]
    assert rewards[2] < 0.1
    assert rewards[3:] == [NO_ANSWER_REWARD[task]] * 2


@pytest.mark.parametrize("task", SCORED_TASKS)
def test_metadata_column_and_id_rebuild_agree(task):
    items = reasoning_gym_items(task, count=4, seed=2)
    completions = [f"\\boxed{{{item['answer']}}}" for item in items[:2]] + ["\\boxed{0}", "nothing"]
    columns = {key: [item[key] for item in items] for key in ("id", "answer", "task")}
    from_ids = get_reward("reasoning_gym")(completions, **columns)
    from_metadata = get_reward("reasoning_gym")(completions, **columns, metadata=[item["metadata"] for item in items])
    assert from_ids == from_metadata
    assert from_ids[:2] == [1.0, 1.0]


def test_countdown_needs_the_metadata_not_just_the_value():
    item = _item("countdown")
    target = str(item["metadata"]["target"])
    rewards = get_reward("reasoning_gym")([f"\\boxed{{{target}}}"], **_columns(item, 1))
    assert rewards == [0.05]  # the bare target is a well-formed expression with the wrong numbers


def test_reasoning_gym_reward_is_none_for_other_rows():
    completions = ["\\boxed{4}", "\\boxed{4}"]
    rewards = get_reward("reasoning_gym")(completions, id=["mine-0", "x"], answer=["4", "4"], task=["", "x"])
    assert rewards == [None, None]


def test_rebuild_refuses_ids_that_do_not_match_the_answers():
    item = _item("chain_sum")
    with pytest.raises(ValueError, match="differs from the regenerated item"):
        get_reward("reasoning_gym")(["\\boxed{1}"], id=[item["id"]], answer=["not the answer"], task=["chain_sum"])
    with pytest.raises(ValueError, match="expected an id 'chain_sum-<seed>-<index>'"):
        get_reward("reasoning_gym")(["\\boxed{1}"], id=["row-7"], answer=["1"], task=["chain_sum"])


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("so \\boxed{\\frac{1}{2}} it is", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{3} first, then \\boxed{5}", "5"),  # the last box wins
        ("work\n**Answer:** 1,234.", "1234"),
        ("Final answer: $-7$", "-7"),
        ("Answer: $12$.", "12"),
        ("The total is \\boxed{\\$1,200}.", "1200"),
        ("\\boxed{\\text{42}} apples", "42"),
        ("\\boxed{6 \\times (4 - 1)}", "6 * (4 - 1)"),
        ("we get 3 apples and then 12 pears", "12"),  # fallback: last number
        ("no digits here", None),
        ("\\boxed{}", None),
    ],
)
def test_extract_final_answer(completion, expected):
    assert extract_final_answer(completion) == expected


def test_math_verify_accepts_boxed_and_answer_forms():
    completions = [
        "Thus \\boxed{28080}.",
        "Thus\nAnswer: 28080",
        "Thus\nAnswer: 28,080 pounds",
        "Thus \\boxed{28081}",
        "Answer: -28080",
        "no answer",
    ]
    rewards = get_reward("math_verify")(completions, answer=["28080"] * len(completions))
    assert rewards == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_math_verify_compares_values_not_strings():
    completions = ["\\boxed{\\frac{1}{2}}", "Answer: 0.5", "\\boxed{\\dfrac{2}{4}}", "\\boxed{1/3}"]
    assert get_reward("math_verify")(completions, answer=["1/2"] * 4) == [1.0, 1.0, 1.0, 0.0]


def test_math_verify_skips_countdown_and_rows_without_reference():
    completions = ["\\boxed{164}", "\\boxed{1}"]
    rewards = get_reward("math_verify")(completions, answer=["6*(98 - 54) - 34 - 66", ""], task=["countdown", ""])
    assert rewards == [None, None]


def test_math_verify_works_outside_the_main_thread():
    """math-verify's SIGALRM timeout raises in worker threads (e.g. a Prefect thread runner)."""
    results = []
    worker = threading.Thread(target=lambda: results.append(get_reward("math_verify")(["\\boxed{4}"], answer=["4"])))
    worker.start()
    worker.join()
    assert results == [[1.0]]


@pytest.mark.parametrize(
    ("completion", "strict", "partial"),
    [
        ("so \\boxed{42}", 1.0, 1.0),
        ("so \\boxed{\\frac{1}{2}}", 1.0, 1.0),
        ("Answer: \\boxed{42}", 1.0, 1.0),
        ("work\nAnswer: 42", 1.0, 1.0),
        ("\\boxed{4} or \\boxed{2}", 0.0, 0.5),
        ("\\boxed{ }", 0.0, 0.5),
        ("\\boxed{42", 0.0, 0.5),
        ("Answer: 4\nAnswer: 2", 0.0, 0.5),
        ("Answer:", 0.0, 0.5),
        ("the answer is 42", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_format_reward(completion, strict, partial):
    assert get_reward("format")([completion]) == [strict]
    assert get_reward("format_partial")([completion]) == [partial]


def test_combine_rewards_weights_and_reports_none():
    completions = ["\\boxed{4}", "Answer: 5", "nothing"]
    columns = {"id": ["a-0", "a-1", "a-2"], "answer": ["4", "4", "4"], "task": ["", "", ""]}
    totals, per_reward = combine_rewards(
        completions, columns, {"math_verify": 1.0, "format": 0.25, "reasoning_gym": 2.0, "format_partial": 0.0}
    )
    assert per_reward["math_verify"] == [1.0, 0.0, 0.0]
    assert per_reward["format"] == [1.0, 1.0, 0.0]
    assert per_reward["reasoning_gym"] == [None, None, None]
    assert per_reward["format_partial"] == [1.0, 1.0, 0.0]  # weight 0: reported, not trained on
    assert totals == [1.25, 0.25, 0.0]


def test_combine_rewards_on_reasoning_gym_rows():
    item = _item("gsm_symbolic")
    totals, per_reward = combine_rewards(
        [f"\\boxed{{{item['answer']}}}", "no idea"], _columns(item, 2), {"reasoning_gym": 1.0, "format": 0.5}
    )
    assert totals == [1.5, 0.0]
    assert per_reward["reasoning_gym"] == [1.0, 0.0]


def test_unknown_reward_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown reward 'accuracy'") as error:
        get_reward("accuracy")
    assert all(name in str(error.value) for name in ("reasoning_gym", "math_verify", "format"))
    with pytest.raises(ValueError, match="unknown reward\\(s\\) 'acc'.*known rewards: .*math_verify"):
        validate_reward_weights({"format": 1.0, "acc": 1.0})


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({}, "no rewards configured"),
        ({"format": math.nan}, "finite number"),
        ({"format": True}, "finite number"),
        ({"format": "1"}, "finite number"),
        ({"format": 0.0, "math_verify": 0}, "all reward weights are 0"),
    ],
)
def test_bad_weights_are_refused(weights, message):
    with pytest.raises(ValueError, match=message):
        validate_reward_weights(weights)


def test_validate_reward_weights_returns_floats():
    assert validate_reward_weights({"format": 1, "math_verify": -0.5}) == {"format": 1.0, "math_verify": -0.5}


def test_combine_rewards_checks_columns_and_reward_output(monkeypatch):
    with pytest.raises(ValueError, match="column 'answer' has 1 rows, expected 2"):
        combine_rewards(["a", "b"], {"answer": ["1"]}, {"format": 1.0})
    monkeypatch.setitem(REWARDS, "broken", lambda completions, **_: [math.inf] * len(completions))
    with pytest.raises(ValueError, match="reward 'broken' returned inf"):
        combine_rewards(["a"], {}, {"broken": 1.0})
    monkeypatch.setitem(REWARDS, "short", lambda completions, **_: [])
    with pytest.raises(ValueError, match="reward 'short' returned 0 values for 1 completions"):
        combine_rewards(["a"], {}, {"short": 1.0})


def test_register_reward_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr("tasks.rewards.REWARDS", dict(REWARDS))
    with pytest.raises(ValueError, match="'format' is already registered"):
        register_reward("format")(lambda completions, **_: [0.0] * len(completions))


def test_numeric_closeness_gives_graded_credit():
    from tasks.rewards import get_reward

    reward = get_reward("numeric_closeness")
    scores = reward(["so \\boxed{42}", "Answer: 40", "the result is 100", "no number here", "\\boxed{42}"],
                    answer=["42", "42", "42", "42", "forty-two"])
    assert scores[0] == 1.0
    assert 0.9 < scores[1] < 1.0 and 0.0 < scores[2] < scores[1]
    assert scores[3] == 0.0 and scores[4] is None
