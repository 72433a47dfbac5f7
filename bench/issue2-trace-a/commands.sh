#!/usr/bin/env bash
# Issue 2 note: trace A (Qwen2.5-Coder-1.5B-Instruct target, 0.5B-Instruct drafter, bf16, 2 threads):
# tokens/s of hf / ar / coupled (k=4) [/ oracle] at the full batch and at batch 1, temperature 1 and greedy.
# These are the exact commands behind the result directories here (each results.json records its own).
set -euo pipefail
cd "$(dirname "$0")/../.."
export SPECACTOR_CACHE_DIR="$PWD/.cache/specactor" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
BENCH=(.venv/bin/python -m benchmark --trace A --repeats 1 -k 4)
OUT=bench/issue2-trace-a

# Full batch: 32 sequences (8 prompts x 4 samples), 256 new tokens. Run 03:57-04:20 with the oracle's single
# pass (what --oracle-passes 1 does now), waiting first for a 1-minute load average <= 1.5.
"${BENCH[@]}" --systems hf,ar,coupled,oracle --oracle-passes 1 --wait-load 1.5 --out $OUT/batch32-t1
"${BENCH[@]}" --systems hf,ar,coupled,oracle --oracle-passes 1 --wait-load 1.5 --temperature 0 --out $OUT/batch32-greedy

# Batch 1, reduced: one trace-A prompt (chain_sum), 1 sample, 96 new tokens (time ran short for 4 x 256).
"${BENCH[@]}" --systems hf,ar,coupled --prompts 1 --samples 1 --max-batch 1 --max-new-tokens 96 \
  --out $OUT/batch1-t1-small
"${BENCH[@]}" --systems hf,ar,coupled --prompts 1 --samples 1 --max-batch 1 --max-new-tokens 96 --temperature 0 \
  --out $OUT/batch1-greedy-small

# Not run yet (about 20 min on a quiet machine): the intended batch-1 subset of 4 sequences x 256 tokens.
# "${BENCH[@]}" --systems hf,ar,coupled,oracle --prompts 4 --samples 1 --max-batch 1 --wait-load 1.5 --out $OUT/batch1-t1
# "${BENCH[@]}" --systems hf,ar,coupled,oracle --prompts 4 --samples 1 --max-batch 1 --wait-load 1.5 --temperature 0 \
#   --out $OUT/batch1-greedy
