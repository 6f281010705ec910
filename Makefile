# MSRM: two set-up commands, `make book` and `make test` (see README.md).
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

PYTHON_BOOT ?= $(shell command -v python3.11 || command -v python3)
VENV        ?= .venv
PY          := $(VENV)/bin/python
EXTRAS      ?= bayes,dask,book,test
STAMP       := $(VENV)/.msrm-installed
CHROMIUM    ?= /usr/bin/chromium
DEVICE      ?= auto
HTML        := _build/html

.PHONY: help install chromium book notebooks html check-book test test-slow notes clean

help:
	@echo "make book       install if needed, run the notebooks (quick profile) on this machine, build $(HTML)"
	@echo "make test       install if needed, run the default test suite (fails when no test ran)"
	@echo "make test-slow  the slow tests (long benchmarks, the full book build)"
	@echo "make notes      run the notebooks with the note profile (the research note's scale)"

$(PY):
	$(PYTHON_BOOT) -m venv $(VENV)

# Reinstall only when pyproject.toml changed since the last install (the stamp records it).
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -e '.[$(EXTRAS)]'
	touch $(STAMP)

install: $(STAMP)

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
	else echo "skipping the browser check: no chromium at $(CHROMIUM)"; fi

# A failing notebook is recorded (results/.../<notebook>.failed/) and the book is still built and checked;
# the exit status then reports the failure.
book: install chromium
	rc=0; $(MAKE) notebooks || rc=$$?; \
	$(MAKE) html; \
	$(MAKE) check-book; \
	if [ "$$rc" -ne 0 ]; then echo "make book: some notebooks failed (see results/*/quick/*.failed/status.json)"; fi; \
	exit $$rc

# pytest exits 5 when it collected no test: that is a failure here.
test: install chromium
	$(PY) -m pytest -q -m "not slow"

test-slow: install chromium
	$(PY) -m pytest -q -m slow

notes: install
	$(PY) -m msrm_lab.notebooks run --profile note --device $(DEVICE)

clean:
	rm -rf _build
