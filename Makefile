# The two commands of the quick start: `make demo` and `make test`.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

export OMP_NUM_THREADS ?= 1

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m minimegatron.train --preset demo

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build runs
