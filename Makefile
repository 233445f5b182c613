# hetero: make help lists the targets. Every config field FOO is the Make variable FOO= and the flag --foo.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# torchrun: one node by default; NNODES>1 uses the c10d rendezvous at RDZV_ENDPOINT (README: several nodes).
NPROC ?= 2
NNODES ?= 1
NODE_RANK ?= 0
RDZV_ENDPOINT ?= 127.0.0.1:29500
RDZV_ID ?= hetero
ifeq ($(NNODES),1)
TORCHRUN_ARGS := --standalone --nproc-per-node=$(NPROC)
else
TORCHRUN_ARGS := --nnodes=$(NNODES) --node-rank=$(NODE_RANK) --nproc-per-node=$(NPROC) \
	--rdzv-backend=c10d --rdzv-endpoint=$(RDZV_ENDPOINT) --rdzv-id=$(RDZV_ID)
endif

FIELDS := MODEL SCHEME HETERO EPOCHS GLOBAL_BATCH MIN_BATCH MAX_BATCH LR MOMENTUM WEIGHT_DECAY DATA DATA_DIR \
	SUBSET TEST_SUBSET AUGMENT SEED DEVICE BACKEND THREADS REBALANCE_EVERY SMOOTHING DEADBAND TIMEOUT_S RUN_DIR \
	OVERWRITE RESUME REPLAY EVAL_BATCH
flag = --$(subst _,-,$(shell printf '%s' '$(1)' | tr A-Z a-z))
ARGS := $(foreach v,$(FIELDS),$(if $(value $(v)),$(call flag,$(v)) '$($(v))'))

.PHONY: help install experiment test clean-venv
help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 14
	@echo; echo "Variables: NPROC NNODES NODE_RANK RDZV_ENDPOINT RDZV_ID and the config fields:"; echo "  $(FIELDS)"

install: $(STAMP)  ## create .venv with torch, torchvision, jupyterlab, papermill, ... (once)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m ipykernel install --user --name hetero --display-name "Python (hetero)" >/dev/null
	touch $@

experiment: $(STAMP)  ## one training run under torchrun, e.g. make experiment MODEL=vgg16 SCHEME=dp HETERO=1:delay=0.01
	WORLD_SIZE=$$(( $(NPROC) * $(NNODES) )) $(BIN)/python -m hetero.train --check $(ARGS)
	$(BIN)/torchrun $(TORCHRUN_ARGS) -m hetero.train $(ARGS)

test: $(STAMP)  ## the test suite (CPU, gloo; a few minutes on 2 cores)
	$(BIN)/python -m pytest -q tests

# --- grids and reports (notebooks) ---
# --- end grids and reports ---

# --- simulator ---
# --- end simulator ---

# --- benchmarks ---
# --- end benchmarks ---

clean-venv:  ## remove the virtual environment
	rm -rf $(VENV)
