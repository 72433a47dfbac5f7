"""Engine behaviour: stop rules, logprobs, bad requests, weight updates, KV rollback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specactor_engine.drafters import DrafterContext
from specactor_engine.drafters.model import ModelDrafter, check_same_tokenizer
from specactor_engine.engine import Engine
from specactor_engine.model.runner import ModelRunner
from specactor_engine.types import Request
from tests.engine.test_exactness import make_drafter, ragged_requests, rollout, run, sampling, token_ids
from tests.fixtures.tiny_models import EOS_ID, make_tiny_model, make_tokenizer


@pytest.fixture(scope="module")
def target():
    return make_tiny_model("llama", seed=5)


def test_logprobs_equal_a_fresh_full_forward(target):
    """Engine logprobs == log_softmax(full-sequence forward / T) within 1e-4 (fp32)."""
    temperature = 0.7
    result = run(target, ragged_requests(6), sampling(temperature, n=2, max_new_tokens=20), "coupled",
                 [make_drafter("model", target, torch.float32)], k=3)
    for out in result.outputs:
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            logits = target(ids).logits[0, len(out.prompt_token_ids) - 1 : -1]
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(out.token_ids)[:, None])
        assert torch.allclose(torch.tensor(out.logprobs), expected[:, 0], atol=1e-4)


def test_top_logprobs_equal_a_fresh_full_forward_and_are_off_by_default(target):
    """top_logprobs=N: per emitted token, the N most likely ids and log-probs of log_softmax(logits / T),
    the same with speculation; the emitted token's log-prob is among or below them; absent when N = 0."""
    temperature, n = 0.7, 5
    params = sampling(temperature, n=2, max_new_tokens=20, top_logprobs=n)
    plain = run(target, ragged_requests(6), params)
    spec = run(target, ragged_requests(6), params, "coupled", [make_drafter("model", target, torch.float32)], k=3)
    for out, other in zip(plain.outputs, spec.outputs):
        assert out.top_logprobs is not None and other.top_logprobs is not None
        ids, values = out.top_logprobs
        assert ids.shape == values.shape == (len(out.token_ids), n) and ids.dtype == torch.int32
        full = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            log_p = torch.log_softmax(target(full).logits[0, len(out.prompt_token_ids) - 1 : -1] / temperature, -1)
        expected = log_p.topk(n, dim=-1)
        assert torch.equal(ids.long(), expected.indices)
        assert torch.allclose(values, expected.values, atol=1e-4)
        assert bool((torch.tensor(out.logprobs) <= values[:, 0] + 1e-6).all())
        assert torch.equal(other.top_logprobs[0], ids) and torch.allclose(other.top_logprobs[1], values, atol=1e-4)
        pairs = out.to_json()["top_logprobs"]
        assert len(pairs) == len(out.token_ids) and pairs[0][0][0] == int(ids[0, 0])
    default = run(target, ragged_requests(2), sampling(temperature, max_new_tokens=5))
    assert all(o.top_logprobs is None and "top_logprobs" not in o.to_json() for o in default.outputs)


def test_top_logprobs_follow_a_stop_string_cut(target):
    plain = run(target, ragged_requests(4), sampling(0.0, max_new_tokens=30))
    stop = plain.outputs[0].text[5:7]
    result = run(target, ragged_requests(4), sampling(0.0, max_new_tokens=30, stop=[stop], top_logprobs=3),
                 "coupled", [make_drafter("self", target, torch.float32)], k=5)
    for out in result.outputs:
        assert out.top_logprobs[0].shape == (len(out.token_ids), 3)
        assert out.top_logprobs[0][:, 0].tolist() == out.token_ids  # greedy: the top token is the emitted one


def test_max_new_tokens_and_eos(target):
    result = run(target, ragged_requests(8), sampling(1.0, max_new_tokens=7, stop_token_ids=[]))
    for out in result.outputs:
        if out.finish_reason == "length":
            assert len(out.token_ids) == 7
        else:
            assert out.finish_reason == "stop" and out.token_ids[-1] == EOS_ID and len(out.token_ids) <= 7


def test_stop_token_ids_end_sequences_in_every_mode(target):
    plain = token_ids(run(target, ragged_requests(8), sampling(0.0, max_new_tokens=30)))
    stop_id = next(iter(plain.values()))[3]  # a token the first sequence emits
    params = sampling(0.0, max_new_tokens=30, stop_token_ids=[stop_id])
    for mode, drafters in (("ar", []), ("coupled", [make_drafter("self", target, torch.float32)])):
        result = run(target, ragged_requests(8), params, mode, drafters, k=4)
        for out in result.outputs:
            full = plain[(out.request_id, 0)]
            cut = full.index(stop_id) + 1 if stop_id in full else len(full)
            assert out.token_ids == full[:cut]
            if stop_id in full:
                assert out.finish_reason == "stop"


def test_stop_strings_cut_text_and_tokens(target):
    tokenizer = make_tokenizer()
    plain = run(target, ragged_requests(4), sampling(0.0, max_new_tokens=30))
    text = plain.outputs[0].text
    stop = text[5:7]
    result = run(target, ragged_requests(4), sampling(0.0, max_new_tokens=30, stop=[stop]), "coupled",
                 [make_drafter("self", target, torch.float32)], k=5)
    first = result.outputs[0]
    assert first.finish_reason == "stop"
    assert first.text == text[: text.find(stop)]
    assert stop in tokenizer.decode(first.token_ids) and stop not in tokenizer.decode(first.token_ids[:-1])


def test_context_limit_and_too_long_prompt_do_not_lose_other_outputs(target):
    engine = Engine(target, make_tokenizer(), rollout("coupled", num_draft_tokens=3),
                    max_model_len=40, drafters=[make_drafter("ngram", target, torch.float32)], check_invariants=True)
    requests = [Request("ok", prompt_token_ids=[1, 2, 3] * 10), Request("long", prompt_token_ids=[5] * 40),
                Request("empty", prompt_token_ids=[])]
    outputs = {o.request_id: o for o in engine.generate(requests, sampling(1.0, max_new_tokens=100, ignore_eos=True)).outputs}
    assert outputs["ok"].finish_reason == "context"
    assert len(outputs["ok"].prompt_token_ids) + len(outputs["ok"].token_ids) == 40
    assert outputs["long"].finish_reason == "error" and "context limit" in outputs["long"].error
    assert outputs["empty"].finish_reason == "error" and "empty" in outputs["empty"].error


def test_update_weights_changes_outputs_and_version(target):
    other = make_tiny_model("llama", seed=6)
    requests = ragged_requests(4)
    engine = Engine(make_tiny_model("llama", seed=5), make_tokenizer(), rollout("ar", max_batch_size=8), max_model_len=64)
    before = token_ids(engine.generate(requests, sampling(0.0)))
    engine.update_weights(other.state_dict().items(), version=3)
    after = engine.generate(requests, sampling(0.0))
    assert token_ids(after) == token_ids(run(other, requests, sampling(0.0)))
    assert token_ids(after) != before
    assert {o.policy_version for o in after.outputs} == {3}
    for name, tensor in other.state_dict().items():
        assert torch.equal(engine.runner.model.state_dict()[name], tensor)
    with pytest.raises(KeyError, match="does not exist"):
        engine.update_weights([("nope.weight", torch.zeros(1))], version=4)


def test_update_drafter_weights_by_name(target):
    context = DrafterContext("cpu", "float32", make_tokenizer(), target.config.vocab_size)
    drafter = ModelDrafter(SimpleNamespace(name="model"), context, model=make_tiny_model("llama", seed=7),
                           tokenizer=make_tokenizer())
    engine = Engine(target, make_tokenizer(), rollout("coupled"), drafters=[drafter],
                    max_model_len=64)
    engine.update_weights(target.state_dict().items(), version=2, component="model")
    assert drafter.version == 2
    for name, tensor in target.state_dict().items():
        assert torch.equal(drafter.runner.model.state_dict()[name], tensor)
    with pytest.raises(KeyError, match="no drafter named"):
        engine.update_weights([], version=1, component="missing")


def test_model_drafter_with_other_tokenizer_is_refused(target):
    from transformers import PreTrainedTokenizerFast

    other = make_tokenizer()
    other.add_tokens(["<extra>"])
    assert isinstance(other, PreTrainedTokenizerFast)
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_same_tokenizer(make_tokenizer(), other, "draft")
    context = DrafterContext("cpu", "float32", make_tokenizer(), target.config.vocab_size)
    with pytest.raises(ValueError, match="tokenizer differs"):
        ModelDrafter(SimpleNamespace(name="d"), context, model=target, tokenizer=other)


def test_kv_rollback_is_a_length_change_without_copy(target):
    """Rolling back only moves the committed length; what follows recomputes as if the dropped tokens had
    never been written: the same logits in the same call shape (1e-6), those of a fresh full-sequence forward
    through other kernels (fp32: 1e-4, as for logprobs), and a different token sees none of the stale KV."""
    runner = ModelRunner(target, num_slots=2, max_len=32)
    keys_before = runner.cache.keys[0].data_ptr()
    slots = torch.tensor([0, 1])
    prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    runner.forward(prompt, slots, torch.tensor([4, 3]), logits_at="last")
    runner.commit(slots, torch.tensor([4, 3]))
    block = torch.tensor([[9, 9, 9], [8, 8, 8]])
    full = runner.forward(block, slots)  # [2, 3, V], not committed
    runner.commit(slots, torch.tensor([1, 3]))  # row 0 keeps 1 of 3, row 1 all
    assert runner.lengths.tolist() == [5, 6]
    assert runner.cache.keys[0].data_ptr() == keys_before
    # rolling row 0 back and re-running the same token gives the same logits
    again = runner.forward(block[:, :1], slots)
    assert torch.allclose(again[0, 0], full[0, 1], atol=1e-6)
    assert torch.allclose(again[1, 0], _last_logits(target, [5, 6, 7, 8, 8, 8, 8]), atol=1e-4)
    # a different token where row 0's dropped drafts were: their KV (positions 5 and 6) must not leak
    other = runner.forward(torch.tensor([[7], [7]]), slots)
    assert torch.allclose(other[0, 0], _last_logits(target, [1, 2, 3, 4, 9, 7]), atol=1e-4)
    assert not torch.allclose(other[0, 0], again[0, 0], atol=1e-2)  # the token matters: the check can fail
    runner.set_lengths(slots, torch.tensor([4, 3]))
    redo = runner.forward(block, slots)
    assert torch.allclose(redo, full, atol=1e-6)


def test_pads_past_the_cache_go_to_its_last_position(target):
    """A padded block whose short row would pad past the cache (the target's cache has no draft headroom) writes
    those pads at its last position: the real tokens' logits and the KV they leave are those of a larger cache; a
    row whose real tokens reach that position is refused rather than overwritten."""
    slots, prompt = torch.tensor([0, 1]), torch.tensor([[1, 2, 3, 0, 0], [5, 6, 7, 8, 9]])
    block, widths = torch.tensor([[9, 8, 7, 6], [4, 3, 2, 1]]), torch.tensor([4, 2])
    outputs = []
    for max_len in (8, 16):  # row 1 writes positions 5, 6 and pads 7, 8: past a cache of 8
        runner = ModelRunner(target, num_slots=2, max_len=max_len)
        runner.forward(prompt, slots, torch.tensor([3, 5]), logits_at="none")
        runner.commit(slots, torch.tensor([3, 5]))
        logits = runner.forward(block, slots, widths)
        runner.commit(slots, widths)
        outputs.append((logits, runner.forward(torch.tensor([[3], [3]]), slots)))
    (tight, tight_after), (roomy, roomy_after) = outputs
    real = torch.arange(4)[None, :] < widths[:, None]
    torch.testing.assert_close(tight[real], roomy[real], rtol=0, atol=0)
    torch.testing.assert_close(tight_after, roomy_after, rtol=0, atol=0)
    runner = ModelRunner(target, num_slots=1, max_len=8)
    runner.forward(prompt[1:, :], slots[:1], logits_at="none")
    runner.commit(slots[:1], torch.tensor([5]))
    runner.forward(torch.tensor([[6]]), slots[:1])
    runner.commit(slots[:1], torch.tensor([1]))
    with pytest.raises(RuntimeError, match="real tokens reach position 7"):  # real 6, 7; pads 8, 9
        runner.forward(block[1:], slots[:1], torch.tensor([2]))


def _last_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """The next-token logits after `tokens` from one plain forward (no KV cache): [V]."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def test_reserve_sizes_the_cache_that_generate_then_reuses(target):
    """Engine.reserve allocates the KV cache a generate of those requests needs (so benchmarks and
    training start-up pay for it, not the rollout); the generate reuses it and outputs do not change."""
    requests, params = ragged_requests(4), sampling(0.8, n=2, max_new_tokens=12)
    expected = token_ids(Engine(target, make_tokenizer(), rollout("ar")).generate(requests, params))
    engine = Engine(target, make_tokenizer(), rollout("ar"))
    engine.reserve(requests, params)
    cache = engine.runner.cache
    assert cache.num_slots >= 8 and cache.max_len >= max(len(r.prompt_token_ids) for r in requests) + 12
    assert token_ids(engine.generate(requests, params)) == expected
    assert engine.runner.cache is cache  # not re-allocated


def test_decoding_returns_freed_heap_memory_every_few_rounds(target, monkeypatch):
    """The decode loop checks every TRIM_HEAP_EVERY rounds whether glibc's heap is due a trim (a long CPU
    rollout's resident memory otherwise climbs with fragmentation), and trimming changes no output."""
    import specactor_engine.run as loop_module
    from specactor_engine.model.heap import release_free_memory

    assert release_free_memory() is True  # glibc (Linux): the trim really runs here
    plain = run(target, ragged_requests(3), sampling(1.0, n=2, max_new_tokens=12), "ar", [])
    calls = []
    monkeypatch.setattr(loop_module, "TRIM_HEAP_EVERY", 2)
    monkeypatch.setattr(loop_module, "trim_heap", lambda: calls.append(1) or True)
    trimmed = run(target, ragged_requests(3), sampling(1.0, n=2, max_new_tokens=12), "ar", [])
    assert len(calls) >= 5  # >= 12 rounds, one trim every 2
    assert token_ids(trimmed) == token_ids(plain)


def test_the_heap_is_trimmed_once_resident_memory_has_grown_by_the_slack(monkeypatch):
    """A trim hands back the pages of the temporaries every round allocates afresh, and the rounds after it fault
    them in again (trace A, session 46: 0.6-1.1 million minor faults in a run that trimmed every 32 rounds). The
    trimmer trims at its first call, then only once resident memory has grown `slack` past its reading after the
    last trim; where resident memory cannot be read it trims at every call."""
    import specactor_engine.model.heap as heap

    resident = [1000]
    trims = []
    monkeypatch.setattr(heap, "resident_bytes", lambda: resident[0])
    monkeypatch.setattr(heap, "release_free_memory", lambda: trims.append(resident[0]) or True)
    trimmer = heap.HeapTrimmer(slack=500)
    done = []
    for reading in (1000, 1200, 1499, 1500, 1700, 1999, 2000):
        resident[0] = reading
        done.append(trimmer.maybe_trim())
    assert done == [True, False, False, True, False, False, True] and trims == [1000, 1500, 2000]
    assert trimmer.after_trim == 2000
    monkeypatch.setattr(heap, "resident_bytes", lambda: None)
    assert trimmer.maybe_trim() and trimmer.maybe_trim() and len(trims) == 5
    real = heap.HeapTrimmer()
    monkeypatch.undo()
    assert heap.resident_bytes() > 0 and real.maybe_trim() is True and real.after_trim > 0  # glibc on Linux


def test_weights_digest_detects_a_single_bit(target):
    from specactor_engine.model.weights import model_digest, weights_digest

    other = make_tiny_model("llama", seed=5)
    assert model_digest(other) == model_digest(target)
    with torch.no_grad():
        flat = other.model.norm.weight.view(torch.int32)
        flat[0] ^= 1  # flip the lowest mantissa bit of one element
    assert model_digest(other) != model_digest(target)
    assert weights_digest([("a", torch.zeros(2))]) != weights_digest([("b", torch.zeros(2))])


@pytest.mark.parametrize("queries", [1, 5])
def test_half_precision_attention_matches_an_fp32_reference(queries):
    """bf16 on CPU takes the grouped fp32 attention: as accurate as fp32 SDPA on the same inputs, and
    a bf16 model's logits through the runner stay within bf16 rounding of its own fp32 copy."""
    import torch.nn.functional as F

    from specactor_engine.model.runner import grouped_attention_fp32

    generator = torch.Generator().manual_seed(0)
    R, H, H_kv, D, S = 3, 6, 2, 16, 40
    q, k, v = (torch.randn(R, h, n, D, generator=generator).to(torch.bfloat16)
               for h, n in ((H, queries), (H_kv, S), (H_kv, S)))
    ends = torch.tensor([[20], [39 - queries + 1], [5]]) + torch.arange(queries)[None, :]
    mask = (torch.arange(S)[None, None, :] <= ends[:, :, None])[:, None]
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=D**-0.5,
                                               enable_gqa=True)
    assert torch.allclose(grouped_attention_fp32(q, k, v, mask, D**-0.5), reference, atol=1e-5)

    model = make_tiny_model("qwen2", seed=4)
    half = make_tiny_model("qwen2", seed=4, dtype=torch.bfloat16)
    tokens = torch.randint(3, 200, (2, 12), generator=generator)
    full = ModelRunner(model, num_slots=2, max_len=16).forward(tokens, torch.arange(2))
    low = ModelRunner(half, num_slots=2, max_len=16).forward(tokens, torch.arange(2)).float()
    assert (low - full).abs().max() < 0.1 * full.abs().max()


def test_on_cuda_torch_attention_runs_without_the_cudnn_backend_and_elsewhere_as_torch_chooses():
    """cuDNN's attention builds a plan per new shape, and every engine round brings new shapes (runner.py):
    the context switches it off on CUDA only, and only while the engine's attention runs."""
    from specactor_engine.model.runner import attention_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends(torch.device("cuda", 0)):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with attention_backends(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before
