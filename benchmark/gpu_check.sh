#!/usr/bin/env bash
# `make gpu-check`: the GPU check with the machine's own python3 (see benchmark/gpu_check.py and
# docs/gpu.md). Usage: benchmark/gpu_check.sh OUT_DIR [WHEELS_DIR]. Exits 0 on a machine without CUDA.
set -euo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [WHEELS_DIR]}
wheels=${2:-.gpu-wheels}
py=${GPU_PYTHON:-python3}
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu-check: no CUDA device here ($py has no torch, or its torch sees no GPU); nothing to check (run it on a GPU machine, docs/gpu.md)."
    exit 0
fi
mkdir -p "$out"
site=$(mktemp -d)
if ls "$wheels"/*.whl >/dev/null 2>&1; then  # what the GPU image lacks (make gpu-wheels)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "transformers", "pydantic", "yaml", "numpy", "pytest", "tokenizers")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu-check: {', '.join(missing)} missing; run `make gpu-wheels` on a machine with network first")
PY
status=0
"$py" -m pytest -m gpu tests/gpu -p no:cacheprovider -q 2>&1 \
    | tee "$out/gpu_tests.log" || status=$?
"$py" -m benchmark.gpu_check --out "$out" ${GPU_CHECK_ARGS:-} 2>&1 | tee "$out/gpu_check.log" || status=$?
exit $status
