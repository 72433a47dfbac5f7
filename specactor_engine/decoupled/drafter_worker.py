"""The drafter role of decoupled speculation: runs ahead of the committed prefix, streaming drafts.

`DraftWorker` is the logic (testable in process); `serve` is the loop every transport runs: apply
every message that has arrived, and if some row has room in its run-ahead window, run one batched
draft step and emit its `Drafts`; with nothing to do it blocks on its inbox. It never waits for the
verifier otherwise. `worker_main` is the entry point of a local worker process (over a pipe).

Per row it keeps the output chain (committed tokens, then its own drafts), how much of it the
verifier has committed (`known`), the rolling hashes of every prefix of the chain, and how many
tokens (prompt included) are in its KV cache. A commit that disagrees with the chain truncates
the chain and the KV at the first difference and installs the verifier's tokens; drafting goes on
from there with the target's position-keyed noise, so a good drafter reproduces the target.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from specactor_engine.decoupled.protocol import (
    HASH_MOD,
    HASH_MUL,
    AddRows,
    Commits,
    Drafts,
    LoadWeights,
    Pause,
    Ready,
    RemoveRows,
    Reserve,
    Reserved,
    Reset,
    SamplingSpec,
    Shutdown,
    WeightsLoaded,
)
from specactor_engine.model.runner import ModelRunner
from specactor_engine.sampling import STREAM_TARGET, SamplingParams, sample_tokens


@dataclass
class _Row:
    key: int
    prompt: np.ndarray
    chain: list[int] = field(default_factory=list)  # output tokens: committed, then drafted
    hashes: list[int] = field(default_factory=lambda: [0])  # hashes[i] = hash of chain[:i]
    known: int = 0  # output tokens the verifier has committed (a prefix of chain)
    kv: int = 0  # tokens (prompt + output) in this worker's KV cache

    def truncate(self, length: int) -> None:
        del self.chain[length:], self.hashes[length + 1 :]
        self.kv = min(self.kv, len(self.prompt) + length)

    def append(self, token: int) -> None:
        self.chain.append(token)
        self.hashes.append((self.hashes[-1] * HASH_MUL + token + 1) % HASH_MOD)


class DraftWorker:
    """Draft-ahead state of one worker over its rows; `step()` drafts one token for each row with room."""

    def __init__(self, model: torch.nn.Module, target_vocab_size: int) -> None:
        self.runner = ModelRunner(model)
        self.target_vocab_size = target_vocab_size
        self.rows: dict[int, _Row] = {}
        self.sampling: SamplingSpec | None = None
        self.params: SamplingParams | None = None
        self.window = 0
        self.max_len = 0
        self.generation = -1
        self.paused = False

    # ------------------------------------------------------------------ messages
    def handle(self, message: Any) -> Any | None:
        """Apply one message; returns the reply to send, if it has one (`LoadWeights`, `Reserve`)."""
        if isinstance(message, LoadWeights):
            return self._load_weights(message)
        if isinstance(message, Reserve):
            self.runner.allocate(message.num_slots, message.max_len)
            return Reserved(self.runner.cache.num_slots, self.runner.cache.max_len)
        if isinstance(message, Reset):
            self.rows.clear()
            self.runner.allocate(message.num_slots, message.max_len)
            self.sampling, self.window, self.max_len = message.sampling, message.window, message.max_len
            self.generation = message.generation
            self.params = SamplingParams(message.sampling.temperature, message.sampling.top_k, message.sampling.top_p)
        elif isinstance(message, AddRows):
            for slot, key, prompt, output in zip(message.slots.tolist(), message.keys.tolist(), message.prompts,
                                                 message.outputs):
                row = _Row(int(key), np.asarray(prompt, dtype=np.int64))
                for token in np.asarray(output).tolist():
                    row.append(int(token))
                row.known = len(row.chain)
                self.rows[slot] = row
        elif isinstance(message, Commits):
            self._apply_commits(message)
        elif isinstance(message, Pause):
            self.paused = message.paused
        elif isinstance(message, RemoveRows):
            for slot in message.slots.tolist():
                self.rows.pop(slot, None)
        else:
            raise TypeError(f"drafter worker: unexpected message {type(message).__name__}")
        return None

    def _load_weights(self, message: LoadWeights) -> WeightsLoaded:
        """New draft-model weights in place (between generate calls: cached KV of old rows is stale,
        so every row re-feeds from its prompt)."""
        from safetensors.torch import load_file

        from specactor_engine.model.weights import load_named_weights, weights_digest

        started = time.perf_counter()
        try:
            load_named_weights(self.runner.model, load_file(message.path).items())
        except Exception as exc:  # noqa: BLE001 - reported to the verifier, which decides; drafting goes on
            return WeightsLoaded(message.version, "", time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
        for row in self.rows.values():
            row.kv = 0
        digest = weights_digest(self.runner.model.named_parameters())
        return WeightsLoaded(message.version, digest, time.perf_counter() - started)

    def _apply_commits(self, message: Commits) -> None:
        offsets = message.offsets.tolist()
        for i, (slot, start) in enumerate(zip(message.slots.tolist(), message.starts.tolist())):
            row = self.rows.get(slot)
            if row is None:
                continue
            tokens = message.tokens[offsets[i] : offsets[i + 1]].tolist()
            have = row.chain[start : start + len(tokens)]
            same = next((j for j, (a, b) in enumerate(zip(have, tokens)) if a != b), len(have))
            if same < len(tokens):  # diverged (or the chain was short): install the verifier's tokens
                row.truncate(start + same)
                for token in tokens[same:]:
                    row.append(token)
            row.known = max(row.known, start + len(tokens))

    # ------------------------------------------------------------------ drafting
    def has_work(self) -> bool:
        return not self.paused and any(self._has_room(row) for row in self.rows.values())

    def _has_room(self, row: _Row) -> bool:
        assert self.sampling is not None
        return (len(row.chain) - row.known < self.window and len(row.chain) < self.sampling.max_new_tokens
                and len(row.prompt) + len(row.chain) < self.max_len)

    def step(self) -> Drafts | None:
        """One batched draft step: the next token of every row with room (None if no row has)."""
        slots = [slot for slot, row in self.rows.items() if self._has_room(row)]
        if not slots:
            return None
        started = time.perf_counter()
        self._share_prompts(slots)
        logits = torch.empty(len(slots), self.target_vocab_size)
        catch_up = [i for i, s in enumerate(slots) if self._unfed(self.rows[s]) > 1]
        single = [i for i, s in enumerate(slots) if self._unfed(self.rows[s]) == 1]
        for group in (catch_up, single):  # a long catch-up must not pad every row's forward
            if group:
                logits[group] = self._feed([slots[i] for i in group]).to(logits.dtype)
        rows = [self.rows[s] for s in slots]
        keys = torch.tensor([r.key for r in rows])
        positions = torch.tensor([len(r.chain) for r in rows])
        assert self.params is not None
        tokens = sample_tokens(logits[:, None], self.params, keys, positions[:, None], STREAM_TARGET)[:, 0]
        parents = [r.hashes[-1] for r in rows]
        for row, token in zip(rows, tokens.tolist()):
            row.append(int(token))
        return Drafts(np.asarray(slots), positions.numpy(), tokens.numpy(), np.asarray(parents, dtype=np.int64),
                      time.perf_counter() - started, self.generation)

    def _share_prompts(self, slots: list[int]) -> None:
        """Rows not prefilled yet whose prompts are the same (a GRPO group): prefill each prompt once and
        copy its KV to the others, which then feed only their own outputs."""
        groups: dict[bytes, list[int]] = {}
        for slot in slots:
            row = self.rows[slot]
            if row.kv == 0 and len(row.prompt) > 1:
                groups.setdefault(row.prompt.tobytes(), []).append(slot)
        shared = [group for group in groups.values() if len(group) > 1]
        if not shared:
            return
        leaders = [group[0] for group in shared]
        # all but the last prompt token: every row keeps a token to feed, whose logits it drafts from
        prompts = [self.rows[slot].prompt[:-1] for slot in leaders]
        self._append(leaders, prompts, [0] * len(leaders), logits_at="none")
        for group, count in zip(shared, [len(p) for p in prompts]):
            followers = torch.tensor(group[1:])
            self.runner.cache.copy_prefix(torch.full_like(followers, group[0]), followers,
                                          torch.full_like(followers, count))
            for slot in group:
                self.rows[slot].kv = count

    def _unfed(self, row: _Row) -> int:
        return len(row.prompt) + len(row.chain) - row.kv

    def _feed(self, slots: list[int]) -> torch.Tensor:
        """Forward every not-yet-cached token of these rows; logits at each row's last: [R, V_target]."""
        rows = [self.rows[s] for s in slots]
        pieces = [np.concatenate([r.prompt, np.asarray(r.chain, dtype=np.int64)])[r.kv :] for r in rows]
        logits = self._append(slots, pieces, [r.kv for r in rows], logits_at="last")
        for row, piece in zip(rows, pieces):
            row.kv += len(piece)
        return self._match_vocab(logits)

    def _append(self, slots: list[int], pieces: list[np.ndarray], starts: list[int], logits_at: str) -> torch.Tensor:
        """Forward pieces[i] after the first starts[i] cached tokens of slots[i] (right-padded into one
        batch) and commit them to the KV cache; returns the runner's logits."""
        tokens = torch.zeros(len(pieces), max(len(p) for p in pieces), dtype=torch.long)
        for i, piece in enumerate(pieces):
            tokens[i, : len(piece)] = torch.from_numpy(piece)
        counts = torch.tensor([len(p) for p in pieces])
        slot_ids = torch.tensor(slots)
        self.runner.set_lengths(slot_ids, torch.tensor(starts))
        logits = self.runner.forward(tokens, slot_ids, counts, logits_at=logits_at)
        self.runner.commit(slot_ids, counts)
        return logits

    def _match_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        width = logits.shape[-1]
        if width > self.target_vocab_size:
            return logits[:, : self.target_vocab_size]
        if width < self.target_vocab_size:
            pad = logits.new_full((logits.shape[0], self.target_vocab_size - width), float("-inf"))
            return torch.cat([logits, pad], dim=-1)
        return logits


def serve(worker: DraftWorker, receive: Callable[[], Any], pending: Callable[[], bool],
          emit: Callable[[Any], None]) -> None:
    """Run a worker until `Shutdown`: apply what has arrived (`pending()`: something is waiting;
    `receive()` blocks for the next message), draft while some row has room, `emit` what it makes."""
    while True:
        while pending() or not worker.has_work():
            message = receive()  # blocks only when there is nothing to draft
            if isinstance(message, Shutdown):
                return
            reply = worker.handle(message)
            if reply is not None:
                emit(reply)
        drafts = worker.step()
        if drafts is not None:
            emit(drafts)


def load_worker(model_path: str, dtype: str, threads: int, target_vocab_size: int) -> tuple[DraftWorker, Ready]:
    """Load the draft model on `threads` torch threads: the worker and its `Ready` announcement."""
    from specactor_engine.model.runner import load_hf_model

    torch.set_num_threads(threads)
    started = time.perf_counter()
    worker = DraftWorker(load_hf_model(model_path, dtype), target_vocab_size)
    return worker, Ready(os.getpid(), time.perf_counter() - started)


def worker_main(conn: Any, model_path: str, dtype: str, threads: int, target_vocab_size: int) -> None:
    """Local process entry: load the draft model, announce `Ready`, then serve the pipe."""
    worker, ready = load_worker(model_path, dtype, threads, target_vocab_size)
    conn.send(ready)
    try:
        serve(worker, conn.recv, lambda: conn.poll(0), conn.send)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the verifier went away
