"""A rollout's journal: every finished sample appended as it finishes, so an interrupted rollout resumes.

`specactor rollout --out X` keeps `X.journal` beside its output while it runs: a header line naming what the
rollout is (a fingerprint of the resolved config and the prompt file's bytes), then one output line
(`SequenceOutput.to_json()`) per finished sample, flushed as it is written. A second run of the same command
reads the journal and decodes only the samples it lacks. That is exact, not approximate: a sample's tokens are
keyed by (seed, request id, sample index, position) and do not depend on which other rows share the engine
(docs/architecture.md 4.1), so the resumed samples are the ones an uninterrupted run would have written. The
output file is written when every sample is in; the journal is then removed.

A run killed mid-write leaves at most a torn last line, which is dropped (and cut off the file) on resume (a torn
header: the journal starts over, it held no sample); a journal of another config or prompt file is refused with a `JournalError` rather than mixed in.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import IO, Any

from specactor_engine.types import SequenceOutput

FORMAT = "specactor-rollout-journal/1"

SampleKey = tuple[str, int]  # (request id, sample index)


class JournalError(ValueError):
    """A journal that cannot be resumed; the message names the file (and line) and what to do."""


def journal_path(out: str | Path) -> Path:
    """Where the journal of a rollout writing `out` lives: `out` + '.journal'."""
    out = Path(out)
    return out.with_name(out.name + ".journal")


def rollout_fingerprint(config_yaml: str, prompts: bytes) -> str:
    """What a journal's samples depend on: the resolved config and the prompt file, hashed."""
    digest = hashlib.sha256()
    for part in (config_yaml.encode("utf-8"), prompts):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


class RolloutJournal:
    """Append-only record of one rollout's finished samples (`open` it; `append` as samples finish)."""

    def __init__(self, path: Path, handle: IO[str], done: dict[SampleKey, dict[str, Any]]) -> None:
        self.path = path
        self._handle = handle
        self.done = done  # samples recorded so far, by (request id, sample index): their output lines

    @classmethod
    def open(cls, path: str | Path, fingerprint: str, restart: bool = False) -> RolloutJournal:
        """Open (creating, or resuming) the journal at `path` of the rollout `fingerprint` names.

        restart: discard an existing journal instead of resuming it."""
        path = Path(path)
        done: dict[SampleKey, dict[str, Any]] = {}
        found = _read(path, fingerprint) if path.exists() and not restart else None
        if found is not None:
            done, good_bytes = found
            handle = path.open("r+", encoding="utf-8")
            handle.truncate(good_bytes)  # a torn last line goes
            handle.seek(good_bytes)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = path.open("w", encoding="utf-8")
            handle.write(json.dumps({"format": FORMAT, "fingerprint": fingerprint}) + "\n")
            _sync(handle)
        return cls(path, handle, done)

    def append(self, output: SequenceOutput) -> None:
        """Record a finished sample (once: a sample already in the journal is not written again)."""
        key = (output.request_id, output.sample_index)
        if key in self.done:
            return
        line = output.to_json()
        self._handle.write(json.dumps(line, ensure_ascii=False) + "\n")
        _sync(self._handle)
        self.done[key] = line

    def close(self) -> None:
        self._handle.close()

    def remove(self) -> None:
        """Close and delete the journal (its rollout's output file is written)."""
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> RolloutJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._handle.closed:
            self.close()


def _sync(handle: IO[str]) -> None:
    handle.flush()
    os.fsync(handle.fileno())


def _read(path: Path, fingerprint: str) -> tuple[dict[SampleKey, dict[str, Any]], int] | None:
    """The journal's samples and the byte length of its whole lines (a torn last line is not counted); None
    without a whole header line (killed as it was created: nothing to resume)."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop()  # after the last newline: empty, or a line cut by a kill
    if not lines:
        return None
    good_bytes = len(data) - len(torn)
    try:
        header = json.loads(lines[0])
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise JournalError(f"{path}:1: not a rollout journal (expected a header with format {FORMAT!r}); remove "
                           "it to start over")
    if header.get("fingerprint") != fingerprint:
        raise JournalError(f"{path}: written by a rollout with a different config or prompt file; run the same "
                           "command to resume it, or pass --restart to discard it")
    done: dict[SampleKey, dict[str, Any]] = {}
    for number, raw in enumerate(lines[1:], start=2):
        try:
            line = json.loads(raw)
            key = (str(line["id"]), int(line["sample"]))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
            raise JournalError(f"{path}:{number}: not an output line (expected JSON with 'id' and 'sample'); "
                               "pass --restart to discard the journal") from None
        done[key] = line
    return done, good_bytes
