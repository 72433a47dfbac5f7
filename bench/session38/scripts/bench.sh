#!/bin/bash
cd /work/main
while [ ! -f /tmp/s38/train.done ]; do sleep 10; done
test -f runs/drafters/qwen1.5b-feature-v5/feature_report.json || { echo "no v5"; exit 1; }
date
.venv/bin/python -m benchmark --trace D --feature-drafter runs/drafters/qwen1.5b-feature-v5 --systems ar,vllm,specactor,coupled-feature --repeats 3 --out /tmp/s38/D
echo rc=$?
date
touch /tmp/s38/bench.done
