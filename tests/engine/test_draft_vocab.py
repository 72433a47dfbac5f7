"""Drafter heads over part of the vocabulary: same logits where defined, exact rollouts, saved beside the model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from specactor_engine.model.draft_vocab import (DRAFT_VOCAB_FILE, SubsetHead, choose_draft_vocab, install_subset_head,
                                          load_draft_vocab, save_draft_vocab)
from specactor_engine.drafters.model import ModelDrafter
from specactor_engine.model.runner import load_hf_model
from specactor_engine.model.weights import load_named_weights
from tests.engine.test_exactness import make_tokenizer, ragged_requests, run, sampling, token_ids
from tests.fixtures.tiny_models import make_tiny_model, save_tiny_model


def test_subset_head_matches_the_full_head_on_its_tokens_and_masks_the_rest():
    model = make_tiny_model("llama", seed=2, dtype=torch.float64)
    hidden = torch.randn(3, 5, model.config.hidden_size, dtype=torch.float64)
    full = model.lm_head(hidden)
    ids = torch.tensor([7, 3, 200, 3])  # unsorted with a duplicate
    head = install_subset_head(model, ids)
    assert head.token_ids.tolist() == [3, 7, 200]
    out = model.lm_head(hidden)
    assert out.shape == full.shape
    assert torch.allclose(out[..., head.token_ids], full[..., head.token_ids])  # a smaller matmul may round apart
    outside = torch.ones(full.shape[-1], dtype=torch.bool)
    outside[head.token_ids] = False
    assert torch.isinf(out[..., outside]).all() and (out[..., outside] < 0).all()
    assert torch.allclose(head.subset_logits(hidden), full[..., head.token_ids])


def test_subset_head_follows_in_place_weight_updates():
    model = make_tiny_model("llama", seed=2, dtype=torch.float64)
    head = install_subset_head(model, torch.arange(10))
    hidden = torch.randn(2, model.config.hidden_size, dtype=torch.float64)
    before = model.lm_head(hidden)
    new = torch.randn_like(model.lm_head.weight)
    load_named_weights(model, [("lm_head.weight", new)])  # the pipeline's weight sync path
    assert torch.allclose(model.lm_head(hidden)[:, :10], hidden @ new[:10].T)
    assert not torch.equal(model.lm_head(hidden), before)
    assert head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings


def test_state_dict_is_unchanged_by_the_subset_head():
    model = make_tiny_model("llama", seed=2)
    names = set(model.state_dict())
    install_subset_head(model, torch.arange(10))
    assert set(model.state_dict()) == names


def test_choose_keeps_the_heaviest_tokens_and_the_forced_ones():
    masses = [(torch.tensor([[5, 6], [5, 9]]), torch.tensor([[0.6, 0.4], [0.9, 0.1]]))]
    chosen = choose_draft_vocab(masses, prompts=[[6, 6]], size=2, vocab_size=16, always=[15])
    assert chosen.tolist() == [6, 15]  # 6 has 0.4 + 2 prompt occurrences; 15 is forced; 5 (1.5) is third
    assert choose_draft_vocab(masses, [], size=100, vocab_size=16).tolist() == [5, 6, 9]  # only used tokens


def test_saved_vocabulary_is_installed_by_load_hf_model(tmp_path: Path):
    path = save_tiny_model(tmp_path / "drafter", "llama", seed=3)
    assert not isinstance(load_hf_model(path, "float32").lm_head, SubsetHead)
    save_draft_vocab(path, torch.tensor([1, 4, 9]))
    assert load_draft_vocab(path).tolist() == [1, 4, 9]
    model = load_hf_model(path, "float32")
    assert isinstance(model.lm_head, SubsetHead) and model.lm_head.token_ids.tolist() == [1, 4, 9]


@pytest.mark.parametrize("content", ["not json", json.dumps({"ids": [1]}), json.dumps({"token_ids": ["a"]})])
def test_a_broken_vocabulary_file_is_named_in_the_error(tmp_path: Path, content: str):
    (tmp_path / DRAFT_VOCAB_FILE).write_text(content)
    with pytest.raises(ValueError, match=DRAFT_VOCAB_FILE):
        load_draft_vocab(tmp_path)


def _subset_self_drafter(target, subset: torch.Tensor) -> ModelDrafter:
    """The target itself with its head cut to `subset`: drafts agree with the target exactly when
    the target's token lies inside the subset, so acceptance is partial and every path is exercised."""
    from specactor_engine.drafters.base import DrafterContext

    draft = copy.deepcopy(target)
    install_subset_head(draft, subset)
    context = DrafterContext("cpu", "float64", make_tokenizer(), target.config.vocab_size)
    return ModelDrafter(type("Cfg", (), {"name": "subset"})(), context, model=draft, tokenizer=make_tokenizer())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("rule", ["position_keyed", "rejection"])
def test_rollouts_with_a_subset_head_drafter_equal_plain_decoding(temperature: float, rule: str):
    target = make_tiny_model("llama", seed=0, init_range=0.5, dtype=torch.float64)
    requests = ragged_requests(6, seed=4)
    params = sampling(temperature, max_new_tokens=20, ignore_eos=True)
    plain = run(target, requests, params)
    subset = torch.arange(0, target.config.vocab_size, 2)  # every other token
    speculative = run(target, requests, params, "coupled", [_subset_self_drafter(target, subset)], k=3,
                      acceptance_rule=rule)
    if rule == "position_keyed":
        assert token_ids(speculative) == token_ids(plain)
    stats = speculative.stats
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # tokens outside the subset are never drafted


def test_a_frozen_subset_head_used_while_drafting_can_then_be_trained_through():
    """The pipeline refreshes a drafter right after it drafted (inference mode) with its tied head frozen:
    the rows cached while drafting must not leak into the training graph."""
    weight = torch.nn.Parameter(torch.randn(10, 4), requires_grad=False)
    head = SubsetHead(weight, torch.tensor([1, 3, 5]))
    with torch.inference_mode():
        head(torch.randn(2, 4))  # drafting caches W[token_ids] as an inference tensor
    hidden = torch.randn(2, 4, requires_grad=True)
    head.subset_logits(hidden).sum().backward()
    # d/dh of sum_j h . W[token_j] is the sum of the subset's rows, for every row of h
    torch.testing.assert_close(hidden.grad, weight[[1, 3, 5]].sum(0).expand(2, 4), rtol=0, atol=1e-6)
