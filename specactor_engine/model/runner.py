"""Forward pass of a Hugging Face decoder-only model over a per-row-length KV cache.

The runner reuses the model's own modules (embeddings, norms, projections, MLPs,
rotary embedding), so weights, names and numerics stay Hugging Face's, and replaces
only the attention bookkeeping: every row has its own committed length, writes land
at `length + i`, and a query at absolute position p sees keys [0, p]. This gives
ragged batched prefill, k+1-token verification and free rollback.

Supported families: llama, qwen2, qwen3, mistral (see SUPPORTED_MODEL_TYPES).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specactor_engine.kernels import decode_ops
from specactor_engine.kernels.build import extension_available
from specactor_engine.kernels.decode_ops import apply_rotary
from specactor_engine.kernels.paged_attention import kernel_available, paged_decode_attention
from specactor_engine.model.draft_vocab import install_subset_head, load_draft_vocab
from specactor_engine.model.kv_cache import KVCache
from specactor_engine.model.packed_linear import PackedLinear, packing_supported
from specactor_engine.model.quantize import Int8PackedLinear

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


HALF_DTYPES = (torch.bfloat16, torch.float16)
# Up to this many new tokens per row, attention runs in specactor_engine/kernels/paged_attention (no KV gather, one
# pass over each slot); longer blocks (prefill) go through torch's batched attention.
DECODE_KERNEL_MAX_TOKENS = 16
# torch's attention backends for the engine on CUDA: all but cuDNN's. The cuDNN backend (torch's first choice for
# bf16/fp16 on Hopper) builds an execution plan for every new shape, and the engine's shapes change every round (the
# key length grows by the accepted tokens, the verify width and the row count vary): on an H200, 15 s of a 24 s first
# bf16 `ar` run at 4 rows went to it, against 0.6 s once every length had been seen (bench/gpu/h200-2026-11-27-s27).
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """The context torch's scaled_dot_product_attention runs in on `device`: CUDA_SDPA_BACKENDS on CUDA, torch's
    own choice elsewhere."""
    return sdpa_kernel(list(CUDA_SDPA_BACKENDS)) if device.type == "cuda" else contextlib.nullcontext()


def grouped_attention_fp32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention in fp32 with grouped KV heads, by two batched matmuls: [R, H, T, D].

    q [R, H, T, D], k/v [R, H_kv, S, D], mask [R, 1, T, S] bool (True: may attend). On CPU, torch's
    fused kernel for bf16/fp16 takes ~20x longer than this at decode shapes (T of 1..k+1 queries
    against hundreds of keys), which made attention over half of a bf16 decode step; fp32
    accumulation keeps it at least as accurate as the fused kernel.
    """
    R, H, T, D = q.shape
    H_kv, S = k.shape[1], k.shape[2]
    group = H // H_kv
    queries = q.float().reshape(R, H_kv, group * T, D)  # heads of a group share their KV head
    scores = torch.matmul(queries, k.float().transpose(-1, -2)).mul_(scale).view(R, H_kv, group, T, S)
    scores.masked_fill_(~mask[:, :, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(R, H_kv, group * T, S)
    return torch.matmul(weights, v.float()).view(R, H, T, D)


# transformers' RMSNorm classes of the supported families: w * (x / rms(x)) in float32, what
# kernels/decode_ops.rms_norm computes (a norm of another kind keeps the model's module)
STANDARD_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def fusable_layers(model: nn.Module) -> bool:
    """Every norm is a standard RMSNorm and the MLPs' activation is SiLU: the decoder layers' elementwise
    work can run as kernels/decode_ops' fused ops."""
    inner = model.model
    norms = [inner.norm] + [n for layer in inner.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    return (getattr(model.config, "hidden_act", None) == "silu"
            and all(type(n).__name__ in STANDARD_NORMS and hasattr(n, "variance_epsilon") for n in norms))


def load_hf_model(path: str | Path, dtype: str, device: str = "cpu") -> nn.Module:
    """Load a causal LM from a local Hugging Face directory and check its family."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{path}: model_type {config.model_type!r} is not supported; "
            f"supported families: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    draft_vocab = load_draft_vocab(path)
    if draft_vocab is not None:  # a drafter trained with a head over part of the vocabulary
        install_subset_head(model, draft_vocab)
    return model.to(device).eval().requires_grad_(False)


PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _LayerProjections:
    """One decoder layer's linears, fused where they share an input and packed for oneDNN (`kind` PackedLinear) or
    quantized to int8 (Int8PackedLinear); the projections named in `int8` are int8 whatever `kind` is."""

    def __init__(self, layer: nn.Module, kind: type[PackedLinear] = PackedLinear, int8: Sequence[str] = ()) -> None:
        attn, mlp = layer.self_attn, layer.mlp

        def make(name: str, linears: list[nn.Module]) -> PackedLinear:
            return (Int8PackedLinear if name in int8 else kind)(linears)

        self.qkv = make("qkv", [attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = make("o", [attn.o_proj])
        self.gate_up = make("gate_up", [mlp.gate_proj, mlp.up_proj])
        self.down = make("down", [mlp.down_proj])
        self.act = mlp.act_fn

    def linears(self) -> tuple[PackedLinear, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class ModelRunner:
    """Owns one model and its KV cache; `forward` runs any number of new tokens per row.

    packed_linear: run the linear layers through oneDNN with pre-packed, fused weights where the
    dtype and device allow it (packed_linear.py; 2-4x faster fp32 projections on CPU); otherwise,
    and always for float64/float16, the model's own modules.
    paged_attention: attention of decode and verify blocks (<= DECODE_KERNEL_MAX_TOKENS new tokens
    per row) in specactor_engine/kernels/paged_attention, reading each slot in place; otherwise torch's attention
    over gathered keys and values.
    head: a module used instead of the model's lm_head (a drafter's compact head over part of the
    vocabulary, whose logits are then [..., N] for its N tokens); it may be replaced between forwards.
    int8: the linears (and the model's own head) as per-channel int8 over the float32 model's weights, fused like
    the packed ones (model/quantize.py `Int8PackedLinear`): a draft model's cheap steps, with no copy of the model.
    int8_projections: of `PROJECTIONS`, those run in int8 while the others stay packed in the model's dtype (float32
    or bfloat16 on a CPU that packs it; their outputs come back in that dtype): a feature-level drafter quantizes
    its MLP and output projection, whose inputs int8 per row keeps, and not q/k/v, whose inputs' outlier channels it
    does not (bench/session52).
    record_features: keep every position's normalised final hidden state in the cache (`KVCache.features`),
    for a feature-level drafter (set before `allocate`; `record_features()` turns it on later).
    With paged_attention on, a CPU model whose layers allow it (`fusable_layers`) also runs each layer's
    norms, residual adds, rotary, KV write and SiLU-mul as kernels/decode_ops' fused ops (not in float64).
    """

    def __init__(self, model: nn.Module, num_slots: int = 0, max_len: int = 0, packed_linear: bool = True,
                 paged_attention: bool = True, head: nn.Module | None = None, record_features: bool = False,
                 int8: bool = False, int8_projections: Sequence[str] = ()) -> None:
        config = model.config
        self.recording = record_features
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.sliding_window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        self.vocab_size = config.vocab_size
        self.cache = self._new_cache(num_slots, max_len)
        if int8 and self.dtype != torch.float32:
            raise ValueError(f"int8 drafting quantizes a float32 model, got {self.dtype}: set the drafter's dtype to "
                             "float32")
        unknown = set(int8_projections) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"int8_projections: {sorted(unknown)} are not projections (expected some of {PROJECTIONS})")
        if int8_projections and not int8 and not packing_supported(self.dtype, self.device):
            raise ValueError(f"int8_projections runs the other projections packed, which {self.dtype} on "
                             f"{self.device.type} is not: use float32 or bfloat16 on a CPU")
        packed = int8 or bool(int8_projections) or (packed_linear and packing_supported(self.dtype, self.device))
        kind = Int8PackedLinear if int8 else PackedLinear
        self.projections = [_LayerProjections(layer, kind, int8_projections) for layer in model.model.layers] \
            if packed else None
        self._packed = packed and not int8  # the model's own head packed for oneDNN too
        self.int8 = int8
        self.paged_attention = paged_attention and self.device.type == "cpu"
        self._packed_head: PackedLinear | None = None
        self.head = head
        self._fused: bool | None = None  # decided at the first forward (it may build the kernels)

    def pack(self) -> None:
        """Pack (or quantize to int8) every projection and the model's own head now, as their first forward would:
        a runner whose first forward falls inside a timed or latency-bound call (a draft model first used mid-rollout)
        pays it where it is built instead. Trace D: the 0.5B's int8 weights took 2.6 s at its first catch-up, inside
        `specactor`'s run, where the benchmark's warm-up had run `coupled-cheap`'s. A weight changed in place later
        is packed again at its next forward (`PackedLinear`)."""
        for layer in self.projections or []:
            for linear in layer.linears():
                linear.prepare()
        head = self._lm_head()
        if isinstance(head, PackedLinear):
            head.prepare()

    def _new_cache(self, num_slots: int, max_len: int) -> KVCache:
        return KVCache(self.config.num_hidden_layers, num_slots, max_len, self.num_kv_heads, self.head_dim,
                       self.dtype, self.device, feature_dim=self.config.hidden_size if self.recording else None)

    def record_features(self) -> None:
        """From the next `allocate` on, keep every position's features (a feature-level drafter reads them)."""
        if not self.recording:
            self.recording = True
            self.cache = self._new_cache(0, 0)

    def allocate(self, num_slots: int, max_len: int) -> None:
        """Size the KV cache for a generate call (reuses the buffers when they are big enough).

        Sizing per call matters: 256 slots x 2k positions of a 30-layer model is ~24 GB.
        """
        cache = self.cache
        if (cache.features is not None) != self.recording:
            cache = self.cache = self._new_cache(0, 0)
        if cache.num_slots >= num_slots and cache.max_len >= max_len and cache.num_slots <= 2 * num_slots:
            cache.lengths.zero_()
            return
        self.cache = None  # free the old buffers before allocating the new ones
        self.cache = self._new_cache(num_slots, max_len)

    @property
    def lengths(self) -> torch.Tensor:
        """Committed KV length per slot: [num_slots] int64 (host)."""
        return self.cache.lengths

    def _attention_mask(self, positions: torch.Tensor, upto: int) -> torch.Tensor:
        """[R, 1, T, upto] bool: query at absolute position p sees keys 0..p (within the window)."""
        keys = torch.arange(upto)
        mask = keys[None, None, :] <= positions[:, :, None]
        if self.sliding_window:
            mask &= keys[None, None, :] > positions[:, :, None] - self.sliding_window
        return mask[:, None].to(self.device)

    def _attention(self, layer_idx: int, layer: nn.Module, x: torch.Tensor, slots: torch.Tensor,
                   positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   mask: torch.Tensor | None) -> torch.Tensor:
        """Self-attention of x [R, T, d] over each slot's cache; mask None: the paged decode kernel."""
        attn = layer.self_attn
        R, T, _ = x.shape
        cos, sin = rope
        if self._fused and self.projections is not None and not hasattr(attn, "q_norm"):
            # one op: rotary on q and k of the fused projection, k and v into the cache
            q = decode_ops.rotary_write_kv(self.projections[layer_idx].qkv(x), cos, sin, self.cache.keys[layer_idx],
                                           self.cache.values[layer_idx], slots, positions, self.num_heads)
            return self._attend(layer_idx, attn, q, slots, positions, mask)
        if self.projections is None:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        else:
            fused = self.projections[layer_idx].qkv
            q, k, v = fused.split(fused(x))
        q = q.view(R, T, self.num_heads, self.head_dim)
        k = k.view(R, T, self.num_kv_heads, self.head_dim)
        v = v.view(R, T, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # qwen3: per-head RMSNorm before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        self.cache.write(layer_idx, slots, positions, k, v)
        return self._attend(layer_idx, attn, q, slots, positions, mask)

    def _attend(self, layer_idx: int, attn: nn.Module, q: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of the rotated queries q [R, T, H, D] over the cache (this layer's new keys written), then
        the output projection: [R, T, d]."""
        R, T = q.shape[:2]
        if mask is None:
            out = paged_decode_attention(q, self.cache.keys[layer_idx], self.cache.values[layer_idx], slots,
                                         positions, attn.scaling, self.sliding_window or 0)  # [R, T, H, D]
        else:
            out = self._block_attention(layer_idx, q, slots, mask, attn.scaling)
        out = out.reshape(R, T, self.num_heads * self.head_dim)
        return attn.o_proj(out) if self.projections is None else self.projections[layer_idx].o(out)

    def _block_attention(self, layer_idx: int, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
                         scale: float) -> torch.Tensor:
        """Attention of long query blocks (prefill) through torch: q [R, T, H, D] -> [R, T, H, D]."""
        keys, values = self.cache.read(layer_idx, slots, mask.shape[-1])  # [R, S, H_kv, D]
        q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        if q.dtype in HALF_DTYPES and q.device.type == "cpu":
            out = grouped_attention_fp32(q, keys, values, mask, scale).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                 enable_gqa=self.num_kv_heads != self.num_heads)  # [R, H, T, D]
        return out.transpose(1, 2)

    def _mlp(self, layer_idx: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP, down(act(gate(x)) * up(x)), with gate and up in one GEMM when packed."""
        if self.projections is None:
            return layer.mlp(x)
        proj = self.projections[layer_idx]
        if self._fused:
            return proj.down(decode_ops.silu_mul(proj.gate_up(x)))
        gate, up = proj.gate_up.split(proj.gate_up(x))
        return proj.down(proj.act(gate) * up)

    def _clamp_pads(self, positions: torch.Tensor, num_tokens: torch.Tensor | None) -> torch.Tensor:
        """positions [R, T], some past the cache: those that are pads moved onto its last position.

        A padded verify block is as wide as its widest row, so a row near its budget pads past its own last
        position; the target's cache has no room for that (Engine._reserve sizes it for real tokens, whose last
        position is never the cache's last). Pads there write garbage that no real query reads. A real token past
        the cache, or one at its last position in a row whose pads would land there, is an overflow.
        """
        last = self.cache.max_len - 1
        pad = torch.zeros_like(positions, dtype=torch.bool) if num_tokens is None else \
            torch.arange(positions.shape[1])[None, :] >= num_tokens[:, None]  # [R, T]
        real_last = torch.where(pad, -1, positions).amax(dim=1)  # [R] each row's last real position
        if int(real_last.max()) > last:
            raise RuntimeError(f"KV cache overflow: position {int(real_last.max())} >= {self.cache.max_len}")
        moved = pad & (positions > last)
        if bool((moved.any(dim=1) & (real_last == last)).any()):
            raise RuntimeError(f"KV cache overflow: a row's real tokens reach position {last}, where its pads "
                               f"past the cache ({self.cache.max_len} positions) would be written")
        return torch.where(moved, last, positions)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor | None = None,
                logits_at: str = "all", embeds: torch.Tensor | None = None,
                return_features: bool = False, offsets: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Append `input_ids` after each slot's committed length and return logits.

        input_ids: [R, T] (rows right-padded; pad positions write scratch KV only)
        slots: [R] cache rows; num_tokens: [R] valid tokens per row (default T)
        logits_at: "all" -> [R, T, V]; "last" -> [R, V] at each row's last valid token;
                   "none" -> empty tensor (prefill of a drafter that only needs KV)
        embeds: [R, T, d] the first layer's input instead of the token embeddings (a feature-level drafter)
        return_features: also return the normalised final hidden states where the logits are ([R, T, d] or
                   [R, d]): (logits, features)
        offsets: [R] each row's first token goes this many positions past its slot's committed length (default 0).
                   A ragged block packed as one token per row (`packed_positions`): a slot may then appear in
                   several rows, each at its own position; every row's keys are written before any attends.
        The committed lengths are NOT advanced: callers commit with `commit`. With `record_features` every
        position's features are written to the cache beside its keys.
        """
        R, T = input_ids.shape
        start = self.cache.lengths[slots]  # [R]
        positions = start[:, None] + torch.arange(T)[None, :]  # [R, T]
        if offsets is not None:
            positions = positions + offsets[:, None]
        if int(positions.max()) >= self.cache.max_len:  # pads past the cache go to its last position; else overflow
            positions = self._clamp_pads(positions, num_tokens)
        inner = self.model.model
        h = inner.embed_tokens(input_ids.to(self.device)) if embeds is None else embeds.to(self.device, self.dtype)
        rope = inner.rotary_emb(h, positions.to(self.device))
        # a few new tokens per row (decode, verify): the kernel reads each slot in place; prefill: torch
        decode = self.paged_attention and T <= DECODE_KERNEL_MAX_TOKENS and kernel_available()
        mask = None if decode else self._attention_mask(positions, int(positions.max()) + 1)
        if self._fused is None:
            # float64 runs are the checks against transformers at float64 precision: they keep torch's ops
            self._fused = (self.paged_attention and self.dtype != torch.float64 and fusable_layers(self.model)
                           and extension_available())
        with attention_backends(h.device):  # once per forward: the context costs ~40 us on an H200's host
            if self._fused:
                h, normed = self._fused_layers(h, slots, positions, rope, mask), True
            else:
                for idx, layer in enumerate(inner.layers):
                    h = h + self._attention(idx, layer, layer.input_layernorm(h), slots, positions, rope, mask)
                    h = h + self._mlp(idx, layer, layer.post_attention_layernorm(h))
                normed = False
        if self.cache.features is not None:
            h = h if normed else inner.norm(h)  # every position's features, kept beside its keys
            self.cache.write_features(slots, positions, h)
            normed = True
        if logits_at == "none":
            return torch.empty(0)
        if logits_at == "last":
            last = (num_tokens if num_tokens is not None else torch.full((R,), T)) - 1
            h = h[torch.arange(R), last.to(self.device)]
        features = h if normed else inner.norm(h)
        logits = self._lm_head()(features)
        return (logits, features) if return_features else logits

    def forward_packed(self, input_ids: torch.Tensor, slots: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
        """`forward` of a ragged block over its real tokens only: input_ids [R, T], num_tokens [R] -> logits [R, T, V]
        (zeros at the pad positions, which nothing reads).

        Past the compute ridge (a CPU's few rows: a width-3 verify of 4 rows is compute-bound on trace D) a padded
        token costs what a real one does; packed as one token per forward row, each at its own position of its slot
        (`offsets`), a row of w tokens costs w. The logits at the real positions are the padded block's up to the
        GEMMs' summation order (BLAS and oneDNN block a matmul's rows by their count), as a decode step's and a verify
        block's are: tests/engine/test_draft_trim.py."""
        R, T = input_ids.shape
        rows, cols = (torch.arange(T)[None, :] < num_tokens[:, None]).nonzero(as_tuple=True)  # [N] each
        logits = self.forward(input_ids[rows, cols][:, None], slots[rows], offsets=cols)  # [N, 1, V]
        out = logits.new_zeros(R, T, logits.shape[-1])
        out[rows.to(out.device), cols.to(out.device)] = logits[:, 0]
        return out

    def _fused_layers(self, h: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """The decoder layers with each residual add fused into the next norm: the embeddings h [R, T, d] in,
        the final norm's output (the features) out."""
        inner = self.model.model
        layers = inner.layers
        first = layers[0].input_layernorm
        x = decode_ops.rms_norm(h, first.weight, first.variance_epsilon)
        for idx, layer in enumerate(layers):
            post = layer.post_attention_layernorm
            h, x = decode_ops.add_rms_norm(h, self._attention(idx, layer, x, slots, positions, rope, mask),
                                           post.weight, post.variance_epsilon)
            following = layers[idx + 1].input_layernorm if idx + 1 < len(layers) else inner.norm
            h, x = decode_ops.add_rms_norm(h, self._mlp(idx, layer, x), following.weight, following.variance_epsilon)
        return x

    def features(self, slots: torch.Tensor, start: torch.Tensor, width: int) -> torch.Tensor:
        """Recorded features of positions start[i] .. start[i] + width - 1 of slots[i]: [R, width, d]."""
        return self.cache.read_features(slots, start, width)

    def _lm_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The model's current head (it may be swapped, e.g. for a sub-vocabulary head), packed if plain."""
        if self.head is not None:
            return self.head
        head = self.model.lm_head
        if not (self._packed or self.int8) or type(head) is not nn.Linear:
            return head
        if self._packed_head is None or self._packed_head.modules[0] is not head:
            self._packed_head = (Int8PackedLinear if self.int8 else PackedLinear)([head])
        return self._packed_head

    def commit(self, slots: torch.Tensor, num_new: torch.Tensor) -> None:
        """Advance committed lengths of `slots` by `num_new` [R] (the rest of the block is dropped)."""
        self.cache.lengths[slots] += num_new

    def set_lengths(self, slots: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll back (or reset) slots to the given committed lengths."""
        self.cache.lengths[slots] = lengths

    def step_bytes(self) -> int:
        """Bytes of weights a one-token step reads: the decoder layers, the final norm and the head in use (the
        token embedding is a lookup of a few rows). A step at a few rows streams them, so the ratio of two
        runners' figures is the ratio of their step times there (the draft-cost prior, policies/verify_length.py)."""
        inner = self.model.model
        head = self.head if self.head is not None else getattr(self.model, "lm_head", None)
        # int8 projections count their int8 bytes in place of their source linears' (int8: every one of them)
        quantized = [linear for layer in self.projections or [] for linear in layer.linears()
                     if isinstance(linear, Int8PackedLinear)]
        if self.int8 and self.head is None and type(head) is nn.Linear:  # the model's own head runs in int8 too
            quantized, head = [*quantized, Int8PackedLinear([head])], None
        if not quantized:
            return tensor_bytes(inner.layers, inner.norm, head)
        sources = {id(m) for linear in quantized for m in linear.modules}
        rest = [sub for layer in inner.layers for sub in layer.modules()
                if id(sub) not in sources and not list(sub.children())]
        return sum(linear.nbytes() for linear in quantized) + tensor_bytes(*rest, inner.norm, head)


def tensor_bytes(*modules: nn.Module | None) -> int:
    """Bytes of the distinct tensors (parameters and buffers) of `modules`, int8 linears' packed weights included
    (model/quantize.py: they are neither); a tensor shared by two counts once."""
    seen: set[int] = set()
    total = 0
    for module in modules:
        if module is None:
            continue
        tensors = [*module.parameters(), *module.buffers()]
        for sub in module.modules():
            if callable(getattr(sub, "weight", None)):  # torch.ao's dynamic int8 Linear: weight() unpacks it
                weight = sub.weight()
                total += weight.numel() * weight.element_size()
        for tensor in tensors:
            key = tensor.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += tensor.untyped_storage().nbytes()
    return total
