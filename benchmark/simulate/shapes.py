"""A transformer's roofline shape: what a GPU cost model needs of a target or a draft model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class ModelShape:
    """What a roofline needs of a transformer: weight bytes streamed per forward, FLOPs per token, KV bytes."""

    params: int  # parameters a forward multiplies with (embedding lookups excluded)
    weight_bytes: int
    kv_bytes_per_token: int  # per committed token, all layers, K and V

    @classmethod
    def from_config(cls, config: Mapping[str, Any], dtype_bytes: int = 2) -> "ModelShape":
        """From a Hugging Face config dict of a Llama/Qwen-style decoder."""
        d, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or d // heads)
        inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
        attention = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d
        per_layer = attention + 3 * d * inter
        params = layers * per_layer + vocab * d  # the LM head; the embedding is a lookup
        return cls(params, params * dtype_bytes, layers * 2 * kv_heads * head_dim * dtype_bytes)
