# Two commands do everything on a fresh machine with only python3:
#   make demo    set up .venv, then the embedded default end to end: text in, text out
#   make test    set up .venv, then run the test suite
# `make test-fast` skips the tests marked slow (whole-model exports, and every test that took
# 0.3 s or more in the last `make durations` run, tests/durations.json): the loop while
# developing. `make durations` runs the suite, then the fast subset, raising the times that
# record holds (tests/conftest.py).
# `make bench` runs the benchmarks (bench/, prints markdown tables).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast durations bench setup docs
setup: $(STAMP)

# torch first and pinned: pip then takes the CPU build that lies on disk, not a CUDA one.
# The base install is the runtime; the "export" extra adds torch, transformers, torch-to-nnef.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[export,test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gdn-fx demo --text

test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

durations: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal --record-durations
	$(PY) -m pytest -q -n 2 --dist worksteal --record-durations -m "not slow"

bench: $(STAMP)
	$(PY) bench/run_all.py

# The docs site (mkdocs.yml, docs/): --strict fails on a broken link or a missing page.
docs: $(STAMP)
	$(PY) -m pip install -q -e ".[docs]"
	$(PY) -c "from gdn_fx.cli import reference; print(reference())" > docs/cli-reference.md
	$(VENV)/bin/mkdocs build --strict
