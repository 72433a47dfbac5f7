#!/bin/bash
cd /work/main
while [ ! -f /tmp/s38/rollouts.done ]; do sleep 10; done
D=runs/drafters/feature-v5-data
test -f $D/rollouts.jsonl || { echo "no rollouts"; exit 1; }
date
cat runs/drafters/feature-v2-data/all.jsonl $D/rollouts.jsonl > $D/all.jsonl
wc -l $D/all.jsonl
V4=runs/drafters/qwen1.5b-feature-v4; V5=runs/drafters/qwen1.5b-feature-v5
rm -rf $V5 && mkdir -p $V5
cp $V4/feature_drafter.* $V4/feature_trainer_state.pt $V4/draft_vocab.json $V4/target_features.pt $V5/
.venv/bin/specactor drafter feature --target qwen2.5-coder-1.5b-instruct --dtype float32 \
  --feature-dtype bfloat16 --data $D/all.jsonl --batch-size 4 --lr 1e-4 --passes 3 --steps 1789 --out $V5
echo rc=$?
date
touch /tmp/s38/train.done
