import json
from collections import Counter
from pathlib import Path

import datasets
import pytest

from specactor_engine.config import DataConfig
from specactor_engine.io import read_requests
from tasks.data import (
    DataError,
    batch_for_step,
    load_prompt_dataset,
    train_eval_split,
    write_prompt_file,
)
from tasks.prompts import build_prompt, reasoning_gym_items

COLUMNS = ["id", "messages", "answer", "task", "metadata"]
RECORDS = [
    {"prompt": "What is 1 + 1?", "answer": "2"},
    {"prompt": "What is 2 + 3?", "answer": "5"},
    {"prompt": "What is 7 * 6?", "answer": "42"},
]


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def _expected_local(stem: str, records: list[dict]) -> list[dict]:
    return [
        {"id": f"{stem}-{i}", "messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"], "task": "",
         "metadata": None}
        for i, r in enumerate(records)
    ]


@pytest.fixture(scope="module")
def gym_ds() -> datasets.Dataset:
    source = DataConfig(kind="reasoning_gym", tasks=["chain_sum", "gsm_symbolic"], count_per_task=10, seed=4)
    return load_prompt_dataset(source)


def test_reasoning_gym_source(gym_ds):
    assert gym_ds.column_names == COLUMNS
    items = reasoning_gym_items("chain_sum", 10, 4) + reasoning_gym_items("gsm_symbolic", 10, 4)
    assert gym_ds.to_list() == [
        {"id": item["id"], "messages": build_prompt(item["question"]), "answer": item["answer"], "task": item["task"],
         "metadata": json.dumps(item["metadata"], sort_keys=True, default=str)}
        for item in items
    ]


def test_a_task_config_sets_the_difficulty_and_the_reward_scores_from_the_rows_metadata():
    """Items generated with a task_config differ from the defaults of the same id, so the reasoning_gym reward
    must score them from the metadata the rows carry, not by rebuilding the item from the id."""
    from tasks.rewards import combine_rewards

    easy = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    ds = load_prompt_dataset(DataConfig(tasks=["chain_sum"], count_per_task=8, seed=3, task_config={"chain_sum": easy}))
    default = load_prompt_dataset(DataConfig(tasks=["chain_sum"], count_per_task=8, seed=3))
    assert ds["id"] == default["id"] and ds["answer"] != default["answer"]
    for row in ds:
        assert json.loads(row["metadata"])["num_terms"] == 2 and len(row["messages"][0]["content"]) > 0
    columns = {"answer": ds["answer"], "task": ds["task"], "id": ds["id"], "metadata": ds["metadata"]}
    right = [f"\\boxed{{{answer}}}" for answer in ds["answer"]]
    totals, per_reward = combine_rewards(right, columns, {"reasoning_gym": 1.0})
    assert per_reward["reasoning_gym"] == [1.0] * len(ds)
    with pytest.raises(ValueError, match="task_config names tasks not in data.tasks"):
        DataConfig(tasks=["chain_sum"], task_config={"basic_arithmetic": easy})
    with pytest.raises(ValueError, match="reasoning-gym refused it"):
        load_prompt_dataset(DataConfig(tasks=["chain_sum"], count_per_task=2, task_config={"chain_sum": {"bogus": 1}}))


def test_jsonl_source(tmp_path):
    path = _write_jsonl(tmp_path / "toy.jsonl", RECORDS)
    ds = load_prompt_dataset(DataConfig(kind="jsonl", path=str(path)))
    assert ds.column_names == COLUMNS
    assert ds.to_list() == _expected_local("toy", RECORDS)


def test_parquet_source_with_numeric_answers(tmp_path):
    datasets.Dataset.from_list([{"prompt": r["prompt"], "answer": int(r["answer"])} for r in RECORDS]).to_parquet(
        str(tmp_path / "toy.parquet")
    )
    ds = load_prompt_dataset(DataConfig(kind="parquet", path=str(tmp_path / "toy.parquet")))
    assert ds.to_list() == _expected_local("toy", RECORDS)


def test_saved_dataset_and_dataset_dict(tmp_path):
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "plain"))
    assert load_prompt_dataset(DataConfig(kind="hf_disk", path=str(tmp_path / "plain"))).to_list() == _expected_local(
        "plain", RECORDS
    )
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(RECORDS[:2]), "test": datasets.Dataset.from_list(RECORDS[2:])}
    )
    splits.save_to_disk(str(tmp_path / "dict"))
    loaded = load_prompt_dataset(DataConfig(kind="hf_disk", path=str(tmp_path / "dict"), split="test"))
    assert loaded["answer"][:] == ["42"]
    with pytest.raises(DataError, match="no split 'valid'.*splits: train, test"):
        load_prompt_dataset(DataConfig(kind="hf_disk", path=str(tmp_path / "dict"), split="valid"))


def test_custom_columns_and_instruction(tmp_path):
    records = [
        {"uid": 17, "question": "What is 2 + 2?", "solution": 4, "kind": "add"},
        {"uid": 18, "question": "What is 3 * 3?", "solution": 9, "kind": "mul"},
    ]
    path = _write_jsonl(tmp_path / "custom.jsonl", records)
    source = DataConfig(
        kind="jsonl",
        path=str(path),
        prompt_column="question",
        answer_column="solution",
        id_column="uid",
        task_column="kind",
        instruction="Put the answer in \\boxed{}.",
    )
    assert load_prompt_dataset(source).to_list() == [
        {
            "id": str(record["uid"]),
            "messages": [{"role": "user", "content": f"{record['question']}\n\nPut the answer in \\boxed{{}}."}],
            "answer": str(record["solution"]),
            "task": record["kind"],
            "metadata": None,
        }
        for record in records
    ]


def test_chat_prompts_are_kept_and_a_directory_is_read_in_name_order(tmp_path):
    chats = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 + 3?"}],
        [{"role": "user", "content": "4 + 4?"}],
    ]
    _write_jsonl(tmp_path / "b.jsonl", [{"messages": chats[1], "answer": "8"}])
    _write_jsonl(tmp_path / "a.jsonl", [{"messages": chats[0], "answer": "6"}])
    ds = load_prompt_dataset(DataConfig(kind="jsonl", path=str(tmp_path), prompt_column="messages", instruction="x"))
    assert ds["messages"][:] == chats  # chat prompts are used as they are, without the instruction
    assert ds["answer"][:] == ["6", "8"]


def test_missing_column_names_file_column_and_available_columns(tmp_path):
    path = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "1 + 1?", "answer": "2"}])
    with pytest.raises(DataError) as error:
        load_prompt_dataset(DataConfig(kind="jsonl", path=str(path)))
    message = str(error.value)
    assert str(path) in message and "no column 'prompt'" in message and "available columns: question, answer" in message

    with pytest.raises(DataError, match="no column 'solution'"):
        load_prompt_dataset(DataConfig(kind="jsonl", path=str(path), prompt_column="question",
                                       answer_column="solution"))


def test_row_without_answer_or_prompt_is_refused(tmp_path):
    path = _write_jsonl(tmp_path / "holes.jsonl", [RECORDS[0], {"prompt": "What is 3 + 3?"}])
    with pytest.raises(DataError, match=r"holes\.jsonl: row 1: no answer in column 'answer'"):
        load_prompt_dataset(DataConfig(kind="jsonl", path=str(path)))
    path = _write_jsonl(tmp_path / "blank.jsonl", [RECORDS[0], {"prompt": "  ", "answer": "1"}])
    with pytest.raises(DataError, match=r"blank\.jsonl: row 1: no prompt in column 'prompt'"):
        load_prompt_dataset(DataConfig(kind="jsonl", path=str(path)))


def test_bad_sources_fail_with_clear_messages(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_dataset(DataConfig(kind="parquet", path=str(tmp_path / "absent.parquet")))
    duplicate = _write_jsonl(tmp_path / "dup.jsonl", [{**RECORDS[0], "id": "a"}, {**RECORDS[1], "id": "a"}])
    with pytest.raises(DataError, match="duplicate id 'a'"):
        load_prompt_dataset(DataConfig(kind="jsonl", path=str(duplicate), id_column="id"))
    (tmp_path / "broken.jsonl").write_text("{not json\n", encoding="utf-8")
    with pytest.raises(DataError, match="broken.jsonl: cannot read as jsonl"):
        load_prompt_dataset(DataConfig(kind="jsonl", path=str(tmp_path / "broken.jsonl")))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "reasoning_gym", "tasks": []}, "needs data.tasks"),
        ({"kind": "reasoning_gym", "tasks": ["chain_sum", "sudoku"]}, "unknown task"),
        ({"kind": "jsonl"}, "needs data.path"),
        ({"kind": "csv", "path": "x.csv"}, "kind"),
        ({"kind": "jsonl", "path": "x.jsonl", "prompt_col": "q"}, "prompt_col"),
    ],
)
def test_prompt_source_is_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        load_prompt_dataset(DataConfig(**fields))


def test_split_is_deterministic_disjoint_and_order_free(gym_ds):
    train, evaluation = train_eval_split(gym_ds, eval_fraction=0.25, seed=0)
    again_train, again_eval = train_eval_split(gym_ds, eval_fraction=0.25, seed=0)
    assert (train["id"][:], evaluation["id"][:]) == (again_train["id"][:], again_eval["id"][:])
    assert len(evaluation) == 5 and len(train) == 15
    assert sorted(train["id"][:] + evaluation["id"][:]) == sorted(gym_ds["id"][:])

    shuffled_eval = train_eval_split(gym_ds.shuffle(seed=3), eval_fraction=0.25, seed=0)[1]
    assert sorted(shuffled_eval["id"][:]) == sorted(evaluation["id"][:])
    assert set(train_eval_split(gym_ds, eval_fraction=0.25, seed=1)[1]["id"][:]) != set(evaluation["id"][:])


def test_split_edge_cases(gym_ds):
    train, evaluation = train_eval_split(gym_ds, eval_fraction=0.0, seed=0)
    assert len(train) == len(gym_ds) and len(evaluation) == 0
    assert len(train_eval_split(gym_ds, eval_fraction=0.001, seed=0)[1]) == 1
    with pytest.raises(ValueError, match="eval_fraction must be in"):
        train_eval_split(gym_ds, eval_fraction=1.0, seed=0)


def test_batch_for_step_is_deterministic(gym_ds):
    first = [batch_for_step(gym_ds, step, prompts_per_step=6, seed=9)["id"][:] for step in range(7)]
    second = [batch_for_step(gym_ds, step, prompts_per_step=6, seed=9)["id"][:] for step in range(7)]
    assert first == second
    assert first != [batch_for_step(gym_ds, step, prompts_per_step=6, seed=10)["id"][:] for step in range(7)]
    assert all(len(batch) == len(set(batch)) == 6 for batch in first)


def test_batch_for_step_cycles_epochs_with_a_fresh_shuffle(gym_ds):
    """20 rows, 5 per step: 4 steps per epoch, each epoch visits every row exactly once."""
    batches = [batch_for_step(gym_ds, step, prompts_per_step=5, seed=0)["id"][:] for step in range(12)]
    epochs = [sum(batches[start : start + 4], []) for start in (0, 4, 8)]
    assert all(Counter(epoch) == Counter(gym_ds["id"][:]) for epoch in epochs)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]

    leftover = [batch_for_step(gym_ds, step, prompts_per_step=6, seed=0)["id"][:] for step in range(3)]
    assert len(set(sum(leftover, []))) == 18  # 3 steps of 6 per epoch; 2 rows sit out this epoch


def test_batch_for_step_refuses_bad_arguments(gym_ds):
    with pytest.raises(ValueError, match="prompts_per_step must be in \\[1, 20\\]"):
        batch_for_step(gym_ds, 0, prompts_per_step=21, seed=0)
    with pytest.raises(ValueError, match="step must be >= 0"):
        batch_for_step(gym_ds, -1, prompts_per_step=2, seed=0)


def test_prompt_file_is_what_the_engine_reads(gym_ds, tmp_path):
    batch = batch_for_step(gym_ds, 1, prompts_per_step=4, seed=0)
    path = write_prompt_file(batch, tmp_path / "step-1" / "prompts.jsonl")
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [set(line) for line in lines] == [{"id", "messages"}] * 4
    requests = read_requests(path)
    assert [request.request_id for request in requests] == batch["id"][:]
    assert [request.messages for request in requests] == batch["messages"][:]
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
