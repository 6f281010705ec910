# MSRM: two set-up commands, `make book` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

# The first interpreter that actually runs (a pyenv shim on PATH may exist for a version that is not active):
# Python 3.12 (python3.12, else the newest of pyenv's 3.12.x), which gets the current JAX; else python3.11 (JAX
# 0.10); else python3. `first_python` prints the command of the first candidate that starts.
PYENV_VERSIONS := $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions
first_python = $(shell for p in $(1); do \
  if [ -n "$$p" ] && "$$p" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then \
  echo "$$p"; break; fi; done)
PY312_CANDIDATES := python3.12 $(lastword $(sort $(wildcard $(PYENV_VERSIONS)/3.12.*/bin/python3.12)))
PY311_CANDIDATES := python3.11 $(lastword $(sort $(wildcard $(PYENV_VERSIONS)/3.11.*/bin/python3.11)))
ifeq ($(origin PYTHON_BOOT),undefined)
PYTHON_BOOT := $(call first_python,$(PY312_CANDIDATES) $(PY311_CANDIDATES) python3)
endif
VENV        ?= .venv
PY          := $(VENV)/bin/python
EXTRAS      ?= bayes,dask,book,test,plot,bids
# make test-oldest: Python 3.11 with the oldest supported JAX, NumPyro and ArviZ (constraints/oldest.txt)
ifeq ($(origin PYTHON_OLDEST),undefined)
PYTHON_OLDEST := $(call first_python,$(PY311_CANDIDATES))
endif
VENV_OLDEST   ?= .venv-oldest
PY_OLDEST     := $(VENV_OLDEST)/bin/python
STAMP_OLDEST  := $(VENV_OLDEST)/.msrm-installed
BENCH_ARGS    ?=
STAMP       := $(VENV)/.msrm-installed
CHROMIUM    ?= /usr/bin/chromium
DEVICE      ?= auto
HTML        := _build/html

.PHONY: help install install-peers chromium book notebooks html check-book test test-oldest test-slow notes bench-device clean

help:
	@echo "make book       install if needed, run the notebooks (quick profile) on this machine, build $(HTML)"
	@echo "make test       install if needed, run the default test suite (fails when no test ran); Python 3.12"
	@echo "                when the machine has it (current JAX), else 3.11; interpreter: $(PYTHON_BOOT)"
	@echo "make test-oldest  the same tests in $(VENV_OLDEST): Python 3.11 with the oldest supported JAX, NumPyro"
	@echo "                and ArviZ (constraints/oldest.txt)"
	@echo "make test-slow  the slow tests (long benchmarks, the full book build)"
	@echo "make notes      run the notebooks with the note profile (the research note's scale)"
	@echo "make bench-device  the device benchmark script, tools/bench_device.sh \$$(BENCH_ARGS)"

$(PY):
	@if [ -z "$(PYTHON_BOOT)" ]; then echo "no Python >= 3.11 found (tried python3.12, pyenv 3.12.x, python3.11, python3)" >&2; exit 1; fi
	$(PYTHON_BOOT) -m venv $(VENV)

# Reinstall only when pyproject.toml changed since the last install (the stamp records it).
# The diagnostics' Numba kernels are compiled once here, into Numba's cache beside msrm/diagnostics_kernels.py, so
# that a user's first call only loads them (run it again after changing that file; a stale entry is recompiled).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[$(EXTRAS)]'
	$(PY) -c 'import msrm.diagnostics as d; d.compile_kernels()'
	touch $(STAMP)

install: $(STAMP)

# The recovery benchmark's peer methods (the `peers` extra: scikit-learn, BrainIAK with mpich, mofapy2, elephant),
# for the book only: `make test` never installs them (each peer's tests skip without its package). If the install
# fails, the book is still built and the benchmark reports those peers as not installed.
STAMP_PEERS := $(VENV)/.msrm-peers-installed
$(STAMP_PEERS): pyproject.toml | $(STAMP)
	if $(PY) -m pip install -e '.[$(EXTRAS),peers]'; then touch $(STAMP_PEERS); \
	else echo "warning: the peers extra did not install; the benchmark reports those peers as not installed" >&2; fi

install-peers: $(STAMP_PEERS)

$(PY_OLDEST):
	@if [ -z "$(PYTHON_OLDEST)" ]; then echo "make test-oldest needs Python 3.11 (python3.11 or pyenv 3.11.x)" >&2; exit 1; fi
	$(PYTHON_OLDEST) -m venv $(VENV_OLDEST)

$(STAMP_OLDEST): pyproject.toml constraints/oldest.txt | $(PY_OLDEST)
	$(PY_OLDEST) -m pip install -e '.[$(EXTRAS)]' -c constraints/oldest.txt
	touch $(STAMP_OLDEST)

# Chromium is needed only for the rendered-book check; install it through apt when missing and root.
chromium:
	@if [ -x "$(CHROMIUM)" ]; then :; \
	elif [ "$$(id -u)" = "0" ] && command -v apt-get >/dev/null; then \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	    || echo "warning: could not install chromium through apt; the browser check will be skipped"; \
	else echo "warning: $(CHROMIUM) is missing and apt is not usable here; the browser check will be skipped"; fi

notebooks: install
	$(PY) -m msrm_lab.notebooks run --profile quick --device $(DEVICE)

html: install
	$(VENV)/bin/jupyter-book build --all -W -n --keep-going .

check-book: chromium
	@if [ -x "$(CHROMIUM)" ]; then $(PY) -m msrm_lab.notebooks check-book $(HTML) --chromium $(CHROMIUM); \
	else echo "no chromium at $(CHROMIUM): the browser check is skipped, the static one runs"; \
	  $(PY) -m msrm_lab.notebooks check-book $(HTML) --static; fi

# A failing notebook is recorded (results/.../<notebook>.failed/) and the book is still built and checked;
# the exit status then reports the failure.
book: install install-peers chromium
	rc=0; $(MAKE) notebooks || rc=$$?; \
	$(MAKE) html; \
	$(MAKE) check-book; \
	if [ "$$rc" -ne 0 ]; then echo "make book: some notebooks failed (see results/*/quick/*.failed/status.json)"; fi; \
	exit $$rc

# pytest exits 5 when it collected no test: that is a failure here.
test: install chromium
	$(PY) -m pytest -q -m "not slow" --durations=40

# The default selection again, on the oldest supported combination.
test-oldest: $(STAMP_OLDEST) chromium
	$(PY_OLDEST) -m pytest -q -m "not slow"

test-slow: install chromium
	$(PY) -m pytest -q -m slow

# The note's rows include the recovery benchmark's peers, so the note profile installs them as make book does.
notes: install install-peers
	$(PY) -m msrm_lab.notebooks run --profile note --device $(DEVICE) --repeats 3

bench-device:
	bash tools/bench_device.sh $(BENCH_ARGS)

clean:
	rm -rf _build
