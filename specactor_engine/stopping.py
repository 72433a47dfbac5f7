"""Stop conditions: EOS / stop token ids, stop strings, max_new_tokens, context limit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class StopRules:
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...]
    max_new_tokens: int
    max_model_len: int


def truncate_emitted(emitted: list[int], output_len: int, total_len: int, rules: StopRules) -> tuple[int, str | None]:
    """How many of this round's emitted tokens to keep, and the finish reason if the row ends.

    output_len/total_len: the row's output/total token counts before this round.
    Token-level rules only; stop strings are checked by `find_stop_string` on the text.
    """
    for i, token in enumerate(emitted):
        if token in rules.stop_token_ids:
            return i + 1, "stop"
        if output_len + i + 1 >= rules.max_new_tokens:
            return i + 1, "length"
        if total_len + i + 1 >= rules.max_model_len:
            return i + 1, "context"
    return len(emitted), None


def find_stop_string(output_ids: list[int], new_count: int, rules: StopRules,
                     decode: Callable[[list[int]], str]) -> tuple[int, str] | None:
    """If a stop string ends within the last `new_count` tokens, return (tokens to keep, text).

    The kept tokens end with the token that completed the stop string; the text is cut
    before the stop string (the OpenAI/vLLM convention).
    """
    if not rules.stop_strings:
        return None
    text = decode(output_ids)
    hits = [(text.find(s), s) for s in rules.stop_strings if s in text]
    if not hits:
        return None
    cut = min(pos for pos, _ in hits)
    for keep in range(max(len(output_ids) - new_count, 0) + 1, len(output_ids) + 1):
        prefix = decode(output_ids[:keep])
        if any(s in prefix for s in rules.stop_strings):
            return keep, text[:cut]
    return len(output_ids), text[:cut]
