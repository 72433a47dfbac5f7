"""Atomic writes and the inter-process file lock (specactor_engine/files.py)."""

from __future__ import annotations

import fcntl
import stat
from pathlib import Path

import pytest

from specactor_engine.files import atomic_write_bytes, atomic_write_text, atomic_writer, file_lock


def test_atomic_write_replaces_the_file_readable_by_all(tmp_path: Path):
    target = atomic_write_text(tmp_path / "sub" / "f.txt", "old")
    assert atomic_write_bytes(target, b"new\x00") == target
    assert target.read_bytes() == b"new\x00"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert [p.name for p in target.parent.iterdir()] == ["f.txt"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path):
    target = atomic_write_text(tmp_path / "f.txt", "old")
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic_writer(target) as handle:
            handle.write("half")
            raise RuntimeError("mid-write")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_file_lock_is_exclusive_until_released(tmp_path: Path):
    lock = tmp_path / "locks" / "x.lock"
    with file_lock(lock):
        with open(lock) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
