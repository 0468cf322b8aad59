# The two set-up commands of the README are `make train` and `make test`; both create .venv on
# first use and install nothing on later calls (the stamp depends on pyproject.toml only).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LIGHTNING := $(VENV)/lightning
UI_PORT ?= 5000
UI_STORE ?= $(CURDIR)/mlruns
SERVER_PORT ?= 5001
SERVER_HOST ?= 127.0.0.1
PYTEST_ARGS ?=
# pytest-xdist workers: two, one per core here. The suite is CPU-bound (the cores 97-100 %
# busy through a run); a third worker made it no faster (CONTRIBUTING.md).
PYTEST_WORKERS ?= 2
# One test file per work unit, all of tests/cluster/ in one (tests/conftest.py, work_unit).
PARALLEL := -n $(PYTEST_WORKERS) --dist loadfile
# The tests' interpreters keep their bytecode: a machine of this kind sets
# PYTHONDONTWRITEBYTECODE=1, so every interpreter of a run (each pytest worker, Slurm job,
# server, prepare-text) compiled train/ again (0.27 s) and each worker re-rewrote the asserts of
# 146 test modules (collection 8.2 s -> 5.4-6.6 s with them kept). Kept where Python keeps it,
# in __pycache__ (ignored by git): a PYTHONPYCACHEPREFIX would also hide the bytecode pip wrote
# for the venv's packages, which a fresh clone's first run then compiled again (torch, mlflow,
# transformers: 9.5 s of CPU per process; a new venv's first make test-fast 60.4 s, 51.3 s now).
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE

.PHONY: setup train test test-fast lint ui mlflow-server bench bench-gpu cluster-up cluster-down clean

setup: $(STAMP)

# torch and torchvision first, pinned, through plain pip: pip's local wheel store holds these
# builds, and installing them alone keeps the resolver from choosing another torch later.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(PY) -m pip install --quiet -e '.[dev,hf]'
	# Lightning for the GPU bench's peer (and its CPU smoke test), in a folder of its own
	# rather than the venv: on the venv's path, mlflow.pytorch imports all of Lightning at
	# every model a job logs (seconds per job; tests/e2e/test_bench_gpu.py adds the folder).
	$(PY) -m pip install --quiet --no-deps --target $(LIGHTNING) lightning==2.6.6 \
	  lightning-utilities==0.15.3 torchmetrics==1.9.0
	touch $(STAMP)

# The main job on the embedded defaults: digits, the small CNN, 2 local gloo ranks.
train: setup
	$(PY) -m train distributed.nproc_per_node=2

# Every kind: tests/unit, tests/e2e (real processes), tests/cluster (the local Slurm cluster);
# the slowest tests listed at the end, so that where the time goes stays visible.
test: setup
	$(TEST_ENV) $(PY) -m pytest $(PARALLEL) --durations=15 $(PYTEST_ARGS)

# The quick layer: tests/unit/ alone (in process: no subprocess, no Slurm, no browser), aimed at
# under 60 s (CONTRIBUTING.md has the figures: 53-64 s on 2026-12-04's second draw).
test-fast: setup
	$(TEST_ENV) $(PY) -m pytest $(PARALLEL) --durations=5 $(PYTEST_ARGS) tests/unit

lint: setup
	$(VENV)/bin/ruff check train tests bench hydra_plugins

# The MLflow UI over the embedded store (mlruns/), on this machine only: the same lean server
# as mlflow-server (gunicorn, 2 workers, ~0.75 GB instead of `mlflow ui`'s ~3 GB). With a login
# (every user of this machine reaches 127.0.0.1): user admin, the password generated into
# $(UI_STORE)/server-auth.env. UI_NO_AUTH=1 opens it to everyone (a laptop nobody else uses).
ui: setup
	@echo "MLflow UI: http://127.0.0.1:$(UI_PORT)  (embedded store $(UI_STORE)/mlflow.db)"
	$(PY) -m train.server --host 127.0.0.1 --port $(UI_PORT) $(if $(UI_NO_AUTH),--no-auth) \
	  --backend-store-uri sqlite:///$(UI_STORE)/mlflow.db --artifacts-destination $(UI_STORE)/artifacts

# A tracking server for clusters (gunicorn, 2 workers, artifacts proxied, logins on; see
# train/server.py). SERVER_ARGS for more options (--certfile/--keyfile, --no-auth, ...).
mlflow-server: setup
	$(PY) -m train.server --host $(SERVER_HOST) --port $(SERVER_PORT) $(SERVER_ARGS)

# `make bench`: the service against a plain DDP loop, on in-memory data, for task=regression and
# task=segmentation (bench/task_data.py), and on an ImageFolder of JPEGs the bench writes itself
# (docs/benchmarks.md); data=arrow's shards against the same JPEGs as an image folder
# (bench/arrow.py: 200,000 images and 800,000, files opened, first step, RSS) and its two
# training orders (bench/arrow_shuffle.py: shards per batch, samples/s cold and warm); model=gpt
# against a nanoGPT-style loop, and model=hf's GPT-2 against the same loop over it (bench/lm.py); FSDP against DDP on a 57 M-parameter GPT
# (bench/fsdp.py); the straggler check's own work (bench/stragglers.py); and Optuna sweeps
# with each pruner against the same sweep without (bench/sweep_pruning.py: four sweeps of 16
# trials, minutes on an idle CPU); `python -m train eval` against the same evaluation inside
# training (bench/evaluate.py).
bench: setup
	$(PY) -m bench.run $(BENCH_ARGS)
	$(PY) -m bench.tasks
	$(PY) -m bench.lm
	$(PY) -m bench.lm --model hf --out .bench/lm-hf.json
	$(PY) -m bench.imagefolder
	$(PY) -m bench.arrow --out .bench/arrow.json
	$(PY) -m bench.arrow_shuffle --out .bench/arrow-shuffle.json
	$(PY) -m bench.new_store --dirty-mb 1000
	$(PY) -m bench.fsdp --out .bench/fsdp.json
	$(PY) -m bench.sweep_pruning --out .bench/sweep_pruning.json
	$(PY) -m bench.stragglers
	$(PY) -m bench.profiling --results .bench/profiling.json
	$(PY) -m bench.recompute --results .bench/recompute.json
	$(PY) -m bench.evaluate --results .bench/evaluate.json

# `make bench-gpu`: the service against plain loops (nanoGPT's, torchvision's reference script,
# Lightning) on one CUDA GPU, ~8 minutes; BENCH_GPU_ARGS=--quick for ~3 (bench/gpu.py). No
# setup: on a bare GPU machine it runs on the machine's own torch with PYTHONPATH at this
# checkout (plus hydra-core, omegaconf and antlr4-python3-runtime; docs/benchmarks.md).
BENCH_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
bench-gpu:
	PYTHONPATH=$(CURDIR)$(if $(wildcard $(LIGHTNING)),:$(CURDIR)/$(LIGHTNING))$${PYTHONPATH:+:$$PYTHONPATH} \
	  PYTHONUNBUFFERED=1 $(BENCH_PY) -m bench.gpu $(BENCH_GPU_ARGS)

cluster-up:
	bash slurm/cluster-up.sh

cluster-down:
	bash slurm/cluster-down.sh

# What runs and the tests leave in the tree, with the bytecode the tests keep (TEST_ENV).
clean:
	rm -rf outputs multirun .pytest_cache .ruff_cache
	find train tests bench hydra_plugins -name __pycache__ -type d -prune -exec rm -rf {} +
