# hetero: make help lists the targets. Every config field FOO is the Make variable FOO= and the flag --foo.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# torchrun: one node by default; NNODES>1 uses the c10d rendezvous at RDZV_ENDPOINT (docs/trainer.md: several nodes).
NPROC ?= 2
NNODES ?= 1
NODE_RANK ?= 0
RDZV_ENDPOINT ?= 127.0.0.1:29500
RDZV_ID ?= hetero

FIELDS := MODEL SCHEME HETERO STRAGGLER EPOCHS GLOBAL_BATCH MIN_BATCH MAX_BATCH LR MOMENTUM WEIGHT_DECAY DATA DATA_DIR \
	SUBSET TEST_SUBSET AUGMENT SEED DEVICE BACKEND THREADS REBALANCE_EVERY SMOOTHING DEADBAND SIGNIFICANCE TIMEOUT_S \
	RUN_DIR OVERWRITE RESUME REPLAY EVAL_BATCH AFFINITY BF16 CHANNELS_LAST SIT_OUT MICRO_BATCH CHECKPOINT_EVERY \
	TENSORBOARD
# Every other variable make takes; one given on the command line that is in neither list is refused (EPOCH=3).
SETTINGS := NPROC NNODES NODE_RANK RDZV_ENDPOINT RDZV_ID PYTHON VENV PARAMS GRID REPORT_DIR RUNS TARGET_TOP1 \
	RUN_TIMEOUT_S LAB_ARGS NOISE QUICK OUT STAMP OMP_NUM_THREADS JOBS
UNKNOWN := $(filter-out $(FIELDS) $(SETTINGS),$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
ifneq ($(UNKNOWN),)
$(error hetero: error: unknown make variable $(foreach v,$(UNKNOWN),$(v)$(if $(filter $(v)%,$(FIELDS) $(SETTINGS)), (did \
	you mean $(firstword $(filter $(v)%,$(FIELDS) $(SETTINGS)))?))): make help lists the variables)
endif
# Values reach the recipes literally. make expands a command-line or environment value wherever it is used, so
# `$(shell ...)` in one would run and `done$X2` would lose its `$X`: a value holding make syntax ($( or ${) is
# refused before anything expands it, and any other `$` is kept as it is (re-set as a simple variable).
given = $(foreach v,$(FIELDS) $(SETTINGS),$(if $(filter command line environment,$(origin $(v))),$(v)))
lparen := (
lbrace := {
syntax = $(or $(findstring $$$(lparen),$(value $(1))),$(findstring $$$(lbrace),$(value $(1))))
MAKE_SYNTAX := $(strip $(foreach v,$(given),$(if $(call syntax,$(v)),$(v))))
ifneq ($(MAKE_SYNTAX),)
$(error hetero: error: $(firstword $(MAKE_SYNTAX)) holds make syntax ($$$(lparen) or $$$(lbrace)), which make would \
	run or expand: values are taken literally, so it is refused)
endif
$(foreach v,$(given),$(if $(findstring $$,$(value $(v))),$(eval override $(v) := $(subst $$,$$$$,$(value $(v))))))
# Numbers that reach shell arithmetic must be numbers (bash evaluates $(( )) operands as expressions).
digits = $(if $(and $(1),$(filter 1,$(words $(1))),$(if $(strip $(subst 0,,$(subst 1,,$(subst 2,,$(subst 3,,$(subst \
	4,,$(subst 5,,$(subst 6,,$(subst 7,,$(subst 8,,$(subst 9,,$(1)))))))))))),,1)),,$(error hetero: error: $(2) \
	must be a whole number (got '$(1)')))
$(call digits,$(NPROC),NPROC)$(call digits,$(NNODES),NNODES)$(call digits,$(NODE_RANK),NODE_RANK)
ifeq ($(NNODES),1)
TORCHRUN_ARGS := --standalone --nproc-per-node=$(NPROC) --log-dir=/dev/null
else
# The rendezvous settings that make a lost node's world re-form in seconds (hetero.lab.recovery.AGENT, which
# make bench measures; docs/elastic.md says why each): a dead node is dropped after 2 missed 1-s heartbeats.
RDZV_CONF := join_timeout=600,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=2
TORCHRUN_ARGS := --nnodes=$(NNODES) --node-rank=$(NODE_RANK) --nproc-per-node=$(NPROC) \
	--rdzv-backend=c10d --rdzv-endpoint="$$RDZV_ENDPOINT" --rdzv-id="$$RDZV_ID" --log-dir=/dev/null \
	--rdzv-conf=$(RDZV_CONF) --monitor-interval=0.1
endif
# Values reach the recipes through the environment ("$$MODEL"), never pasted into the command text: a value
# holding ' or ; stays one argument and runs nothing.
# (export each after its default: `export V` first would define V empty, and V ?= would then keep that)
export $(FIELDS) RDZV_ENDPOINT RDZV_ID
flag = --$(subst _,-,$(shell printf '%s' '$(1)' | tr A-Z a-z))
ARGS := $(foreach v,$(FIELDS),$(if $(value $(v)),$(call flag,$(v)) "$$$(v)"))

# The checkout's own Jupyter kernel "hetero", registered inside the venv (not user-wide): papermill and make lab
# use it, and a venv's own kernels come before user-wide ones (jupyter_core prefers the environment in a venv).
KERNEL := $(VENV)/share/jupyter/kernels/hetero/kernel.json
# torchrun sets OMP_NUM_THREADS=1 for its workers when unset, and prints a banner saying so; the trainer sizes its
# thread pool itself (THREADS=), so setting torchrun's default explicitly changes nothing but the noise. (Launches
# from Python, grids and benchmarks, get the same from hetero.lab.launch.clean_env.)
OMP_NUM_THREADS ?= 1

.PHONY: help install experiment test test-slow test-all lint clean-venv
help:  ## list the targets and the config fields (meaning, choices, default)
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 14
	@echo; echo "Variables (any other is refused):"; echo "  $(SETTINGS)"
	@echo "and the config fields (python -m hetero.trainer --help):"
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m hetero.trainer.cli

install: $(STAMP)  ## create .venv with torch, torchvision, jupyterlab, papermill, ... (once)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m ipykernel install --sys-prefix --name hetero --display-name "Python (hetero)" >/dev/null
	@# DeepSpeed's first init_distributed compiles its CPU communication op (25-65 s here): once, now, not in a test
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; \
		B().load(verbose=False)" >/dev/null 2>&1 || echo "note: DeepSpeed's CPU op did not build (no compiler?)"
	touch $@

$(KERNEL): | $(STAMP)  # a venv installed before the kernel moved into it (order-only: no reinstall)
	$(BIN)/python -m ipykernel install --sys-prefix --name hetero --display-name "Python (hetero)" >/dev/null

experiment: $(STAMP)  ## one training run under torchrun, e.g. make experiment MODEL=vgg16 SCHEME=dp HETERO=1:delay=0.01
	WORLD_SIZE=$$(( $(NPROC) * $(NNODES) )) RANK=$$(( $(NODE_RANK) * $(NPROC) )) LOCAL_WORLD_SIZE=$(NPROC) \
		$(BIN)/python -m hetero.trainer --check $(ARGS)
	OMP_NUM_THREADS=$(OMP_NUM_THREADS) $(BIN)/torchrun $(TORCHRUN_ARGS) -m hetero.trainer $(ARGS)

# JOBS: pytest-xdist runs the test files in JOBS processes (--dist loadfile: a file's tests stay in one, so its
# shared fixtures launch once), the costliest files first (tests/conftest.py, from tests/costs.csv). Default 3 on
# 2 cores, CI included: a launch leaves a core idle while its ranks wait at an all-reduce, a timeout or a launcher's
# start, and a third process fills it (docs/getting-started.md: the times). JOBS=1 runs them one by one.
JOBS ?= 3
$(call digits,$(JOBS),JOBS)
XDIST := $(if $(filter-out 1,$(JOBS)),-n $(JOBS) --dist loadfile --no-loadscope-reorder,)

test: $(STAMP)  ## the test suite without the slow tier (CPU, gloo; docs/getting-started.md: time on 2 cores)
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow" tests

test-slow: $(STAMP)  ## only the slow tier (real CIFAR-10 images, benchmark smoke tests, ...)
	$(BIN)/python -m pytest -q $(XDIST) -m slow tests

test-all: $(STAMP)  ## both tiers (what .ci/run runs), each test's time kept in runs/ci/ (.ci/durations.py)
	@mkdir -p runs/ci
	$(BIN)/python -m pytest -q $(XDIST) --junitxml=runs/ci/junit.xml tests; rc=$$?; \
		$(BIN)/python .ci/durations.py runs/ci/junit.xml; exit $$rc

lint: $(STAMP)  ## ruff check . (rules in pyproject's [tool.ruff]; no formatter: the code is formatted by hand)
	$(BIN)/ruff check .

# --- grids and reports (notebooks) ---
# make grid PARAMS=notebooks/params/paper.yaml [GRID=name] [EPOCHS=3 SEED='[0, 1]' ...]: papermill runs
# notebooks/grid.ipynb into runs/GRID/grid.ipynb; a set Make variable (a config field, NPROC, RUN_TIMEOUT_S) overrides
# the YAML file and may be a list. make report GRID=name (or RUNS='runs/a runs/b' REPORT_DIR=...) renders the report.
PARAMS ?= notebooks/params/demo.yaml
GRID ?= $(basename $(notdir $(PARAMS)))
REPORT_DIR ?= runs/$(GRID)/report
RUNS ?=
TARGET_TOP1 ?=
RUN_TIMEOUT_S ?=
export PARAMS GRID REPORT_DIR RUNS TARGET_TOP1 RUN_TIMEOUT_S
# ipykernel warns on every start that its local TCP sockets are unencrypted (they listen on 127.0.0.1 only);
# that one line is dropped from the kernel's stderr, everything else passes.
QUIET_KERNEL := 2> >(grep -v --line-buffered 'Kernel is running over TCP without encryption' >&2)
PAPERMILL := PYTHONPATH=$(CURDIR) $(BIN)/papermill -k hetero --cwd $(CURDIR) --no-progress-bar --log-output
lower = $(shell printf '%s' '$(1)' | tr A-Z a-z)
GRID_OVERRIDES := $(foreach v,$(FIELDS) RUN_TIMEOUT_S,$(if $(value $(v)),-y "$(call lower,$(v)): $$$(v)")) \
	$(if $(filter command line environment,$(origin NPROC)),-p nproc $(NPROC))
# The recipes' arguments are shell words: "$$GRID" (from the environment) or a fixed name. The parameters are
# checked first (plain lines, exit 2); papermill then runs the notebook with the same ones.
define grid_recipe  # $(1): grid name, $(2): parameter file
	PYTHONPATH=$(CURDIR) $(BIN)/python -m hetero.lab.grid --check -f $(2) $(GRID_OVERRIDES) -p grid $(1) -p runs_root runs
	mkdir -p runs/$(1)
	$(PAPERMILL) notebooks/grid.ipynb runs/$(1)/grid.ipynb -f $(2) $(GRID_OVERRIDES) -p grid $(1) -p runs_root runs \
		$(QUIET_KERNEL)
endef
define report_recipe  # $(1): grid folder, $(2): output folder
	PYTHONPATH=$(CURDIR) $(BIN)/python -m hetero.lab.analysis --check $(1) $(2) $(if $(RUNS),$$RUNS)
	mkdir -p $(2)
	$(PAPERMILL) notebooks/report.ipynb $(2)/report.ipynb -p grid_dir $(1) -p out_dir $(2) \
		$(if $(RUNS),-y "run_dirs: [$$(printf '%s, ' $$RUNS | sed 's/, $$//')]") \
		$(if $(TARGET_TOP1),-p target_top1 "$$TARGET_TOP1") $(QUIET_KERNEL)
	$(BIN)/jupyter nbconvert --to html --no-input --log-level WARN $(2)/report.ipynb
	@echo "report: $(2)/report.html (figures: $(2)/*.png, *.svg; table: $(2)/summary.csv)"
endef
.PHONY: grid report lab demo

grid: $(STAMP) $(KERNEL)  ## a grid of runs from PARAMS=notebooks/params/NAME.yaml into runs/GRID (default: the file's name)
	$(call grid_recipe,"$$GRID","$$PARAMS")

report: $(STAMP) $(KERNEL)  ## the HTML report (no code) and figures of runs/GRID, or of RUNS='runs/a runs/b'
	$(call report_recipe,runs/"$$GRID","$$REPORT_DIR")

LAB_ARGS ?=  # added to the defaults, e.g. --no-browser --ip=0.0.0.0 --port=8888
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)  # as root JupyterLab refuses to start without it
lab: $(STAMP) $(KERNEL)  ## JupyterLab on notebooks/ with this checkout's kernel "Python (hetero)" (LAB_ARGS=...)
	PYTHONPATH=$(CURDIR) $(BIN)/jupyter lab --notebook-dir=$(CURDIR) $(LAB_ROOT) $(LAB_ARGS) notebooks/

demo: $(STAMP) $(KERNEL)  ## the main job: a small grid (tiny model, 2 ranks, one 3x slower) and its report, about 4 min on 2 CPUs
	$(call grid_recipe,demo,notebooks/params/demo.yaml)
	$(call report_recipe,runs/demo,runs/demo/report)
# --- end grids and reports ---

# --- simulator ---
# The step simulator (hetero/lab/simulator.py): no processes, no torch.distributed; seconds on a laptop.
# make sim-bench [NOISE=0.02]: python -m hetero.lab.simbench --noise 0.02, affine vs the paper's rule for 2, 16 and 1024
# workers, and 4096-worker timings. make sim-notebook: notebooks/balancers.ipynb (paper delays, slowdowns, random
# delays, changing speeds) executed into runs/sim/balancers.ipynb and rendered to runs/sim/balancers.html.
NOISE ?= 0
export NOISE
.PHONY: sim-bench sim-notebook

sim-bench: $(STAMP)  ## simulator benchmark: affine vs the paper's rule, 2/16/1024 workers (~10 s; NOISE=)
	$(BIN)/python -m hetero.lab.simbench --noise "$$NOISE"

sim-notebook: $(STAMP) $(KERNEL)  ## the balancers notebook on simulated scenarios, into runs/sim/balancers.html (~1 min)
	mkdir -p runs/sim
	$(PAPERMILL) notebooks/balancers.ipynb runs/sim/balancers.ipynb $(QUIET_KERNEL)
	$(BIN)/jupyter nbconvert --to html --no-input --log-level WARN runs/sim/balancers.ipynb
# --- end simulator ---

# --- benchmarks ---
# make bench [QUICK=1] [OUT=dir]: the benchmark suite on CPU ranks (python -m hetero.lab.bench [--quick] [--out dir]),
# into runs/bench/<time>/bench.json and table.md. make gpu-check [OUT=file.json] runs on a GPU machine with its own
# python3 and torch. Each knob is the flag of the same name: QUICK=1 --quick, OUT= --out.
QUICK ?=
# OUT from the command line only: an OUT in the environment (a common name) must not redirect the output
OUT :=
export OUT
.PHONY: bench gpu-check

bench: $(STAMP)  ## benchmarks on CPU ranks (QUICK=1 about 7 min on 2 cores, outside part included): runs/bench/<time>/bench.json
	$(BIN)/python -m hetero.lab.bench $(if $(QUICK),--quick) $${OUT:+--out "$$OUT"}

gpu-check:  ## the GPU check (one GPU, < 5 min; PYTHON needs torch): OUT=runs/gpu_check.json (and .md)
	$(PYTHON) scripts/gpu_check.py --out "$${OUT:-runs/gpu_check.json}"
# --- end benchmarks ---

# --- documentation ---
# The site (mkdocs + mkdocs-material, the API reference by mkdocstrings from the docstrings): mkdocs.yml, docs/*.md.
# make docs builds it in strict mode into site/ (git-ignored): a broken link, a missing heading or an API name that no
# longer exists fails it (.ci/run runs it). make docs-serve serves it on http://127.0.0.1:8000, rebuilt on every edit.
.PHONY: docs docs-serve

docs: $(STAMP)  ## the documentation site, strict, into site/ (open site/index.html)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean --site-dir site

docs-serve: $(STAMP)  ## the documentation site on a local server, http://127.0.0.1:8000
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict
# --- end documentation ---

clean-venv:  ## remove the virtual environment
	rm -rf $(VENV)
