"""Messages between the verifier and its drafter workers, and the chain hash that validates drafts.

Verifier -> drafter:  `Reserve` (size the KV cache at start-up), `Reset` (a new generate call),
                      `AddRows`, `Commits` (the tokens each row committed: every round, or in one message
                      when paused workers resume), `RemoveRows`, `Pause`, `LoadWeights` (the pipeline's
                      drafter sync, between generate calls), `Shutdown`.
Drafter -> verifier:  `Drafts` (one draft step: one token per row it drafted for), `Ready`,
                      `WeightsLoaded` (the answer to `LoadWeights`), `Reserved` (the answer to `Reserve`).

A draft is trusted only if it continues exactly the chain the verifier holds. Rather than epochs
that both sides must keep in step, every draft carries the rolling hash of the output tokens it
was drafted after (`parent_hash`); the verifier appends it to a row's pending drafts only if it
sits at the next position and its parent hash equals the hash of committed + pending tokens.
Drafts from a stale prefix therefore die on arrival, whatever the delays. A hash collision can
only let a wrong draft into a verify block, where it is rejected: outputs never depend on drafts.

All per-row payloads are numpy arrays, one message per round or draft step, so neither side
loops over tokens in Python on the verifier's path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HASH_MOD = (1 << 31) - 1  # Mersenne prime; h * HASH_MUL stays below 2**62
HASH_MUL = 1_000_003
EMPTY_HASH = 0


def extend_hash(hashes: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Roll hashes [R] forward over one token per row [R] (int64): the hash of chain + token."""
    return (hashes * HASH_MUL + tokens + 1) % HASH_MOD


def extend_hash_many(hashes: np.ndarray, tokens: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Roll hashes [R] over the first counts[r] tokens of tokens [R, T] (column loop, rows vectorised)."""
    out = hashes.copy()
    for j in range(tokens.shape[1] if tokens.ndim == 2 else 0):
        live = counts > j
        if not live.any():
            break
        out[live] = extend_hash(out[live], tokens[live, j])
    return out


def chain_hash(tokens: list[int] | np.ndarray) -> int:
    """Hash of a whole output chain (reference implementation, used by the drafter per row)."""
    h = EMPTY_HASH
    for token in tokens:
        h = (h * HASH_MUL + int(token) + 1) % HASH_MOD
    return h


@dataclass(frozen=True)
class SamplingSpec:
    """What a drafter needs to draw with the target's position-keyed noise."""

    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int


@dataclass(frozen=True)
class Reserve:
    """Size the KV cache now, ahead of generate calls of up to this size (start-up; rows unchanged).
    Answered with `Reserved` once the cache is allocated."""

    num_slots: int
    max_len: int


@dataclass(frozen=True)
class Reserved:
    """The answer to `Reserve`: the worker's KV cache has this many slots of this many positions."""

    num_slots: int
    max_len: int


@dataclass(frozen=True)
class Reset:
    """A new generate call: forget every row; size the KV cache."""

    num_slots: int
    max_len: int
    sampling: SamplingSpec
    window: int  # run at most this many drafts past the last commit it knows
    generation: int  # stamped on every draft, so drafts of an earlier call are recognised


@dataclass(frozen=True)
class AddRows:
    """New rows: slot ids, their sequence keys, prompts, and the output committed so far."""

    slots: np.ndarray  # [R]
    keys: np.ndarray  # [R]
    prompts: list[np.ndarray]  # R arrays of token ids
    outputs: list[np.ndarray]  # R arrays (committed output tokens; non-empty after a restart)


@dataclass(frozen=True)
class Commits:
    """Tokens committed this round: row r committed tokens[offsets[r]:offsets[r+1]] at output
    positions starting from `starts[r]`."""

    slots: np.ndarray  # [R]
    starts: np.ndarray  # [R]
    offsets: np.ndarray  # [R + 1]
    tokens: np.ndarray  # [sum]


@dataclass(frozen=True)
class RemoveRows:
    slots: np.ndarray


@dataclass(frozen=True)
class Pause:
    """Stop (True) or resume (False) drafting; commits are still applied while paused."""

    paused: bool


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class LoadWeights:
    """Copy the draft model's weights from a safetensors file (a path the worker can read) in place."""

    path: str
    version: int


@dataclass(frozen=True)
class Drafts:
    """One draft step of a worker: for each row, the token at output position `positions`,
    drafted after a chain whose hash is `parent_hashes`."""

    slots: np.ndarray  # [R]
    positions: np.ndarray  # [R]
    tokens: np.ndarray  # [R]
    parent_hashes: np.ndarray  # [R]
    busy_s: float  # the step's compute time
    generation: int = -1  # the `Reset.generation` the step belongs to


@dataclass(frozen=True)
class Ready:
    """The worker has loaded its model (sent once after start)."""

    pid: int
    load_s: float


@dataclass(frozen=True)
class WeightsLoaded:
    """The worker loaded `LoadWeights(version)`; `digest` is `weights_digest` of its model after the load
    ("" with `error` set when the load failed: the worker keeps drafting with its old weights)."""

    version: int
    digest: str
    load_s: float
    error: str = ""
