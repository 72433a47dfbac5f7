"""Update throughput: response tokens per second of the trainer's GRPO step, variants side by side.

    python -m benchmark.update_throughput                      # the `make run` config as it is
    python -m benchmark.update_throughput --variants float32:2:4,bfloat16:0:4 --steps 3 --out bench/update.json

Each variant builds the trainer `specactor train` builds (`tasks.host.build_trainer`: DeepSpeed) from the config's
`train.optim` with the overrides the variant names (`dtype` or `dtype:zero_stage:micro_batch_size`) and times
`step` on one synthetic batch shaped like a `make run` step (prompts x samples, prompt and output lengths),
after one untimed warm-up step. Variants run in turn in this process, so they see the same machine state;
the medians and the others' CPU share are printed and saved. Speed lives here, not in tests
(tests/tasks/test_trainer.py holds what the update computes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmark.machine import busy_cpu_s, machine_info
from specactor_engine.config import OptimConfig, SpecActorConfig, load_config
from specactor_engine.model.registry import resolve_model
from tasks.host import build_trainer
from tasks.trainer import RolloutBatch

DEFAULT_CONFIG = "configs/train_smollm2.yaml"


def synthetic_batch(samples: int, prompt_tokens: int, output_tokens: int, vocab_size: int, seed: int = 0,
                    group_size: int = 1) -> RolloutBatch:
    """`samples` rows of random ids (speed does not depend on the values), output lengths spread around
    `output_tokens` (0.5x-1.5x) in a random order as a rollout's are, advantages of both signs; each run of
    `group_size` rows shares its prompt, as a GRPO group's samples do (the lengths do not depend on it)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, outputs = [], []
    for row, i in enumerate(torch.randperm(samples, generator=gen).tolist()):
        length = max(1, int(output_tokens * (0.5 + i / max(samples - 1, 1))))
        prompt = torch.randint(vocab_size, (prompt_tokens,), generator=gen).tolist()
        prompts.append(prompt if row % group_size == 0 else prompts[-1])
        outputs.append(torch.randint(vocab_size, (length,), generator=gen).tolist())
    advantages = [(-1.0) ** i * (1 + i % 4) / 4 for i in range(samples)]
    return RolloutBatch(prompts, outputs, [[-1.0] * len(o) for o in outputs], advantages)


def parse_variant(text: str, base: OptimConfig) -> tuple[str, OptimConfig]:
    """`dtype[:zero_stage[:micro_batch_size[:micro_batch_tokens[:shared_prompt]]]]` over the config's optim
    settings (an empty field keeps the config's; shared_prompt 0 or 1; dtype `autocast`: float32 weights with
    bf16 matrix multiplies, `train.optim.autocast: bfloat16`)."""
    parts = text.split(":")
    fields: dict[str, Any] = {"dtype": parts[0]} if parts[0] else {}
    if parts[0] == "autocast":
        fields = {"dtype": "float32", "autocast": "bfloat16"}
    elif parts[0]:
        fields["autocast"] = "none"
    if len(parts) > 1 and parts[1]:
        fields["zero_stage"] = int(parts[1])
    if len(parts) > 2 and parts[2]:
        fields["micro_batch_size"] = int(parts[2])
    if len(parts) > 3 and parts[3]:
        fields["micro_batch_tokens"] = int(parts[3])
    if len(parts) > 4 and parts[4]:
        fields["shared_prompt"] = bool(int(parts[4]))
    return text, base.model_copy(update=fields)


def measure(config: SpecActorConfig, model_path: Path, optim: OptimConfig, batch: RolloutBatch, steps: int
            ) -> dict[str, Any]:
    """The trainer `specactor train` builds (tasks/host.py), with `optim`, timed on `batch`."""
    variant = config.model_copy(update={"train": config.train.model_copy(update={"optim": optim})})
    trainer = build_trainer(variant, model_path)
    trainer.step(batch)  # warm-up: allocations, first-call dispatch
    seconds = []
    busy_before, own_before, wall_before = busy_cpu_s(), time.process_time(), time.perf_counter()
    for _ in range(steps):
        started = time.perf_counter()
        trainer.step(batch)
        seconds.append(time.perf_counter() - started)
    wall = time.perf_counter() - wall_before
    others = None
    if busy_before is not None:
        busy = busy_cpu_s() - busy_before  # type: ignore[operator]
        capacity = wall * torch.get_num_threads()
        others = max(0.0, min(1.0, (busy - (time.process_time() - own_before)) / capacity)) if capacity else None
    median = statistics.median(seconds)
    return {"step_s": seconds, "median_step_s": median, "tokens_per_s": batch.num_output_tokens / median,
            "others_cpu_share": others}


def _gradient(trainer: Any) -> torch.Tensor:
    """The trainer's whole gradient after `backward`, flattened in parameter order (float64)."""
    from deepspeed.utils import safe_get_full_grad

    return torch.cat([safe_get_full_grad(p).double().flatten() for _, p in trainer.module.named_parameters()])


def accuracy(config: SpecActorConfig, model_path: Path, variants: list[tuple[str, OptimConfig]], batch: RolloutBatch
             ) -> list[dict[str, Any]]:
    """What each variant computes against the first one's on one on-policy batch (its log-probabilities are the
    first variant's own): the loss, the gradient's error relative to its norm and cosine, and the mean absolute
    gap between the variant's log-probabilities and the first's (what a ratio over rollout log-probabilities
    computed by the reference's numerics would see)."""
    def build(optim: OptimConfig) -> Any:
        return build_trainer(config.model_copy(update={"train": config.train.model_copy(update={"optim": optim})}),
                             model_path)

    reference = build(variants[0][1])
    batch = RolloutBatch(batch.prompt_token_ids, batch.output_token_ids, reference.logprobs(batch), batch.advantages)
    expected_loss = reference.backward(batch)["loss"]
    expected = _gradient(reference)
    rows = []
    for name, optim in variants[1:]:
        trainer = build(optim)
        metrics = trainer.backward(batch)
        got = _gradient(trainer)
        error = torch.linalg.vector_norm(got - expected) / torch.linalg.vector_norm(expected)
        rows.append({"variant": name, "reference": variants[0][0], "loss": metrics["loss"],
                     "reference_loss": expected_loss, "gradient_error": float(error),
                     "gradient_cosine": float(torch.nn.functional.cosine_similarity(got, expected, dim=0)),
                     "logprob_gap": metrics["rollout_logprob_gap"]})
        del trainer
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="a train config (its model and train.optim)")
    parser.add_argument("--variants", default=":", help="comma-separated dtype[:zero_stage[:micro_batch_size"
                        "[:micro_batch_tokens[:shared_prompt]]]] (an empty field: the config's; dtype autocast: fp32 "
                        "weights, bf16 matrix multiplies; default: the config as it is)")
    parser.add_argument("--prompts", type=int, default=None, help="default: train.prompts_per_step")
    parser.add_argument("--samples", type=int, default=None, help="per prompt; default: sampling.n")
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--output-tokens", type=int, default=80, help="mean output length")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the results here as JSON")
    parser.add_argument("--accuracy", action="store_true", help="instead of timing: each variant's loss, gradient "
                        "(relative error, cosine) and log-probabilities against the first variant's on one on-policy "
                        "batch (e.g. --variants float32:0,autocast:0,bfloat16:0)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_path = resolve_model(config.model.target, dtype="float32", cache_dir=config.model.cache_dir)
    vocab = int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    group = args.samples or config.sampling.n
    rows = (args.prompts or config.train.prompts_per_step) * group
    batch = synthetic_batch(rows, args.prompt_tokens, args.output_tokens, vocab, group_size=group)
    print(f"{config.model.target}: {rows} samples in groups of {group}, {batch.num_output_tokens} response tokens, "
          f"{torch.get_num_threads()} threads")
    if args.accuracy:
        variants = [parse_variant(text.strip(), config.train.optim) for text in args.variants.split(",")]
        rows = accuracy(config, model_path, variants, batch)
        for row in rows:
            print(f"{row['variant']:<24} loss {row['loss']:+.5f} ({row['reference']}: {row['reference_loss']:+.5f})  "
                  f"gradient error {row['gradient_error']:.1%}  cosine {row['gradient_cosine']:.4f}  "
                  f"log-probability gap {row['logprob_gap']:.4f}", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"config": args.config, "samples": len(batch),
                                            "response_tokens": batch.num_output_tokens, "accuracy": rows}, indent=1)
                                + "\n", encoding="utf-8")
        return
    results = []
    for text in args.variants.split(","):
        name, optim = parse_variant(text.strip(), config.train.optim)
        result = {"variant": name, "optim": optim.model_dump(mode="json"),
                  **measure(config, model_path, optim, batch, args.steps)}
        results.append(result)
        others = result["others_cpu_share"]
        print(f"{name:<24} {result['median_step_s']:7.2f} s/step  {result['tokens_per_s']:8.1f} tokens/s"
              + (f"  others' CPU {others:.0%}" if others is not None else ""), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine_info(torch.get_num_threads()), "config": args.config,
                                        "samples": rows, "response_tokens": batch.num_output_tokens,
                                        "results": results}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
