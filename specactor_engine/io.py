"""JSONL prompt files in, JSONL outputs and JSON stats out.

Input lines are `{"id": ..., "prompt": "text"}`, `{"id": ..., "messages": [...]}` or
`{"id": ..., "prompt_token_ids": [...]}`; other keys (answers, metadata) are ignored. Every problem is
raised as a `PromptFileError` reading `file:line: what was wrong`. Writes are atomic: a temporary file
in the target directory, then a rename, so a crash never leaves a half-written output.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from specactor_engine.config import describe_error
from specactor_engine.files import atomic_writer
from specactor_engine.types import Request, SequenceOutput

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


class PromptFileError(ValueError):
    """A prompt file line that cannot be read; the message reads `file:line: what was wrong`."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: str = Field(min_length=1)
    content: str


class _PromptLine(BaseModel):
    """The schema of one input line."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | int
    prompt: str | None = Field(None, min_length=1)
    messages: list[_Message] | None = Field(None, min_length=1)
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one_prompt(self) -> _PromptLine:
        found = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(found) != 1:
            given = ", ".join(f"'{name}'" for name in found) or "none"
            raise ValueError(f"expected exactly one of 'prompt', 'messages', 'prompt_token_ids' (found {given})")
        return self

    def to_request(self) -> Request:
        messages = [m.model_dump() for m in self.messages] if self.messages is not None else None
        return Request(str(self.id), self.prompt, messages, self.prompt_token_ids)


def read_requests(path: str | Path) -> list[Request]:
    """Parse a JSONL prompt file; blank lines are skipped, ids must be unique."""
    requests: list[Request] = []
    first_line: dict[str, int] = {}
    for line_number, raw in enumerate(Path(path).read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        request = _parse_line(raw, f"{path}:{line_number}")
        if request.request_id in first_line:
            raise PromptFileError(
                f"{path}:{line_number}: duplicate id '{request.request_id}' "
                f"(first used on line {first_line[request.request_id]})"
            )
        first_line[request.request_id] = line_number
        requests.append(request)
    if not requests:
        raise PromptFileError(f"{path}: no requests in file")
    return requests


def write_outputs(path: str | Path, outputs: Iterable[SequenceOutput]) -> int:
    """Write one `SequenceOutput.to_json()` line per output, atomically; return the line count."""
    return write_output_lines(path, (output.to_json() for output in outputs))


def write_output_lines(path: str | Path, lines: Iterable[dict[str, Any]]) -> int:
    """Write output lines (`SequenceOutput.to_json()` dicts) as JSONL, atomically; return the line count."""
    count = 0
    with atomic_writer(path) as handle:
        for line in lines:
            handle.write(json.dumps(line, ensure_ascii=False) + "\n")
            count += 1
    return count


def write_stats(path: str | Path, stats: dict[str, Any]) -> None:
    """Write `stats` as indented JSON, atomically."""
    with atomic_writer(path) as handle:
        handle.write(json.dumps(stats, indent=2, ensure_ascii=False) + "\n")


def _parse_line(raw: bytes, where: str) -> Request:
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{where}: invalid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(data, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    try:
        return _PromptLine.model_validate(data).to_request()
    except ValidationError as exc:
        problems = dict.fromkeys(_describe_line_error(err) for err in exc.errors())
        raise PromptFileError(f"{where}: " + "; ".join(problems)) from None


def _describe_line_error(err: Any) -> str:
    key = ".".join(str(part) for part in err["loc"] if part not in ("str", "int"))
    if err["type"] == "missing":
        return f"'{key}' is required"
    if key == "id":
        return f"'id' must be a string or an integer (got {err['input']!r})"
    return f"'{key}': {describe_error(err)}" if key else describe_error(err)
