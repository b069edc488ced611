# gpufeed — every target that needs the environment builds it first (idempotent, quick when done).
# `make help` lists the targets: each one's line below ends with `## what it does`.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
REDIS_PORT ?= 6379
FUZZ_MINUTES ?= 10

.PHONY: help setup redis-server promtool tmux chromium test test-fast fuzz lint demo run-worker run-redis bench soak \
	soak-cluster gpu-check gpu-check-prepare gpu-check-rehearse docs docs-serve docs-gen docs-figures clean

help: ## this list
	@echo "make TARGET, where TARGET is one of:"
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) \
	  | sed -E 's/^([a-zA-Z0-9_-]+):.*## (.*)$$/\1\t\2/' \
	  | while IFS=$$'\t' read -r target text; do printf '  make %-18s %s\n' "$$target" "$$text"; done

setup: $(STAMP) redis-server promtool tmux chromium ## .venv with the packages; redis-server, promtool, tmux and chromium from the OS packages

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[worker,bench,dev,docs]'
	@touch $(STAMP)

redis-server: ## install redis-server from the OS packages when it is missing
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server from the OS packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server >/dev/null; }
	@# The OS package starts a system-wide server on :6379; gpufeed's targets start their own.

# tmux is the terminal the `worker top` tests draw in (skipped without it).
tmux: ## install tmux from the OS packages when it is missing
	@command -v tmux >/dev/null 2>&1 || { \
	  echo "installing tmux from the OS packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq tmux >/dev/null; }

# chromium is the browser the docs site is opened in with the network cut (the diagram is
# drawn, no page asks for an outside host); the tests that need it are skipped without it.
chromium: ## install chromium from the OS packages when it is missing
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  echo "installing chromium from the OS packages"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  { $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; } \
	  || echo "chromium could not be installed: the tests that need it will be skipped"; }

# promtool checks deploy/prometheus (rule syntax, alert unit tests, the dashboard's
# queries). Only the binary is taken out of Debian's `prometheus` package, into the venv:
# installing the package itself would also start a Prometheus server. Without it the
# tests that need it are skipped.
promtool: $(STAMP) ## put promtool (from Debian's prometheus package) into .venv/bin
	@command -v promtool >/dev/null 2>&1 || test -x $(VENV)/bin/promtool || { \
	  echo "fetching promtool from the OS's prometheus package"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  dir=$$(mktemp -d) && venv_bin=$$(cd $(VENV)/bin && pwd) && \
	  { $$SUDO apt-get update -qq; cd $$dir && apt-get download -qq prometheus 2>/dev/null \
	    && dpkg-deb -x prometheus_*.deb root && install -m 0755 root/usr/bin/promtool $$venv_bin/promtool; } \
	  || echo "promtool could not be installed: the tests that need it will be skipped"; \
	  rm -rf $$dir; }

# The one test command (CI runs exactly this): lint and types, then the suite, whose property
# tests draw the same examples on every run (HYPOTHESIS_PROFILE=ci; `make fuzz` draws new ones).
test: setup lint ## ruff, mypy, then the test suite (starts its own redis-server)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q --durations=30

# The core's tests (tests/<folder>/ mirrors worker/'s folders), less those marked slow (real
# worker processes, a Redis Cluster, a compiled model): the lane to run while changing the
# core. `make test` stays the gate CI runs.
FAST_TESTS := tests/base tests/ipc tests/jobs tests/config tests/decode tests/model tests/fetch \
	tests/pipeline tests/observe tests/delivery tests/lifecycle
test-fast: setup ## the core's tests without the slow ones, in minutes (make test is the gate)
	HYPOTHESIS_PROFILE=ci $(PY) -m pytest -q -m "not slow" $(FAST_TESTS)

# Every test that uses hypothesis, under the `fuzz` profile of tests/conftest.py (`make test`
# keeps their examples fixed), round after round until FUZZ_MINUTES (whole minutes) have
# passed; the first failure stops it and prints the falsifying example. Run it before each
# submission: what it finds becomes an @example on its test, and a fix.
fuzz: setup ## the property tests with fresh random examples for FUZZ_MINUTES (default 10)
	@end=$$(( $$(date +%s) + 60 * $(FUZZ_MINUTES) )); round=0; \
	files=$$(grep -rl --include="test_*.py" "^from hypothesis" tests); \
	while [ $$(date +%s) -lt $$end ]; do \
	  round=$$((round + 1)); echo "fuzz: round $$round"; \
	  HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -x -m hypothesis -p no:cacheprovider \
	    $$files || exit 1; \
	done; \
	echo "fuzz: $$round rounds in $(FUZZ_MINUTES) minutes found nothing"

lint: setup ## ruff check, ruff format --check, mypy (strict)
	$(VENV)/bin/ruff check worker producer measure tests scripts
	$(VENV)/bin/ruff format --check worker producer measure tests scripts
	$(VENV)/bin/mypy

demo: setup ## a local Redis, a worker, sample jobs, each result and a throughput line
	$(PY) -m worker demo

# One worker per visible GPU (or per GPU in GPUS=0,2), each its own consumer; one worker
# on a host with a single GPU or none.
run-worker: setup ## run a worker (one per GPU) with the GPUFEED_* / REDIS_URL settings of the environment
	PYTHON=$(PY) bash scripts/run-workers.sh

run-redis: redis-server ## a throwaway redis-server in the foreground on 127.0.0.1:6379, or a free port if taken
	REDIS_PORT=$(REDIS_PORT) bash scripts/run-redis.sh

# The benchmark: ceiling, naive worker, gpufeed and its ablations on generated image sets;
# writes bench/out/report.json, report.md and throughput.png. BENCH_PROFILE=tiny|quick|full
# (default: quick on CPU hosts, full on CUDA hosts); MODEL=./my-model (a model directory or
# a torchvision name) instead of the profile's models.
bench: setup ## the benchmark report (bench/out/); MODEL=DIR for a model directory
	$(PY) -m measure bench $(if $(MODEL),--model $(MODEL))

# 20,000 mixed good and bad jobs through 2 worker processes, with a worker SIGKILLed and
# restarted and Redis restarted; prints a report, writes .soak/report.json (scripts/soak.py
# --help for --jobs, --workers, --out). Fails if a job is missing or answered twice.
# SOAK_DECODE_PROCESSES=2 runs the workers with 2 decode processes each (0: decode threads).
soak: setup ## 20,000 jobs with a worker killed and Redis restarted (.soak/report.json)
	$(PY) scripts/soak.py $(if $(SOAK_DECODE_PROCESSES),--decode-processes $(SOAK_DECODE_PROCESSES))

# The cluster variant: a private Redis Cluster (3 masters, 1 replica each), 3 shards, 2
# workers on the null model, a master SIGKILLed at 50% answered; reports duplicates, lost
# results and jobs/s (.soak/cluster-report.json). SOAK_WAIT_REPLICAS=1 to WAIT for replicas.
soak-cluster: setup ## 3,000 jobs on a Redis Cluster with a master killed (.soak/cluster-report.json)
	$(PY) scripts/soak.py --cluster --jobs 3000 --out .soak/cluster-report.json \
	  --wait-replicas $(or $(SOAK_WAIT_REPLICAS),0)

# Every CUDA test and a short benchmark on a GPU host without network, each claim judged;
# writes $$GPU_CHECK_OUT/report.json. Uses the host's python3 (PYTHON) and PyTorch: no setup.
gpu-check: ## on a GPU host: every CUDA test and the GPU benchmark, each claim judged
	PYTHON="$(PYTHON)" bash scripts/gpu-check.sh

gpu-check-prepare: ## where there is network: wheels and redis-server for gpu-check into .gpu-check/
	bash scripts/prepare-gpu-host.sh

# What a GPU host runs before it needs the GPU, here, with only the host's packages and the
# carry importable (tests/measure/test_gpu_host_rehearsal.py runs it in `make test`).
gpu-check-rehearse: setup ## the GPU check's set-up and test collection, in a GPU host's environment
	$(PY) scripts/gpu_host_rehearsal.py

# The documentation site (mkdocs.yml): docs/ built into site/ with --strict, so a broken
# link or anchor, or a page missing from the nav, fails the build.
docs: setup ## build the documentation site into site/ (strict: a broken link fails)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: setup ## serve the site on http://127.0.0.1:8000, rebuilt on each edit (warnings shown, not fatal)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --no-strict --dev-addr 127.0.0.1:8000

# The reference pages written from the code (docs/reference/: settings, error codes, result
# fields, metrics, make targets, command line); tests/project/test_docs.py fails when one is stale.
docs-gen: setup ## rewrite the generated reference pages under docs/reference/
	$(PY) -m worker.docs_gen

# The benchmark's figures for the docs: runs the bench (BENCH_PROFILE, default quick), keeps
# its report as docs/figures/report.json, and writes docs/figures.md and every
# <!-- figures:NAME --> block of README.md and docs/ from it.
docs-figures: setup ## run the benchmark and write docs/figures.md (and the figures blocks) from it
	$(PY) -m measure bench --profile $(or $(BENCH_PROFILE),quick) --figures-page docs/figures.md

clean: ## remove .venv, caches and the demo's files
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .demo site *.egg-info
