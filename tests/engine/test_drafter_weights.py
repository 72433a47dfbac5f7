"""The drafter capability "has weights to sync and save" (Drafter.trainable_model)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specactor_engine.drafters.base import DrafterContext
from specactor_engine.drafters.model import ModelDrafter
from specactor_engine.drafters.ngram import NgramDrafter
from specactor_engine.drafters.suffix import SuffixDrafter
from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer


def _context() -> DrafterContext:
    return DrafterContext("cpu", "float32", make_tokenizer(), make_tiny_model("llama").config.vocab_size)


def test_model_free_drafters_have_no_trainable_model():
    context = _context()
    assert NgramDrafter(SimpleNamespace(name="ngram"), context).trainable_model() is None
    assert SuffixDrafter(SimpleNamespace(name="suffix"), context).trainable_model() is None


def test_the_model_drafter_exposes_the_module_it_drafts_with():
    draft = make_tiny_model("llama", seed=1, num_layers=1)
    drafter = ModelDrafter(SimpleNamespace(name="draft"), _context(), model=draft, tokenizer=make_tokenizer())
    model = drafter.trainable_model()
    assert isinstance(model, torch.nn.Module)
    assert all(a is b for a, b in zip(model.parameters(), drafter.runner.model.parameters()))  # not a copy
    drafter.update_weights([(n, torch.zeros_like(p)) for n, p in model.named_parameters()], version=3)
    assert all(not p.any() for p in drafter.trainable_model().parameters()) and drafter.version == 3
