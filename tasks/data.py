"""Prompt datasets for post-training: reasoning-gym tasks or local JSONL / parquet / saved HF datasets.

Every source becomes one `datasets.Dataset` with the columns
`id` (str, unique), `messages` (chat list of {role, content}), `answer` (str) and `task` (str, "" for
local data). The source is the validated `DataConfig` (specactor_engine/config.py, the run config's
train.data). Problems with the source (unknown task, missing file, missing column, empty prompt,
duplicate id) raise before anything else runs. `batch_for_step` picks each step's prompts
deterministically from a seed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from specactor_engine.config import DataConfig
from specactor_engine.files import atomic_writer
from tasks.prompts import SUPPORTED_TASKS, build_prompt, reasoning_gym_items

if TYPE_CHECKING:
    from datasets import Dataset

_FILE_SUFFIXES = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",)}
_HF_OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


class DataError(ValueError):
    """A prompt source that cannot be used; the message names the file and what is wrong."""


def check_source(source: DataConfig) -> None:
    """Refuse reasoning-gym task names this project cannot generate (the config checks the rest)."""
    unknown = [task for task in source.tasks if task not in SUPPORTED_TASKS] if source.kind == "reasoning_gym" else []
    if unknown:
        raise DataError(f"unknown task(s) {unknown}; expected any of: {', '.join(SUPPORTED_TASKS)}")


def load_prompt_dataset(source: DataConfig) -> Dataset:
    """The prompts of `source` (the run config's train.data) as a Dataset with columns id, messages, answer, task."""
    check_source(source)
    if source.kind == "reasoning_gym":
        return _to_dataset(_reasoning_gym_rows(source))
    raw, where = _read_local(source)
    return _to_dataset(_local_rows(raw, source, where))


def train_eval_split(ds: Dataset, eval_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Split off `round(len * eval_fraction)` rows (at least 1 when the fraction is > 0) for evaluation.

    A row's side depends only on its id and `seed` (rows ranked by a seeded hash of the id), so the
    split ignores row order and a prompt keeps its side when the dataset grows a little.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    num_eval = max(1, round(len(ds) * eval_fraction)) if eval_fraction > 0 else 0
    if num_eval >= len(ds):
        raise ValueError(f"eval_fraction {eval_fraction} of {len(ds)} rows leaves no training rows")
    ids = list(ds["id"])
    ranked = sorted(range(len(ds)), key=lambda row: _id_hash(seed, ids[row]))
    eval_rows = set(ranked[:num_eval])
    train = ds.select([row for row in range(len(ds)) if row not in eval_rows])
    return train, ds.select(sorted(eval_rows))


def batch_for_step(ds: Dataset, step: int, prompts_per_step: int, seed: int) -> Dataset:
    """The prompts of `step`: epochs of `len // prompts_per_step` steps, each over a fresh seeded shuffle.

    A batch never spans two epochs (the rows left over by the division sit out that epoch), so its
    ids are unique; the same (ds, step, prompts_per_step, seed) always gives the same batch.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if not 1 <= prompts_per_step <= len(ds):
        raise ValueError(f"prompts_per_step must be in [1, {len(ds)}] (the dataset size), got {prompts_per_step}")
    steps_per_epoch = len(ds) // prompts_per_step
    epoch, step_in_epoch = divmod(step, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(len(ds))
    start = step_in_epoch * prompts_per_step
    return ds.select(order[start : start + prompts_per_step].tolist())


def write_prompt_file(ds: Dataset, path: str | Path) -> Path:
    """Write the engine's prompt file (`{"id", "messages"}` per line) atomically; return its path."""
    target = Path(path)
    with atomic_writer(target) as handle:
        for row in ds.select_columns(["id", "messages"]):
            handle.write(json.dumps({"id": row["id"], "messages": row["messages"]}, ensure_ascii=False) + "\n")
    return target


def _reasoning_gym_rows(source: DataConfig) -> list[dict[str, Any]]:
    """Rows of the generated items; their metadata (JSON) goes along, so the reasoning_gym reward scores an item
    generated with a task_config from it rather than from the id (which it rebuilds with the defaults)."""
    rows = []
    for task in source.tasks:
        for item in reasoning_gym_items(task, source.count_per_task, source.seed, source.task_config.get(task)):
            rows.append({"id": item["id"], "messages": build_prompt(item["question"]), "answer": item["answer"],
                         "task": task, "metadata": json.dumps(item["metadata"], sort_keys=True, default=str)})
    return rows


def _read_local(source: DataConfig) -> tuple[Dataset, str]:
    """The raw table at `source.path` and a name for it in messages."""
    path = Path(source.path)  # type: ignore[arg-type]  # the validator ensures a path
    if not path.exists():
        raise FileNotFoundError(f"prompt source {path} does not exist (kind {source.kind!r})")
    datasets = _import_datasets()
    try:
        if source.kind == "hf_disk":
            return _pick_split(datasets.load_from_disk(str(path)), source.split, path), str(path)
        files = _data_files(path, source.kind)
        builder = "json" if source.kind == "jsonl" else "parquet"
        return datasets.load_dataset(builder, data_files=files, split="train"), str(path)
    except (DataError, FileNotFoundError):
        raise
    except Exception as error:  # pyarrow / datasets raise many types for unreadable input
        raise DataError(f"{path}: cannot read as {source.kind}: {error}") from error


def _data_files(path: Path, kind: str) -> list[str]:
    if path.is_file():
        return [str(path)]
    files = sorted(str(file) for file in path.iterdir() if file.suffix in _FILE_SUFFIXES[kind])
    if not files:
        raise FileNotFoundError(f"no {'/'.join(_FILE_SUFFIXES[kind])} files in directory {path}")
    return files


def _pick_split(loaded: Any, split: str, path: Path) -> Dataset:
    if not hasattr(loaded, "keys"):
        return loaded
    if split not in loaded:
        raise DataError(f"{path}: no split {split!r} in the saved DatasetDict (splits: {', '.join(loaded)})")
    return loaded[split]


def _local_rows(raw: Dataset, source: DataConfig, where: str) -> list[dict[str, Any]]:
    wanted = [source.prompt_column, source.answer_column, source.id_column, source.task_column]
    for column in filter(None, wanted):
        if column not in raw.column_names:
            raise DataError(
                f"{where}: no column {column!r} (available columns: {', '.join(raw.column_names)}); "
                "set prompt_column / answer_column / id_column / task_column to the right names"
            )
    if len(raw) == 0:
        raise DataError(f"{where}: no rows")
    rows = []
    for index, record in enumerate(raw):
        rows.append(
            {
                "id": _row_id(record, index, source, where),
                "messages": _messages(record[source.prompt_column], source, f"{where}: row {index}"),
                "answer": _answer(record[source.answer_column], source.answer_column, f"{where}: row {index}"),
                "task": str(record[source.task_column] or "") if source.task_column else "",
            }
        )
    _check_unique_ids(rows, where)
    return rows


def _row_id(record: dict[str, Any], index: int, source: DataConfig, where: str) -> str:
    if source.id_column is None:
        return f"{Path(where).stem}-{index}"
    if record[source.id_column] is None:
        raise DataError(f"{where}: row {index} has no value in id column {source.id_column!r}")
    return str(record[source.id_column])


def _messages(prompt: Any, source: DataConfig, where: str) -> list[dict[str, str]]:
    """A string prompt becomes one user message (plus the instruction); a message list is kept."""
    if isinstance(prompt, str) and prompt.strip():
        content = f"{prompt}\n\n{source.instruction}" if source.instruction else prompt
        return [{"role": "user", "content": content}]
    if isinstance(prompt, list) and prompt:
        if all(_is_message(message) for message in prompt):
            return [{"role": message["role"], "content": message["content"]} for message in prompt]
        raise DataError(f"{where}: column {source.prompt_column!r} holds messages without string 'role'/'content'")
    raise DataError(f"{where}: no prompt in column {source.prompt_column!r} (got {prompt!r})")


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and all(isinstance(message.get(key), str) for key in ("role", "content"))


def _answer(value: Any, column: str, where: str) -> str:
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{where}: no answer in column {column!r}")
    return value if isinstance(value, str) else str(value)


def _check_unique_ids(rows: list[dict[str, Any]], where: str) -> None:
    seen: set[str] = set()
    for index, row in enumerate(rows):
        if row["id"] in seen:
            raise DataError(f"{where}: duplicate id {row['id']!r} (row {index})")
        seen.add(row["id"])


def _import_datasets() -> Any:
    """`datasets`, imported after the offline switches (it reads them at import) unless the caller set them."""
    for name, value in _HF_OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    import datasets

    return datasets


def _to_dataset(rows: list[dict[str, Any]]) -> Dataset:
    datasets = _import_datasets()
    Features, List, Value = datasets.Features, datasets.List, datasets.Value
    features = Features(
        {
            "id": Value("string"),
            "messages": List({"role": Value("string"), "content": Value("string")}),
            "answer": Value("string"),
            "task": Value("string"),
            "metadata": Value("string"),  # JSON; None for local data
        }
    )
    return datasets.Dataset.from_list([{**row, "metadata": row.get("metadata")} for row in rows], features=features)


def _id_hash(seed: int, row_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{row_id}".encode(), digest_size=8).digest(), "big")
