"""Crash-safe file primitives: atomic writes and an inter-process file lock.

`atomic_writer(path)` yields a handle to a temporary sibling of `path` (same directory, so the
rename cannot cross file systems); on success the data is flushed and fsynced, the file renamed
over `path` and the directory fsynced, so a crash leaves either the old file or the new one,
never half of either. On failure the temporary file is removed and `path` is untouched.
`file_lock(path)` holds an exclusive `flock` on `path`; the OS drops it when its holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

FILE_MODE = 0o644  # mkstemp's 0600 would otherwise survive the rename


@contextlib.contextmanager
def atomic_writer(path: str | Path, binary: bool = False) -> Iterator[IO]:
    """Yield a handle to a temporary sibling of `path`; rename it over `path` on success."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.fchmod(fd, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(target.parent)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically; return the path."""
    with atomic_writer(path) as handle:
        handle.write(text)
    return Path(path)


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` atomically; return the path."""
    with atomic_writer(path, binary=True) as handle:
        handle.write(data)
    return Path(path)


def fsync_dir(directory: str | Path) -> None:
    """Flush a directory's entries (a rename into it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) across processes."""
    lock_path = Path(path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
