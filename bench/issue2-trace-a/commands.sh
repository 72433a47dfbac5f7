#!/usr/bin/env bash
# Issue 2 note: trace A (Qwen2.5-Coder-1.5B target, 0.5B drafter, bf16, 2 threads), tokens/s of
# hf / ar / coupled (k=4) / oracle at batch 1 (a subset of 4 sequences: 2 chain_sum + 2
# basic_arithmetic prompts, 1 sample each, decoded one at a time) and at the full batch (32
# sequences), temperature 1 and greedy. Each invocation first waits (up to 10 min) until the 1-minute
# load average or the busy CPUs over 10 s are <= 1.5; every run records the other processes' CPU share.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SPECACTOR_CACHE_DIR="$PWD/.cache/specactor" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
BENCH=(.venv/bin/python -m benchmark --trace A --systems hf,ar,coupled,oracle --repeats 1 -k 4 --oracle-passes 2
       --wait-load 1.5)
OUT=bench/issue2-trace-a

"${BENCH[@]}" --prompts 4 --samples 1 --max-batch 1 --out $OUT/batch1-t1
"${BENCH[@]}" --prompts 4 --samples 1 --max-batch 1 --temperature 0 --out $OUT/batch1-greedy
"${BENCH[@]}" --out $OUT/batch32-t1
"${BENCH[@]}" --temperature 0 --out $OUT/batch32-greedy

# What was actually run for batch 1 (time ran short for the 4-sequence, 256-token runs above):
# one trace-A prompt, 1 sample, 96 new tokens, hf/ar/coupled.
"${BENCH[@]}" --systems hf,ar,coupled --prompts 1 --samples 1 --max-batch 1 --max-new-tokens 96 --out $OUT/batch1-t1-small
"${BENCH[@]}" --systems hf,ar,coupled --prompts 1 --samples 1 --max-batch 1 --max-new-tokens 96 --temperature 0 --out $OUT/batch1-greedy-small
