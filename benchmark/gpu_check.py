"""Measurements for `make gpu-check` on a CUDA machine: the verify-cost table of real architectures
(random weights) and `ar` against `oracle-dynamic` on a random-weight model.

    python3 -m benchmark.gpu_check --out bench/gpu [--models qwen2.5-1.5b,qwen2.5-7b] [--budget-s 420]

The GPU machine this project is sometimes lent reaches no network and holds no model weights, so the
architectures are built from their published dimensions (`ARCHITECTURES`) with random weights: a forward's
cost depends on the shapes, not the values. Acceptance on such a model means nothing, except for the oracle,
whose drafts are the `ar` run's own outputs (every draft accepted while the verify forward reproduces them),
so `ar` vs `oracle-dynamic` bounds what any drafter can give at each per-worker batch size.

Writes (each file as soon as its part is done, so a run cut short keeps what it measured):
    environment.json                    torch, CUDA, device, memory
    cost_<arch>.json                    CostProfile (policies/verify_length.py): seconds[rows][width] per context
    ar_vs_oracle.json                   makespans, tokens/s and acceptance per max batch size
On a machine without CUDA it says so and exits 0 (`--device cpu` runs the same code on the CPU, tiny only).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# Published dimensions (config.json of each model on the Hugging Face hub, Qwen/Qwen2.5-*).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # the CPU test's stand-in (tests/benchmark/test_gpu_check.py)
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=512, tie_word_embeddings=False),
}
ROWS = (1, 4, 16, 64, 128, 256)
MAX_K = 8  # widths 1..MAX_K + 1
CONTEXTS = (256, 1024)


def random_model(arch: str, dtype: torch.dtype, device: str, seed: int = 0) -> torch.nn.Module:
    """A Qwen2 causal LM of `arch`'s shapes with random weights, built on `device`."""
    import transformers

    config = transformers.Qwen2Config(**ARCHITECTURES[arch], max_position_embeddings=32768, rope_theta=1e6,
                                      rms_norm_eps=1e-6, eos_token_id=None, bos_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


class _NoTokenizer:
    """The engine's tokenizer interface for token-id requests on a random model: no text, no EOS."""

    eos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def environment(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__,
                             "platform": platform.platform(), "device": device}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        facts.update(name=props.name, capability=f"{props.major}.{props.minor}",
                     multiprocessors=props.multi_processor_count, memory_gib=round(total / 2**30, 1),
                     free_gib=round(free / 2**30, 1), cuda=torch.version.cuda,
                     tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
    return facts


def measure_cost_table(arch: str, device: str, rows: tuple[int, ...], contexts: tuple[int, ...],
                       max_k: int, dtype: torch.dtype) -> dict[str, Any]:
    """The engine's own verify round (ModelRunner forward + seeded sampling) over rows x widths x contexts."""
    from specactor_engine.model.runner import ModelRunner
    from specactor_engine.policies.cost_profile import measure_verify_costs
    from specactor_engine.policies.verify_length import CostProfile

    started = time.perf_counter()
    model = random_model(arch, dtype, device)
    runner = ModelRunner(model)
    widths = tuple(range(1, max_k + 2))
    tables = tuple(measure_verify_costs(runner, rows, widths, context) for context in contexts)
    params = sum(p.numel() for p in model.parameters())
    del runner, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"arch": arch, "dims": ARCHITECTURES[arch], "parameters": params, "dtype": str(dtype),
            "profile": CostProfile(tables).to_dict(), "measure_s": round(time.perf_counter() - started, 1)}


def _sampling(max_new_tokens: int, n: int, seed: int = 0) -> SimpleNamespace:
    return SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, n=n, seed=seed,
                           stop=[], stop_token_ids=[], ignore_eos=True)


def ar_vs_oracle(arch: str, device: str, batch_sizes: tuple[int, ...], max_new_tokens: int, max_k: int,
                 dtype: torch.dtype, cost_profile: dict[str, Any] | None, passes: int = 2) -> list[dict[str, Any]]:
    """Per max batch size: `ar`, then the oracle with the cost-model verify length, its drafts `ar`'s outputs.

    passes > 1: untimed oracle runs first, each replacing the drafts with its own outputs. In bf16 a verify
    forward of k + 1 tokens per row does not round like `ar`'s width-1 forward (the GEMMs' kernels depend
    on the batch shape), so sampled tokens differ at near-ties, the rollouts part, and `ar`'s outputs stop
    matching; the oracle's own outputs are what its verify forwards reproduce (as benchmark/oracle.py does)."""
    from benchmark.oracle import OracleDrafter
    from specactor_engine.config import DecoupledConfig, RolloutConfig
    from specactor_engine.engine import Engine
    from specactor_engine.policies.verify_length import CostProfile
    from specactor_engine.sampling import sequence_key
    from specactor_engine.types import Request

    model = random_model(arch, dtype, device, seed=1)
    vocab = model.config.vocab_size
    profile = CostProfile.from_dict(cost_profile) if cost_profile else None
    results = []
    for rows in batch_sizes:
        samples = 4
        prompts = max(4, 2 * rows // samples)  # at least two full batches of GRPO groups of 4
        gen = torch.Generator().manual_seed(rows)
        requests = [Request(f"p{i}", prompt_token_ids=torch.randint(vocab, (64,), generator=gen).tolist())
                    for i in range(prompts)]
        params = _sampling(max_new_tokens, samples)
        entry: dict[str, Any] = {"max_batch_size": rows, "sequences": prompts * samples,
                                 "max_new_tokens": max_new_tokens}
        ar_config = RolloutConfig(mode="ar", max_batch_size=rows, decoupled=DecoupledConfig(drafter=None))
        ar_engine = Engine(model, _NoTokenizer(vocab), ar_config, max_model_len=64 + max_new_tokens + max_k + 2)
        ar_engine.generate(requests[:1], _sampling(8, 1))  # warm-up (kernel selection, allocator)
        timed = _timed(device, lambda: ar_engine.generate(requests, params))
        ar, entry["ar_s"] = timed
        references = {sequence_key(params.seed, o.request_id, o.sample_index): o.token_ids for o in ar.outputs}
        config = RolloutConfig(mode="coupled", max_batch_size=rows, num_draft_tokens=max_k, verify_length="dynamic",
                               combine_below=0, decoupled=DecoupledConfig(drafter=None))
        engine = Engine(model, _NoTokenizer(vocab), config, max_model_len=64 + max_new_tokens + max_k + 2,
                        drafters=[OracleDrafter(references)], cost_table=profile)
        engine.generate(requests[:1], _sampling(8, 1))
        for _ in range(passes - 1):
            refresh = engine.generate(requests, params)
            references.update({sequence_key(params.seed, o.request_id, o.sample_index): o.token_ids
                               for o in refresh.outputs})
            engine.length_policy = None  # the timed run starts from the same statistics as the first
        oracle, entry["oracle_dynamic_s"] = _timed(device, lambda: engine.generate(requests, params))
        tokens = sum(len(o.token_ids) for o in ar.outputs)
        same = sum(a.token_ids == b.token_ids for a, b in zip(ar.outputs, oracle.outputs))
        stats = oracle.stats
        entry.update(tokens=tokens, speedup=round(entry["ar_s"] / entry["oracle_dynamic_s"], 3),
                     ar_tokens_per_s=round(tokens / entry["ar_s"], 1),
                     oracle_tokens_per_s=round(tokens / entry["oracle_dynamic_s"], 1),
                     identical_sequences=f"{same}/{len(ar.outputs)}",
                     accept_len=round(stats.mean_acceptance_length, 3),
                     drafted=stats.drafted_tokens, accepted=stats.accepted_tokens, oracle_passes=passes,
                     ar_rounds=ar.stats.verify_rounds, oracle_rounds=stats.verify_rounds,
                     ar_ms_per_round=round(1e3 * entry["ar_s"] / max(ar.stats.verify_rounds, 1), 2),
                     oracle_ms_per_round=round(1e3 * entry["oracle_dynamic_s"] / max(stats.verify_rounds, 1), 2),
                     verify_lengths=_histogram(engine.length_policy.history if engine.length_policy else []))
        results.append(entry)
        print(f"  {arch} rows {rows}: ar {entry['ar_s']:.2f} s, oracle-dynamic {entry['oracle_dynamic_s']:.2f} s "
              f"({entry['speedup']}x), identical {entry['identical_sequences']}", flush=True)
    return results


def _histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def _timed(device: str, run: Any) -> tuple[Any, float]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = run()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, round(time.perf_counter() - started, 3)


def _write(out: Path, name: str, data: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON results")
    parser.add_argument("--device", default="cuda", help="torch device (default cuda; 'cpu' for the test)")
    parser.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-0.5b,qwen2.5-7b",
                        help="architectures whose verify-cost table to measure (of %s)" % ", ".join(ARCHITECTURES))
    parser.add_argument("--oracle-model", default="qwen2.5-1.5b", help="architecture of the ar vs oracle run")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="batch sizes of the cost table")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="committed contexts of the table")
    parser.add_argument("--max-k", type=int, default=MAX_K, help="deepest verify length (widths 1..k+1)")
    parser.add_argument("--oracle-rows", default="4,16,64,128", help="max batch sizes of the ar vs oracle runs")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--oracle-passes", type=int, default=2,
                        help="oracle runs; all but the last are untimed and replace its drafts with its outputs")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device here; nothing to measure (run it on the GPU machine).")
        return 0
    dtype = getattr(torch, args.dtype)
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    torch.backends.cuda.matmul.allow_tf32 = False
    facts = environment(args.device)
    _write(args.out, "environment.json", facts)
    print(f"gpu-check on {facts.get('name', args.device)} (torch {torch.__version__})", flush=True)
    models = [m for m in args.models.split(",") if m]
    # the oracle's architecture first (its table feeds the oracle's verify length), then the ar vs oracle
    # runs, then the other tables: a run cut short keeps the most of what it measured
    order = sorted(models, key=lambda m: m != args.oracle_model)
    if args.oracle_model not in order:
        order.insert(0, args.oracle_model)
    for arch in order:
        table = measure_cost_table(arch, args.device, ints(args.rows), ints(args.contexts), args.max_k, dtype)
        _write(args.out, f"cost_{arch}.json", table)
        first = table["profile"]["tables"][0]
        print(f"  cost table {arch}: {table['measure_s']} s; width 1: "
              + ", ".join(f"{r} rows {s[0] * 1e3:.1f} ms" for r, s in zip(first["batch_sizes"], first["seconds"])),
              flush=True)
        if arch == args.oracle_model:
            runs = ar_vs_oracle(arch, args.device, ints(args.oracle_rows), args.max_new_tokens, args.max_k, dtype,
                                table["profile"], args.oracle_passes)
            _write(args.out, "ar_vs_oracle.json", {"arch": arch, "dtype": args.dtype, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
