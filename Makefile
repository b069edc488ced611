# gpufeed — every target that needs the environment builds it first (idempotent, quick when done).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
REDIS_PORT ?= 6379

.PHONY: setup redis-server test lint demo run-worker run-redis bench gpu-check clean help

help:
	@echo "make demo        local Redis + worker + sample jobs + results and throughput"
	@echo "make test        ruff, mypy, then the test suite (starts its own redis-server)"
	@echo "make run-worker  run a worker with the GPUFEED_* / REDIS_URL settings of the environment"
	@echo "make run-redis   a local redis-server on 127.0.0.1:$(REDIS_PORT), nothing kept on disk"
	@echo "make lint        ruff and mypy"
	@echo "make setup       .venv with the packages, and redis-server from the OS packages"

setup: $(STAMP) redis-server

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[worker,dev]'
	@touch $(STAMP)

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server from the OS packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@# The OS package starts a system-wide server on :6379; gpufeed's targets start their own.

# The one test command (CI runs exactly this): lint and types, then the suite.
test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check worker producer tests scripts
	$(VENV)/bin/ruff format --check worker producer tests scripts
	$(VENV)/bin/mypy

demo: setup
	$(PY) -m worker demo

# One worker per visible GPU (or per GPU in GPUS=0,2), each its own consumer; one worker
# on a host with a single GPU or none.
run-worker: setup
	PYTHON=$(PY) bash scripts/run-workers.sh

# The benchmark: ceiling, naive worker, gpufeed and its ablations on generated image sets;
# writes bench/out/report.json, report.md and throughput.png. BENCH_PROFILE=tiny|quick|full
# (default: quick on CPU hosts, full on CUDA hosts); MODEL=./my-model (a model directory or
# a torchvision name) instead of the profile's models.
bench: setup
	$(PY) -m worker bench $(if $(MODEL),--model $(MODEL))

# The CUDA tests and a short benchmark on a GPU host without network; writes
# $$GPU_CHECK_OUT/report.json. Uses the host's python3 and PyTorch: no setup here.
gpu-check:
	bash scripts/gpu-check.sh

# Where there is network: gather wheels and redis-server for gpu-check into .gpu-check/.
.PHONY: gpu-check-prepare
gpu-check-prepare:
	bash scripts/prepare-gpu-host.sh

run-redis: redis-server
	redis-server --port $(REDIS_PORT) --bind 127.0.0.1 --save "" --appendonly no

# 20,000 mixed good and bad jobs through 2 worker processes, with a worker SIGKILLed and
# restarted and Redis restarted; prints a report, writes .soak/report.json (scripts/soak.py
# --help for --jobs, --workers, --out). Fails if a job is missing or answered twice.
.PHONY: soak
soak: setup
	$(PY) scripts/soak.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .demo *.egg-info
