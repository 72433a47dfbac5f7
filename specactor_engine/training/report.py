"""How a long training job tells its caller what it is doing, without knowing who shows it.

A job runs in phases (sampling the target, the teacher pass, the training steps) and makes a few
decisions worth telling the user (resuming, which soft targets, the draft head's size). The CLI shows
them as progress bars and console lines; a library caller gets them as log lines (`LogReporter`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import ContextManager, Protocol

logger = logging.getLogger(__name__)


class PhaseProgress(Protocol):
    """Called as a phase advances: `done` units of its total, and the latest loss where there is one."""

    def __call__(self, done: int, loss: float | None = None) -> None: ...


class Reporter(Protocol):
    """What a job reports: one-line notes, and phases with a known total."""

    def note(self, message: str) -> None:
        """A decision the user should see (e.g. 'resuming the drafter in out/')."""

    def phase(self, name: str, total: int) -> ContextManager[PhaseProgress]:
        """A phase of `total` units named `name`; the context yields the progress callback."""


class LogReporter:
    """Notes as log lines, phases unshown: for callers without a console."""

    def note(self, message: str) -> None:
        logger.info("%s", message)

    @contextlib.contextmanager
    def phase(self, name: str, total: int) -> Iterator[PhaseProgress]:
        logger.info("%s: %d", name, total)
        yield _ignore


def _ignore(done: int, loss: float | None = None) -> None:
    """A phase's progress nobody watches."""
