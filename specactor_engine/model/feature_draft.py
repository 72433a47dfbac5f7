"""A feature-level draft model (EAGLE-style): one decoder layer over the target's own features.

At position j it reads the token t_j and the target's feature at the position before, f_{j-1} (the
target's final hidden state, normalised: what its LM head reads), and predicts f_j:

    x_j = fc([embed(t_j); f_{j-1}])          fc: [2d -> d], embed: the target's (shared, frozen)
    g_j = norm(layer(x_j | x_<j))             one decoder layer of the target's family, its own KV cache
    logits_{j+1} = head(g_j)                  the target's LM head rows (a draft vocabulary's, shared)

Drafting k tokens past the committed t_0..t_{n-1} feeds the committed positions with the target's
features (known up to f_{n-2}: the target has not seen t_{n-1} yet), then its own predictions g in
place of the features it has not got: x_n = fc([embed(d_1); g_{n-1}]) and so on. It costs one layer of
the target plus the head per draft token. Only `fc`, the layer and the norm are this model's weights;
the embedding and the head stay the target's and are passed in, never copied or saved.

This module is the model only: the drafter around it is drafters/feature.py, its training
training/feature_distill.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specactor_engine.kernels.decode_ops import apply_rotary

WEIGHTS_FILE = "feature_drafter.safetensors"
CONFIG_FILE = "feature_drafter.json"
FORMAT = 1


def one_layer_config(target_config: Any) -> Any:
    """The target's model config cut to one decoder layer (per-layer lists cut with it)."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = 1
    for name in ("layer_types", "mlp_only_layers"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            setattr(config, name, value[:1])
    return config


class _Inner(nn.Module):
    """The attribute layout ModelRunner reads (`layers`, `norm`, `rotary_emb`); the first layer's input is
    always given as embeddings, so there is no `embed_tokens`."""

    def __init__(self, layer: nn.Module, norm: nn.Module, rotary: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer])
        self.norm = norm
        self.rotary_emb = rotary


class FeatureDraftModel(nn.Module):
    """fc + one decoder layer + norm (module docstring); built for one target and saved without its weights."""

    def __init__(self, target: nn.Module) -> None:
        """A fresh model for `target` (a Hugging Face causal LM of a supported family): the layer and the
        norm start as copies of the target's last layer and final norm, fc as [I | I] (token embedding plus
        feature), so training starts from the target's own top layer."""
        super().__init__()
        inner = target.model
        self.config = one_layer_config(target.config)
        d = self.config.hidden_size
        param = next(target.parameters())
        self.fc = nn.Linear(2 * d, d, bias=False, dtype=param.dtype, device=param.device)
        with torch.no_grad():
            eye = torch.eye(d, dtype=param.dtype, device=param.device)
            self.fc.weight.copy_(torch.cat([eye, eye], dim=1))
        layer = type(inner.layers[-1])(self.config, layer_idx=0).to(param.device, param.dtype)
        layer.load_state_dict(inner.layers[-1].state_dict())
        self.model = _Inner(layer, copy.deepcopy(inner.norm), copy.deepcopy(inner.rotary_emb))
        self.target_signature = signature(target)
        self.trained_passes = 1  # the draft steps its training covered (training/feature_distill.py); from its file
        self.temperature_scale = 1.0  # the drafting temperature scale its training chose (feature_job.py); its file

    @property
    def layer(self) -> nn.Module:
        return self.model.layers[0]

    def inputs(self, token_embeds: torch.Tensor, prev_features: torch.Tensor) -> torch.Tensor:
        """x = fc([embed(t); f_prev]): [..., d] from two [..., d]."""
        return self.fc(torch.cat([token_embeds, prev_features.to(token_embeds.dtype)], dim=-1))

    def forward(self, token_embeds: torch.Tensor, prev_features: torch.Tensor) -> torch.Tensor:
        """Teacher-forced over whole sequences (training): token_embeds [B, T, d] of t_0..t_{T-1},
        prev_features [B, T, d] of f_{-1}..f_{T-2} (f_{-1} = 0) -> predicted features g [B, T, d].
        Causal attention from position 0; right padding only affects the padded positions."""
        x = self.inputs(token_embeds, prev_features)
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device)[None, :].expand(B, T)
        cos, sin = self.model.rotary_emb(x, positions)
        layer = self.layer
        h = x + self._attention(layer, layer.input_layernorm(x), cos, sin)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.norm(h)

    def forward_unrolled(self, token_embeds: torch.Tensor, prev_features: torch.Tensor, passes: int
                         ) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3's): `passes` teacher-forced passes, pass p showing every position what
        draft step p of a round would: pass 1 is `forward`; pass p > 1 reads, in place of f_{j-1}, pass p-1's
        own prediction g_{j-1}, and its query at j attends to what the drafter's cache holds when it drafts the
        p-th token at j: pass 1's keys at positions <= j-p+1 (fed with the target's features), then pass q's
        key at j-p+q for q = 2..p (its own earlier drafts). Same shapes as `forward`; returns [g_1, ..., g_p].
        Pass p's output at j is meaningful for j >= p-1 (it needs p-1 earlier positions)."""
        B, T, _ = token_embeds.shape
        positions = torch.arange(T, device=token_embeds.device)[None, :].expand(B, T)
        layer = self.layer
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        outputs: list[torch.Tensor] = []
        prev = prev_features
        for p in range(1, passes + 1):
            x = self.inputs(token_embeds, prev)
            cos, sin = self.model.rotary_emb(x, positions)
            mask = None if p == 1 else _unrolled_mask(T, p, x.device)
            h = x + self._attention(layer, layer.input_layernorm(x), cos, sin, keys, mask)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            outputs.append(self.model.norm(h))
            prev = torch.cat([torch.zeros_like(outputs[-1][:, :1]), outputs[-1][:, :-1]], dim=1)  # g_{j-1}
        return outputs

    def _attention(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   keys: list[tuple[torch.Tensor, torch.Tensor]] | None = None, mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Causal self-attention over x; with `keys` (earlier passes' (k, v) [B, H_kv, T, hd], appended to) and
        `mask` [T, (passes) * T] (True: attend), over theirs and this pass's keys instead."""
        attn, config = layer.self_attn, self.config
        B, T, _ = x.shape
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        q = attn.q_proj(x).view(B, T, heads, head_dim)
        k = attn.k_proj(x).view(B, T, kv_heads, head_dim)
        v = attn.v_proj(x).view(B, T, kv_heads, head_dim)
        if hasattr(attn, "q_norm"):  # qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if keys is not None:
            keys.append((k, v))
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling,
                                                 enable_gqa=kv_heads != heads)
        else:
            assert keys is not None
            all_k, all_v = torch.cat([kk for kk, _ in keys], dim=2), torch.cat([vv for _, vv in keys], dim=2)
            out = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask, scale=attn.scaling,
                                                 enable_gqa=kv_heads != heads)
        return attn.o_proj(out.transpose(1, 2).reshape(B, T, heads * head_dim))

    # ------------------------------------------------------------------ files
    def save(self, directory: Path, extra: dict[str, Any] | None = None) -> None:
        """directory/feature_drafter.safetensors (fc, layer, norm) and feature_drafter.json (what it was built
        for, and `extra`, e.g. its training report)."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().contiguous() for name, tensor in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE))
        meta = {"format": FORMAT, "target": self.target_signature, **(extra or {})}
        (directory / CONFIG_FILE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, directory: str | Path, target: nn.Module) -> "FeatureDraftModel":
        """The model saved in `directory` for `target`; refuses one built for another target shape."""
        from safetensors.torch import load_file

        directory = Path(directory)
        weights, meta_path = directory / WEIGHTS_FILE, directory / CONFIG_FILE
        if not weights.is_file() or not meta_path.is_file():
            raise FileNotFoundError(f"{directory}: no feature drafter here (expected {WEIGHTS_FILE} and {CONFIG_FILE}; "
                                    "build one with `specactor drafter feature`)")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{meta_path}: not JSON ({exc})") from None
        want = signature(target)
        if meta.get("target") != want:
            raise ValueError(f"{directory}: built for a target {meta.get('target')}, this target is {want}")
        model = cls(target)
        model.trained_passes = int(meta.get("passes", 1))
        model.temperature_scale = float(meta.get("temperature_scale", 1.0))
        param = next(target.parameters())
        state = {name: t.to(param.device, param.dtype) for name, t in load_file(str(weights)).items()}
        model.load_state_dict(state, strict=False)
        missing = {n for n, _ in model.named_parameters()} - set(state)
        if missing:
            raise ValueError(f"{weights}: missing weights {sorted(missing)[:4]}")
        return model


def _unrolled_mask(T: int, passes: int, device: torch.device) -> torch.Tensor:
    """Pass `passes`' attention mask over the keys of passes 1..passes laid end to end: [T, passes * T], True
    where query j may attend (`FeatureDraftModel.forward_unrolled`). A query with no key (j < passes - 1: the
    step cannot happen there) attends to its own key alone, so no row is empty."""
    j = torch.arange(T, device=device)
    mask = torch.zeros(T, passes * T, dtype=torch.bool, device=device)
    mask[:, :T] = j[None, :] <= (j[:, None] - passes + 1)  # pass 1's keys, fed with the target's features
    for q in range(2, passes + 1):
        at = j - passes + q  # pass q's key at j - passes + q
        rows = at >= 0
        mask[j[rows], (q - 1) * T + at[rows]] = True
    mask[j, (passes - 1) * T + j] = True  # its own key
    return mask


def signature(target: nn.Module) -> dict[str, Any]:
    """What a feature drafter must agree on with its target: family, widths, vocabulary."""
    config = target.config
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "vocab_size": config.vocab_size}
