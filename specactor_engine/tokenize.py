"""Turning requests into prompt token ids (chat template when configured)."""

from __future__ import annotations

from typing import Any

from specactor_engine.types import Request


def encode_request(request: Request, tokenizer: Any, chat_template: bool) -> tuple[list[int] | None, str | None]:
    """Prompt token ids of a request, or (None, error message) for a request that cannot run."""
    try:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.messages is not None:
            ids = _encode_chat(tokenizer, request.messages)
        elif chat_template and getattr(tokenizer, "chat_template", None):
            ids = _encode_chat(tokenizer, [{"role": "user", "content": request.prompt or ""}])
        else:
            ids = tokenizer(request.prompt or "", add_special_tokens=True)["input_ids"]
    except Exception as exc:  # a bad request must not take the batch down
        return None, f"could not tokenize request {request.request_id!r}: {exc}"
    if not ids:
        return None, f"request {request.request_id!r} has an empty prompt"
    vocab = len(tokenizer)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        return None, f"request {request.request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})"
    return ids, None


def _encode_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template, so 'messages' cannot be used")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """End-of-sequence ids from the tokenizer and the model's generation config."""
    ids: set[int] = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_eos, int):
        ids.add(config_eos)
    elif config_eos:
        ids.update(int(t) for t in config_eos)
    return sorted(ids)
