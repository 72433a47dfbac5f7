#!/bin/bash
cd /work/main
D=runs/drafters/feature-v5-data
B=.venv/bin
mkdir -p $D
date
$B/specactor prompts --task chain_sum --count 128 --seed 3000 --out $D/chain_sum.jsonl
$B/specactor prompts --task basic_arithmetic --count 128 --seed 3000 --out $D/basic.jsonl
cat $D/chain_sum.jsonl $D/basic.jsonl > $D/prompts.jsonl
$B/specactor rollout --prompts $D/prompts.jsonl --out $D/rollouts.jsonl.partial \
  --set model.target=qwen2.5-coder-1.5b-instruct --set model.dtype=bfloat16 --set rollout.mode=ar \
  --set sampling.n=2 --set sampling.max_new_tokens=256 --set sampling.temperature=1.0 \
  --set rollout.max_batch_size=128 --set sampling.seed=11 && mv $D/rollouts.jsonl.partial $D/rollouts.jsonl
echo rc=$?
date
touch /tmp/s38/rollouts.done
