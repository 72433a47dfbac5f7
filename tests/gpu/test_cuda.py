"""The engine on a CUDA device (`make gpu-check`; skipped where torch sees no GPU).

What must hold on a GPU as on the CPU:
- the position-keyed noise and the compiled Gumbel-max (a Triton kernel on CUDA) equal their CPU
  references bit for bit, so a token's sampling noise does not depend on the device;
- `ar` on CUDA emits what `ar` on the CPU emits (fp32 tiny models, TF32 off), and `coupled` and `specactor`
  on CUDA (model, feature-level, suffix and n-gram drafters) emit what `ar` on CUDA emits;
- the cost profile measures on CUDA (the timings synchronise the device).
These run with the GPU machine's own python3 (torch, transformers, pytest there; pydantic carried as
wheels by `make gpu-wheels`); the CPU suite covers the same code paths on the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specactor_engine.drafters import DrafterContext
from specactor_engine.drafters.feature import FeatureDrafter
from specactor_engine.drafters.model import ModelDrafter
from specactor_engine.drafters.ngram import NgramDrafter
from specactor_engine.drafters.suffix import SuffixDrafter
from specactor_engine.engine import Engine
from specactor_engine.kernels.gumbel_argmax import gumbel_argmax, gumbel_argmax_reference
from specactor_engine.sampling import token_hash, uniform_noise
from tests.engine.test_exactness import MAX_LEN, ragged_requests, rollout, sampling, token_ids
from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (make gpu-check runs these)")]

CUDA = "cuda"
K = 3


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 matmuls in full fp32 (TF32 would round inputs to 10 mantissa bits and break equality with the CPU)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_position_keyed_noise_on_cuda_equals_the_cpu_fast_path():
    keys = torch.tensor([0, 7, 2**31 + 5, 2**32 - 1], dtype=torch.long)
    positions = torch.arange(12).view(4, 3) * 37
    cpu = uniform_noise(keys, positions, 5000)
    gpu = uniform_noise(keys.to(CUDA), positions.to(CUDA), 5000)
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)


def test_compiled_gumbel_argmax_on_cuda_equals_the_reference_and_the_cpu():
    """TorchInductor compiles the fused Gumbel-max to a Triton kernel on CUDA: same choice, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    vocab = 151_936
    scores = torch.randn(24, vocab, generator=gen) * 3
    scores[3, 100:] = float("-inf")  # a top-k style row
    keys = torch.randint(0, 2**32, (24,), generator=gen)
    hashes = token_hash(vocab, "cpu")
    cpu = gumbel_argmax_reference(scores, keys, hashes)
    reference = gumbel_argmax_reference(scores.to(CUDA), keys.to(CUDA), hashes.to(CUDA))
    compiled = gumbel_argmax(scores.to(CUDA), keys.to(CUDA), hashes.to(CUDA))
    assert torch.equal(reference.cpu(), cpu)
    assert torch.equal(compiled.cpu(), cpu)


def _context(dtype: torch.dtype, device: str) -> DrafterContext:
    return DrafterContext(device, str(dtype).removeprefix("torch."), make_tokenizer(), 261)


def _drafters(kind: str, target, device: str) -> list:
    """The drafters of one system on `device` (the model drafters' weights live there)."""
    dtype = next(target.parameters()).dtype
    context = _context(dtype, device)
    tokenizer = make_tokenizer()
    made = []
    for name in kind.split("+"):
        if name == "model":
            draft = make_tiny_model("qwen2", seed=1, num_layers=1, dtype=dtype).to(device)
            made.append(ModelDrafter(SimpleNamespace(name="model"), context, model=draft, tokenizer=tokenizer))
        elif name == "self":  # the target as its own drafter: every draft is accepted
            made.append(ModelDrafter(SimpleNamespace(name="self"), context, model=target, tokenizer=tokenizer))
        elif name == "feature":
            fields = dict(name="feature", path=None, quantize="none", draft_vocab=None)
            made.append(FeatureDrafter(SimpleNamespace(**fields), context))
        elif name == "ngram":
            made.append(NgramDrafter(SimpleNamespace(name="ngram", min_n=1, max_n=3), context))
        elif name == "suffix":
            made.append(SuffixDrafter(SimpleNamespace(name="suffix", max_depth=12, min_match=1, max_history=4),
                                      context))
    return made


def _generate(target, mode: str, drafters=(), **fields):
    config = rollout(mode, num_draft_tokens=K, max_batch_size=16, **fields)
    engine = Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN, drafters=list(drafters),
                    check_invariants=True)
    return engine.generate(ragged_requests(6), sampling(1.0, n=2, max_new_tokens=30))


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def targets(request):
    """The same fp32 weights on the CPU and on CUDA."""
    cpu = make_tiny_model(request.param, seed=3, num_layers=2, dtype=torch.float32)
    gpu = make_tiny_model(request.param, seed=3, num_layers=2, dtype=torch.float32).to(CUDA)
    return cpu, gpu


def test_ar_on_cuda_equals_ar_on_the_cpu(targets):
    cpu, gpu = targets
    assert token_ids(_generate(gpu, "ar")) == token_ids(_generate(cpu, "ar"))


@pytest.mark.parametrize("drafters", ["self", "model", "ngram+suffix", "feature"])
def test_coupled_on_cuda_equals_ar(targets, drafters):
    _, gpu = targets
    reference = token_ids(_generate(gpu, "ar"))
    result = _generate(gpu, "coupled", _drafters(drafters, gpu, CUDA))
    assert token_ids(result) == reference
    assert result.stats.drafted_tokens > 0
    if drafters == "self":
        assert result.stats.accepted_tokens == result.stats.drafted_tokens


def test_specactor_on_cuda_equals_ar(targets):
    """Fastest-of-N over a model drafter, the feature drafter and the model-free methods, dynamic verify length."""
    from tests.engine.test_dynamic_verify_length import table

    _, gpu = targets
    reference = token_ids(_generate(gpu, "ar"))
    config = rollout("specactor", num_draft_tokens=K, max_batch_size=16, verify_length="dynamic")
    engine = Engine(gpu, make_tokenizer(), config, max_model_len=MAX_LEN,
                    drafters=_drafters("model+feature+suffix+ngram", gpu, CUDA), cost_table=table(0.01, 0.0001),
                    check_invariants=True)
    result = engine.generate(ragged_requests(6), sampling(1.0, n=2, max_new_tokens=30))
    assert token_ids(result) == reference
    assert result.stats.drafted_tokens > 0


def test_the_cost_profile_measures_on_cuda(targets):
    from specactor_engine.model.runner import ModelRunner
    from specactor_engine.policies.cost_profile import measure_verify_costs

    _, gpu = targets
    table = measure_verify_costs(ModelRunner(gpu), (1, 4), (1, 2, 3), context=32)
    assert table.batch_sizes == (1, 4) and table.widths == (1, 2, 3)
    assert all(0 < seconds < 1 for row in table.seconds for seconds in row)


def test_the_engines_attention_on_cuda_runs_without_the_cudnn_backend(monkeypatch):
    """cuDNN's attention builds a plan per new shape (runner.CUDA_SDPA_BACKENDS): the engine's attention runs
    with it switched off, in bf16 too (where torch would otherwise pick it on Hopper)."""
    from specactor_engine.model import runner as runner_module

    real, seen = runner_module.F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module.F, "scaled_dot_product_attention", spy)
    model = make_tiny_model("qwen2", seed=3, num_layers=2, dtype=torch.bfloat16).to(CUDA)
    _generate(model, "ar")
    assert seen and not any(seen)
