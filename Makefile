# The two README commands. Everything they need is installed by the targets below.
PY      := .venv/bin/python
STAMP   := .venv/.installed
ADDR    ?= 127.0.0.1:8000

.PHONY: setup serve test test-torch test-under-load lint bench clean

setup: $(STAMP)

# torch 2.13.0 first: a local CPU wheel where pip's find-links has one, so the
# dependency below is already satisfied and never pulls the CUDA build.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

# vendor-assets: the site's pinned mermaid.js from npm, integrity-checked (once; cached afterwards).
serve: setup
	tools/vendor-assets
	tools/pin-and-cite fetch
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --dev-addr $(ADDR)

# Two pytest-xdist workers; the tests that share one torchrun launch (one per world size), and the site tests,
# each stay in one worker (tests/conftest.py::scope_of), the rest go a module at a time. The slowest 20 tests
# are listed at the end: where the suite's time goes. Python's bytecode cache stays on where the environment
# turns it off (PYTHONDONTWRITEBYTECODE): each of the suite's hundreds of short-lived processes of the tool
# and the reference would compile their modules again (a fifth of the tool tests' CPU time).
test: setup
	tools/ensure-browser
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -n 2 --durations=20

# The reference's tests on another torch (not run in CI): `make test-torch TORCH=2.11.0` installs that torch
# from PyPI (on Linux a CUDA build, several GB; it runs on CPU) and the project's test extras, constrained as
# CI's except for torch, into its own .venv-torch-$(TORCH), then runs tests/reference and the upstream evidence
# of tests/evidence there (not its re-recordings of the site's traces and runs, made on the pinned torch).
# Tests that run torch's own FSDP/DTensor/pipelining as upstream evidence skip: the citations are of the pinned
# torch.
TORCH_VENV := .venv-torch-$(TORCH)
test-torch:
	@test -n "$(TORCH)" || { echo "make: error: name the torch to test, e.g. make test-torch TORCH=2.11.0"; exit 2; }
	test -f $(TORCH_VENV)/.installed || { \
	  python3 -m venv $(TORCH_VENV) && \
	  grep -v '^torch==' constraints.txt > $(TORCH_VENV)/constraints.txt && \
	  $(TORCH_VENV)/bin/python -m pip install -q torch==$(TORCH) && \
	  $(TORCH_VENV)/bin/python -m pip install -q -c $(TORCH_VENV)/constraints.txt -e '.[test]' && \
	  touch $(TORCH_VENV)/.installed; }
	$(TORCH_VENV)/bin/python -m pytest tests/reference tests/evidence -p no:xdist \
	  --ignore=tests/evidence/test_run_it.py --ignore=tests/evidence/test_trace_freshness.py $(PYTEST_ARGS)

# The load-sensitive tests (a hung rank's timeouts, traced pipelines, the 70B scale traces) with two CPU-bound
# processes beside them, as on a busy laptop (not run in CI). The hogs end with the run, whatever its result.
LOAD_TESTS := tests/reference/test_hung_rank.py tests/tools/test_traces.py tests/reference/test_scale.py \
	tests/evidence/test_trace_freshness.py
test-under-load: setup
	@hogs=""; for i in 1 2; do $(PY) -c 'while True: pass' & hogs="$$hogs $$!"; done; \
	trap 'kill $$hogs 2>/dev/null' EXIT INT TERM; \
	echo "two CPU hogs running (pids$$hogs)"; \
	$(PY) -m pytest -p no:xdist $(LOAD_TESTS) $(PYTEST_ARGS)

# ruff's lint and format check (configured in pyproject.toml); CI runs it before the tests.
lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	$(PY) benchmarks/fetch_vs_clone.py
	$(PY) benchmarks/relocate_accuracy.py

clean:
	rm -rf .venv .venv-torch-* site
