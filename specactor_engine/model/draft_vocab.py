"""A drafter head over part of the vocabulary (the tokens a task actually uses).

A small drafter spends much of its time in the vocabulary projection (SmolLM2: 28M of the
44M weights of a 4-layer drafter multiply into 49,152 logits). Restricting the drafter's head
to the few thousand tokens the target puts mass on in the task's domain makes drafting and
distillation several times cheaper. Losslessness is untouched: a draft is only a proposal, and
a token the drafter cannot produce is simply never drafted (the verifier emits it).

The token list lives beside the model as `draft_vocab.json`; `load_hf_model` installs a
`SubsetHead` when it finds one, so every drafter (in-process, worker, trainer) uses it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import torch
from torch import nn

DRAFT_VOCAB_FILE = "draft_vocab.json"


class SubsetHead(nn.Module):
    """Logits for `token_ids` only, from the (possibly tied) full head weight.

    weight: the full [V, d] head parameter, shared (not copied), so weight syncs and tied
    embeddings keep working and the state dict keeps its usual `lm_head.weight` entry.
    forward(h [..., d]) -> [..., V] with -inf outside the subset (what samplers expect);
    subset_logits(h [..., d]) -> [..., N] (what training uses).
    """

    def __init__(self, weight: nn.Parameter, token_ids: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.register_buffer("token_ids", token_ids.to(torch.long), persistent=False)
        self._rows: torch.Tensor | None = None
        self._rows_version = -1

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[0]

    def rows(self) -> torch.Tensor:
        """W[token_ids]: [N, d]; cached for inference, rebuilt when the weight changes in place."""
        if self.weight.requires_grad and torch.is_grad_enabled():
            return self.weight[self.token_ids]  # training: keep the graph to the full weight
        version = self.weight._version
        # rows cached while drafting (inference mode) cannot enter a graph: training with a frozen head rebuilds them
        stale_mode = self._rows is not None and self._rows.is_inference() and not torch.is_inference_mode_enabled()
        if self._rows is None or self._rows_version != version or stale_mode:
            with torch.no_grad():
                self._rows = self.weight[self.token_ids].contiguous()
            self._rows_version = version
        return self._rows

    def subset_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.rows().T

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        small = self.subset_logits(h)
        full = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.token_ids] = small
        return full


def install_subset_head(model: nn.Module, token_ids: torch.Tensor) -> SubsetHead:
    """Replace `model.lm_head` by a SubsetHead over `token_ids` (sorted, unique)."""
    head = model.lm_head
    if not isinstance(head, SubsetHead) and getattr(head, "bias", None) is not None:
        raise ValueError("a drafter head with a bias cannot be restricted to a sub-vocabulary")
    ids = torch.unique(token_ids.to(torch.long))
    if len(ids) == 0 or int(ids.min()) < 0 or int(ids.max()) >= head.weight.shape[0]:
        raise ValueError(f"draft vocabulary ids must lie in [0, {head.weight.shape[0]})")
    subset = SubsetHead(head.weight, ids.to(head.weight.device))
    model.lm_head = subset
    return subset


def choose_draft_vocab(masses: Iterable[tuple[torch.Tensor, torch.Tensor]], prompts: Sequence[Sequence[int]],
                       size: int, vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` tokens with most target probability mass in the data: sorted ids [N].

    masses: (token_ids [L, k], probs [L, k]) per sample, e.g. the target's top-k per position;
    prompt tokens count one each (prompts are copied into answers); `always` (e.g. EOS) is kept.
    """
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, probs in masses:
        mass.index_add_(0, ids.reshape(-1).long(), probs.reshape(-1).double())
    for prompt in prompts:
        mass.index_add_(0, torch.tensor(list(prompt), dtype=torch.long), torch.ones(len(prompt), dtype=torch.float64))
    if always:
        mass[torch.tensor(list(always), dtype=torch.long)] = float("inf")
    used = int((mass > 0).sum())
    return torch.sort(torch.topk(mass, min(size, used)).indices).values


def save_draft_vocab(directory: Path, token_ids: torch.Tensor) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": [int(t) for t in token_ids]}) + "\n",
                                              encoding="utf-8")


def load_draft_vocab(directory: str | Path) -> torch.Tensor | None:
    """The saved token ids, or None when the model has a full head (no file)."""
    path = Path(directory) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))["token_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: expected {{\"token_ids\": [int, ...]}} ({exc})") from None
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"{path}: 'token_ids' must be a list of integers")
    return torch.tensor(ids, dtype=torch.long)


class GrowingVocab:
    """A drafter's vocabulary that grows with the tokens the target actually uses.

    It starts from `initial` ids (for a model drafter without a trained sub-vocabulary: the lowest
    ids, which byte-level BPE vocabularies order by merge, so by frequency in the tokenizer's corpus,
    plus the special tokens) and takes in every token of the prompts and of what the target commits
    (`add`), so a token the target has used once can be drafted from then on. `ids` keeps insertion
    order (a new token is appended), and `version` counts the changes, so a head built over it is
    rebuilt only when it grew.
    """

    def __init__(self, initial: torch.Tensor, vocab_size: int) -> None:
        initial = torch.unique(initial.to(torch.long))
        initial = initial[(initial >= 0) & (initial < vocab_size)]
        self.member = torch.zeros(vocab_size, dtype=torch.bool)
        self.member[initial] = True
        self.ids = initial
        self.version = 0

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, tokens: torch.Tensor) -> None:
        tokens = tokens.reshape(-1).to(torch.long)
        tokens = tokens[(tokens >= 0) & (tokens < len(self.member))]
        new = torch.unique(tokens[~self.member[tokens]])
        if len(new):
            self.member[new] = True
            self.ids = torch.cat([self.ids, new])
            self.version += 1


class SplitHead(nn.Module):
    """Logits [..., N + E] of a compact head: `base` over its N tokens, then E more rows (tokens added to a
    growing vocabulary since `base` was built) as a plain float matmul."""

    def __init__(self, base: nn.Module, extra: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("extra", extra, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.base(h), h.to(self.extra.dtype) @ self.extra.T], dim=-1)


def lowest_ids_vocab(size: int, vocab_size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` lowest token ids and the `always` ones (special tokens): the starting draft vocabulary
    of a model drafter that has none of its own."""
    ids = torch.arange(min(size, vocab_size))
    extra = torch.tensor([t for t in always if 0 <= t < vocab_size], dtype=torch.long)
    return torch.unique(torch.cat([ids, extra]))
