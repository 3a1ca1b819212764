# Every target builds its own virtualenv in .venv on first use; `make test` also makes sure the
# PostgreSQL server binaries are there (the test suite starts its own throwaway server).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
APT    := DEBIAN_FRONTEND=noninteractive apt-get

.PHONY: test lint pytest demo bench clean postgres-binaries browser

# Two stamps: `make demo` installs only the runtime (trio, attrs, pyrsistent, immutables, cronsim:
# what the examples it runs import), `make test` and the other targets the dev tools on top of it.
DEMO_STAMP := $(VENV)/.installed-runtime

define make_venv
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { \
	  echo "venv unavailable: installing python3-venv with apt-get"; \
	  rm -rf $(VENV); $(APT) update -qq && $(APT) install -y -qq python3-venv && \
	  $(PYTHON) -m venv $(VENV); }
endef

$(STAMP): pyproject.toml
	$(make_venv)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# -qq: setuptools' editable install prints an informational notice that -q still shows;
	@# errors are still printed.
	$(BIN)/python -m pip install --quiet --quiet -e '.[dev]'
	touch $(STAMP) $(DEMO_STAMP)

$(DEMO_STAMP): pyproject.toml
	$(make_venv)
	$(BIN)/python -m pip install --quiet --quiet --disable-pip-version-check -e .
	touch $(DEMO_STAMP)

test: lint pytest

lint: $(STAMP)
	$(BIN)/ruff check stm ferry tests examples
	$(BIN)/ruff format --check stm ferry tests examples
	$(BIN)/mypy stm ferry examples tests

# The suite runs on as many pytest-xdist workers as there are cores, at most 2 (CI's 2 cores; each
# worker starts its own throwaway PostgreSQL, and the process tests measure under that load: ADR
# 0172). `make pytest WORKERS=0` runs it serially; one file is `python -m pytest tests/....py`.
WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ "$$n" -gt 2 ] && n=2; echo $$n)

pytest: $(STAMP) postgres-binaries browser
	$(BIN)/python -m pytest -n $(WORKERS) --dist worksteal

postgres-binaries:
	@command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  echo "PostgreSQL server binaries missing: installing them with apt-get"; \
	  $(APT) update -qq && $(APT) install -y -qq --no-install-recommends postgresql; }

# The dashboard's browser test drives headless Chromium; without it (no package to be had) the
# test is skipped and says why.
browser:
	@{ command -v chromium && test -x /usr/bin/chromedriver; } >/dev/null 2>&1 || { \
	  echo "Chromium or chromedriver missing: installing them with apt-get (the dashboard's browser test)"; \
	  $(APT) update -qq && $(APT) install -y -qq chromium chromium-driver || \
	  echo "could not install Chromium: the dashboard's browser test will be skipped"; }

demo: $(DEMO_STAMP)
	$(BIN)/python examples/ledger.py --ops 5000
	@# The orders' store is kept in the checkout: `python -m ferry.flow orders.db list` (README).
	$(BIN)/python examples/orders.py --db orders.db

bench: $(STAMP) postgres-binaries
	$(BIN)/python -m tests.bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
